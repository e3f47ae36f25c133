"""Issue 11: a preemption signal at any moment, on a saturated node, never costs the job (real Slurm).

Every job is the ``gpt_tiny`` recipe on 2 CPU ranks, submitted through NeMo-Run's ``SlurmExecutor`` with our
plugins, with the machine's cores kept busy by ``tests/loadgen.py`` for the whole module. A watcher thread per
job aims ``scancel -s SIGTERM`` (what ``--signal`` does, without waiting for a time limit) at one moment per
Slurm attempt, found from the trainer's own log lines in that attempt's log. Rank 1 of every signalled job
waits 0.5 s in every step (``SLOWED``: a sleep, no CPU), so each moment aimed at lasts longer than Slurm takes to
deliver a signal:

- ``setup`` (torchrun): attempt 0 during setup (2 s after rank 0 announced its handler, still importing; rank 1
  may still be in nemo_run's runner imports, before its handler, and then dies of the signal); attempt 1 inside a
  step (step 5, before the first periodic save at step 20: the save at the signal is the process's first save,
  the form that failed in CI); attempt 2 runs to the end.
- ``save`` (torchrun): attempt 0 inside the first periodic save (``checkpoint.simulated_slow_save``: step 10's
  save waits 20 s before its commit); attempt 1 twice in a row at step 15; attempt 2 runs to the end.
- ``ft`` (ft_launcher, FaultTolerancePlugin): attempt 0 rank 1 killed at step 15, then the signal during
  ft_launcher's restart of the workers; attempt 1 inside a step (step 25); attempt 2 runs to the end.
- ``late`` (torchrun, ``preempt_time=10``): attempt 0 the save at the signal (step 12) takes 30 s, torchrun kills
  the ranks after 10 s; attempt 1 runs to the end.

Each job must end COMPLETED after exactly those requeues, every attempt resuming from the newest complete
checkpoint, with per-step losses equal to an uninterrupted run for every step (a step redone after a lost
save keeps its last value, which must be equal too), the signal on record (log line per rank, ``signal``
record), and for ``late`` the lost steps reported in the stop_reason.json the requeue decision read.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
from loadgen import saturated

from megatron_resilience.upstream import import_nemo_run, installed_versions
from slurm.cluster import wait_for_job
from slurm.jobs import Job, ranks_catching, scancel_signal, submit, tiny_task, wait_until, waiting_rank

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402

STEPS = 40
SETUP_SAVE_INTERVAL = 20  # the "setup" job's: its window for a signal inside a step before the first save
# A tiny step takes 20 ms, even on a saturated machine, less than a signal takes from scancel through slurmctld,
# slurmd and slurmstepd to the ranks (0.4-1.2 s measured; it overshot an aim by 18 steps). In every signalled
# job rank 1 waits this long in every step (a sleep: no CPU, no effect on the numbers), so each aimed-at window is
# seconds long.
SLOWED = waiting_rank(1, 0.5)
LOAD_SECONDS = 1800  # the load generator's bound: it stops by itself even if this process dies


PREEMPTED_REQUEUE = "decision (nemo_run): requeue: preempted: not a failure, requeued without spending a retry"


def tiny(root: str, name: str, **edits):
    """``gpt_tiny`` on 2 ranks, 40 steps, a checkpoint every 10 steps; ``section__field=value`` edits."""
    return tiny_task(root, name, nodes=1, ranks=2, max_steps=STEPS, save_interval=10, **edits)


# --- aiming the signal --------------------------------------------------------------------------------------------


def last_step_logged(text: str) -> int:
    return max((int(m) for m in re.findall(rf"step (\d+)/{STEPS} \| loss", text)), default=0)


class Aim:
    """One signal per attempt: ``(restart, predicate(log text) -> bool, how many signals)``."""

    def __init__(self, job: Job, plan: list[tuple[int, callable, int]]) -> None:
        self.job, self.plan = job, plan
        self.sent: list[tuple[int, float]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"aim-{job.name}")
        self.thread.start()

    def _run(self) -> None:
        try:
            for restart, ready, count in self.plan:
                wait_until(lambda: ready(self.job.attempt_log(restart, missing_ok=True)), timeout=1500, interval=0.1,
                           what=f"{self.job.name}: the moment to signal attempt {restart}")
                for _ in range(count):
                    self.sent.append((restart, scancel_signal(self.job)))
                    time.sleep(0.3)
        except BaseException as err:  # noqa: BLE001 - reported by the tests
            self.error = err


def at_step(step: int):
    return lambda text: last_step_logged(text) >= step


def contains(marker: str):
    return lambda text: marker in text


def every_rank_catching(job: Job, lines: int = 1):
    """Rank 0 logged its handler ``lines`` times (the attempt's ``lines``-th worker group), and both ranks of that
    group catch SIGTERM."""
    marker = "handler installed at process start"
    return lambda text: text.count(marker) >= lines and ranks_catching(job, 2)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, nemorun_home, slurm_tmp):
    root = os.path.join(slurm_tmp, "preemption")
    js: dict[str, Job] = {}
    aims: dict[str, Aim] = {}

    def partial(name, plugins, launcher="torchrun", **edits):
        task = tiny(root, name, **edits)
        executor = slurm_cluster.executor(time="00:30:00", ntasks_per_node=2, launcher=launcher)
        js[name] = submit(name, task, executor, plugins, run_dir=task.run_dir)

    t0 = time.monotonic()
    with saturated(seconds=LOAD_SECONDS):
        partial("ref", [])
        partial("setup", [PreemptionPlugin(preempt_time=60)], checkpoint__save_interval=SETUP_SAVE_INTERVAL,
                **SLOWED)
        partial("save", [PreemptionPlugin(preempt_time=60)], checkpoint__simulated_slow_save=20.0, **SLOWED)
        partial("ft", [FaultTolerancePlugin(num_in_job_restarts=2, num_job_retries_on_failure=2),
                       PreemptionPlugin(preempt_time=60)], launcher=None,
                ft__simulate_fault=True, ft__simulated_fault_type="rank_killed", ft__simulated_fault_rank=1,
                ft__simulated_fault_step=15, **SLOWED)
        partial("late", [PreemptionPlugin(preempt_time=10)], checkpoint__simulated_slow_save=30.0, **SLOWED)
        # Rank 0 announces its handler before importing Megatron-Core, which takes seconds: the signal goes as soon
        # as every rank catches SIGTERM (their handlers are installed: none dies of it in nemo_run's runner imports).
        aims["setup"] = Aim(js["setup"], [(0, every_rank_catching(js["setup"]), 1), (1, at_step(5), 1)])
        aims["save"] = Aim(js["save"], [(0, contains("the save of step 10 waits"), 1), (1, at_step(15), 2)])
        # ft_launcher restarts the workers after the kill: the second "handler installed" line is the restarted
        # group's rank 0, which announces it before importing Megatron-Core; the signal goes when both restarted
        # ranks catch SIGTERM, still in setup (imports alone take seconds).
        aims["ft"] = Aim(js["ft"], [(0, every_rank_catching(js["ft"], lines=2), 1), (1, at_step(25), 1)])
        aims["late"] = Aim(js["late"], [(0, at_step(12), 1)])
        finals = {name: wait_for_job(job.slurm_id, timeout=2400) for name, job in js.items()}
    for aim in aims.values():
        aim.thread.join(timeout=10)
    print(f"\nSlurm preemption jobs done in {time.monotonic() - t0:.0f} s")
    return {"jobs": js, "finals": finals, "aims": aims}


# --- what every job must show -------------------------------------------------------------------------------------


def _signal_records(job: Job) -> list[dict]:
    return [r for r in job.records() if r.get("kind") == "signal"]


def _checkpoints(job: Job) -> list[dict]:
    return [r for r in job.records() if r.get("kind") == "checkpoint"]


def _starts(job: Job) -> list[dict]:
    return [r for r in job.records() if r.get("kind") == "start"]


def _assert_completed_after(job: Job, finals: dict, aims: dict, requeues: int) -> None:
    aim = aims[job.name]
    assert aim.error is None, f"{aim.error!r}\n{job.describe()}"
    info = finals[job.name]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", str(requeues)), \
        job.describe()
    assert [a["State"] for a in job.attempts()] == ["REQUEUED"] * requeues + ["COMPLETED"], job.describe()
    stop = job.stop_reason()
    assert (stop["reason"], stop["step"], stop["finished"], stop["checkpoint_step"], stop["lost_steps"]) == (
        "finished", STEPS, True, STEPS, 0), job.describe()


def _assert_same_losses(job: Job, ref: Job) -> None:
    expected = ref.losses()
    assert sorted(expected) == list(range(1, STEPS + 1)), ref.describe()
    assert job.losses() == expected, job.describe()  # every step, bitwise; re-run steps keep their last value


def _assert_ranks_logged_the_signal(text: str, times: int = 1) -> None:
    for rank in (0, 1):
        lines = re.findall(rf"\[rank {rank}\] megatron_resilience\.resilience\.preemption: received SIGTERM at "
                           r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \(phase: ", text)
        assert len(lines) == times, text[-6000:]


def _assert_every_rank_left_setup(text: str) -> None:
    """A signal during setup, aimed when every rank caught SIGTERM: each rank logged it and exited 0 at once."""
    exited = re.findall(r"\[rank (\d)\] megatron_resilience\.resilience\.preemption: received SIGTERM at "
                        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \(phase: setup; pid \d+\): "
                        r"nothing trained yet, exiting 0", text)
    assert sorted(exited) == ["0", "1"], text[-6000:]
    assert "exitcode: -15" not in text and "forcefully exiting" not in text, text[-6000:]


def test_jobs_ran_on_this_lanes_upstream_versions(jobs):
    """The newest lane's PYTHONPATH reaches the jobs (sbatch exports the submitter's environment)."""
    starts = _starts(jobs["jobs"]["ref"])
    assert starts and starts[0]["versions"] == installed_versions(), starts


def test_signal_during_setup_then_inside_a_step_before_the_first_save(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job = js["setup"]
    _assert_completed_after(job, finals, jobs["aims"], requeues=2)
    first, second = job.attempt_log(0), job.attempt_log(1)
    # Attempt 0: every rank left during setup, at once; the requeue decision read rank 0's stop_reason.
    _assert_every_rank_left_setup(first)
    setup_signal, step_signal = _signal_records(job)
    assert (setup_signal["received_during"], setup_signal["before_training"]) == ("setup", True), job.describe()
    # Attempt 1: the signal inside a step before the first periodic save (the CI failure of issue 11): the save
    # at the signal is this process's first save, and it is durable before the exit.
    _assert_ranks_logged_the_signal(second)
    stopped = step_signal["step"]
    # A signal during the step that ends on the first periodic save still stops the run before that save.
    assert 5 <= stopped <= SETUP_SAVE_INTERVAL, step_signal
    assert step_signal["received_during"].startswith(("step", "after step")), step_signal
    at_signal = [c for c in _checkpoints(job) if c["step"] == stopped]
    assert [(c["reason"], c["first_in_process"]) for c in at_signal] == [("signal", True)], job.describe()
    assert [(s["step"], s["attempt"]["slurm_restart"]) for s in _starts(job)] == [(0, 1), (stopped, 2)]
    assert job.log().count(PREEMPTED_REQUEUE) == 2, job.describe()  # the job-level decision, twice
    _assert_same_losses(job, js["ref"])


def test_signal_inside_the_first_periodic_save_then_twice_in_a_row(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job = js["save"]
    _assert_completed_after(job, finals, jobs["aims"], requeues=2)
    in_save, twice = _signal_records(job)
    # Attempt 0: the signal came while step 10's save (the process's first) was being written: that save
    # completes, and the run stops right after it ("already saved"), resuming from step 10.
    assert in_save["received_during"] == "checkpoint save of step 10" and in_save["step"] == 10, in_save
    assert [(s["step"], s["attempt"]["slurm_restart"]) for s in _starts(job)][:2] == [(0, 0), (10, 1)], \
        job.describe()
    # Attempt 1: two signals in a row: one stop, one checkpoint. The second changes nothing, whether it lands
    # before the ranks agree on the stop (they log "received SIGTERM 2 times") or while torchrun is already
    # shutting the stopped workers down (its second "got signal: 15").
    second = job.attempt_log(1)
    assert "received SIGTERM 2 times" in second or twice["count"] == 2 or second.count("got signal: 15") >= 2, \
        second[-6000:]
    assert [s["step"] for s in _starts(job)][2] == twice["step"], job.describe()
    assert twice["step"] in [c["step"] for c in _checkpoints(job)], job.describe()
    _assert_same_losses(job, js["ref"])


def test_signal_during_a_restart_by_ft_launcher_then_inside_a_step(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job = js["ft"]
    _assert_completed_after(job, finals, jobs["aims"], requeues=2)
    first = job.attempt_log(0)
    assert "SIMULATED FAULT" in first and "rank_killed on rank 1" in first, job.describe()
    # The restarted workers got the signal during their setup and left at once (the results check below: the
    # attempt was a preemption, no failure retry spent). Read from the restarted group on: how long the first
    # group's survivor took to exit before the restart (on a saturated node ft_launcher may SIGKILL it after its
    # --workers-stop-timeout) is no part of the signal's path.
    restarted = first.index("restart_count=1", first.index("rank_killed on rank 1"))
    _assert_every_rank_left_setup(first[restarted:])
    during_restart, in_step = _signal_records(job)
    assert during_restart["before_training"] and during_restart["received_during"] == "setup", during_restart
    starts = [(s["step"], s["attempt"]["slurm_restart"], s["attempt"]["in_job_restart"]) for s in _starts(job)]
    assert starts[0] == (0, 0, 0) and starts[1] == (10, 1, 0), job.describe()
    assert starts[2] == (in_step["step"], 2, 0) and in_step["step"] >= 25, job.describe()
    # Each requeue was a success in nemo_run's FT bookkeeping: no failure retry spent on a preemption.
    assert job.job_results() == [f"{job.slurm_id} {n} S" for n in range(3)], job.describe()
    _assert_same_losses(job, js["ref"])


def test_save_at_the_signal_that_cannot_finish_still_requeues_and_reports_the_lost_steps(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job = js["late"]
    _assert_completed_after(job, finals, jobs["aims"], requeues=1)
    first = job.attempt_log(0)
    assert "forcefully exiting via 9" in first, first[-6000:]  # torchrun killed the ranks mid-save
    # The job-level decision read the stop_reason.json written before the cut-off save ("stopped by the signal").
    assert job.log().count(PREEMPTED_REQUEUE) == 1, job.describe()
    with open(os.path.join(job.run_dir, "job_ledger.jsonl")) as f:
        first = next(r for r in map(json.loads, f) if r["kind"] == "attempt")
    cls = first["classification"]
    assert (cls["error_type"], cls["source"], cls["fields"]["reason"], first["decision"]["action"],
            first["checkpoint_step"]) == ("preempted", "stop_reason", "signal", "requeue", 10), first
    stopped = int(cls["fields"]["step"])
    assert stopped >= 12
    assert [(s["step"], s["resumed_from"]) for s in _starts(job)] == [(0, None), (10, 10)], job.describe()
    assert f"skipping {job.run_dir}/checkpoints/iter_{stopped:07d}.tmp" in job.attempt_log(1), job.describe()
    _assert_same_losses(job, js["ref"])
