"""A dense fault stream inside one Slurm attempt: every in-job cycle is classified from its own lines.

Issue 34 §5: a chaos run on the allocation clock (faults land whenever they come due, during a restart too) read
four of its sixteen faults as another fault's kind. A fault that lands while the restarted workers are still
setting up kills them before the trainer writes its ``start`` record: ft_launcher counts a cycle the trainer never
saw, and pairing the trainer's cycles with the launcher's by position gave every later cycle the previous cycle's
evidence (the hang read as the Xid before it), then a trailing cycle with no start of its own.

The attempt replayed here, on one node with two ranks under ft_launcher (nvidia-resiliency-ext 0.4.1's log: one
job-step log, cut into cycles at the rendezvous' ``restart_count=N``):

- cycle 0: training; an Xid (chaos: the kernel line into rank 1's stderr, then SIGKILL) at 40 s;
- cycle 1: training; an uncorrectable ECC error on rank 0 at 60 s;
- cycle 2: an Xid at 80 s kills rank 1 during setup: the trainer never wrote its start record;
- cycle 3: training; rank 1 stopped (SIGSTOP) at 110 s, ended by the rank monitor's step-section timeout;
- cycle 4: training; the scheduler's preemption notice (SIGTERM) at 170 s: the trainer saves and the attempt ends.

Each killed rank's last lines reach the log after the launcher's failure line (the launcher's tail of the rank's
stderr is drained when the workers are stopped), as ft_launcher's ``--tee`` writes them. The test runs the batch
trap's code (``attempts.end_attempt``) on those files, then the report on the run directory with the chaos ledger.
"""

from __future__ import annotations

import json
import os
import time

from resilience_support.goodput_records import T0, save, start, steps, write_jsonl

from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve
from megatron_resilience.records.ledger import Ledger
from megatron_resilience.report import run_report as report
from megatron_resilience.report.injected import format_injected

LAUNCHER = "[ft_launcher3001@node-01]"
END = 175.0  # the attempt's end (the batch trap ran then)


def at(t: float) -> str:
    """Python logging's stamp of T0 + t, in local time as the launcher writes it."""
    when = T0 + t
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + f",{round((when % 1) * 1000):03d}"


def launcher(t: float, message: str, level: str = "INFO") -> str:
    return f"[{at(t)}] [{level}] {LAUNCHER} {message}"


def rendezvous(t: float, count: int) -> list[str]:
    """torchelastic's rendezvous result (one multi-line log record) and the worker group's start."""
    return [launcher(t, "[default] Rendezvous complete for workers. Result:"), f"  restart_count={count}",
            "  master_addr=node-01", "  master_port=29500", "  group_rank=0", "  group_world_size=1",
            "  local_ranks=[0, 1]", "  role_ranks=[0, 1]", "  global_ranks=[0, 1]", "  role_world_sizes=[2, 2]",
            "  global_world_sizes=[2, 2]", "", launcher(t + 0.1, "[default] Starting worker group")]


def step_line(t: float, step: int) -> str:
    return (f"[default0]:[{at(t)}] [rank 0] megatron_resilience.runtime.metrics: step {step}/100 | loss 3.2100 | "
            "lr 2.800e-03 | grad_norm 0.9100 | step_time 31.0 ms | tokens/s 16400")


def failed(t: float, local_rank: int, pid: int, left: int) -> list[str]:
    return [launcher(t, f"failed (exitcode: -9) local_rank: {local_rank} (pid: {pid}) of binary: "
                        "/work/.venv/bin/python", "ERROR"),
            launcher(t, f"[default] Worker group FAILED. {left}/30 attempts left; will restart worker group"),
            launcher(t + 0.1, "Stopping workers... Timeout = 15 sec.")]


def xid(pid: int) -> str:
    """chaos's gpu_xid line, as the launcher's tail of rank 1's stderr prints it."""
    return f"[default1]:node-01 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python, GPU has fallen off " \
           "the bus."


