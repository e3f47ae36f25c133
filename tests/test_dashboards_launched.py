"""TensorBoard and W&B after a run with an in-job restart AND a requeue, read back with each tool's reader.

The real trainer (tiny GPT, 2 CPU ranks, gloo) under the real ft_launcher, three processes' worth of attempts
on one run_dir:

1. attempt 0: rank 1 is SIGKILLed at the start of step 6 (``ft.simulated_fault_repeat``: every attempt, 6 steps
   after where it resumed); logged 1-5, checkpoint 4;
2. ft_launcher restarts the worker group (in-job restart 1): resumes from 4, recomputes 5, logs 6-9, killed at
   step 10; checkpoint 8; the launcher's one restart is spent, it exits non-zero;
3. the job is requeued (a second launch on the same run_dir with ``SLURM_RESTART_COUNT=1``, as Slurm sets it,
   fault off): resumes from 8, recomputes 9, trains 10-16 and finishes.

W&B runs in offline mode (``WANDB_MODE=offline``); nothing talks to a network.
"""

from __future__ import annotations

import math
import struct

import pytest
from dashboards_support import read_tensorboard, read_wandb_offline
from resilience_support.launch import run_to_end

pytestmark = pytest.mark.slow

WAIT = 900
COMMON = ["train.max_steps=16", "checkpoint.save_interval=4", "train.eval_interval=4", "train.eval_iters=1",
          "logger.wandb_project=mr-dashboards", "logger.wandb_exp_name=restart-and-requeue"]
FAULT = ["ft.simulate_fault=true", "ft.simulated_fault_type=rank_killed", "ft.simulated_fault_rank=1",
         "ft.simulated_fault_step=6", "ft.simulated_fault_repeat=true"]
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboards")
    first = run_to_end(root / "run", COMMON + FAULT, max_restarts=1, timeout=WAIT, env=OFFLINE)
    requeue = run_to_end(root / "run", COMMON, max_restarts=0, timeout=WAIT,
                         env={**OFFLINE, "SLURM_RESTART_COUNT": "1"})  # no SLURM_JOB_ID: NVRx 0.7 would check srun
    return first, requeue


def test_the_scenario_ran_as_planned(run):
    first, requeue = run
    assert first.returncode != 0 and requeue.returncode == 0, requeue.log()[-3000:]
    starts = [r for r in requeue.records() if r["kind"] == "start"]
    assert [(s["step"], s["restart"], s["last_logged_step"]) for s in starts] == [
        (0, "first", None), (4, "in_job_restart", 5), (8, "requeue", 9)]
    assert [s["totals"] for s in starts] == [
        {"in_job_restarts": 0, "inprocess_restarts": 0, "requeues": 0, "recomputed_steps": 0, "preemption_stops": 0,
         "rerun_exits": 0},
        {"in_job_restarts": 1, "inprocess_restarts": 0, "requeues": 0, "recomputed_steps": 1, "preemption_stops": 0,
         "rerun_exits": 0},
        {"in_job_restarts": 1, "inprocess_restarts": 0, "requeues": 1, "recomputed_steps": 2, "preemption_stops": 0,
         "rerun_exits": 0}]
    train = [r["step"] for r in requeue.records() if r["kind"] == "train"]
    assert train == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 14, 15, 16]


def _expected_losses(run):
    records = [r for r in run.records() if r["kind"] == "train"]
    by_step: dict[int, list[float]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r["loss"])
    assert all(len(set(v)) == 1 for v in by_step.values())  # recomputed steps are bitwise the same (exact resume)
    return {step: values[0] for step, values in by_step.items()}


