"""The report's accounting, bucket by bucket, against runs whose seconds per phase are known.

Each scenario is a synthetic ``metrics.jsonl`` (the trainer's record kinds, documented in
``runtime/metrics.py``) and, for Slurm chains, a synthetic ``job_ledger.jsonl`` and chaos ledger, with
every phase's seconds chosen by hand; the expected buckets are worked out in the comments. The
demo's real numbers are checked in ``test_examples.py``, a real Slurm chain's in ``tests/slurm``.
"""

from __future__ import annotations

import json

import pytest
from resilience_support.goodput_records import (
    HANG_RUN,
    T0,
    approx,
    assert_tiles,
    buckets,
    save,
    start,
    steps,
    write_jsonl,
)

from megatron_resilience.goodput.accounting import PRODUCTIVE, account
from megatron_resilience.goodput.buckets import BUCKETS, AttemptWindow
from megatron_resilience.report import run_report as report


def test_every_bucket_of_an_in_job_restart_after_an_injected_hang():
    window = AttemptWindow(index=0, start=T0, end=T0 + 60, ending="finished", cycle_endings={0: "hang"},
                           detections=[T0 + 36.0])
    acc = account([window], HANG_RUN, [{"time": T0 + 31.0, "fault": "hang", "expected": ["hang"]}])
    assert_tiles(acc)
    assert acc.allocated == 60
    # productive: steps 1-6 and 7-10 once each, 1.5 s each; steps 5-6 run again after the restart are wasted
    assert acc.productive == pytest.approx(15.0)
    assert buckets(acc) == approx({
        # launch 2 (launcher -> process), process start -> imports 8, -> distributed 1, -> model 1, -> optimizer 1,
        # checkpoint_load -> start record 1; second process: 1 + 3 + 1 + 0.5 + 0.5 + 0.5
        "startup": 14.0 + 6.5,
        "data_loading": 2.0 + 0.5,  # optimizer -> data marks
        "checkpoint_restore": 1.0 + 1.0,  # data -> checkpoint_load marks
        "checkpoint_save": 0.4 + 0.3,  # the records' blocking_s
        "wasted_progress": 1.0 + 3.0,  # last sign of life (30) -> fault (31), and steps 5-6 re-run
        "failure_detection": 5.0,  # fault (31) -> the launcher's detection line (36)
        "restart_process": 2.0,  # detection -> the new process (38)
        "eval": 0.8,
        "other": 7.5,  # 0.5 s between steps (0.1 beside the save), 0.2 before the eval, teardown 1.6
    })
    [hang] = acc.interruptions
    assert (hang.kind, hang.cause, hang.fault_source, hang.fault_time, hang.detected) == \
        ("process", "hang", "injected", T0 + 31, T0 + 36)
    # cost: last sign of life (30) -> first new productive step (step 7 begins at 50.5), nothing productive inside
    assert hang.resumed == pytest.approx(T0 + 50.5) and hang.total == pytest.approx(20.5)
    assert hang.cost == approx({
        "wasted_progress": 4.0, "failure_detection": 5.0, "restart_process": 2.0, "startup": 6.5,
        "data_loading": 0.5, "checkpoint_restore": 1.0, "other": 1.5})
    # Daly's R: fault -> the first step of the next cycle (step 5's re-run begins at 46.5)
    assert hang.restart_seconds == pytest.approx(15.5)
    assert sum(acc.by_cause["hang"].values()) == pytest.approx(20.5)
    assert sum(acc.by_cause["-"].values()) == pytest.approx(60 - 15 - 20.5)


def test_wasted_progress_is_drawn_where_the_steps_were_run_again():
    acc = account([AttemptWindow(index=0, start=T0, end=T0 + 60, cycle_endings={0: "hang"})], HANG_RUN)
    wasted = [(round(s.start - T0, 6), round(s.end - T0, 6)) for s in acc.spans if s.bucket == "wasted_progress"]
    # no injection: the fault is the last sign of life, so no lost work in progress; the re-runs of steps 5 and 6
    assert wasted == [(46.5, 48.0), (48.5, 50.0)]
    first_runs = [(round(s.start - T0, 6), round(s.end - T0, 6)) for s in acc.spans
                  if s.bucket == PRODUCTIVE and s.start < T0 + 30]
    assert first_runs[-2:] == [(25.5, 27.0), (27.5, 29.0)]  # their first runs stay productive