PEER_LOST = ("[default0]:[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
             "closed by peer [127.0.0.1]:35913")

STEP_LOG = [
    launcher(1.0, "Using nproc_per_node=2."),
    *rendezvous(3.0, 0),
    step_line(30.0, 5), step_line(38.0, 9),
    *failed(40.6, 1, 4101, 30),
    PEER_LOST,  # rank 0 lost its peer
    xid(4101),  # the killed rank's line, drained after the failure line
    *rendezvous(41.5, 1),
    step_line(59.5, 7),
    *failed(60.5, 0, 4200, 29),
    "[default0]:[rank0]: Traceback (most recent call last):",  # chaos's gpu_ecc lines, after the failure line
    "[default0]:[rank0]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
    *rendezvous(61.5, 2),
    f"[default0]:[{at(75.0)}] [rank 0] megatron_resilience.runtime.distributed: distributed: world_size=2 tp=1 pp=1 "
    "dp=2 device=cuda backend=nccl",
    *failed(80.5, 1, 4301, 28),
    xid(4301),  # killed before the trainer's start record
    *rendezvous(81.5, 3),
    step_line(100.0, 7), step_line(108.0, 11),
    f"[{at(130.4)}] [WARNING] [RankMonServer3210@node-01:1] Section 'step' has been open for 20.40 seconds. "
    "Timeout is 20.00 seconds.",
    f"[{at(130.4)}] [INFO] [RankMonServer3210@node-01:1] Terminating rank 1 (pid 4401) with SIGKILL",
    *failed(131.0, 1, 4401, 27),
    *rendezvous(132.0, 4),
    step_line(150.0, 12), step_line(168.0, 21),
    f"[default0]:[{at(170.2)}] [rank 0] megatron_resilience.resilience.hooks: stopping after step 21: SIGTERM "
    "received; saving a checkpoint and exiting 0 (training not finished: the job should be requeued and resume)",
    f"[default0]:[{at(171.5)}] [rank 0] megatron_resilience.resilience.hooks: training ended: reason=signal "
    "step=21 exit_code=0",
    f"[{at(172.0)}] [WARNING] [torch.distributed.elastic.agent.server.api] Received Signals.SIGTERM death signal, "
    "shutting down workers",
]

METRICS = [  # the trainer's records: a start per cycle it reached, its steps and saves (rank 0 writes them)
    start(20.0, process_start=3.5, launcher_start=1.0, job_id="77", in_job=0, world_size=2),
    *steps(1, 9, at=22.0, every=2.0, step_time=0.5), save(5, 31.0, 0.3),
    start(56.0, step=5, resumed_from=5, process_start=42.0, job_id="77", in_job=1, world_size=2),
    *steps(6, 7, at=57.5, every=2.0, step_time=0.5),
    start(96.0, step=5, resumed_from=5, process_start=82.0, job_id="77", in_job=3, world_size=2),
    *steps(6, 12, at=97.5, every=2.0, step_time=0.5), save(10, 105.8, 0.3),
    start(146.0, step=10, resumed_from=10, process_start=132.5, job_id="77", in_job=4, world_size=2),
    *steps(11, 21, at=148.0, every=2.0, step_time=0.5),
    {"kind": "signal", "signal": "SIGTERM", "step": 21, "received_time": T0 + 170.1, "first_received_time": T0 + 170.1,
     "time": T0 + 170.1},
    save(21, 170.3, 0.8, reason="signal"),
    {"kind": "end", "step": 21, "reason": "signal", "exit_code": 0, "time": T0 + 171.5},
]

INJECTED = [(40.0, "gpu_xid", "xid_error"), (60.0, "gpu_ecc", "ecc_error"), (80.0, "gpu_xid", "xid_error"),
            (110.0, "rank_hang", "hang"), (170.0, "preempt", "preempted")]


