"""The corpus of tests/joblevel_corpus/ as cases: each one's logs, the trainer's stop record, Slurm's view, and what
the classifier and every preset must make of it (``test_joblevel_corpus.py`` runs them; other tests reuse ``case``)."""

from __future__ import annotations

import os
import time

CORPUS = os.path.join(os.path.dirname(__file__), "joblevel_corpus")
PRESETS = ("default", "megatron_transient", "megatron_aggressive", "megatron_conservative")

FINISHED = {"reason": "finished", "step": 100, "exit_code": 0, "finished": True}
SIGNAL = {"reason": "signal", "step": 31, "exit_code": 0, "finished": False}


def signal_stop(step: int, checkpoint_step: int, at: str, during: str, checkpoint_at_stop: str) -> dict:
    """stop_reason.json of a stop on SIGTERM received at ``at`` (the corpus log's local time, ``%Y-%m-%d
    %H:%M:%S.%f``), as the trainer writes it: at once when the signal arrives, rewritten on exit."""
    received = local_time(at)
    return {"reason": "signal", "step": step, "exit_code": 0, "finished": False, "checkpoint_step": checkpoint_step,
            "lost_steps": step - checkpoint_step, "checkpoint_at_stop": checkpoint_at_stop,
            "signal": {"signal": "SIGTERM", "received_time": received, "received_during": during, "count": 1}}


def local_time(at: str) -> float:
    """The epoch of ``at`` (``%Y-%m-%d %H:%M:%S.%f``, local time, as the corpus logs stamp their lines)."""
    return time.mktime(time.strptime(at.split(".")[0], "%Y-%m-%d %H:%M:%S")) + float("0." + at.split(".")[1])


def case(step=None, batch=None, *, exit_code, nodes=("node-01",), stop_reason=None, state=None, flag=False,
         expect, decisions, node_info=None, batch_signal=None, stop_reason_written=None):
    """node_info: ``scontrol show node`` of the attempt's nodes as the trap would read it (state, reason, addr);
    batch_signal: the signal the batch shell received (``scancel --signal=TERM --full``, preemption);
    stop_reason_written: when the trainer wrote stop_reason.json (the log's local time; None: now)."""
    return dict(step=step, batch=batch, exit_code=exit_code, nodes=list(nodes), stop_reason=stop_reason,
                state=state, flag=flag, expect=expect, decisions=decisions, node_info=node_info or {},
                batch_signal=batch_signal, stop_reason_written=stop_reason_written)


DOWN = {"state": "DOWN+NOT_RESPONDING", "reason": "Not responding", "addr": ""}
UP = {"state": "ALLOCATED", "reason": "", "addr": ""}
NIDS = ("nid001", "nid002", "nid003", "nid004")