def preempted_chain(tmp_path):
    """Attempt 0 (0-20 s) is preempted: signal at 13.2 s, save 13.6-14.6, end 15; queue 20-32; attempt 1 (32-50)
    resumes from step 8 and finishes. A chaos run injected the preemption at 13.1 s."""
    metrics = [
        start(5, process_start=1, marks={"imports": 3, "checkpoint_load": 4}, job_id="100"),
        *steps(1, 8, at=6, every=1, step_time=0.8),
        {"kind": "signal", "signal": "SIGTERM", "received_time": T0 + 13.2, "first_received_time": T0 + 13.2,
         "step": 8, "time": T0 + 13.5},
        save(8, 13.6, 1.0, reason="signal"),
        {"kind": "end", "step": 8, "reason": "signal", "exit_code": 0, "time": T0 + 15.0},
        start(36, step=8, resumed_from=8, process_start=33, marks={"imports": 35, "checkpoint_load": 35.5},
              job_id="100", restart=1),
        *steps(9, 12, at=37, every=1, step_time=0.8),
        save(12, 40.1, 0.5, reason="finished"),
        {"kind": "end", "step": 12, "reason": "finished", "exit_code": 0, "time": T0 + 41.0},
    ]
    ledger = [
        {"kind": "attempt_start", "job_id": "100", "slurm_restart": 0, "nodes": "n1", "time": T0},
        {"kind": "attempt", "by": "batch", "job_id": "100", "slurm_restart": 0, "start": T0, "end": T0 + 20,
         "nodes": ["n1"], "exit_code": 0, "classification": {"error_type": "preempted", "mode": None,
                                                              "source": "stop_reason"},
         "decision": {"action": "requeue"}, "cycles": [{"cycle": 0, "resumed_from": None, "last_step": 8}],
         "policy": "megatron_transient", "time": T0 + 20},
        {"kind": "attempt_start", "job_id": "100", "slurm_restart": 1, "nodes": "n2", "time": T0 + 32},
        {"kind": "attempt", "by": "batch", "job_id": "100", "slurm_restart": 1, "start": T0 + 32, "end": T0 + 50,
         "nodes": ["n2"], "exit_code": 0, "classification": {"error_type": "finished", "mode": None,
                                                             "source": "stop_reason"},
         "decision": {"action": "stop", "outcome": "finished"}, "cycles": [{"cycle": 0, "resumed_from": 8,
                                                                           "last_step": 12}],
         "policy": "megatron_transient", "time": T0 + 50},
        {"kind": "final", "outcome": "finished", "message": "training finished after 2 attempt(s)", "time": T0 + 50},
    ]
    write_jsonl(tmp_path / "metrics.jsonl", metrics)
    write_jsonl(tmp_path / "job_ledger.jsonl", ledger)
    write_jsonl(tmp_path / "chaos_ledger.jsonl", [
        {"kind": "injection", "fault": "preempt", "cause": "Host maintenance", "expected": ["preempted"],
         "job_id": "100", "slurm_restart": 0, "node": "n1", "time": T0 + 13.1}])
    return tmp_path