def lay_out(tmp_path) -> tuple[JobLevelConfig, Ledger]:
    job_dir, run_dir = tmp_path / "job", tmp_path / "run"
    job_dir.mkdir()
    run_dir.mkdir()
    (job_dir / "log-acct.gpt_77_0.out").write_text("".join(line + "\n" for line in STEP_LOG))
    write_jsonl(run_dir / "metrics.jsonl", METRICS)
    (run_dir / "stop_reason.json").write_text(json.dumps({"reason": "signal", "step": 21, "exit_code": 0,
                                                          "finished": False}))
    os.utime(run_dir / "stop_reason.json", (T0 + 171.5, T0 + 171.5))  # written when the last cycle's trainer ended
    write_jsonl(run_dir / "chaos_ledger.jsonl", [
        {"kind": "injection", "fault": fault, "expected": [kind], "job_id": "77", "slurm_restart": 0, "node": "node-01",
         "ok": True, "time": T0 + t} for t, fault, kind in INJECTED])
    policy, monitors = resolve("megatron_transient", None)
    cfg = JobLevelConfig(job_name="gpt", job_dir=str(job_dir), ledger=str(run_dir / "job_ledger.jsonl"),
                         finished_flag=str(job_dir / "gpt_finished_flag"), run_dir=str(run_dir),
                         stop_reason=str(run_dir / "stop_reason.json"), metrics=str(run_dir / "metrics.jsonl"),
                         ft=True, policy=policy, monitors=monitors)
    ledger = Ledger(cfg.ledger)
    ledger.append({"kind": "attempt_start", "job_id": "77", "slurm_restart": 0, "resubmission": 0,
                   "nodes": "node-01", "time": T0, "batch_log_offset": 0})
    return cfg, ledger


def end(cfg: JobLevelConfig, ledger: Ledger):
    return end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=1, slurm_state="RUNNING", by="batch",
                       end_time=T0 + END, batch_signal="TERM", node_info={},
                       cluster_info=Cluster(nodes=["node-01", "spare-1"], partition="batch"))


def test_every_in_job_cycle_of_a_dense_stream_ends_as_the_fault_injected_into_it(tmp_path):
    cfg, ledger = lay_out(tmp_path)
    ending = end(cfg, ledger)
    cycles = ending.record["cycles"]
    assert len(cycles) == 5
    assert [c["cycle"] for c in cycles] == [0, 1, 2, 3, 4]
    assert [c["in_job_restart"] for c in cycles] == [0, 1, 2, 3, 4]  # the launcher's restart count of each
    assert [(c.get("ended") or {}).get("error_type") for c in cycles] == \
        ["xid_error", "ecc_error", "xid_error", "hang", None]  # the last one's ending is the attempt's
    assert ending.classification.error_type == "preempted" and ending.classification.source == "stop_reason"
    # start: the trainer's start record; cycle 2's trainer never wrote one: the launcher's rendezvous
    assert [c["start_time"] - T0 for c in cycles] == [20.0, 56.0, 61.5, 96.0, 146.0]
    assert [c.get("trainer_started", True) for c in cycles] == [True, True, False, True, True]
    # end: the launcher's first line about the failure (the rank monitor's timeout for the hang)
    assert [round(c["ended"]["time"] - T0, 3) for c in cycles[:4]] == [40.6, 60.5, 80.5, 130.4]
    assert [c.get("resumed_from") for c in cycles] == [None, 5, None, 5, 10]
    assert [c["ended"]["hosts"] for c in cycles[:4]] == [["node-01"]] * 4
    assert cycles[0]["ended"]["evidence"][0] == xid(4101)  # its own killed rank's line, not the next cycle's
    assert cycles[2]["ended"]["evidence"][0] == xid(4301)


