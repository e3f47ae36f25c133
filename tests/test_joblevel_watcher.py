"""The watcher's decisions against a scripted Slurm (what cannot be staged on the shared one-node cluster).

``scontrol``/``sacct``/``squeue``/``sinfo``/``sbatch``/``scancel`` are one stub that answers from a JSON file
describing the cluster and records every command that changes something. Covered here: a node failure that
Slurm requeued by itself (the exclusion is applied to the pending job when another node exists, recorded but
not applied when it would strand the job; recorded once accounting shows NODE_FAIL, whatever the trainer wrote,
and left to the watcher by the batch script), finished-but-alive, a stall without progress, a job pending on an
exclusion that cannot be met, the per-run lock, and reconciliation of an interrupted submission. The same
paths against the real cluster: tests/slurm/test_joblevel_on_slurm.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve
from megatron_resilience.records.ledger import Ledger
from megatron_resilience.watch.watcher import Watcher, WatcherBusy

STUB = r'''#!PYTHON
import json, os, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
state = json.load(open(os.environ["FAKE_SLURM"]))
def record():
    with open(os.environ["FAKE_SLURM"] + ".calls", "a") as f:
        f.write(" ".join([name] + args) + "\n")
job = state.get("job", {})
if name == "scontrol" and args[:2] == ["show", "hostnames"]:
    print("\n".join(args[2].split(","))); sys.exit(0)
if name == "scontrol" and "show" in args:
    if not job: sys.exit(1)
    print(" ".join(f"{k}={v}" for k, v in job.items())); sys.exit(0)
if name == "sacct":
    for run in state.get("runs", []):
        print("|".join([run.get(k, "") for k in ("JobID", "State", "ExitCode", "Submit", "Start", "End", "NodeList",
                                                   "Reason", "Partition")]))
    sys.exit(0)
if name == "sinfo":
    for node, st in state.get("nodes", {}).items():
        print(f"{node}|{st}")
    sys.exit(0)
if name == "squeue":
    for j in state.get("live", []):
        print(f"{j}|RUNNING|/")
    sys.exit(0)
record()
if name == "scontrol" and args and args[0] == "requeue" and state.get("requeue_refused"):
    print("Requested operation is presently disabled"); sys.exit(1)
if name == "sbatch":
    print("900"); sys.exit(0)
sys.exit(0)
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("scontrol", "sacct", "squeue", "sinfo", "sbatch", "scancel"):
        (bin_dir / name).write_text(STUB.replace("PYTHON", sys.executable))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    state_file = tmp_path / "slurm.json"
    monkeypatch.setenv("FAKE_SLURM", str(state_file))

    def set_state(**state):
        state_file.write_text(json.dumps(state))

    def calls():
        path = str(state_file) + ".calls"
        return open(path).read().splitlines() if os.path.exists(path) else []

    job_dir, run_dir = tmp_path / "job", tmp_path / "run"
    job_dir.mkdir()
    run_dir.mkdir()
    (job_dir / "gpt_sbatch.sh").write_text("#!/bin/bash\n")
    policy, monitors = resolve("megatron_transient", None)
    cfg = JobLevelConfig(job_name="gpt", job_dir=str(job_dir), ledger=str(run_dir / "job_ledger.jsonl"),
                         finished_flag=str(job_dir / "gpt_finished_flag"), run_dir=str(run_dir),
                         stop_reason=str(run_dir / "stop_reason.json"), metrics=str(run_dir / "metrics.jsonl"),
                         policy=policy, monitors=monitors, sbatch_script=str(job_dir / "gpt_sbatch.sh"),
                         finished_grace_seconds=120.0, inactivity_threshold=60.0)
    ledger = Ledger(cfg.ledger)
    ledger.append({"kind": "attempt_start", "job_id": "77", "job_name": "acct.gpt", "slurm_restart": 0,
                   "nodes": "n1", "time": time.time() - 1000})
    return cfg, ledger, set_state, calls


def job(state="RUNNING", restarts=0, **kw):
    return {"JobId": "77", "JobName": "acct.gpt", "JobState": state, "Restarts": str(restarts), "ExitCode": "0:0",
            "NodeList": "n1", "Reason": "None", "Partition": "p", **kw}


@pytest.mark.parametrize("nodes, applied, not_applied", [
    ({"n1": "down", "n2": "idle"}, ["n1"], None),
    ({"n1": "idle"}, [], "excluding n1 would leave 0 usable node(s)"),
])
def test_node_failure_requeued_by_slurm_gets_the_exclusion(fake, nodes, applied, not_applied):
    cfg, ledger, set_state, calls = fake
    (open(os.path.join(cfg.job_dir, "sbatch_acct.gpt_77.out"), "w")
     .write("slurmstepd: error: *** JOB 77 ON n1 CANCELLED AT 2026-03-10T01:44:09 DUE TO NODE FAILURE, SEE SLURMCTLD "
            "LOG FOR DETAILS ***\n"))
    set_state(job=job("PENDING", restarts=1, Reason="BeginTime"), nodes=nodes,
              runs=[{"JobID": "77", "State": "NODE_FAIL", "ExitCode": "0:0", "NodeList": "n1"},
                    {"JobID": "77", "State": "PENDING", "ExitCode": "0:0", "NodeList": "None assigned"}])
    assert Watcher(cfg).step() is False
    [attempt] = ledger.attempts()
    assert (attempt["by"], attempt["classification"]["error_type"], attempt["decision"]["action"]) == \
        ("watcher", "node_fail", "requeue")
    assert attempt["decision"]["exclude_applied"] == applied
    assert (attempt["decision"]["exclude_not_applied"] or "").startswith(not_applied or "")
    assert calls() == ([f"scontrol update JobId=77 ExcNodeList={','.join(applied)}"] if applied else [])
    assert Watcher(cfg).step() is False and len(ledger.attempts()) == 1  # recorded once


def test_node_failure_is_recorded_once_slurm_accounts_for_it_whatever_the_trainer_wrote(fake):
    """A node set DOWN on this one machine: its slurmd SIGTERMs the trainer, which saves and writes "stopped on a
    signal" (exit 0) before Slurm's accounting shows NODE_FAIL. Not a preemption: a node failure, excluded."""
    cfg, ledger, set_state, calls = fake
    with open(cfg.stop_reason, "w") as f:
        json.dump({"reason": "signal", "step": 14, "exit_code": 0, "finished": False}, f)
    pending = job("PENDING", restarts=1, Reason="BeginTime")
    set_state(job=pending, nodes={"n1": "down", "n2": "idle"},
              runs=[{"JobID": "77", "State": "RUNNING", "ExitCode": "0:0", "NodeList": "n1"}])
    assert Watcher(cfg).step() is False and ledger.attempts() == []  # accounting not final yet: the next poll
    set_state(job=pending, nodes={"n1": "down", "n2": "idle"},
              runs=[{"JobID": "77", "State": "NODE_FAIL", "ExitCode": "0:0", "NodeList": "n1"}])
    assert Watcher(cfg).step() is False
    [attempt] = ledger.attempts()
    assert (attempt["classification"]["error_type"], attempt["classification"]["source"],
            attempt["decision"]["exclude_applied"]) == ("node_fail", "slurm", ["n1"])
    assert calls() == ["scontrol update JobId=77 ExcNodeList=n1"]