def test_a_preemptions_recovery_is_its_own_cost_signal_to_first_new_step(tmp_path):
    run = report.build(str(preempted_chain(tmp_path)), slurm_lookup=False)
    acc = run.accounting
    assert_tiles(acc)
    assert acc.allocated == pytest.approx(38.0) and acc.queue_wait == pytest.approx(12.0)
    assert acc.productive == pytest.approx(12 * 0.8)
    assert buckets(acc) == approx({
        "startup": 1 + 2 + 1 + 1 + 2 + 0.5,  # launch (0-1), 1-3, checkpoint_load -> start; launch 32-33, 33-35, ->36
        "checkpoint_restore": 1.0 + 0.5,
        "checkpoint_save": 1.0 + 0.5,
        "restart_job": 5.0,  # the preempted trainer's end (15) -> the attempt's end (20)
        "other": 38 - 9.6 - 7.5 - 1.5 - 1.5 - 5.0,
    })
    [p] = acc.interruptions
    assert (p.kind, p.cause, p.fault_source, p.fault_time) == ("preemption", "preempted", "injected", T0 + 13.1)
    # 13.1 -> step 9's start (36.2): 0.5 other + 1.0 save + 0.4 other + 5 restart, then launch 1 + 2 + 0.5 restore
    # + 0.5 startup + 0.2 other in attempt 1; and the 12 s in the queue beside it
    assert p.total == pytest.approx(6.9 + 4.2) and p.queue_wait == pytest.approx(12.0)
    assert p.cost["restart_job"] == pytest.approx(5.0) and p.cost["checkpoint_save"] == pytest.approx(1.0)
    assert run.injected["all_classified"] and run.injected["by_fault"] == {
        "preempt": {"injected": 1, "classified_as_expected": 1, "as_expected": {"preempted": 1}, "as_another": {},
                    "absorbed": [], "no_interruption": [], "not_done": [], "outside_job": {}}}
    text = report.format_report(run)
    assert "goodput: 25.3% (productive training 9.6s of 38.0s allocated)" in text
    assert "queue wait (not allocated): 12.0s" in text
    assert "cost by cause: preempted 11.1s (29.2%)" in text
    assert "  preempt: injected 1, classified as expected 1 (preempted)" in text
    assert [(r.attempt, r.state, r.ended) for r in run.rows] == [(0, "?", "preempted (stop_reason)"),
                                                                (1, "?", "finished (stop_reason)")]
    data = run.to_dict()
    assert data["accounting"]["goodput"] == pytest.approx(9.6 / 38) and set(data["accounting"]["badput"]) == \
        set(BUCKETS)


def test_in_process_restarts_are_their_own_bucket():
    """Issue 24's records: an ``inprocess_restart`` record (iteration, fault_time, cause, restored_from) and a start
    record with ``attempt.inprocess_restart``; the old process's creation and marks are not counted again."""
    records = [
        start(3, process_start=1, marks={"imports": 2, "checkpoint_load": 2.5}),
        *steps(1, 5, at=4, every=1, step_time=0.5),
        {"kind": "inprocess_restart", "iteration": 1, "fault_time": T0 + 8.4, "cause": "python_exception",
         "restored_from": {"tier": "memory", "step": 5}, "time": T0 + 8.9},
        start(9.8, step=5, resumed_from=5, process_start=1, inprocess=1,
              marks={"imports": 2, "entered": 9.0, "checkpoint_load": 9.6}),
        *steps(6, 8, at=10.8, every=1, step_time=0.5),
        {"kind": "end", "step": 8, "reason": "finished", "exit_code": 0, "time": T0 + 13.0},
    ]
    acc = account([AttemptWindow(index=0, start=T0, end=T0 + 14)], records)
    assert_tiles(acc)
    assert buckets(acc) == approx({
        "startup": 1 + 1 + 0.5 + 0.2,  # launch, imports, checkpoint_load -> start; 9.6 -> 9.8 after the restart
        "checkpoint_restore": 0.5 + 0.6,  # 2 -> 2.5; 'entered' 9.0 -> 'checkpoint_load' 9.6
        "wasted_progress": 0.4,  # last step record (8.0) -> fault (8.4)
        "failure_detection": 0.5,  # fault -> the restart record (8.9)
        "restart_inprocess": 0.1,  # restart -> the iteration's first mark (9.0)
        "other": 14 - 8 * 0.5 - 2.7 - 1.1 - 0.4 - 0.5 - 0.1,
    })
    [i] = acc.interruptions
    assert (i.kind, i.cause, i.fault_source) == ("inprocess", "python_exception", "trainer")
    assert acc.badput["restart_process"] == 0


