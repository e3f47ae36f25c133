"""Submit the real trainer to the local cluster through NeMo-Run, and read back what happened.

A ``Job`` is one ``run.Experiment`` with one task, submitted detached through a ``SlurmExecutor``
with a ``LocalTunnel`` (as on a login node). Everything asserted comes from the real artefacts:
Slurm's records (``scontrol``, ``sacct``), nemo_run's log files, the trainer's ``metrics.jsonl``,
``stop_reason.json`` and checkpoint folders.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from resilience_support.polling import poll

from megatron_resilience.records.jsonl import read_jsonl
from megatron_resilience.records.names import METRICS_FILE
from slurm.cluster import SlurmCluster, attempts, job_info, wait_for_job

_TICK_PROBE = 'trap "exit 0" USR1; while true; do sleep 0.1; done'


@dataclass
class Job:
    name: str
    exp_id: str
    slurm_id: str
    job_dir: str  # nemo_run's job directory: sbatch script, sbatch_*.out, log-*_<id>_<restart>.out
    run_dir: str  # the trainer's run directory: metrics.jsonl, stop_reason.json, checkpoints/

    def info(self) -> dict[str, str]:
        return job_info(self.slurm_id)

    def attempts(self) -> list[dict[str, str]]:
        return attempts(self.slurm_id)

    def log(self) -> str:
        files = sorted(glob.glob(os.path.join(self.job_dir, "*.out")))
        return "".join(f"\n==> {os.path.basename(p)} <==\n" + open(p, errors="replace").read() for p in files)

    def attempt_log(self, restart: int, *, missing_ok: bool = False) -> str:
        """The job step's log of Slurm attempt ``restart`` (0 = the first run): the launcher and every rank.
        ``missing_ok``: '' while that attempt has not started (for polling), instead of failing."""
        names = [p for p in os.listdir(self.job_dir) if p.startswith("log-") and p.endswith(f"_{restart}.out")]
        if not names and missing_ok:
            return ""
        assert len(names) == 1, f"no log of run {restart}: {os.listdir(self.job_dir)}\n{self.describe()}"
        return open(os.path.join(self.job_dir, names[0]), errors="replace").read()

    def records(self) -> list[dict[str, Any]]:
        # the trainer appends while the test reads: a line not yet whole is skipped (the package's one reader)
        return read_jsonl(os.path.join(self.run_dir, METRICS_FILE))

    def losses(self) -> dict[int, float]:
        """Per-step training loss; a step re-run after a restart keeps its last value."""
        return {r["step"]: r["loss"] for r in self.records() if r.get("kind") == "train"}

    def losses_per_start(self) -> list[dict[int, float]]:
        """Per-step training loss of each (re)start of the trainer, in order: a step trained before a fault and again
        after the resume appears in both, so the two can be compared."""
        runs: list[dict[int, float]] = []
        for r in self.records():
            if r.get("kind") == "start":
                runs.append({})
            elif r.get("kind") == "train":
                runs[-1][r["step"]] = r["loss"]
        return runs

    def starts(self) -> list[int]:
        """The step each (re)start of the trainer began from."""
        return [r["step"] for r in self.records() if r.get("kind") == "start"]

    def last_step(self) -> int:
        steps = [r["step"] for r in self.records() if r.get("kind") == "train"]
        return max(steps, default=0)

    def checkpoint_steps(self) -> list[int]:
        folder = os.path.join(self.run_dir, "checkpoints")
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"iter_(\d+)", n)))

    def stop_reason(self) -> dict[str, Any]:
        with open(os.path.join(self.run_dir, "stop_reason.json")) as f:
            return json.load(f)

    def job_results(self) -> list[str]:
        """nemo_run's FT sbatch bookkeeping: one '<job id> <restart> S|F' line per Slurm run."""
        (path,) = [os.path.join(self.job_dir, p) for p in os.listdir(self.job_dir) if p.endswith("_job_results")]
        return open(path).read().split("\n")[:-1]

    def describe(self) -> str:
        """For assertion messages: Slurm's view, then the tail of each log, the trainer's newest attempt first
        (what ended the job; a CI report shows the start of a long message), the batch script's last."""
        files = sorted(glob.glob(os.path.join(self.job_dir, "*.out")), key=lambda p: (
            os.path.basename(p).startswith("sbatch_"), -os.path.getmtime(p)))
        tails = "".join(f"\n==> {os.path.basename(p)} (tail) <==\n" + open(p, errors="replace").read()[-2500:]
                        for p in files)
        return f"{self.name} (job {self.slurm_id}): {self.info()}\n{self.attempts()}{tails}"


def tiny_task(root: str, name: str, *, max_steps: int, save_interval: int | None, nodes: int = 1, ranks: int = 2,
              **edits: Any) -> Any:
    """The ``gpt_tiny`` recipe (fault tolerance, straggler reports, rerun state machine, exit handler on) on ``nodes``
    x ``ranks`` CPU ranks, ``max_steps`` long, then ``section__field=value`` edits.

    Why here: the Slurm modules' jobs (resilience, preemption, multi-node) all start from this task; one builder
    keeps their edits spelled and applied the same way."""
    from megatron_resilience.recipes import RECIPES

    task = RECIPES["gpt_tiny"](dir=root, name=name, num_nodes=nodes, num_gpus_per_node=ranks)
    task.train.max_steps = max_steps
    task.checkpoint.save_interval = save_interval
    for key, value in edits.items():
        section, field = key.split("__")
        setattr(getattr(task, section), field, value)
    return task


