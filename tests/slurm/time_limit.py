"""A real Slurm time limit in a test: lower a training job's limit so that Slurm's own ``--signal`` warning comes
at slurmctld's next tick, whatever its setup took, and put the limit back once that run has ended."""

from __future__ import annotations

import subprocess
import threading
import time

from slurm.jobs import Job, wait_until

_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def run_seconds(job: Job) -> int | None:
    """Seconds the job's current run has been running (``scontrol``'s RunTime), None unless RUNNING."""
    info = job.info()
    if info.get("JobState") != "RUNNING":
        return None
    days, _, hms = info["RunTime"].rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def limit_when_training(job: Job, record: dict, *, after_step: int, warning: int) -> None:
    """For a background thread: once ``job`` trained ``after_step`` steps, set its time limit so that the warning
    ``--signal=SIG@warning`` (a whole number of minutes) is due at the next tick; ``record`` gets what was done.

    slurmctld sends ``--signal=SIG@P`` at the first 30 s tick where the end is <= P + 30 s away, and enforces
    the limit at the first tick after the end. The new limit is the whole minute that ends P + 10 to P + 30 s
    after the update (waiting, while the job trains, until its run time is 30-50 s past a minute): the warning
    comes at the next tick, at most 30 s later, and at least P - 20 s before the limit.
    """
    try:
        wait_until(lambda: job.last_step() >= after_step, timeout=900, interval=0.2,
                   what=f"{job.name} to train {after_step} steps")
        elapsed = wait_until(lambda: (e := run_seconds(job)) is not None and 30 <= e % 60 < 50 and e, timeout=120,
                             interval=0.2, what=f"{job.name}'s run time to be 30-50 s past a minute")
        minutes = elapsed // 60 + warning // 60 + 1
        subprocess.run(["scontrol", "update", f"JobId={job.slurm_id}", f"TimeLimit={minutes}"], check=True)
        record.update(minutes=minutes, elapsed=elapsed, step=job.last_step(), wall=time.time())
    except Exception as err:  # noqa: BLE001 - reported by the test that needs it
        record["error"] = err


def limit_back_after_first_run(job: Job, limiter: threading.Thread, minutes: int) -> None:
    """For a background thread: once the first run has ended, the limit goes back to ``minutes`` so that the
    requeued run is not signalled again."""
    limiter.join(timeout=1200)
    wait_until(lambda: int(job.info().get("Restarts", 0)) >= 1 or job.info().get("JobState") in _ENDED,
               timeout=1200, interval=0.5, what=f"{job.name}'s first run to end")

    def restored() -> bool:  # retried: Slurm refuses the update while the requeued job is still completing
        if job.info().get("JobState") in _ENDED:
            return True
        subprocess.run(["scontrol", "update", f"JobId={job.slurm_id}", f"TimeLimit={minutes}"], capture_output=True)
        return job.info().get("TimeLimit") == f"{minutes // 60:02d}:{minutes % 60:02d}:00"

    wait_until(restored, timeout=600, interval=0.5, what=f"{job.name}'s time limit back to {minutes} minutes")