def test_in_process_restarts_in_two_processes_are_each_charged_from_their_own_record():
    """Iterations count from 1 again in every process: after a process restart, the second process's in-process
    restart writes ``iteration: 1`` too. Each record belongs to the restart it follows (by time, within the cycle).
    Cycles count every start (``local_window``'s endings): cycle 1, process 0's second call, ended in the kill."""
    def restarted(iteration, fault, detected, t, cause):
        return {"kind": "inprocess_restart", "iteration": iteration, "fault_time": T0 + fault,
                "detected_time": T0 + detected, "began_time": T0 + detected + 0.2, "cause": cause,
                "restored_from": {"tier": "memory", "step": 5}, "time": T0 + t}

    records = [
        start(3, process_start=1, marks={"imports": 2, "checkpoint_load": 2.5}),
        *steps(1, 5, at=4, every=1, step_time=0.5),
        restarted(1, 8.3, 8.6, 8.9, "exception on rank 1"),
        start(9.8, step=5, resumed_from=5, process_start=1, inprocess=1,
              marks={"imports": 2, "entered": 9.0, "checkpoint_load": 9.6}),
        *steps(6, 8, at=10.8, every=1, step_time=0.5),
        # the process dies after step 8 (12.8); ft_launcher's new process starts at 16
        start(20, step=8, resumed_from=8, process_start=16, in_job=1, inprocess=0,
              marks={"imports": 18, "checkpoint_load": 19}),
        *steps(9, 12, at=21, every=1, step_time=0.5),
        restarted(1, 24.2, 24.7, 24.9, "soft_timeout on ranks 0,1"),
        start(25.8, step=12, resumed_from=12, process_start=16, in_job=1, inprocess=1,
              marks={"imports": 18, "entered": 25.0, "checkpoint_load": 25.6}),
        *steps(13, 15, at=26.8, every=1, step_time=0.5),
        {"kind": "end", "step": 15, "reason": "finished", "exit_code": 0, "time": T0 + 29.0},
    ]
    acc = account([AttemptWindow(index=0, start=T0, end=T0 + 30, cycle_endings={1: "killed"})], records)
    assert_tiles(acc)
    assert acc.productive == pytest.approx(15 * 0.5)  # every step once
    assert buckets(acc) == approx({
        # launch 0-1, 1-2 imports, 2.5-3; 9.6-9.8; new process 16-18, 19-20; 25.6-25.8
        "startup": 2.5 + 0.2 + 3.0 + 0.2,
        "checkpoint_restore": 0.5 + 0.6 + 1.0 + 0.6,  # 2-2.5; 'entered' 9.0-9.6; 18-19; 'entered' 25.0-25.6
        "wasted_progress": 0.3 + 0.2,  # last step record -> fault: 8.0-8.3, 24.0-24.2
        "failure_detection": 0.3 + 0.5,  # fault -> detected: 8.3-8.6, 24.2-24.7
        "restart_inprocess": 0.4 + 0.3,  # detected -> the iteration's first mark: 8.6-9.0, 24.7-25.0
        "restart_process": 3.2,  # the last sign of life (12.8) -> the new process (16)
        "other": 30 - 7.5 - 5.9 - 2.7 - 0.5 - 0.8 - 0.7 - 3.2,
    })
    assert [(i.kind, i.cause, i.fault_source, round(i.fault_time - T0, 6), round(i.detected - T0, 6))
            for i in acc.interruptions] == [("inprocess", "exception on rank 1", "trainer", 8.3, 8.6),
                                            ("process", "killed", "last sign of life", 12.8, 12.8),
                                            ("inprocess", "soft_timeout on ranks 0,1", "trainer", 24.2, 24.7)]
    first, process, second = acc.interruptions
    # each: its fault (or last sign of life) -> the first new productive step (10.3, 20.5, 26.3)
    assert first.cost == approx({"wasted_progress": 0.3, "failure_detection": 0.3, "restart_inprocess": 0.4,
                                 "checkpoint_restore": 0.6, "startup": 0.2, "other": 0.5})
    assert process.cost == approx({"restart_process": 3.2, "startup": 3.0, "checkpoint_restore": 1.0, "other": 0.5})
    assert second.cost == approx({"wasted_progress": 0.2, "failure_detection": 0.5, "restart_inprocess": 0.3,
                                  "checkpoint_restore": 0.6, "startup": 0.2, "other": 0.5})
    assert [i.resumed - T0 for i in acc.interruptions] == pytest.approx([10.3, 20.5, 26.3])


