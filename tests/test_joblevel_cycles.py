"""ft_launcher's per-cycle restart history (nvidia-resiliency-ext >= 0.7) in the ledger.

When the installed release writes cycle-info files (``--ft-cycle-info-dir``: ``cycle_info.<job>.<attempt>.<cycle>``
JSON) and one application log per restart cycle (``--ft-per-cycle-applog-prefix``), the ledger's attempt record
has one entry per in-job cycle: when it ran, on which nodes, and why each earlier cycle ended — read from that
cycle's own log — while the attempt's classification comes from the last cycle's log.

``test_cycles_from_nvrx_own_writer`` writes the files with nvidia-resiliency-ext 0.7.0's own ``CycleInfoWriter``,
run inside that release (``tests/nvrx_releases.py``), so it runs in both lanes.
``test_cycles_from_files_in_nvrx_format`` always runs, with files in the format that writer produced here
(captured from 0.7.0: the fields and their JSON types below).
"""

from __future__ import annotations

import json
import os
import shutil
import time

from nvrx_releases import probe

from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve
from megatron_resilience.records.ledger import Ledger

CORPUS = os.path.join(os.path.dirname(__file__), "joblevel_corpus")


def job_layout(tmp_path) -> tuple[JobLevelConfig, Ledger, str]:
    job_dir, run_dir = tmp_path / "job", tmp_path / "run"
    (job_dir / "ft_cycle_info").mkdir(parents=True)
    (job_dir / "ft_cycle_logs").mkdir()
    run_dir.mkdir()
    (job_dir / "log-acct.gpt_77_0.out").write_text(
        "[2026-11-23 05:13:23,126] [INFO] [ft_launcher7125@nid001] [default] Starting worker group\n"
        "[2026-11-23 05:20:01,002] [INFO] [ft_launcher7125@nid001] [default] Worker group FAILED. 1/2 attempts left;"
        " will restart worker group\n")
    policy, monitors = resolve("megatron_transient", None)
    cfg = JobLevelConfig(job_name="gpt", job_dir=str(job_dir), ledger=str(run_dir / "job_ledger.jsonl"),
                         finished_flag=str(job_dir / "gpt_finished_flag"), run_dir=str(run_dir),
                         stop_reason=str(run_dir / "stop_reason.json"), metrics=str(run_dir / "metrics.jsonl"),
                         ft=True, policy=policy, monitors=monitors, cycle_info_dir=str(job_dir / "ft_cycle_info"),
                         cycle_log_prefix=str(job_dir / "ft_cycle_logs" / "cycle"))
    ledger = Ledger(cfg.ledger)
    ledger.append({"kind": "attempt_start", "job_id": "77", "slurm_restart": 0, "nodes": "nid001", "time": 0.0})
    return cfg, ledger, str(job_dir)


def check(cfg: JobLevelConfig, ledger: Ledger, logs: list[str]) -> None:
    ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=1, slurm_state="RUNNING", by="batch",
                         cluster_info=Cluster(nodes=["nid001", "nid002"]))
    record = ending.record
    assert ending.classification.error_type == "cuda_oom"  # the last cycle's log
    assert [c["cycle"] for c in record["cycles"]] == [0, 1]
    assert record["cycles"][0]["ended"]["error_type"] == "nccl_timeout"  # the first cycle's own log
    # its lines name no node; the attempt ran on one: that node (the report's per-node table counts it)
    assert record["cycles"][0]["ended"]["hosts"] == ["nid001"]
    assert [c["cycle_info"]["active_nodes"] for c in record["cycles"]] == ["nid001", "nid001"]
    assert record["cycles"][1]["cycle_info"]["cycle_start_time"] == "2026-11-23T05:20:30Z"
    assert [p for p in record["log_files"] if "ft_cycle_logs" in p] == logs


def write_cycles(job_dir: str, cycles: list[tuple[str, str, str]]) -> list[str]:
    """Per-cycle logs (corpus files) and cycle-info files as nvidia-resiliency-ext 0.7 writes them."""
    logs = []
    for cycle, (start, end, log) in enumerate(cycles):
        path = os.path.join(job_dir, "ft_cycle_logs", f"cycle_cycle{cycle}.log")
        shutil.copy(os.path.join(CORPUS, log), path)
        logs.append(path)
        with open(os.path.join(job_dir, "ft_cycle_info", f"cycle_info.77.0.{cycle}"), "w") as f:
            json.dump({"job_id": "77", "cycle_start_time": start, "cycle_end_time": end, "cycle_log_file": path,
                       "active_nodes": "nid001", "generation": "1", "attempt_index": 0, "cycle_number": cycle,
                       "standby_nodes": "", "active_ranks": ""}, f, indent=2)
    os.symlink(f"cycle_info.77.0.{cycle}", os.path.join(job_dir, "ft_cycle_info", "cycle_info.77.current"))
    return logs


def test_cycles_from_files_in_nvrx_format(tmp_path):
    cfg, ledger, job_dir = job_layout(tmp_path)
    logs = write_cycles(job_dir, [("2026-11-23T05:13:23Z", "2026-11-23T05:20:01Z", "nccl_timeout.log"),
                                  ("2026-11-23T05:20:30Z", "2026-11-23T05:31:10Z", "cuda_oom.log")])
    check(cfg, ledger, logs)


