"""Per preemption, the ledger says whether the save at the signal finished and the margin left before Slurm's kill;
PreemptionPlugin warns at submit time when preempt_time is below what the run measured (issue 26)."""

from __future__ import annotations

import json
import logging

import pytest

from megatron_resilience.jobs import preemption_margin
from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve
from megatron_resilience.records.ledger import Ledger
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import PreemptionPlugin  # noqa: E402
from megatron_resilience.recipes import gpt_tiny  # noqa: E402

T0 = 1_800_000_000.0


def preempted_run(run_dir, *, save_done: float | None, at_stop: str) -> None:
    """Signal at T0+100 (step 40), the save at the signal 100.5 -> save_done, the trainer's end at 108."""
    records = [{"kind": "start", "step": 0, "time": T0},
               {"kind": "train", "step": 40, "step_time_s": 2.0, "time": T0 + 99},
               {"kind": "signal", "signal": "SIGTERM", "received_time": T0 + 100.2, "first_received_time": T0 + 100.0,
                "step": 40, "time": T0 + 100.3}]
    if save_done is not None:
        records.append({"kind": "checkpoint", "step": 40, "reason": "signal", "start_time": T0 + 100.5,
                        "blocking_s": save_done - 100.5, "durable_time": T0 + save_done, "time": T0 + save_done})
    records.append({"kind": "end", "step": 40, "reason": "signal", "exit_code": 0, "time": T0 + 108})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "stop_reason.json").write_text(json.dumps({
        "reason": "signal", "step": 40, "exit_code": 0, "finished": False, "checkpoint_step": 40 if save_done else 20,
        "checkpoint_at_stop": at_stop, "signal": {"signal": "SIGTERM", "received_time": T0 + 100.2}}))


def attempt(tmp_path, *, save_done: float | None, at_stop: str, preempt_time: int | None) -> dict:
    job_dir, run_dir = tmp_path / "job", tmp_path / "run"
    job_dir.mkdir()
    run_dir.mkdir()
    preempted_run(run_dir, save_done=save_done, at_stop=at_stop)
    policy, monitors = resolve("megatron_transient", None)
    cfg = JobLevelConfig(job_name="gpt", job_dir=str(job_dir), ledger=str(run_dir / "job_ledger.jsonl"),
                         finished_flag=str(job_dir / "gpt_finished_flag"), run_dir=str(run_dir),
                         stop_reason=str(run_dir / "stop_reason.json"), metrics=str(run_dir / "metrics.jsonl"),
                         policy=policy, monitors=monitors, preempt_time=preempt_time)
    ledger = Ledger(cfg.ledger)
    ledger.append({"kind": "attempt_start", "job_id": "9", "slurm_restart": 0, "nodes": "n1", "time": T0 - 10})
    ending = end_attempt(cfg, ledger, job_id="9", restart=0, exit_code=0, slurm_state="RUNNING", by="batch",
                         end_time=T0 + 110.0, cluster_info=Cluster(nodes=["n1", "n2"]))
    assert ending.classification.error_type == "preempted" and ending.decision.action == "requeue"
    ledger.append(ending.record)
    return ending.record


def test_a_preempted_attempt_records_the_save_at_the_signal_and_the_margin(tmp_path):
    record = attempt(tmp_path, save_done=103.0, at_stop="saved", preempt_time=60)
    assert record["preemption"] == pytest.approx({
        "signal_time": T0 + 100.0, "checkpoint_at_stop": "saved", "saved_at_signal": True,
        "save_done_time": T0 + 103.0, "exit_time": T0 + 110.0, "needed_s": 10.0, "preempt_time": 60,
        "margin_s": 50.0})


def test_a_save_at_the_signal_that_did_not_finish_is_on_record(tmp_path):
    record = attempt(tmp_path, save_done=None, at_stop="failed", preempt_time=None)
    p = record["preemption"]
    assert (p["saved_at_signal"], p["checkpoint_at_stop"], p["save_done_time"], p["margin_s"]) == \
        (False, "failed", None, None)
    assert preemption_margin.preempt_time_of("B:SIGUSR1@90") == 90 and preemption_margin.preempt_time_of(None) is None


def _setup(tmp_path, preempt_time: int):
    task = gpt_tiny(dir=str(tmp_path / "runs"), name="gpt", num_gpus_per_node=1)
    executor = run.SlurmExecutor(account="a", time="01:00:00", tunnel=run.LocalTunnel(job_dir=str(tmp_path / "exp")))
    executor.assign("exp_1", str(tmp_path / "exp" / "exp_1"), task_id="job", task_dir="job")
    PreemptionPlugin(preempt_time=preempt_time).setup(task, executor)
    return task


def test_preemption_plugin_warns_when_preempt_time_is_below_what_the_run_needed(tmp_path, caplog):
    run_dir = tmp_path / "runs" / "gpt"
    run_dir.mkdir(parents=True)
    caplog.set_level(logging.WARNING, logger="megatron_resilience.plugins")
    # before any preemption: the slowest step (2 s) plus the slowest save (70 s) from the run's metrics
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "step_time_s": 2.0}) + "\n" +
                                           json.dumps({"kind": "checkpoint", "step": 1, "blocking_s": 70.0}) + "\n")
    _setup(tmp_path, 60)
    assert caplog.messages == [
        "PreemptionPlugin.preempt_time=60 s is below what a stop at the signal needs: this run's slowest step plus its "
        "slowest save took 72 s (the launcher's shutdown comes on top); the save at the signal may not finish before "
        "Slurm's kill: raise PreemptionPlugin.preempt_time above 73"]
    caplog.clear()
    # a preemption on record: signal -> exit took 75 s
    Ledger(str(run_dir / "job_ledger.jsonl")).append({"kind": "attempt", "preemption": {"needed_s": 75.0}})
    _setup(tmp_path, 74)
    assert caplog.messages == [
        "PreemptionPlugin.preempt_time=74 s is below what a stop at the signal needs: this run's ledger measured 75 s "
        "from the signal to the exit (a step, the save, the launcher's shutdown); the save at the signal may not "
        "finish before Slurm's kill: raise PreemptionPlugin.preempt_time above 76"]
    caplog.clear()
    _setup(tmp_path, 90)
    assert caplog.messages == []