def test_the_batch_script_leaves_an_attempt_slurm_requeued_itself_to_the_watcher(fake, monkeypatch, capsys):
    from megatron_resilience.jobs import batch_exit

    cfg, ledger, set_state, calls = fake
    with open(cfg.path, "w") as f:
        f.write(cfg.to_json())
    set_state(job=job("PENDING", restarts=1), nodes={"n1": "down", "n2": "idle"})
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    # main ignores SIGTERM (as its own process, inside the EXIT trap); here it must not leak into this process:
    # a child started with SIGTERM ignored cannot trap it (bash), and the sbatch-logic tests run bash
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    assert batch_exit.main(["--config", cfg.path, "--exit-code", "0"]) == 0
    out = capsys.readouterr().out
    assert "was requeued by Slurm or the watcher (now PENDING, restart 1)" in out, out
    assert out.splitlines()[-1] == "megatron_resilience: batch exit code 0"
    assert ledger.attempts() == [] and calls() == []  # no record, no scontrol requeue: the watcher's


def test_finished_but_alive_is_cancelled_after_the_grace_period(fake):
    cfg, ledger, set_state, calls = fake
    set_state(job=job(), live=["77"])
    with open(cfg.stop_reason, "w") as f:
        json.dump({"reason": "finished", "step": 100, "exit_code": 0, "finished": True}, f)
    assert Watcher(cfg).step() is False  # within finished_grace_seconds
    old = time.time() - 150
    os.utime(cfg.stop_reason, (old, old))
    assert Watcher(cfg).step() is True
    assert calls() == ["scancel 77"]
    assert ledger.attempts()[-1]["classification"]["error_type"] == "finished_but_alive"
    assert ledger.final()["outcome"] == "finished"


