"""The chaos benchmark's short form against Megatron-LM's real trainer (``benchmarks/chaos_megatron_lm.py``, issue 32).

Run as a user would run it: Megatron-LM's ``pretrain`` (megatron-core 0.19.2, the lane's CPU layer) on 2 ranks under
ft_launcher, through ``run.Script`` on the multi-node instance with FaultTolerancePlugin, PreemptionPlugin and
RestartPolicyPlugin(``megatron_transient``), the watcher and a chaos stream of three faults, one of each recovery
path (``tests/slurm/chaos_short_mix.yaml``: a rank killed with an Xid line, a maintenance preemption, a node
failure), and an uninterrupted reference on the default cluster. The trainer writes no ``metrics.jsonl``: the stream,
the watcher and the report read its job folder and its own log. Asserted: the chain finished by itself, every
injected fault was classified as its kind, the failed node was excluded, the buckets sum to the allocated time, and
every step's loss as Megatron-LM prints it equals the reference's (``compare_losses``). Never how long anything took.
"""

from __future__ import annotations

import json
import os

import pytest
from slurm.chaos_benchmark import run_benchmark
from slurm.test_chaos_on_slurm import MIX, MTBF, seed_with_one_of_each  # the same short mix, seed and MTBF

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

STEPS, SAVE_INTERVAL = 250, 20


@pytest.fixture(scope="module")
def short(multinode_cluster, slurm_cluster, slurm_tmp):
    return run_benchmark("chaos_megatron_lm.py", multinode_cluster, os.path.join(slurm_tmp, "chaos_megatron_lm"), [
        "--mix", MIX, "--seed", str(seed_with_one_of_each()), "--mtbf", str(MTBF), "--max-count", "3",
        "--steps", str(STEPS), "--save-interval", str(SAVE_INTERVAL), "--step-delay", "0.05", "--repair", "20",
        "--job-minutes", "15"], log_name="mlm-chaos.chaos.log")


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


def test_the_buckets_sum_to_the_allocation_and_the_losses_equal_the_uninterrupted_runs(short):
    run = short["run"]
    acc = run["report"]["accounting"]
    assert run["sum_error_s"] < 1e-6
    assert acc["productive"] + sum(acc["badput"].values()) == pytest.approx(acc["allocated"], abs=1e-6)
    assert run["reference"]["steps"] == STEPS
    # the steps no log shows: those the failed node's attempt trained after its last logged line and saved at Slurm's
    # SIGTERM (its job step's output is lost with the node), which the next attempt resumed from
    with open(os.path.join(run["job_dir"], "job_ledger.jsonl")) as f:
        attempts = [r for r in map(json.loads, f) if r.get("kind") == "attempt"]
    lost = [(a["cycles"][-1]["last_step"], b["cycles"][0]["resumed_from"]) for a, b in zip(attempts, attempts[1:])
            if a["classification"]["error_type"] == "node_fail"]
    unlogged = [s for last, resumed in lost for s in range(last + 1, resumed + 1)]
    expected = f"bitwise (not in any log: {unlogged})" if unlogged else "bitwise"
    assert run["losses_vs_reference"] == expected, short["stdout"][-4000:]
