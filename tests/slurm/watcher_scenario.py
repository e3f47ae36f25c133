"""The watcher scenario of the job-level Slurm tests: nothing in the job can decide, watchers die mid-decision.

The watched job's batch shell is frozen and killed (as when its batch host is lost); watcher 1 is killed
after writing its intent and before ``sbatch``, watcher 2 after ``sbatch`` and before recording the new
job, watcher 3 reconciles and follows the chain to its end. A thread counts the run's live jobs all the
while: there must never be two.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from slurm.cluster import wait_for_job
from slurm.jobs import Job, wait_until

SBATCH_WRAPPER = """#!/bin/bash
# The watcher's sbatch, interrupted: MODE=before stops before submitting, MODE=after after it.
touch "$MARK.called"
[ "$MODE" = before ] && exec sleep 3600
out=$(%(sbatch)s "$@") || exit 1
echo "$out"
echo "$out" > "$MARK.submitted"
exec sleep 3600
"""


def steps(job_id: str) -> list[str]:
    """The job's running steps other than the batch step (``squeue -s``)."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], capture_output=True, text=True, timeout=60)
    return [s for s in out.stdout.split() if not s.endswith((".batch", ".extern"))]


def live_jobs(name: str) -> list[str]:
    """The run's jobs that are pending or running, as ``id:state``. A job that is COMPLETING (``CG``: its processes
    are gone, Slurm still runs the epilog and frees the node) is not live: it trains nothing and can overlap its
    successor's start for a few seconds on a loaded machine."""
    out = subprocess.run(["squeue", "--me", "-h", "-n", name, "-o", "%i:%t"], capture_output=True, text=True,
                         timeout=60)
    return [j for j in out.stdout.split() if not j.endswith(":CG")]


class Watcher:
    """``python -m megatron_resilience.watch`` in its own process group (killed as a whole, like kill -9)."""

    def __init__(self, run_dir: str, env: dict, log: str) -> None:
        self.log = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_resilience.watch", run_dir, "--interval", "1"],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.log.close()


def watcher_env(cluster, tmp: str, mode: str | None) -> dict:
    env = dict(cluster.env)
    if mode:
        bin_dir = os.path.join(tmp, f"bin_{mode}")
        os.makedirs(bin_dir, exist_ok=True)
        wrapper = os.path.join(bin_dir, "sbatch")
        with open(wrapper, "w") as f:
            f.write(SBATCH_WRAPPER % {"sbatch": subprocess.check_output(["which", "sbatch"], text=True).strip()})
        os.chmod(wrapper, 0o755)
        env.update(PATH=f"{bin_dir}:{env['PATH']}", MODE=mode, MARK=os.path.join(tmp, f"mark_{mode}"))
    return env


def watcher_scenario(job: Job, cluster, tmp: str, *, first_checkpoint: int) -> dict:
    """Kill the batch shell (nothing in the job decides), then watchers killed mid-resubmission, then one that
    finishes the chain. Returns what happened; a thread counts the run's live jobs throughout."""
    name = job.info()["JobName"]
    counts: list[int] = []
    seen: list[list[str]] = []  # the live jobs whenever more than one was seen: the failure message shows them
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            live = live_jobs(name)
            counts.append(len(live))
            if len(live) > 1:
                seen.append(live)
            time.sleep(0.5)

    wait_until(lambda: first_checkpoint in job.checkpoint_steps(), timeout=900, interval=0.2,
               what="the first checkpoint")
    subprocess.run(["scontrol", "update", f"JobId={job.slurm_id}", "Requeue=0"], check=True)  # Slurm cannot requeue
    # As when the batch host is lost, nothing in the job may save or decide: the batch shell is frozen, the trainer
    # aborted (SIGABRT: scancel -s KILL would cancel the job instead), then the shell killed (Slurm: FAILED 0:9).
    for flags in (["-b", "-s", "STOP"], ["-s", "ABRT"]):
        subprocess.run(["scancel", *flags, job.slurm_id], check=True)
    wait_until(lambda: not steps(job.slurm_id), timeout=120, what="the aborted job step to end")
    subprocess.run(["scancel", "-b", "-s", "KILL", job.slurm_id], check=True)
    first = wait_for_job(job.slurm_id, timeout=300)
    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    try:
        w1 = Watcher(job.run_dir, watcher_env(cluster, tmp, "before"), os.path.join(tmp, "watch1.log"))
        wait_until(lambda: os.path.exists(os.path.join(tmp, "mark_before.called")), timeout=300, what="watcher 1")
        w1.kill()  # between deciding (intent on disk) and submitting
        w2 = Watcher(job.run_dir, watcher_env(cluster, tmp, "after"), os.path.join(tmp, "watch2.log"))
        wait_until(lambda: os.path.exists(os.path.join(tmp, "mark_after.submitted")), timeout=300, what="watcher 2")
        w2.kill()  # after submitting, before recording the new job
        second = open(os.path.join(tmp, "mark_after.submitted")).read().split(";")[0].strip()
        w3 = subprocess.run([sys.executable, "-m", "megatron_resilience.watch", job.run_dir, "--interval", "2"],
                            env=cluster.env, capture_output=True, text=True, timeout=1200)
        last = wait_for_job(second, timeout=600)
    finally:
        stop.set()
        counter.join(timeout=30)
    return {"first": first, "second": second, "last": last, "counts": counts, "seen": seen, "w3": w3,
            "logs": [open(os.path.join(tmp, f"watch{i}.log")).read() for i in (1, 2)]}