def test_the_report_matches_every_injected_fault_to_the_cycle_it_ended(tmp_path):
    """The report reads the ledger's cycles: the one whose workers died in setup is an interruption of its own (its
    fault is not absorbed by the restart before it), charged from its fault to the next productive step."""
    cfg, ledger = lay_out(tmp_path)
    ledger.append(end(cfg, ledger).record)
    run = report.build(cfg.run_dir, slurm_lookup=False)
    assert [(r.cycle, round(r.start - T0, 3), round(r.end - T0, 3), r.ended, r.world_size) for r in run.rows] == [
        (0, 20.0, 56.0, "xid_error", 2), (1, 56.0, 61.5, "ecc_error", 2), (2, 61.5, 96.0, "xid_error", None),
        (3, 96.0, 146.0, "hang", 2), (4, 146.0, END, "preempted (stop_reason)", 2)]
    assert [(i.cycle, i.kind, i.cause, i.fault_time - T0, round(i.detected - T0, 3),
             (i.injection or {}).get("fault"), i.absorbed) for i in run.accounting.interruptions] == [
        (0, "process", "xid_error", 40.0, 40.6, "gpu_xid", []), (1, "process", "ecc_error", 60.0, 60.5, "gpu_ecc", []),
        (2, "process", "xid_error", 80.0, 80.5, "gpu_xid", []), (3, "process", "hang", 110.0, 130.4, "rank_hang", []),
        (4, "preemption", "preempted", 170.0, 171.5, "preempt", [])]
    ecc, setup = run.accounting.interruptions[1:3]
    # the ECC's restart ends where the Xid in the next setup begins (80): from there the cost is the Xid's
    assert {k: round(v, 3) for k, v in ecc.cost.items()} == {"wasted_progress": 0.5, "failure_detection": 0.5,
                                                             "restart_process": 19.5}
    assert {k: round(v, 3) for k, v in setup.cost.items()} == {
        "failure_detection": 0.5, "restart_process": 1.5, "startup": 14.0, "other": 7.0, "wasted_progress": 2.0}
    assert [(r["fault"], r["classified"], r["match"], r["absorbed_by"]) for r in run.injected["injections"]] == [
        ("gpu_xid", "xid_error", True, None), ("gpu_ecc", "ecc_error", True, None),
        ("gpu_xid", "xid_error", True, None), ("rank_hang", "hang", True, None), ("preempt", "preempted", True, None)]
    assert format_injected(run.injected) == [
        "injected faults: 5 (all classified as injected: 5 classified as injected)",
        "  gpu_ecc: injected 1, classified as expected 1 (ecc_error)",
        "  gpu_xid: injected 2, classified as expected 2 (xid_error)",
        "  preempt: injected 1, classified as expected 1 (preempted)",
        "  rank_hang: injected 1, classified as expected 1 (hang)",
        # three of the attempt's cycles ended in hardware errors on node-01: the preemption's requeue leaves it out
        "  nodes excluded by the job-level decision: node-01"]


def test_cycles_pair_by_the_launchers_restart_count_else_by_position():
    """The pairing's rules: the trainer's ``in_job_restart`` names its launcher cycle (several: in-process restarts;
    none: workers that died in setup); cycles whose marks a cut log lost have no launcher lines; records without the
    count (another trainer) pair by position."""
    from megatron_resilience.jobs.attempt_end import _pairs
    from megatron_resilience.records.launcher_log import LauncherCycle

    launcher = [LauncherCycle(n) for n in (0, 1, 2, 3)]
    named = [{"in_job_restart": n} for n in (0, 1, 1, 3)]
    assert _pairs(named, launcher) == [(0, 0), (1, 1), (2, 1), (None, 2), (3, 3)]
    cut = [LauncherCycle(n) for n in (2, 3)]  # the log's last 8 MiB: cycles 0 and 1 lost their marks
    assert _pairs([{"in_job_restart": n} for n in (0, 1, 2, 3)], cut) == [(0, None), (1, None), (2, 0), (3, 1)]
    assert _pairs([{"in_job_restart": None}, {}], launcher) == [(0, 0), (1, 1), (None, 2), (None, 3)]