def submit(name: str, task: Any, executor: Any, plugins: list[Any] = (), *, run_dir: str) -> Job:
    """``run.Experiment`` + ``exp.add`` + ``exp.run(detach=True)``, as a notebook user would."""
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    with run.Experiment(name, executor=executor) as exp:
        exp.add(task, executor=executor, plugins=list(plugins), name=name)
        exp.run(detach=True)
    job = exp.jobs[0]
    handle = job.handle
    assert handle, f"{name}: not submitted"
    return Job(name=name, exp_id=exp._id, slurm_id=handle.rstrip("/").rsplit("/", 1)[-1],
               job_dir=job.executor.job_dir, run_dir=run_dir)


def tick_probe(cluster: SlurmCluster) -> str:
    """A job that ends at slurmctld's next 30 s limit/signal tick (it exits on its own warning signal).

    slurmctld sends ``--signal`` warnings and enforces limits only on that fixed tick, so a job that
    depends on this one (``afterany``) starts right after a tick and gets its ``--time=1`` warning
    signal about 30 s later, not anywhere between 0 and 30 s.
    """
    out = subprocess.run(
        ["sbatch", "--parsable", f"--partition={cluster.partition}", f"--account={cluster.account}",
         "--job-name=tick-probe", "--time=1", "--signal=B:USR1@59", "--output=/dev/null", "--wrap", _TICK_PROBE],
        capture_output=True, text=True, check=True, env=cluster.env)
    return out.stdout.strip().split(";")[0]


def wait_until(predicate, *, timeout: float, interval: float = 0.25, what: str) -> Any:
    """``predicate()``'s first truthy value; TimeoutError after ``timeout`` s (``resilience_support.polling``)."""
    return poll(predicate, timeout=timeout, interval=interval, what=what, error=TimeoutError)


def ranks_catching(job: Job, ranks: int, signum: int = 15) -> bool:
    """Whether the job's ``ranks`` rank processes on this machine (the newest per rank: a restarted group's) all
    catch ``signum`` (``SigCgt`` in ``/proc/PID/status``): their handler is installed, so a signal now is handled
    by every rank, never a default death during imports."""
    from megatron_resilience.chaos.on_node import rank_processes

    found = rank_processes(job.slurm_id, None)
    if len(found) != ranks:
        return False
    for proc in found:
        try:
            with open(f"/proc/{proc['pid']}/status", encoding="ascii") as f:
                caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        except (OSError, StopIteration, ValueError):
            return False
        if not caught >> (signum - 1) & 1:
            return False
    return True


def scancel_signal(job: Job, signal: str = "SIGTERM") -> float:
    """``scancel -s SIG``: Slurm signals the job's steps (not the batch shell), like ``--signal`` without ``B:``.

    A request slurmctld never answered (its clients time out after MessageTimeout on a saturated machine) did not
    reach the job: it is sent again, up to a minute, and each such try is printed (the test's output keeps it).
    Any other failure is raised with scancel's own words."""
    from megatron_resilience.chaos.runner import SLURM_UNANSWERED

    deadline = time.monotonic() + 60
    while True:
        proc = subprocess.run(["scancel", "-s", signal, job.slurm_id], capture_output=True, text=True)
        if proc.returncode == 0:
            return time.time()
        said = (proc.stdout + proc.stderr).strip()
        state = subprocess.run(["squeue", "-h", "-j", job.slurm_id, "-o", "%T"], capture_output=True,
                               text=True).stdout.strip()
        # seen under load: "Invalid job id specified" for a job squeue shows RUNNING; the signal never left
        unanswered = any(s in said for s in SLURM_UNANSWERED) or ("Invalid job id" in said and state == "RUNNING")
        if not unanswered or time.monotonic() > deadline:
            raise RuntimeError(f"scancel -s {signal} {job.slurm_id} failed (exit {proc.returncode}): {said}")
        print(f"scancel -s {signal} {job.slurm_id}: not delivered ({said}; job {state}); sending it again",
              flush=True)
        time.sleep(1.0)


def signal_when_training(job: Job, sent: dict, after_step: int) -> None:
    """For a background thread: once the first run has logged ``after_step`` steps, ``scancel -s SIGTERM`` its
    steps; ``sent[job.name]`` gets the time it was sent, or the error for the test that needs it."""
    try:
        wait_until(lambda: job.last_step() >= after_step, timeout=900, interval=0.1,
                   what=f"{job.name} to train {after_step} steps")
        sent[job.name] = scancel_signal(job)
    except Exception as err:  # noqa: BLE001 - reported by the test that needs it
        sent[job.name] = err


def requeue_when_completed(job: Job, record: dict) -> None:
    """For a background thread: a finished run that is requeued anyway (node failure, an operator) must not train
    again. ``record`` gets the first ending ("final") and the requeued one's ("again").

    Requeued right when it ends: slurmctld forgets a finished job ``MinJobAge`` (300 s) later, and other jobs
    of a module may take much longer on a loaded machine.
    """
    try:
        record["final"] = final = wait_for_job(job.slurm_id, timeout=1500)
        if final["JobState"] == "COMPLETED":
            subprocess.run(["scontrol", "requeue", job.slurm_id], check=True, capture_output=True)
            wait_until(lambda: job.info().get("Restarts") != final["Restarts"], timeout=60,
                       what="the requeue to register")
            record["again"] = wait_for_job(job.slurm_id, timeout=900)
    except Exception as err:  # noqa: BLE001 - reported by the fixture
        record["error"] = err


def waiting_rank(rank: int, seconds: float) -> dict[str, object]:
    """Task edits (``section__field``): ``rank`` sleeps ``seconds`` in every step, a long step that costs no CPU
    (``straggler.simulated_straggler_mode=wait``) and changes no number: a timing window that holds on a loaded
    machine without loading it further."""
    return {"straggler__simulated_straggler_rank": rank, "straggler__simulated_straggler_delay": seconds,
            "straggler__simulated_straggler_mode": "wait"}