def test_cycles_from_nvrx_own_writer(tmp_path):
    """The files nvidia-resiliency-ext 0.7.0's own CycleInfoWriter writes (run in that release: both lanes)."""
    cfg, ledger, job_dir = job_layout(tmp_path)
    answer = probe("0.7.0", {"cycle_info": {
        "dir": cfg.cycle_info_dir, "prefix": cfg.cycle_log_prefix, "job": "77", "attempt": 0, "nodes": "nid001",
        "cycles": [["2026-11-23T05:13:23Z", "2026-11-23T05:20:01Z"],
                   ["2026-11-23T05:20:30Z", "2026-11-23T05:31:10Z"]]}})
    logs = answer["cycle_logs"]  # the per-cycle log names ft_launcher uses
    for path, log in zip(logs, ("nccl_timeout.log", "cuda_oom.log")):
        shutil.copy(os.path.join(CORPUS, log), path)
    check(cfg, ledger, logs)


def test_in_process_restarts_are_cycles_of_their_own_and_each_launcher_cycle_keeps_its_cause(tmp_path):
    """Two launcher cycles (ft_launcher restarted the workers once, after an NCCL timeout), each with an in-process
    restart inside it: four trainer cycles. The in-process ones say so and leave the cause to their own record;
    the process restart's cause is read from launcher cycle 0's log, not from whichever log has the same index."""
    cfg, ledger, job_dir = job_layout(tmp_path)
    write_cycles(job_dir, [("2026-11-23T05:13:23Z", "2026-11-23T05:20:01Z", "nccl_timeout.log"),
                           ("2026-11-23T05:20:30Z", "2026-11-23T05:31:10Z", "cuda_oom.log")])
    starts = [(0, 0, 10.0), (0, 1, 20.0), (1, 0, 30.0), (1, 1, 40.0)]  # (in_job_restart, inprocess_restart, time)
    with open(cfg.metrics, "w") as f:
        for k, (job_restart, inprocess, t) in enumerate(starts):
            if inprocess:
                f.write(json.dumps({"kind": "inprocess_restart", "time": t - 1, "iteration": inprocess,
                                    "cause": "exception on rank 1"}) + "\n")
            attempt = {"job_id": "77", "slurm_restart": 0, "in_job_restart": job_restart,
                       "inprocess_restart": inprocess}
            f.write(json.dumps({"kind": "start", "time": t, "step": 2 * k, "resumed_from": 2 * k,
                                "attempt": attempt}) + "\n")
            f.write(json.dumps({"kind": "train", "time": t + 5, "step": 2 * k + 1, "loss": 1.0}) + "\n")
    record = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=1, slurm_state="RUNNING", by="batch",
                         cluster_info=Cluster(nodes=["nid001", "nid002"])).record
    endings = [(c["cycle"], (c.get("ended") or {}).get("inprocess"), (c.get("ended") or {}).get("error_type"))
               for c in record["cycles"]]
    assert endings == [(0, True, None), (1, None, "nccl_timeout"), (2, True, None), (3, None, None)], endings
    assert [c["in_job_restart"] for c in record["cycles"]] == [0, 0, 1, 1]
    assert [c["cycle_info"]["cycle_start_time"] for c in record["cycles"]] == [  # each launcher cycle's own
        "2026-11-23T05:13:23Z", "2026-11-23T05:13:23Z", "2026-11-23T05:20:30Z", "2026-11-23T05:20:30Z"]


def test_the_launchers_own_lines_go_to_the_cycle_they_name_or_ran_in(tmp_path):
    """With per-cycle logs the job step's log keeps the launcher's own lines: an earlier cycle's rank-monitor timeout
    (``[Cycle 0]``) and failure line (stamped while cycle 0 ran) are that cycle's evidence, not the last cycle's,
    whose ending is the attempt's (issue 34 §5: every cycle's evidence from its own lines)."""
    cfg, ledger, job_dir = job_layout(tmp_path)
    t0 = 1_800_000_000

    def stamp(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0 + t)) + ",000"

    def iso(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0 + t))

    write_cycles(job_dir, [(iso(0), iso(400), "healthy_megatron.log"), (iso(430), iso(900), "cuda_oom.log")])
    with open(os.path.join(job_dir, "log-acct.gpt_77_0.out"), "w") as f:
        f.write(f"[{stamp(0)}] [INFO] [ft_launcher7125@nid001] [default] Starting worker group\n"
                f"[{stamp(380)}] [WARNING] [RankMonServer3210@nid001:1] [Cycle 0] Section 'step' has been open for "
                "185.43 seconds. Timeout is 180.00 seconds.\n"
                f"[{stamp(381)}] [ERROR] [ft_launcher7125@nid001] failed (exitcode: -9) local_rank: 1 (pid: 3411) of "
                "binary: /usr/bin/python\n"
                f"[{stamp(381)}] [INFO] [ft_launcher7125@nid001] [default] Worker group FAILED. 1/2 attempts left; "
                "will restart worker group\n")
    ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=1, slurm_state="RUNNING", by="batch",
                         cluster_info=Cluster(nodes=["nid001", "nid002"]))
    first = ending.record["cycles"][0]["ended"]
    assert (first["error_type"], first["time"], first["hosts"]) == ("hang", t0 + 400, ["nid001"])
    assert first["evidence"][0].endswith("[Cycle 0] Section 'step' has been open for 185.43 seconds. Timeout is "
                                         "180.00 seconds.")
    assert ending.classification.error_type == "cuda_oom"
    assert not [line for line in ending.classification.evidence if "Section 'step'" in line]