def test_tensorboard_event_files_read_back_exactly(run):
    _, requeue = run
    tb = read_tensorboard(str(requeue.run_dir / "tensorboard"))
    assert len(list((requeue.run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 3  # one per (re)start
    for tag, points in tb.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), (tag, steps)  # no step twice, never backwards
    losses = _expected_losses(requeue)
    assert tb["lm loss"] == [(s, f32(losses[s])) for s in range(1, 17)]  # float32, as Megatron-LM's writer
    lrs = {r["step"]: r["lr"] for r in requeue.records() if r["kind"] == "train"}
    assert tb["learning-rate"] == [(s, f32(lrs[s])) for s in range(1, 17)]
    evals = {r["step"]: r["eval_loss"] for r in requeue.records() if r["kind"] == "eval"}
    assert sorted(evals) == [4, 8, 12, 16]
    assert tb["lm loss validation"] == [(s, f32(evals[s])) for s in (4, 8, 12, 16)]
    assert [s for s, _ in tb["grad-norm"]] == [s for s, _ in tb["iteration-time"]] == list(range(1, 17))
    saves = [r for r in requeue.records() if r["kind"] == "checkpoint"]
    assert [s for s, _ in tb["checkpoint/save-seconds"]] == [r["step"] for r in saves] == [4, 8, 12, 16]
    # The companion series: restarts and requeues step up where training went on after them (steps 6 and 10).
    assert tb["resilience/in-job-restarts"] == [(s, 0.0 if s < 6 else 1.0) for s in range(1, 17)]
    assert tb["resilience/requeues"] == [(s, 0.0 if s < 10 else 1.0) for s in range(1, 17)]
    assert tb["resilience/recomputed-steps"] == [(s, 0.0 if s < 6 else 1.0 if s < 10 else 2.0) for s in range(1, 17)]
    assert tb["resilience/restart-resumed-from"] == [(6, 4.0), (10, 8.0)]
    assert tb["resilience/restart-recomputed"] == [(6, 1.0), (10, 1.0)]
    assert [s for s, _ in tb["checkpoint/load-seconds"]] == [6, 10]
    assert all(0 < v < 600 for _, v in tb["checkpoint/load-seconds"])
    events = tb["resilience/events"]
    assert [s for s, _ in events] == [6, 10]
    assert events[0][1] == ("in-job restart (worker group restarted) (slurm restart 0, in-job restart 1): "
                            "resumed from checkpoint step 4; step 5 recomputed")
    assert events[1][1] == ("requeue (slurm restart 1, in-job restart 0): resumed from checkpoint step 8; "
                            "step 9 recomputed")


def test_wandb_offline_files_one_run_across_attempts(run):
    _, requeue = run
    run_id = (requeue.ckpt / "wandb_run_id").read_text().strip()
    runs = read_wandb_offline(str(requeue.run_dir), rows=16)
    assert [r["id"] for r in runs] == [run_id] * 3  # one W&B run (one id), a folder per (re)start
    assert {r["project"] for r in runs} == {"mr-dashboards"} and {r["name"] for r in runs} == {"restart-and-requeue"}
    # Each (re)start's folder holds the steps it logged, in order. A killed attempt's W&B service writes its file
    # every second (x_transaction_log_flush_interval), so its last rows can be lost with it: the rows it kept are
    # a prefix of what it logged (seen under CI load: steps 4-5 of the first attempt). The finished attempt has all.
    logged = [list(range(1, 6)), list(range(6, 10)), list(range(10, 17))]
    kept = [[row["_step"] for row in r["rows"]] for r in runs]
    assert all(k == want[:len(k)] for k, want in zip(kept, logged)) and kept[2] == logged[2], kept
    rows = [row for r in runs for row in r["rows"]]
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps))  # what `wandb sync --id` uploads, in order: never a step twice or backwards
    losses = _expected_losses(requeue)
    assert [row["lm loss"] for row in rows] == [losses[s] for s in steps]  # float64: exact
    assert [row["resilience/in-job-restarts"] for row in rows] == [int(s >= 6) for s in steps]
    assert [row["resilience/requeues"] for row in rows] == [int(s >= 10) for s in steps]
    assert {row["_step"]: row["resilience/restart-resumed-from"] for row in rows
            if "resilience/restart-resumed-from" in row} == {s: r for s, r in ((6, 4), (10, 8)) if s in steps}
    assert {row["_step"] for row in rows if "lm loss validation" in row} == {4, 8, 12, 16} & set(steps)
    assert all(math.isfinite(row["iteration-time"]) for row in rows)
    # every wandb.init tried again (the killed process's W&B service still held the run) is on record, none silent
    retries = [r for r in requeue.records() if r["kind"] == "retry"]
    assert {r["what"] for r in retries} <= {"wandb.init"}
    held = "is still held by the previous process's W&B service"
    assert len(retries) == requeue.log().count(held), retries