# decisions: (default, megatron_transient, megatron_aggressive, megatron_conservative, nemo_run rule with FT)
#   "stop"; "requeue" (spends the error type's mode); "free" (requeued, nothing spent); "x:<nodes>" (requeued,
#   these nodes excluded)
CASES = {
    # --- must not trigger: healthy and handled output ---------------------------------------------------------
    "healthy_megatron_finished": case(
        "healthy_megatron.log", exit_code=0, stop_reason=FINISHED, flag=True,
        expect={"error_type": "finished", "source": "stop_reason"},
        decisions=("stop", "stop", "stop", "stop", "stop")),
    "healthy_megatron_killed": case(  # the same healthy log; the attempt was SIGKILLed with nothing said
        "healthy_megatron.log", exit_code=137,
        expect={"error_type": "killed", "source": "exit_code", "signal": "SIGKILL"},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "healthy_ours_ft_finished": case(
        "healthy_ours_ft.log", exit_code=0, stop_reason=FINISHED, flag=True,
        expect={"error_type": "finished", "source": "stop_reason"},
        decisions=("stop", "stop", "stop", "stop", "stop")),
    "handled_errors_then_killed": case(  # logged-and-handled OOM/Gloo/NCCL WARN/NVML, then SIGKILL
        "handled_errors.log", exit_code=137,
        expect={"error_type": "killed", "source": "exit_code", "signal": "SIGKILL"},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "truncated_oom_line": case(  # "CUDA out of mem" cut off mid-line by the kill: not an OOM
        "truncated_step.log", exit_code=1,
        expect={"error_type": "unknown", "source": "exit_code"},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    # --- the trainer's own verdicts ---------------------------------------------------------------------------
    "preempted_saved": case(  # torchrun exits 1 after forwarding SIGTERM; stop_reason says signal, exit 0
        "preempted_saved.log", exit_code=1, stop_reason=SIGNAL,
        expect={"error_type": "preempted", "source": "stop_reason"},
        decisions=("free", "free", "free", "free", "free")),
    "preempted_save_cut_short": case(  # SIGTERM, the save never finished, ranks killed: still a preemption
        "preempted_save_cut_short.log", exit_code=1,
        expect={"error_type": "preempted", "source": "log", "signal": "SIGTERM", "fields": {"step": "6"}},
        decisions=("free", "free", "free", "free", "free")),
    # captured from the long chaos run: rank 1's ECC error, rank 0 exiting for its lost peer, then ft_launcher,
    # out of restarts, tearing the group down with SIGTERM: rank 0's handler wrote "stopped by the signal" (its
    # save still pending) before the process was gone. The launcher's signal is no preemption: the error decides.
    "teardown_signal_after_ecc": case(
        "teardown_signal_after_ecc.log", exit_code=1, nodes=("node-02",),
        stop_reason=signal_stop(2516, 2508, "2026-11-29 11:37:47.567", "step", "pending"),
        expect={"error_type": "ecc_error", "source": "log"},
        decisions=("requeue", "x:node-02", "x:node-02", "x:node-02", "requeue")),
    # the same in a restarted group's setup: rank 0 got the launcher's SIGTERM before training and exited 0
    "teardown_signal_in_setup_after_ecc": case(
        "teardown_signal_in_setup_after_ecc.log", exit_code=0, nodes=("node-02",),
        stop_reason=signal_stop(1999, 1999, "2026-11-29 11:54:22.311", "setup", "not needed"),
        expect={"error_type": "ecc_error", "source": "log"},
        decisions=("requeue", "x:node-02", "x:node-02", "x:node-02", "requeue")),
    # the same lines with the signal received before the launcher saw rank 1 fail: a preemption first
    "signal_before_the_ecc": case(
        "teardown_signal_after_ecc.log", exit_code=1, nodes=("node-02",),
        stop_reason=signal_stop(2516, 2508, "2026-11-29 11:37:47.300", "step", "pending"),
        expect={"error_type": "preempted", "source": "stop_reason"},
        decisions=("free", "free", "free", "free", "free")),
    # a real preemption whose save was cut short: the exception comes after the signal, its consequence
    "preempted_then_exception_in_the_save": case(
        "preempted_save_cut_short.log", exit_code=1,
        stop_reason=signal_stop(6, 0, "2026-11-23 06:30:08.800", "step", "pending"),
        expect={"error_type": "preempted", "source": "stop_reason"},
        decisions=("free", "free", "free", "free", "free")),
    # captured from the long chaos run (a rank hang injected in setup, then a preemption): the ranks, stuck in the
    # rendezvous, never ran their signal handler; ft_launcher got SIGTERM from outside and SIGKILLed them after its
    # shutdown timeout. No stop record, no failure before the launcher's line: a preemption, not "killed"
    "preempted_while_setup_hung": case(
        "preempted_while_setup_hung.log", exit_code=1,
        expect={"error_type": "preempted", "source": "launcher", "signal": "SIGTERM"},
        decisions=("free", "free", "free", "free", "free")),
    # the same with rank 1's ECC error before the signal: the error decides, the signal is the teardown
    "preempted_after_an_ecc_in_setup": case(
        "preempted_after_an_ecc_in_setup.log", exit_code=1,
        expect={"error_type": "ecc_error", "source": "log"},
        decisions=("requeue", "x:node-01", "x:node-01", "x:node-01", "requeue")),
    # captured from the long chaos run: in cycle 2 rank 0 got the launcher's teardown SIGTERM after rank 1's Xid and
    # wrote "stopped on a signal"; cycle 3's rank 1 fell off the bus in setup, before either rank wrote anything. The
    # record is cycle 2's (written before cycle 3 started): the last cycle's Xid decides, not a free preemption
    "stale_stop_record_then_xid_in_setup": case(
        "stale_stop_record_then_xid_in_setup.log", exit_code=1, nodes=("node-02",),
        stop_reason=signal_stop(4368, 4352, "2026-11-29 16:03:11.400", "step", "not needed"),
        stop_reason_written="2026-11-29 16:03:11.450",
        expect={"error_type": "xid_error", "source": "log"},
        decisions=("requeue", "x:node-02", "x:node-02", "x:node-02", "requeue")),
    # a record the last cycle wrote (a signal received in it, before its Xid) still decides; the presets that exclude
    # after one attribution leave out the node cycle 2's Xid blamed, even on a free requeue
    "stop_record_of_the_last_cycle": case(
        "stale_stop_record_then_xid_in_setup.log", exit_code=1, nodes=("node-02",),
        stop_reason=signal_stop(4368, 4352, "2026-11-29 16:03:14.500", "setup", "not needed"),
        stop_reason_written="2026-11-29 16:03:14.600",
        expect={"error_type": "preempted", "source": "stop_reason"},
        decisions=("free", "free", "x:node-02", "x:node-02", "free")),
    "rerun_16": case(
        "rerun_16.log", exit_code=16, nodes=("nid004410",), stop_reason={"reason": "rerun:16", "step": 811,
                                                                          "exit_code": 16, "finished": False},
        expect={"error_type": "rerun_resume", "source": "stop_reason", "hosts": ["nid004410"]},
        decisions=("x:nid004410", "x:nid004410", "x:nid004410", "x:nid004410", "requeue")),
    "rerun_17": case(
        None, exit_code=17, flag=True, stop_reason={"reason": "rerun:17", "step": 12, "exit_code": 17,
                                                    "finished": False},
        expect={"error_type": "rerun_failed_validation", "source": "stop_reason"},
        decisions=("stop", "stop", "stop", "stop", "stop")),
    "nvrx_no_restart_93": case(
        "nvrx_no_restart.log", exit_code=93,
        expect={"error_type": "do_not_restart", "source": "nvrx", "fields": {"reason": "no_progress"}},
        decisions=("stop", "stop", "stop", "stop", "stop")),
    # ft_launcher's progress tracker gave up on this allocation because a GPU kept falling off the bus: the Xid
    # decides (a new allocation without the node), not the tracker's verdict (which would end a weeks-long run)
    "xid_behind_no_progress_93": case(
        "xid_then_no_progress.log", exit_code=93, nodes=("nid002544", "nid002545"),
        expect={"error_type": "xid_error", "source": "log", "hosts": ["nid002544"],
                "fields": {"xid": "79", "launcher_gave_up": "no_progress"}},
        decisions=("requeue", "x:nid002544", "x:nid002544", "x:nid002544", "requeue")),
    # --- Slurm's record ---------------------------------------------------------------------------------------
    "user_cancel_after_saving": case(  # scancel: SIGTERM reached the trainer, which saved: still a person's stop
        "preempted_saved.log", "user_cancel_batch.log", exit_code=1, stop_reason=SIGNAL, state="CANCELLED",
        expect={"error_type": "user_cancel", "source": "slurm"},
        decisions=("stop", "stop", "stop", "stop", "stop")),
    "cancel_line_but_slurm_says_failed": case(  # the batch shell was killed: Slurm's record (FAILED) wins
        "preempted_saved.log", "user_cancel_batch.log", exit_code=137, stop_reason=SIGNAL, state="FAILED",
        expect={"error_type": "preempted", "source": "stop_reason"},
        decisions=("free", "free", "free", "free", "free")),
    "cancel_line_but_slurm_says_failed_nothing_saved": case(
        "healthy_ours_ft.log", "user_cancel_batch.log", exit_code=137, state="FAILED",
        expect={"error_type": "killed", "source": "exit_code", "signal": "SIGKILL"},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "step_cancel_line_after_a_signal_stop": case(  # srun ended a 2-node step whose ranks stopped on SIGTERM
        "preempted_saved.log", "step_cancelled_multinode_batch.log", exit_code=0, stop_reason=SIGNAL, state="RUNNING",
        expect={"error_type": "preempted", "source": "stop_reason"},
        decisions=("free", "free", "free", "free", "free")),
    "step_cancel_line_of_another_trainer_stopped_on_a_signal": case(  # no stop_reason, exit 0, no finished flag
        "healthy_ours_ft.log", "step_cancelled_batch.log", exit_code=0, state="RUNNING",
        expect={"error_type": "finished", "source": "exit_code"},
        decisions=("free", "free", "free", "free", "free")),
    "signal_to_the_whole_job_is_no_cancel": case(  # captured: slurmstepd prints the job's line for --full too
        "healthy_ours_ft.log", "signal_full_batch.log", exit_code=137, state="RUNNING", batch_signal="TERM",
        expect={"error_type": "preempted", "source": "log", "signal": "SIGTERM"},
        decisions=("free", "free", "free", "free", "free")),
    "user_cancel_from_log_only": case(  # the line names the batch host: not a suspect of anything
        "healthy_ours_ft.log", "user_cancel_batch.log", exit_code=143,
        expect={"error_type": "user_cancel", "source": "slurm", "hosts": [],
                "fields": {"batch_host": "nid001002"}},
        decisions=("stop", "stop", "stop", "stop", "stop")),
    "node_fail": case(
        None, "node_failure_batch.log", exit_code=None, nodes=("nid003310",), state="NODE_FAIL",
        expect={"error_type": "node_fail", "source": "slurm", "hosts": ["nid003310"]},
        decisions=("requeue", "x:nid003310", "x:nid003310", "x:nid003310", "requeue")),
    # --- which node failed (jobs/attribution.py): 2-4-node attempts, the exact node excluded ------------------
    "node_failure_srun_names_the_dead_node_not_the_batch_host": case(  # nid001 (batch host) is healthy
        None, "node_failure_multinode_batch.log", exit_code=None, nodes=NIDS, state="NODE_FAIL",
        expect={"error_type": "node_fail", "source": "slurm", "hosts": ["nid003"]},
        decisions=("requeue", "x:nid003", "x:nid003", "x:nid003", "requeue")),
    "node_failure_slurm_record_names_the_down_node": case(  # slurmstepd names nid001; scontrol: nid002 DOWN
        None, "node_failure_batch_host_line_only.log", exit_code=None, nodes=NIDS[:2], state="NODE_FAIL",
        node_info={"nid001": UP, "nid002": DOWN},
        expect={"error_type": "node_fail", "source": "slurm", "hosts": ["nid002"]},
        decisions=("requeue", "x:nid002", "x:nid002", "x:nid002", "requeue")),
    "node_failure_naming_only_the_batch_host_excludes_nothing": case(  # no record, 2 nodes: nobody blamed
        None, "node_failure_batch_host_line_only.log", exit_code=None, nodes=NIDS[:2], state="NODE_FAIL",
        node_info={"nid001": UP, "nid002": UP},
        expect={"error_type": "node_fail", "source": "slurm", "hosts": []},
        decisions=("requeue", "requeue", "requeue", "requeue", "requeue")),
    "xid_gathered_from_a_node_names_that_node": case(  # "<node>: [ t] NVRM: Xid" on 1 of 3 nodes
        "xid_node_prefixed.log", exit_code=1, nodes=NIDS[:3],
        expect={"error_type": "xid_error", "source": "log", "hosts": ["nid002"], "fields": {"xid": "48"}},
        decisions=("requeue", "x:nid002", "x:nid002", "x:nid002", "requeue")),
    "first_failed_task_over_the_peers_that_timed_out": case(  # srun: nid003's task failed first
        "first_failed_task_step.log", "first_failed_task_batch.log", exit_code=1, nodes=NIDS[:3],
        expect={"error_type": "nccl_timeout", "source": "log", "hosts": ["nid003"]},
        decisions=("requeue", "requeue", "x:nid003", "stop", "requeue")),
    "ib_errors_about_an_unmapped_peer_blame_no_reporter": case(  # the Xid case without its Xid line: nid001 and
        "ib_peer_unmapped.log", exit_code=1, nodes=NIDS[:3],       # nid003 report peer 10.31.0.12 (IPoIB), which
        node_info={"nid001": {**UP, "addr": "10.30.0.11"}, "nid002": {**UP, "addr": "10.30.0.12"},  # no NodeAddr is
                   "nid003": {**UP, "addr": "10.30.0.13"}},                                           # the healthy
        expect={"error_type": "nccl_error", "source": "log", "hosts": [],                             # reporters stay
                "attribution": "no node blamed: nid001,nid003 reported an error about a remote peer "
                               "(10.31.0.12<48211>, 10.31.0.12<48390>) that is no node of this attempt"},
        decisions=("requeue", "requeue", "requeue", "stop", "requeue")),
    "killed_rank_on_the_second_node_is_killed_not_its_peers_symptom": case(  # 2 nodes x 1 rank: nid002's rank
        "killed_rank_multinode_step.log", exit_code=1, nodes=NIDS[:2],         # (local_rank 0) SIGKILLed, rank 0's
        expect={"error_type": "killed", "source": "launcher", "signal": "SIGKILL", "hosts": ["nid002"],  # gloo
                "reason": "local rank 0 on nid002 was killed by SIGKILL (the launcher's report, exit code -9); "
                          "rank(s) 0 lost contact with another rank (communication_error: a consequence, "
                          "1 line(s))"},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "first_failure_host_names_the_node_excluded": case(  # 3 nodes x 2 ranks: rank 2 (nid002, local_rank 0) hit a
        "first_failure_host_multinode_step.log", exit_code=1, nodes=NIDS[:3],  # CUDA error; ranks 0 and 4 timed out
        expect={"error_type": "cuda_error", "source": "log", "hosts": ["nid002"],  # waiting for it
                "attribution": "nid002: first_failure (strongest of 4 host mention(s))"},
        decisions=("requeue", "stop", "x:nid002", "stop", "requeue")),
    "ib_error_names_the_remote_peer_by_address": case(  # node-2 reports; the peer 10.2.0.5 is node-1
        "ib_peer_named.log", exit_code=1, nodes=("node-1", "node-2"),
        node_info={"node-1": {**UP, "addr": "10.2.0.5"}, "node-2": {**UP, "addr": "10.2.0.4"}},
        expect={"error_type": "nccl_error", "source": "log", "hosts": ["node-1"]},
        decisions=("requeue", "requeue", "x:node-1", "stop", "requeue")),
    "time_limit": case(
        "healthy_megatron.log", "time_limit_batch.log", exit_code=143, state="TIMEOUT",
        expect={"error_type": "time_limit", "source": "slurm"},
        decisions=("requeue", "requeue", "requeue", "stop", "requeue")),
    "host_oom_kill": case(
        None, "cpu_oom_batch.log", exit_code=137,
        expect={"error_type": "cpu_oom", "source": "log", "fields": {"count": "1"}},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    # --- log signals ------------------------------------------------------------------------------------------
    "cuda_oom": case(  # rank 3 OOMs; rank 1's NCCL watchdog times out afterwards: the OOM is the cause
        "cuda_oom.log", exit_code=1,
        expect={"error_type": "cuda_oom", "source": "log", "fields": {"alloc": "2.00 GiB", "rank": "3"}},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "nccl_timeout": case(
        "nccl_timeout.log", exit_code=1,
        expect={"error_type": "nccl_timeout", "source": "log", "signal": "SIGABRT",
                "fields": {"op": "_ALLGATHER_BASE", "timeout_ms": "600000"}},
        decisions=("requeue", "requeue", "x:node-01", "stop", "requeue")),
    "nccl_error_ib": case(  # nid004017 reports its IB peer 10.128.9.41, which no NodeAddr maps: nobody blamed
        "nccl_error_ib.log", exit_code=1, nodes=("nid004017", "nid004018"),
        expect={"error_type": "nccl_error", "source": "log", "hosts": []},
        decisions=("requeue", "requeue", "requeue", "stop", "requeue")),
    "hang_ft_section": case(
        "hang_ft_section.log", exit_code=1,
        expect={"error_type": "hang", "source": "log", "signal": "SIGKILL",
                "fields": {"section": "step", "timeout_s": "180.00"}},
        decisions=("requeue", "requeue", "requeue", "stop", "requeue")),
    "nan_disabled_rerun": case(
        "nan_disabled_rerun.log", exit_code=1, nodes=("nid001877",),
        expect={"error_type": "nan_inf", "source": "log", "hosts": ["nid001877"],
                "fields": {"iteration": "51213", "value": "nan"}},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "python_exception": case(
        "python_exception.log", exit_code=1,
        expect={"error_type": "python_exception", "source": "log",
                "fields": {"exception": "KeyError", "rank": "1"}},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "xid_handled_and_application_xids_leave_the_exception_deciding": case(  # Xid 63 (row remapped: handled)
        # on nid002 and Xid 31 (a page fault: usually the application's) on nid001 beside a rank's KeyError
        "xid_handled_then_exception.log", exit_code=1, nodes=NIDS[:2],
        expect={"error_type": "python_exception", "source": "log", "hosts": ["nid001"],
                "fields": {"exception": "KeyError", "rank": "1"}},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    # the root cause is the first failure in time (jobs/time_order.py): no launcher line here, only srun's
    "bug_then_a_peers_watchdog_timeout_is_the_bug": case(  # rank 9 raises a ValueError and exits; 10 minutes
        # later rank 0's NCCL watchdog times out and aborts: the timeout follows the bug, whatever its type
        "bug_then_peer_watchdog_multinode_step.log", exit_code=1, nodes=NIDS[:2],
        expect={"error_type": "python_exception", "source": "log", "hosts": ["nid002"],
                "fields": {"exception": "ValueError", "rank": "9"}},
        decisions=("requeue", "stop", "requeue", "stop", "requeue")),
    "watchdog_timeout_then_a_teardown_exception_is_the_timeout": case(  # the mirror: the exception came after
        "watchdog_then_teardown_exception_multinode_step.log", exit_code=1, nodes=NIDS[:2],
        expect={"error_type": "nccl_timeout", "source": "log", "hosts": ["nid001"]},
        decisions=("requeue", "requeue", "x:nid001", "stop", "requeue")),
    "store_port_in_use": case(  # rank 0's TCPStore could not bind MASTER_PORT (seen under a crowded test run)
        "store_port_in_use.log", exit_code=1,
        expect={"error_type": "communication_error", "source": "log", "fields": {"port": "45011"}},
        decisions=("requeue", "requeue", "requeue", "stop", "requeue")),
    "xid_fell_off_bus": case(
        "xid_fell_off_bus.log", exit_code=1, nodes=("nid002544", "nid002545"),
        expect={"error_type": "xid_error", "source": "log", "hosts": ["nid002544"], "fields": {"xid": "79"}},
        decisions=("requeue", "x:nid002544", "x:nid002544", "x:nid002544", "requeue")),
    "ecc_error": case(  # no host in the line: a one-node attempt's node is the suspect
        "ecc_error.log", exit_code=1, nodes=("node-02",),
        expect={"error_type": "ecc_error", "source": "log"},
        decisions=("requeue", "x:node-02", "x:node-02", "x:node-02", "requeue")),
}
