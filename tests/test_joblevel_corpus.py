"""The classifier and every preset policy against a corpus of realistic logs (tests/joblevel_corpus/).

Each case lays its logs out as a real attempt leaves them in nemo_run's job directory (the job step's
``log-*_<job>_<restart>.out`` and the batch script's ``sbatch_*_<job>.out``), with the trainer's
``stop_reason.json`` when it wrote one, and runs the same code the batch script's EXIT trap and the
watcher run (``attempts.end_attempt``). Asserted exactly: the error type, what decided it, the
extracted fields/hosts, and each preset's decision (and nemo_run's rule without a policy) for a
first attempt. The "must not trigger" cases are healthy or handled output: they must never yield
an error signal. The Slurm node list is given (no sinfo here), so exclusions are decided as on a
four-node partition.
"""

from __future__ import annotations

import json
import os

import pytest
from joblevel_corpus_cases import CASES, CORPUS, NIDS, PRESETS, UP, case, local_time  # noqa: F401  (case, UP: reused)

from megatron_resilience.jobs import monitors as mon
from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.jobs.evidence import read_tail
from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve
from megatron_resilience.records.ledger import Ledger


def lay_out(tmp_path, c: dict, policy: str | None, settings: dict | None = None) -> tuple[JobLevelConfig, Ledger]:
    """The case's files in a job/run directory; ``settings``: a plugin's resolved policy/monitors (else ``policy``)."""
    job_dir, run_dir = tmp_path / "job", tmp_path / "run"
    job_dir.mkdir(parents=True)
    run_dir.mkdir(parents=True)
    if c["step"]:
        (job_dir / "log-acct.gpt_77_0.out").write_bytes(open(os.path.join(CORPUS, c["step"]), "rb").read())
    if c["batch"]:
        (job_dir / "sbatch_acct.gpt_77.out").write_bytes(open(os.path.join(CORPUS, c["batch"]), "rb").read())
    if c["stop_reason"]:
        (run_dir / "stop_reason.json").write_text(json.dumps(c["stop_reason"]))
        if c["stop_reason_written"]:
            written = local_time(c["stop_reason_written"])
            os.utime(run_dir / "stop_reason.json", (written, written))
    flag = job_dir / "gpt_finished_flag"
    if c["flag"]:
        flag.write_text("")
    if settings is None:
        resolved, monitor_specs = resolve(policy, None)
        settings = {"policy": resolved, "monitors": monitor_specs}
    cfg = JobLevelConfig(job_name="gpt", job_dir=str(job_dir), ledger=str(run_dir / "job_ledger.jsonl"),
                         finished_flag=str(flag), run_dir=str(run_dir), stop_reason=str(run_dir / "stop_reason.json"),
                         metrics=str(run_dir / "metrics.jsonl"), ft=True, policy=settings["policy"],
                         monitors=settings["monitors"], monitor_only=settings.get("monitor_only", False))
    ledger = Ledger(cfg.ledger)
    ledger.append({"kind": "attempt_start", "job_id": "77", "slurm_restart": 0, "resubmission": 0,
                   "nodes": ",".join(c["nodes"]), "time": 0.0, "batch_log_offset": 0})
    return cfg, ledger


def encode(decision, cls) -> str:
    if decision.action in ("stop", "record"):  # record: monitor-only
        return decision.action
    if decision.exclude_applied:
        return "x:" + ",".join(decision.exclude_applied)
    return "requeue" if decision.spent else "free"


@pytest.mark.parametrize("name", sorted(CASES))
def test_classification_and_every_presets_decision(tmp_path, name):
    c = CASES[name]
    cluster = Cluster(nodes=c["nodes"] + ["spare-1", "spare-2"], partition="batch")
    got = []
    for i, policy in enumerate(PRESETS + (None,)):
        cfg, ledger = lay_out(tmp_path / str(i), c, policy)
        ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=c["exit_code"], slurm_state=c["state"],
                             by="batch", retries=3, cluster_info=cluster, node_info=c["node_info"],
                             batch_signal=c["batch_signal"])
        cls = ending.classification
        for key, value in c["expect"].items():
            actual = getattr(cls, key) if key != "fields" else {k: cls.fields.get(k) for k in value}
            assert actual == value, f"{name}: classification.{key} = {actual!r}, expected {value!r}\n{cls}"
        if cls.error_type not in ("finished", "preempted", "user_cancel", "rerun_failed_validation"):
            assert cls.evidence or cls.source == "exit_code", cls
        got.append(encode(ending.decision, cls))
    assert tuple(got) == c["decisions"], f"{name}: decisions {got} (presets {PRESETS} + nemo_run rule)"


MUST_NOT_TRIGGER = ("healthy_megatron.log", "healthy_ours_ft.log", "handled_errors.log", "truncated_step.log")


@pytest.mark.parametrize("log", MUST_NOT_TRIGGER)
def test_healthy_and_handled_output_yields_no_error_signal(log):
    """With every monitor on, healthy/handled/truncated output gives at most info/warning signals (a last line
    cut off mid-write, as a killed process leaves it, is not a line)."""
    monitors = mon.load_monitors(["megatron_production"])
    text = read_tail(os.path.join(CORPUS, log), max_bytes=1 << 20)  # as the trap reads it
    lines = [("log", line) for line in text.lines]
    found = [s for s in mon.scan(lines, monitors) if s.severity in ("error", "fatal")]
    assert found == []


def test_nan_iterations_zero_never_matches_and_nonzero_is_only_a_warning():
    monitors = mon.load_monitors(["megatron_basic"])
    line = (" [2026-03-02 11:03:40] iteration 10/ 500000 | lm loss: 1.05E+01 | number of skipped iterations:   0 | "
            "number of nan iterations:   {} |")
    assert mon.scan([("log", line.format(0))], monitors) == []
    [signal] = mon.scan([("log", line.format(3))], monitors)
    assert (signal.error_type, signal.severity, signal.fields) == ("nan_inf", "warning", {"count": "3"})


def test_the_evidence_records_every_host_it_read_and_from_which_line(tmp_path):
    """A node failure on 4 nodes: srun names the dead node, slurmstepd the batch host; both are recorded, one blamed."""
    c = CASES["node_failure_srun_names_the_dead_node_not_the_batch_host"]
    cfg, ledger = lay_out(tmp_path, c, "megatron_transient")
    ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=None, slurm_state="NODE_FAIL", by="batch",
                         cluster_info=Cluster(nodes=[*NIDS, "nid005"], partition="batch"), node_info={})
    recorded = ending.record["classification"]
    assert [(m["host"], m["node"], m["role"], m["line"][:30]) for m in recorded["host_evidence"]] == [
        ("nid003", "nid003", "failed", "srun: error: Node failure on n"),
        ("nid001", "nid001", "batch_host", "slurmstepd: error: *** JOB 600"),
    ]
    assert recorded["hosts"] == ["nid003"]
    assert recorded["attribution"] == "nid003: failed (strongest of 2 host mention(s))"
    assert {m["source"] for m in recorded["host_evidence"]} == {f"log:{cfg.job_dir}/sbatch_acct.gpt_77.out"}
    assert ending.record["decision"]["exclude_applied"] == ["nid003"]