def test_a_run_without_records_of_its_own_is_all_startup_or_failed_start():
    acc = account([AttemptWindow(index=0, start=T0, end=T0 + 10, ending="node_fail", failure=True),
                   AttemptWindow(index=1, start=T0 + 15, end=T0 + 20, ending="running", running=True)], [])
    assert acc.badput["restart_job"] == 10 and acc.badput["startup"] == 5 and acc.queue_wait == 5
    assert_tiles(acc)


def test_faults_injected_into_an_attempt_that_never_trained_are_its_own():
    """Found by the long chaos run: a rank hang landed in setup, then a preemption found the ranks hung; the attempt
    wrote no record and its interruption was timed from its start, so both faults read as matched to no
    interruption. The one its classification names ends it, the other is absorbed; the cost stays the window."""
    hang = {"time": T0 + 3, "fault": "rank_hang", "expected": ["hang"]}
    preempt = {"time": T0 + 29, "fault": "preempt", "expected": ["preempted"]}
    later = {"time": T0 + 70, "fault": "gpu_ecc", "expected": ["ecc_error"]}
    acc = account([AttemptWindow(index=0, start=T0, end=T0 + 60, ending="preempted"),
                   AttemptWindow(index=1, start=T0 + 65, end=T0 + 71, ending="ecc_error", failure=True)], [],
                  [hang, preempt, later])
    first, second = acc.interruptions
    assert (first.kind, first.injection, first.absorbed, first.fault_source, first.fault_time) == \
        ("preemption", preempt, [hang], "injected", T0 + 29)
    assert (second.kind, second.injection, second.absorbed, second.fault_source) == ("job", later, [], "injected")
    assert acc.badput["restart_job"] == 66 and acc.queue_wait == 5  # both windows, as before
    assert_tiles(acc)


def test_a_save_the_windows_end_cut_is_a_save_stall_up_to_the_end():
    """Found by the fresh-clone CI run's short chaos run: Slurm's End (whole seconds, + the 1 s the trainer's records
    may lie past it) fell between a save's start and its record (written when it was durable), so the save's blocking
    time, inside the window, was painted as the node failure's restart. Its part inside the window is a save."""
    window = AttemptWindow(index=0, start=T0, end=T0 + 40, ending="node_fail", failure=True)
    records = [start(5, process_start=1), *steps(1, 30, at=6, every=1, step_time=0.9),
               save(30, 35.5, 0.6),  # recorded at 36.1: inside
               save(31, 39.7, 0.6, reason="signal")]  # recorded at 40.3, 0.3 s past the end: 0.3 s of it inside
    acc = account([window], records)
    assert acc.badput["checkpoint_save"] == pytest.approx(0.6 + 0.3)
    assert_tiles(acc)


def test_allocation_is_slurms_start_to_end_and_another_clusters_job_is_ignored(tmp_path, monkeypatch):
    """With Slurm's record, a window is sacct's Start -> End (whole seconds; the trainer's last record may lie up to
    1 s past End); a job of another name under the same id (SLURM_CONF pointing at another cluster) is ignored."""
    import time

    from megatron_resilience.jobs import slurm

    run_dir = preempted_chain(tmp_path)
    with open(run_dir / "job_ledger.jsonl") as f:
        lines = [json.loads(x) for x in f]
    for rec in lines:
        if rec["kind"] == "attempt_start":
            rec["job_name"] = "acct-bench.gpt"
    write_jsonl(run_dir / "job_ledger.jsonl", lines)

    def stamp(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + t))

    job = "acct-bench.gpt"
    runs = {job: [{"State": "REQUEUED", "Start": stamp(-2), "End": stamp(21), "JobName": job},
                  {"State": "COMPLETED", "Start": stamp(31), "End": stamp(40), "JobName": job}]}
    name = ["acct-bench.gpt"]
    monkeypatch.setattr(slurm, "sacct_runs", lambda job: runs.get(name[0], [{"JobName": name[0]}]))
    run = report.build(str(run_dir))
    assert [(w.start - T0, w.end - T0) for w in run.windows] == [(-2, 21), (31, pytest.approx(41.0))]
    assert [r.state for r in run.rows] == ["REQUEUED", "COMPLETED"]  # the trainer's end (41.0) is within End + 1 s
    assert_tiles(run.accounting)
    name[0] = "someone-else"  # sacct answers for another cluster's job 100
    run = report.build(str(run_dir))
    assert [(w.start - T0, w.end - T0) for w in run.windows] == [(0, 20), (32, 50)]  # the ledger's times