def test_a_stall_without_progress_is_requeued_when_ft_is_off(fake):
    cfg, ledger, set_state, calls = fake
    set_state(job=job(), nodes={"n1": "idle"}, live=["77"])
    with open(cfg.metrics, "w") as f:
        f.write(json.dumps({"kind": "train", "step": 5, "time": time.time() - 90}) + "\n")
    old = time.time() - 90  # older than inactivity_threshold=60
    os.utime(cfg.metrics, (old, old))
    Watcher(cfg).step()
    [attempt] = ledger.attempts()
    assert (attempt["classification"]["error_type"], attempt["decision"]["action"], attempt["decision"]["spent"]) == \
        ("hang", "requeue", "stall")
    assert calls() == ["scontrol requeue 77"]


def test_a_job_pending_on_an_impossible_exclusion_gets_it_dropped(fake):
    cfg, ledger, set_state, calls = fake
    ledger.append({"kind": "attempt", "job_id": "77", "slurm_restart": 0, "classification": {"mode": "crash"},
                   "decision": {"action": "requeue", "exclude_applied": ["n1"]}})
    set_state(job=job("PENDING", restarts=1, Reason="BadConstraints", ExcNodeList="n1"), live=["77"])
    Watcher(cfg).step()
    assert calls() == ["scontrol update JobId=77 ExcNodeList="]


def test_one_watcher_per_run(fake):
    cfg, *_ = fake
    first = Watcher(cfg)
    first.lock()
    with pytest.raises(WatcherBusy, match=r"another watcher \(pid \d+ on .*\) holds .*\.job_level_watch\.lock"):
        Watcher(cfg).lock()


@pytest.mark.parametrize("live, outcome", [([], (False, None)), (["901"], (True, "901"))])
def test_an_interrupted_submission_is_reconciled(fake, live, outcome):
    cfg, ledger, set_state, calls = fake
    ledger.append({"kind": "intent", "id": "abc", "action": "sbatch", "by": "watcher"})
    set_state(live=live, job=job("RUNNING", StdOut=os.path.join(cfg.job_dir, "sbatch_acct.gpt_901.out")) if live
              else {})
    Watcher(cfg).reconcile()
    last = ledger.records("outcome")[-1]
    assert (last["intent"], last["ok"], last.get("new_job_id")) == ("abc", *outcome)
    assert ledger.pending_intents() == [] and calls() == []  # nothing submitted while reconciling


def test_batch_lost_is_requeued_and_resubmitted_when_slurm_refuses(fake):
    cfg, ledger, set_state, calls = fake
    set_state(job=job("FAILED", ExitCode="0:9"), requeue_refused=True, nodes={"n1": "idle"})
    Watcher(cfg).step()
    [attempt] = ledger.attempts()
    assert (attempt["classification"]["error_type"], attempt["decision"]["action"]) == ("batch_lost", "requeue")
    assert calls() == ["scontrol requeue 77", "sbatch --parsable --requeue --export=ALL,MEGATRON_RESILIENCE_"
                       f"RESUBMISSION=1 --job-name=acct.gpt {cfg.sbatch_script}"]
    assert ledger.records("outcome")[-1]["new_job_id"] == "900"


