"""In-process restart and the recovery ladder, proven with the real trainer (tiny GPT, 2 CPU ranks, gloo) under the
real ft_launcher with FT on, and node-local checkpoints replicated between two ft_launcher agents.

Every faulty run finishes (or gives up) with per-step losses bitwise equal to an uninterrupted run's, and its
``metrics.jsonl`` tells which rung of the ladder recovered it: ``start`` records carry ``attempt.in_job_restart``
(ft_launcher restarted the processes) and ``attempt.inprocess_restart`` (the training function was called again
in the same process), each in-process restart has its ``inprocess_restart`` record (cause, restored tier).

1. an exception on rank 1 restarts in-process from the in-memory copy; then rank 0 is SIGKILLed (a dead process):
   ft_launcher restarts the processes, which resume from the node-local tier;
2. a rank that stops making progress (alive, responsive) is interrupted by the soft timeout, in-process;
3. a NaN in one rank's weights: the rerun state machine's NaN check raises, in-process restart; with
   ``rerun.rerun_mode=validate_results`` the same NaN ends in exit 16 instead, which goes to a process restart;
4. a hang the wrapper cannot abort (SIGSTOP): the hard timeout terminates the rank, ft_launcher restarts;
5. a fault on every call: the in-process budget runs out, the processes restart, their budget runs out, the
   launcher exits non-zero (no loop);
6. two agents (one rank each, the launchers of a two-node job): a node's local checkpoint folder is lost, the
   next run fetches that rank's part from its replica on the other node.

Runs are independent and launched together (a thread pool for the module); each test waits for its own.
Assertions are on order and causality, never on timing.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from resilience_support.agents import launch_two_agents
from resilience_support.launch import launch, run_to_end, wait_for

from megatron_resilience.report import run_report as report

pytestmark = pytest.mark.slow

WAIT = 900
STEPS = 16


def base(run_dir, **inprocess) -> list[str]:
    timeouts = {"soft_timeout": 120, "hard_timeout": 240, "heartbeat_interval": 5, "heartbeat_timeout": 120,
                "barrier_timeout": 300, "completion_timeout": 300, **inprocess}
    return [f"train.max_steps={STEPS}", "checkpoint.save_interval=8", f"checkpoint.local_dir={run_dir / 'local'}",
            "checkpoint.local_interval=2", "checkpoint.replication_factor=2", "checkpoint.replication_jump=1",
            "inprocess.enabled=true", *(f"inprocess.{k}={v}" for k, v in timeouts.items())]


def fault(kind: str, rank: int, step: int) -> list[str]:
    return ["ft.simulate_fault=true", f"ft.simulated_fault_type={kind}", f"ft.simulated_fault_rank={rank}",
            f"ft.simulated_fault_step={step}"]


def _reference(root):
    return run_to_end(root / "reference", base(root / "reference"), max_restarts=0, timeout=WAIT)


def _exception_then_killed(root):
    run_dir = root / "exception_killed"
    run = launch(run_dir, base(run_dir) + fault("exception", 1, 5), max_restarts=1)

    def restarted_in_process_and_past_step_10():
        recs = run.records() if (run_dir / "metrics.jsonl").exists() else []
        return (any(r["kind"] == "inprocess_restart" for r in recs)
                and any(r["kind"] == "train" and r["step"] >= 11 for r in recs))

    wait_for(restarted_in_process_and_past_step_10, timeout=WAIT, what="an in-process restart, then step 11")
    pid, _ = run.worker_pids()[0]
    os.kill(pid, signal.SIGKILL)
    run.extra["killed_pid"] = pid
    run.wait(WAIT)
    return run


def _stalled(root):
    run_dir = root / "stalled"
    return run_to_end(run_dir, base(run_dir, soft_timeout=30, hard_timeout=120) + fault("rank_stalled", 1, 7),
                      max_restarts=0, timeout=WAIT)


def _nan(root):
    run_dir = root / "nan"
    return run_to_end(run_dir, base(run_dir) + fault("nan", 0, 7), max_restarts=0, timeout=WAIT)


def _nan_validated(root):
    run_dir = root / "nan_validated"  # short: both attempts end at the suspicious step 3
    overrides = base(run_dir) + fault("nan", 0, 3) + ["rerun.rerun_mode=validate_results"]
    run_to_end(run_dir, overrides, max_restarts=1, timeout=WAIT)  # 16: ft_launcher told not to restart
    return run_to_end(run_dir, overrides, max_restarts=0, timeout=WAIT)  # the job level's requeue, same machine


def _hung(root):
    run_dir = root / "hung"
    return run_to_end(run_dir, base(run_dir, soft_timeout=20, hard_timeout=40) + fault("rank_hung", 1, 7),
                      max_restarts=1, timeout=WAIT)


def _budget(root):
    run_dir = root / "budget"
    return run_to_end(run_dir, base(run_dir, max_iterations=2) + fault("exception", 1, 3)
                      + ["ft.simulated_fault_repeat=true"], max_restarts=1, timeout=WAIT)


def _lost_node(root):
    run_dir = root / "lost_node"
    # the first run stops at step 10 of the reference's schedule (the learning rate decays over 16 steps)
    common = [f"checkpoint.local_dir={run_dir / 'local'}", "checkpoint.local_interval=2",
              "checkpoint.replication_factor=2", "checkpoint.save_on_exit=false", f"optim.lr_decay_steps={STEPS}"]
    first = launch_two_agents(run_dir, common + ["train.max_steps=10"], join_timeout=300, max_restarts=0)
    first.wait(WAIT)
    rank1 = glob.glob(str(run_dir / "local" / "*" / "1"))
    lost = {"folder": rank1, "files": sorted(os.listdir(rank1[0])) if rank1 else None}
    for folder in rank1:
        shutil.rmtree(folder)  # node 1's local disk is gone (the node was replaced)
    first_codes = [a.returncode for a in first.agents]
    second = launch_two_agents(run_dir, common + [f"train.max_steps={STEPS}"], join_timeout=300, max_restarts=0)
    second.wait(WAIT)
    second.extra.update(first_codes=first_codes, lost=lost)
    return second


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inprocess")
    jobs = {"reference": _reference, "exception_killed": _exception_then_killed, "stalled": _stalled, "nan": _nan,
            "nan_validated": _nan_validated, "hung": _hung, "budget": _budget, "lost_node": _lost_node}
    pool = ThreadPoolExecutor(max_workers=len(jobs))
    futures = {name: pool.submit(fn, root) for name, fn in jobs.items()}
    yield futures
    pool.shutdown(wait=True)


def _get(runs, name):
    return runs[name].result(timeout=3 * WAIT)


def _ladder(run) -> list[tuple]:
    """(kind, in_job_restart, inprocess_restart, resumed step, tier) of every start and in-process restart."""
    out = []
    for r in run.records():
        if r["kind"] == "start":
            out.append(("start", r["attempt"]["in_job_restart"], r["attempt"]["inprocess_restart"],
                        r["resumed_from"], r["resumed_tier"]))
        elif r["kind"] == "inprocess_restart":
            out.append(("inprocess_restart", r["iteration"], r["restored_from"]["tier"], r["restored_from"]["step"]))
    return out


def _restart_record(run, iteration=1) -> dict:
    return next(r for r in run.records() if r["kind"] == "inprocess_restart" and r["iteration"] == iteration)


def _assert_exact(run, ref, steps=STEPS):
    losses = run.losses()
    assert sorted(losses) == list(range(1, steps + 1)), sorted(losses)
    assert losses == {s: ref.losses()[s] for s in losses}  # bitwise: nothing lost, nothing computed differently


def test_reference_finishes_without_restarts(runs):
    ref = _get(runs, "reference")
    assert ref.returncode == 0, ref.log()[-3000:]
    assert _ladder(ref) == [("start", 0, 0, None, None)]
    assert sorted(ref.losses()) == list(range(1, STEPS + 1)) and ref.flag.exists()
    saves = [(r["step"], r["tier"]) for r in ref.records() if r["kind"] == "checkpoint"]
    assert saves == [(2, "local"), (4, "local"), (6, "local"), (8, "persistent"), (8, "local"), (10, "local"),
                     (12, "local"), (14, "local"), (16, "persistent")]


def test_exception_restarts_in_process_from_memory_then_a_killed_rank_falls_through_to_a_process_restart(runs):
    ref, run = _get(runs, "reference"), _get(runs, "exception_killed")
    log = run.log()
    assert run.returncode == 0, log[-3000:]
    ladder = _ladder(run)
    # in-process restart after the exception at step 5 (the memory copy of step 4), then the process restart
    # after the kill, from the local tier (a new process has no memory copy); the newest local save <= 11 is 10
    assert ladder[:3] == [("start", 0, 0, None, None), ("inprocess_restart", 1, "memory", 4),
                          ("start", 0, 1, 4, "memory")], ladder
    assert ladder[3][:3] == ("start", 1, 0) and ladder[3][4] == "local" and ladder[3][3] >= 10, ladder
    assert len(ladder) == 4, ladder
    record = _restart_record(run)
    assert record["cause"] == "exception on rank 1"
    # the run's history counts the in-process restart like any other restart (start records' totals)
    last = [r for r in run.records() if r["kind"] == "start"][-1]
    assert (last["restart"], last["totals"]["in_job_restarts"], last["totals"]["inprocess_restarts"]) == \
        ("in_job_restart", 1, 1), last
    assert record["fault_time"] <= record["detected_time"] <= record["began_time"] <= record["time"]
    assert "exception:cuda_oom on rank 1" in log and "at the start of step 5" in log
    assert "in-process restart: shut down" in log  # gloo freed by closing its connections
    assert "Worker group UNHEALTHY. 1/1 attempts left; will restart worker group" in log or \
        "Worker group FAILED. 1/1 attempts left; will restart worker group" in log
    assert f"resuming from the local checkpoint of step {ladder[3][3]}" in log
    _assert_exact(run, ref)
    assert run.flag.exists()

    # The report (the goodput issue's accounting) charges each rung to its own bucket: the in-process restart's
    # downtime (the first abort -> the restarted function) to restart_inprocess, the process restart's to
    # restart_process; the in-process one is named by its record's cause.
    acc = report.build(str(run.run_dir), slurm_lookup=False).accounting
    assert [(i.kind, i.cause, i.fault_source) for i in acc.interruptions] == [
        ("inprocess", "exception on rank 1", "trainer"), ("process", "in_job_restart", "last sign of life")]
    inprocess, process = acc.interruptions
    assert (inprocess.fault_time, inprocess.detected) == (record["fault_time"], record["detected_time"])
    assert inprocess.cost["restart_inprocess"] == pytest.approx(record["began_time"] - record["detected_time"])
    assert "restart_process" not in inprocess.cost and "restart_inprocess" not in process.cost
    assert process.cost["restart_process"] > 0
    assert acc.badput["restart_inprocess"] == pytest.approx(inprocess.cost["restart_inprocess"])
    assert acc.badput["restart_process"] == pytest.approx(process.cost["restart_process"])


def test_a_stalled_rank_is_interrupted_by_the_soft_timeout_and_restarts_in_process(runs):
    ref, run = _get(runs, "reference"), _get(runs, "stalled")
    log = run.log()
    assert run.returncode == 0, log[-3000:]
    assert "rank_stalled on rank 1" in log
    assert _ladder(run) == [("start", 0, 0, None, None), ("inprocess_restart", 1, "memory", 6),
                            ("start", 0, 1, 6, "memory")]
    record = _restart_record(run)
    assert "soft_timeout" in record["cause"]
    # no rank raised: the fault is the last sign of progress (the report's fallback); the abort is timed
    assert record["fault_time"] is None and record["detected_time"] <= record["began_time"] <= record["time"]
    _assert_exact(run, ref)


def test_a_nan_rejected_by_the_rerun_state_machine_restarts_in_process(runs):
    ref, run = _get(runs, "reference"), _get(runs, "nan")
    log = run.log()
    assert run.returncode == 0, log[-3000:]
    assert "nan on rank 0" in log and "Unexpected result nan (message='found NaN in local forward loss" in log
    assert _ladder(run) == [("start", 0, 0, None, None), ("inprocess_restart", 1, "memory", 6),
                            ("start", 0, 1, 6, "memory")]
    assert _restart_record(run)["cause"] == "exception on rank 0"
    _assert_exact(run, ref)


def test_a_nan_the_rerun_state_machine_validates_exits_16_to_a_process_restart_not_in_process(runs):
    """``rerun.rerun_mode=validate_results``: the NaN step is re-run in place, NaN again, saved with the diagnosis,
    and the run exits 16 (re-run the step on other hardware), which an in-process restart cannot give, and neither
    can an in-job one (the same allocation): the wrapper returns the code instead of restarting, ft_launcher is told
    not to restart, and the next attempt (the job level's requeue; here the same machine again) resumes from the
    persistent checkpoint that carries the diagnosis (the local copy of its step is discarded). It runs on the same
    node, so Megatron-Core asks again (16)."""
    ref, run = _get(runs, "reference"), _get(runs, "nan_validated")
    log = run.log()
    assert run.returncode != 0, log[-3000:]
    assert "nan on rank 0" in log and "Unexpected result nan on rank 0" in log
    assert _ladder(run) == [("start", 0, 0, None, None), ("start", 0, 0, 2, "persistent")]
    assert "falling through to a process restart" not in log  # exit 16 is the function's result, not a fault
    assert log.count("rerun state machine: exiting with code 16 at step 3") == 2
    first = log.index("failed (exitcode: 16)")
    assert "WorkloadControlRequest(action=WorkloadAction.ShutdownWorkload, description=rerun:16: do not restart)" \
        in log, log[-3000:]
    assert ("checkpoint: local checkpoints of step 2 and later discarded (the persistent checkpoint of step 2 carries "
            "the rerun state machine's diagnosis)") in log
    assert ("checkpoint: resuming from the persistent checkpoint of step 2 (the newest; found: memory none, local "
            "none, persistent step 2)") in log[first:]
    assert ("checkpoint: rerun state machine restored (state WILL_RERUN_FROM_CHECKPOINT, iteration 2, mode "
            "VALIDATE_RESULTS)") in log[first:]
    records = run.records()
    assert [(r["step"], r["tier"], r["reason"]) for r in records if r["kind"] == "checkpoint"] == [
        (2, "local", "interval"), (2, "persistent", "rerun state machine, exit code 16")]
    ends = [(r["step"], r["reason"], r["exit_code"]) for r in records if r["kind"] == "end"]
    assert ends == [(2, "rerun:16", 16)] * 2
    assert run.stop_reason()["exit_code"] == 16 and not run.flag.exists()  # 16: the job level requeues
    _assert_exact(run, ref, steps=2)


def test_a_hang_the_wrapper_cannot_abort_ends_in_the_hard_timeout_and_a_process_restart(runs):
    ref, run = _get(runs, "reference"), _get(runs, "hung")
    log = run.log()
    assert run.returncode == 0, log[-3000:]
    assert "rank_hung on rank 1" in log
    assert "failed (exitcode: -15) local_rank: 1" in log  # SIGTERM from the wrapper's monitor at the hard timeout
    ladder = _ladder(run)
    assert ladder == [("start", 0, 0, None, None), ("start", 1, 0, 6, "local")], ladder
    _assert_exact(run, ref)


def test_an_exhausted_in_process_budget_falls_through_and_the_ladder_ends(runs):
    ref, run = _get(runs, "reference"), _get(runs, "budget")
    log = run.log()
    assert run.returncode != 0, log[-3000:]  # every call faults: the launcher gives up instead of looping
    ladder = _ladder(run)
    kinds = [(e[1], e[2]) if e[0] == "start" else ("ip", e[1]) for e in ladder]
    assert kinds == [(0, 0), ("ip", 1), (0, 1), (1, 0), ("ip", 1), (1, 1)], ladder
    assert log.count("in-process budget exhausted (inprocess.max_iterations=2): falling through to a process "
                     "restart") >= 2
    assert not run.flag.exists()
    losses = run.losses()
    assert losses and losses == {s: ref.losses()[s] for s in losses}


def test_a_lost_nodes_local_part_is_fetched_from_its_replica(runs):
    ref, run = _get(runs, "reference"), _get(runs, "lost_node")
    assert run.extra["first_codes"] == [0, 0], run.log()[-3000:]
    # node 1 held its own part of step 8 and rank 0's replica; both are gone with its folder
    assert run.extra["lost"]["files"] == ["iter_0000008_0_local.pt", "iter_0000008_1_local.pt"]
    assert [a.returncode for a in run.agents] == [0, 0], run.log()[-3000:]
    log = run.log()
    assert "resuming from the local checkpoint of step 8 (the newest; found: memory none, local step 8, " \
           "persistent none)" in log
    assert "the local parts of rank(s) [1] for step 8 are not on their nodes (a lost or replaced node): " \
           "fetching them from their replicas (groups [(0, 1)])" in log
    starts = [r for r in run.records("start")]
    assert [(s["resumed_from"], s["resumed_tier"]) for s in starts] == [(None, None), (8, "local")]
    assert run.losses() == ref.losses()  # steps 9-10 trained twice, bitwise the same; 11-16 continue exactly