def test_a_fault_that_lands_before_the_previous_one_was_noticed_is_absorbed_by_the_failure_it_shares():
    """The allocation clock lets a second fault land during the first one's detection: a hang at 31 s, then a rank
    killed (Xid) at 33 s, noticed at 36 s. The cycle ended once, classified as the kill: the Xid caused it, the
    hang was absorbed by it, and the cost starts at the hang (the first fault: its silence is detection time)."""
    from megatron_resilience.report.injected import format_injected, summarize

    hang = {"time": T0 + 31.0, "fault": "rank_hang", "expected": ["hang"], "ok": True}
    xid = {"time": T0 + 33.0, "fault": "gpu_xid", "expected": ["xid_error"], "ok": True}
    missed = {"time": T0 + 32.0, "fault": "gpu_ecc", "expected": ["ecc_error"], "ok": False,  # not carried out
              "why": "no rank process of job 7 on mn1"}
    window = AttemptWindow(index=0, start=T0, end=T0 + 60, ending="finished", cycle_endings={0: "xid_error"},
                           detections=[T0 + 36.0])
    acc = account([window], HANG_RUN, [hang, missed, xid])
    assert_tiles(acc)
    [intr] = acc.interruptions
    assert (intr.cause, intr.fault_time, intr.detected, intr.injection, intr.absorbed) == \
        ("xid_error", T0 + 31, T0 + 36, xid, [hang])
    assert buckets(acc)["wasted_progress"] == pytest.approx(1.0 + 3.0)  # 30 -> the hang at 31, steps 5-6 re-run
    assert buckets(acc)["failure_detection"] == pytest.approx(5.0)  # the hang (31) -> noticed (36)
    summary = summarize(acc, [hang, missed, xid], [window])
    assert [(r["fault"], r["classified"], r["match"], r["absorbed_by"]) for r in summary["injections"]] == [
        ("rank_hang", None, False, "gpu_xid"), ("gpu_ecc", None, False, None), ("gpu_xid", "xid_error", True, None)]
    assert not summary["all_classified"]  # the injection chaos could not carry out stays unexplained
    assert [r["done"] for r in summary["injections"]] == [True, False, True]
    assert format_injected(summary)[1] == "  gpu_ecc: injected 1, classified as expected 0; not done 1 (no rank " \
                                          "process of job 7 on mn1)"
    absorbed_apart = summarize(acc, [hang, xid], [window])
    assert not absorbed_apart["all_classified"]  # an absorbed fault is never counted as classified
    assert absorbed_apart["none_misread"] and not summary["none_misread"]  # ... nor as misread; an undone one is
    assert (absorbed_apart["as_expected"], absorbed_apart["absorbed"], absorbed_apart["as_another"]) == (1, 1, 0)
    assert format_injected(absorbed_apart)[:3] == [
        "injected faults: 2 (none misread: 1 classified as injected, 1 absorbed by a fault that "
        "landed before they were noticed (counted apart))",
        "  gpu_xid: injected 1, classified as expected 1 (xid_error)",
        "  rank_hang: injected 1, classified as expected 0; absorbed 1 (by the gpu_xid that ended attempt 0 cycle 0)"]



def test_a_node_set_down_just_past_slurms_whole_second_end_is_the_attempts_fault():
    """NODE_FAIL ends the attempt at once and sacct's End has whole seconds: the injection at End + 0.7 s is the
    fault that ended the attempt (a job-level interruption), not one of the next attempt."""
    window = AttemptWindow(index=0, start=T0, end=T0 + 40, ending="node_fail", failure=True)
    records = [start(5, process_start=1, marks={"checkpoint_load": 4}), *steps(1, 30, at=6, every=1, step_time=0.9)]
    down = {"time": T0 + 40.7, "fault": "node_down", "expected": ["node_fail"]}
    acc = account([window], records, [down])
    [intr] = acc.interruptions
    assert (intr.kind, intr.cause, intr.injection, intr.fault_source) == ("job", "node_fail", down, "injected")