def test_a_resubmission_with_min_nodes_asks_for_the_nodes_the_partition_can_give(fake):
    """Issue 25: a 2-node job (FaultTolerancePlugin(min_nodes=1)) whose batch host is lost while its other node is
    down: Slurm refuses the requeue, and the resubmission asks for the one node that can take it (--nodes=1) and
    excludes the attempt's node sinfo shows down (issue 34: a node the scheduler keeps from work)."""
    import dataclasses

    cfg, ledger, set_state, calls = fake
    cfg = dataclasses.replace(cfg, min_nodes=1, nodes=2)
    set_state(job=job("FAILED", ExitCode="0:9", NodeList="n1,n2"), requeue_refused=True,
              nodes={"n1": "idle", "n2": "down", "n3": "allocated"})
    Watcher(cfg).step()
    [attempt] = ledger.attempts()
    assert (attempt["decision"]["action"], attempt["node_count"]["nodes"], attempt["node_count"]["was"]) == \
        ("requeue", 1, 2), json.dumps(attempt)
    assert calls() == ["scontrol requeue 77", "sbatch --parsable --requeue --export=ALL,MEGATRON_RESILIENCE_"
                       f"RESUBMISSION=1 --job-name=acct.gpt --exclude=n2 --nodes=1 {cfg.sbatch_script}"]
    assert attempt["decision"]["exclude_scheduler"] == {"n2": "down"}


def test_a_watcher_started_while_the_job_is_pending_waits_for_its_first_attempt(fake, capsys):
    """Issue 23: ``watch RUN_DIR --job-id ID`` on a pending job waits (saying why), then follows the chain."""
    import threading

    from megatron_resilience.watch.cli import main

    cfg, ledger, set_state, calls = fake
    os.remove(ledger.path)  # nothing has started yet: no ledger, no job-level config
    set_state(job=job("PENDING", Reason="Priority", NodeList="(null)"))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(code=main([cfg.run_dir, "--job-id", "77",
                                                                       "--interval", "0.2"])))
    thread.start()
    seen, deadline = "", time.monotonic() + 120  # the watcher says why it waits (however slow a loaded machine is)
    while "waiting for the run's first attempt" not in seen and time.monotonic() < deadline:
        time.sleep(0.1)
        seen += capsys.readouterr().out
    time.sleep(0.5)  # a few more polls: it keeps waiting, and says so once
    assert thread.is_alive() and ledger.records() == []
    # the first attempt starts (the batch script writes its config and attempt_start), trains and finishes
    with open(cfg.path, "w") as f:
        f.write(cfg.to_json())
    ledger.append({"kind": "attempt_start", "job_id": "77", "job_name": "acct.gpt", "slurm_restart": 0, "nodes": "n1",
                   "time": time.time(), "config": cfg.path})
    with open(cfg.stop_reason, "w") as f:
        json.dump({"reason": "finished", "step": 100, "exit_code": 0, "finished": True}, f)
    set_state(job=job("COMPLETED", ExitCode="0:0"), nodes={"n1": "idle"})
    thread.join(timeout=120)
    assert result == {"code": 0}
    out = seen + capsys.readouterr().out
    assert out.count("waiting for the run's first attempt: job 77 is PENDING (Priority)") == 1, out
    assert f"the run's first attempt started: watching with {cfg.path}" in out
    [attempt] = ledger.attempts()
    assert (attempt["by"], attempt["classification"]["error_type"]) == ("watcher", "finished")
    assert ledger.final()["outcome"] == "finished" and calls() == []


