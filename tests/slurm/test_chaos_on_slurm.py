"""The chaos benchmark's short form on the real multi-node cluster: three injected faults, invariants only.

``benchmarks/chaos.py`` runs as a user would run it (``--intervals young_daly``, the ``off`` variant) with the
short mix (``chaos_short_mix.yaml``: a rank killed with an Xid line, a maintenance preemption, a node failure)
and a seed whose first three faults are one of each: the real trainer, two ranks (rank 0 hosts the job's store, so
a rank fault may hit it), under ft_launcher through NeMo-Run's
``SlurmExecutor`` with FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin(megatron_transient), the
watcher and the chaos stream, and an uninterrupted reference on the default cluster. Asserted: the chain
finished by itself, every injected fault was classified as its kind, the failed node was excluded, the
buckets sum to the allocated time, each attempt's allocation is Slurm's (sacct Start -> End), and the losses
equal the reference's bitwise. Never how long anything took (that is the benchmark's table).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_resilience.chaos.mix import load_mix
from megatron_resilience.chaos.runner import plan
from megatron_resilience.report.inputs import parse_slurm_time
from slurm.chaos_benchmark import run_benchmark

HERE = os.path.dirname(os.path.abspath(__file__))
MIX = os.path.join(HERE, "chaos_short_mix.yaml")
# Seed 6 gives 4.7 + 4.3 + 3.3 s of training between the faults; 250 steps of >= 50 ms (--step-delay) cover it.
MTBF, STEPS = 3, 250


def seed_with_one_of_each() -> int:
    mix = load_mix(MIX)
    one_of_each = ["gpu_xid", "node_down", "preempt"]
    return next(s for s in range(1000) if sorted(p.fault for p in plan(mix, seed=s, mtbf=MTBF, count=3)) == one_of_each)


@pytest.fixture(scope="module")
def short(multinode_cluster, slurm_cluster, slurm_tmp):
    got = run_benchmark("chaos.py", multinode_cluster, os.path.join(slurm_tmp, "chaos_short"), [
        "--intervals", "young_daly", "--mix", MIX, "--seed", str(seed_with_one_of_each()), "--mtbf", str(MTBF),
        "--max-count", "3", "--steps", str(STEPS), "--step-delay", "0.05", "--repair", "20", "--job-minutes", "15",
        "--ranks-per-node", "2"])
    return {**got, "cluster": multinode_cluster}


def test_every_injected_fault_is_classified_as_its_kind_and_the_failed_node_is_excluded(short):
    run = short["run"]
    assert run["final"] == "training finished after 3 attempt(s)", short["chaos_log"] + short["stdout"][-4000:]
    injected = run["report"]["injected"]
    rows = injected["injections"]
    assert sorted(r["fault"] for r in rows) == ["gpu_xid", "node_down", "preempt"]
    assert injected["all_classified"], (rows, short["chaos_log"])
    assert {r["fault"]: r["classified"] for r in rows} == {"gpu_xid": "xid_error", "preempt": "preempted",
                                                          "node_down": "node_fail"}
    [down] = [r for r in rows if r["fault"] == "node_down"]
    assert down["exclusion_requested"] == [down["node"]] and down["node"] in injected["excluded_nodes"]
    kinds = sorted(i["kind"] for i in run["report"]["accounting"]["interruptions"])
    assert kinds == ["job", "preemption", "process"]  # in-job restart, requeue after a save, requeue after NODE_FAIL


def test_every_try_chaos_made_again_is_on_record(short):
    """A fault chaos could not carry out at once (its target between attempts, Slurm not answering) is tried again;
    each injection record counts its earlier tries, and chaos's log says so for each: none is silent."""
    with open(os.path.join(short["run"]["run_dir"], "chaos_ledger.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    injections = [r for r in records if r.get("kind") == "injection"]
    assert len(injections) == 3 and all(isinstance(r["retries"], int) for r in injections), injections
    assert short["chaos_log"].count(" tries not done (") == sum(1 for r in injections if r["retries"]), \
        short["chaos_log"]


def test_the_buckets_sum_to_slurms_allocation(short):
    run = short["run"]
    acc = run["report"]["accounting"]
    assert run["sum_error_s"] < 1e-6
    assert acc["productive"] + sum(acc["badput"].values()) == pytest.approx(acc["allocated"], abs=1e-6)
    windows = run["report"]["windows"]
    assert len(windows) == 3
    env = {**os.environ, "SLURM_CONF": short["cluster"].slurm_conf}
    sacct = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", run["job"], "-o", "Start,End"], env=env,
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(sacct) == 3
    for window, line in zip(windows, sacct):
        start, end = (parse_slurm_time(t) for t in line.split("|"))
        assert window["start"] == start  # the allocation is Slurm's, not the batch script's or the watcher's
        assert end <= window["end"] <= end + 1  # sacct has whole seconds; the window covers the trainer's records
    assert sum(w["end"] - w["start"] for w in windows) == pytest.approx(acc["allocated"], abs=1e-6)
    assert acc["queue_wait"] > 0  # two requeues: reported beside, not allocated


def test_each_bucket_is_what_the_records_say(short):
    """The buckets against the trainer's own records: every save's blocking time inside an allocation is
    ``checkpoint_save`` (saves paint first), productive time is at most the first runs' step times and most of
    them (a step's time is poured into the free time before its record), and each recovery path left its own
    bucket: the Xid's in-job restart ``restart_process``, the two requeues ``restart_job``, the resumes
    ``checkpoint_restore``."""
    run = short["run"]
    acc = run["report"]["accounting"]
    with open(os.path.join(run["run_dir"], "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    saves = [(r["start_time"], r["start_time"] + r["blocking_s"]) for r in records
             if r.get("kind") == "checkpoint" and r.get("start_time") is not None and r.get("blocking_s") is not None]
    windows = [(w["start"], w["end"]) for w in run["report"]["windows"]]
    inside = [sum(max(0.0, min(end, b) - max(start, a)) for a, b in windows) for start, end in saves]
    whole = [i for i, (start, end) in zip(inside, saves) if i == pytest.approx(end - start)]
    # a save cut by the end of its allocation (the node failure) counts at most its part inside the window
    assert saves and sum(whole) - 1e-4 <= acc["badput"]["checkpoint_save"] <= sum(inside) + 1e-4, (saves, windows)
    first_runs: dict[int, float] = {}
    for r in records:
        if r.get("kind") == "train":
            first_runs.setdefault(r["step"], r["step_time_s"])
    assert sorted(first_runs) == list(range(1, STEPS + 1))
    # sums of ~100 spans between epoch-second stamps (a double holds them to ~2e-7 s each): 1e-6 was once exceeded
    assert 0.5 * sum(first_runs.values()) < acc["productive"] <= sum(first_runs.values()) + 1e-4
    for bucket in ("restart_process", "restart_job", "checkpoint_restore", "startup"):
        assert acc["badput"][bucket] > 0, (bucket, acc["badput"])


def test_the_save_at_the_maintenance_signal_finished_and_its_margin_is_on_record(short):
    """The ledger's word on the injected preemption: the trainer saved at the signal; the margin is what is left of
    the job's ``preempt_time`` after the signal -> exit it measured (its size is the machine's, never asserted)."""
    with open(os.path.join(short["run"]["run_dir"], "job_ledger.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    [preempted] = [r for r in records if r.get("kind") == "attempt" and r.get("preemption")]
    margin = preempted["preemption"]
    assert margin["saved_at_signal"] is True and margin["checkpoint_at_stop"] in ("saved", "already saved"), margin
    assert margin["preempt_time"] == 60  # PreemptionPlugin(preempt_time=60) in the benchmark
    assert margin["margin_s"] == pytest.approx(margin["preempt_time"] - margin["needed_s"])
    if margin["checkpoint_at_stop"] == "saved":  # "already saved": the signal came right after a periodic save
        assert margin["signal_time"] <= margin["save_done_time"] <= margin["exit_time"], margin


def test_losses_equal_an_uninterrupted_run_bitwise(short):
    run = short["run"]
    # the off variant trains on one node with two ranks (DP 2): its reference is the DP-2 one
    assert run["reference"] == "reference-dp2" and short["data"]["references"]["2"]["steps"] == STEPS
    assert run["steps"] == STEPS
    assert run["losses_vs_reference"] == "bitwise"