def test_a_watcher_for_a_job_cancelled_while_pending_gives_up(fake, capsys):
    from megatron_resilience.watch.cli import main

    cfg, ledger, set_state, calls = fake
    os.remove(ledger.path)
    set_state(runs=[{"JobID": "77", "State": "CANCELLED by 0", "ExitCode": "0:0", "NodeList": "None assigned"}])
    assert main([cfg.run_dir, "--job-id", "77", "--interval", "0.2"]) == 1
    assert "job 77 ended (CANCELLED) before its first attempt started: nothing to watch" in capsys.readouterr().out


def test_a_watcher_for_a_job_slurm_never_knew_gives_up(fake, capsys):
    """A mistyped job id: neither scontrol nor sacct knows it; the watcher stops after UNKNOWN_POLLS polls."""
    from megatron_resilience.watch.cli import UNKNOWN_POLLS, main

    cfg, ledger, set_state, calls = fake
    os.remove(ledger.path)
    set_state()  # no job, no accounting records
    started = time.monotonic()
    assert main([cfg.run_dir, "--job-id", "78", "--interval", "0.05"]) == 2
    assert time.monotonic() - started >= (UNKNOWN_POLLS - 1) * 0.05
    assert capsys.readouterr().out.splitlines() == [
        "megatron_resilience watch: waiting for the run's first attempt: job 78 is not known to Slurm yet (polling "
        "every 0.05 s)",
        f"megatron_resilience watch: job 78 is not known to Slurm (scontrol, sacct) after {UNKNOWN_POLLS} polls "
        "0.05 s apart: giving up (is the job id right, and is this the cluster it was submitted to?)"]
    assert calls() == [] and not os.path.exists(ledger.path)


def test_monitor_only_watcher_records_what_the_job_could_not_and_never_acts(fake):
    """A node failure Slurm requeued by itself, then the batch shell lost: recorded (classified), nothing done."""
    import dataclasses

    cfg, ledger, set_state, calls = fake
    cfg = dataclasses.replace(cfg, policy=None, monitor_only=True)
    (open(os.path.join(cfg.job_dir, "sbatch_acct.gpt_77.out"), "w")
     .write("slurmstepd: error: *** JOB 77 ON n1 CANCELLED AT 2026-03-10T01:44:09 DUE TO NODE FAILURE, SEE SLURMCTLD "
            "LOG FOR DETAILS ***\n"))
    set_state(job=job("PENDING", restarts=1, Reason="BeginTime"), nodes={"n1": "down", "n2": "idle"},
              runs=[{"JobID": "77", "State": "NODE_FAIL", "ExitCode": "0:0", "NodeList": "n1"},
                    {"JobID": "77", "State": "PENDING", "ExitCode": "0:0", "NodeList": "None assigned"}])
    assert Watcher(cfg).step() is False  # Slurm's own requeue goes on: still watching
    [attempt] = ledger.attempts()
    assert (attempt["classification"]["error_type"], attempt["decision"]["action"], attempt["policy"]) == \
        ("node_fail", "record", "monitor_only")
    assert calls() == [] and ledger.final() is None
    ledger.append({"kind": "attempt_start", "job_id": "77", "job_name": "acct.gpt", "slurm_restart": 1,
                   "nodes": "n2", "time": time.time() - 10,
                   "batch_log_offset": os.path.getsize(os.path.join(cfg.job_dir, "sbatch_acct.gpt_77.out"))})
    set_state(job=job("FAILED", restarts=1, ExitCode="0:9", NodeList="n2"), nodes={"n1": "down", "n2": "idle"},
              runs=[{"JobID": "77", "State": "NODE_FAIL", "ExitCode": "0:0", "NodeList": "n1"},
                    {"JobID": "77", "State": "FAILED", "ExitCode": "0:9", "NodeList": "n2"}])
    assert Watcher(cfg).step() is True
    last = ledger.attempts()[-1]
    assert (last["classification"]["error_type"], last["decision"]["action"]) == ("batch_lost", "record")
    assert calls() == [] and ledger.final()["outcome"] == "monitor_only"
