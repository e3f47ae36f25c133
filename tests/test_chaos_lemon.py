"""A lemon node in the chaos stream (``--lemon NODE=WEIGHT``): faults that pick a node pick it more often.

The acceptance run of issue 34 needs one node that fails repeatedly; the job-level decision must avoid it after
its repeats and never a healthy node (tests/test_joblevel_node_exclusion.py proves the decision side).
"""

from __future__ import annotations

import os
import random

import pytest

from megatron_resilience.chaos.cli import lemons, main
from megatron_resilience.chaos.runner import ChaosConfig, pick_node


def test_without_a_lemon_among_the_nodes_a_seed_draws_the_node_it_always_drew():
    nodes = ["mn1", "mn2", "mn3"]
    for seed in range(50):
        expected = nodes[random.Random(seed).randrange(3)]
        assert pick_node(nodes, seed, {}) == expected
        assert pick_node(nodes, seed, {"elsewhere": 9.0}) == expected


def test_a_lemon_is_picked_weight_times_as_often_as_any_other_node():
    nodes = ["mn1", "mn2", "mn3"]
    picks = [pick_node(nodes, seed, {"mn2": 5.0}) for seed in range(7000)]
    share = picks.count("mn2") / len(picks)
    assert abs(share - 5 / 7) < 0.02, share  # 5 / (5 + 1 + 1)
    assert pick_node(nodes, 11, {"mn2": 5.0}) == pick_node(nodes, 11, {"mn2": 5.0})  # seeded


def test_lemon_option_is_parsed_and_a_bad_one_names_the_option(tmp_path, capsys):
    assert lemons(["mn2=5", "mn3=2.5"]) == {"mn2": 5.0, "mn3": 2.5}
    for bad in ("mn2", "=5", "mn2=five"):
        with pytest.raises(ValueError, match=r"^chaos --lemon: must be NODE=WEIGHT \(e\.g\. mn2=5\), got "):
            lemons([bad])
    with pytest.raises(ValueError, match=r"^chaos --lemon: must be NODE=WEIGHT with a node name and a finite "
                                         r"weight > 0, got 'mn2'=0"):
        ChaosConfig(run_dir=str(tmp_path), mtbf=60, lemons={"mn2": 0})
    assert main([str(tmp_path), "--mtbf", "60", "--lemon", "mn2", "--plan"]) == 2
    assert "megatron_resilience chaos: chaos --lemon: must be NODE=WEIGHT (e.g. mn2=5), got 'mn2'" in \
        capsys.readouterr().err


def test_with_a_pool_a_hardware_fault_strikes_any_machine_and_a_lemon_most_often(tmp_path):
    """--pool: each node of the partition fails on its own. A hardware fault (Xid, ECC, node lost) strikes one of the
    pool's nodes, the lemon ``weight`` times as often, wherever the job runs; a fault of the job itself (a hang, a
    preemption) lands on the job's nodes. Without a pool a one-node job meets every hardware fault."""
    from megatron_resilience.chaos.runner import strike

    cfg = ChaosConfig(run_dir=str(tmp_path), mtbf=60, lemons={"mn3": 20.0}, pool=["mn1", "mn2", "mn3"])
    hits = [strike(True, ["mn1"], seed, cfg) for seed in range(2200)]
    assert abs(hits.count("mn3") / len(hits) - 20 / 22) < 0.02 and {"mn1", "mn2"} <= set(hits)
    assert {strike(False, ["mn1"], seed, cfg) for seed in range(200)} == {"mn1"}
    bare = ChaosConfig(run_dir=str(tmp_path), mtbf=60, lemons={"mn3": 20.0})
    assert {strike(True, ["mn1"], seed, bare) for seed in range(200)} == {"mn1"}
    with pytest.raises(ValueError, match=r"^chaos --pool: must be distinct node names, got \['mn1', 'mn1'\]$"):
        ChaosConfig(run_dir=str(tmp_path), mtbf=60, pool=["mn1", "mn1"])


def test_a_hardware_fault_on_a_machine_outside_the_job_is_recorded_and_not_tried_again(monkeypatch, tmp_path):
    """The Slurm job and the injector are scripted (tests/test_chaos_units.py's FakeJob; the real loop runs on the
    Slurm cluster in tests/slurm/test_chaos_on_slurm.py): the job runs on n1, the pool's lemon is n9. An Xid that
    strikes n9 costs the job nothing: one record, not done, naming the node, never retried; a preemption lands."""
    from test_chaos_units import FakeJob, run_chaos

    mix = tmp_path / "two.yaml"
    mix.write_text("name: two\nsource: a test\ncauses:\n  - {cause: a GPU, count: 1, fault: gpu_xid}\n"
                   "  - {cause: maintenance, count: 1, fault: preempt}\n")
    fake = FakeJob(["RUNNING"], [{"ok": True, "rank": 0}])
    summary, ledger = run_chaos(monkeypatch, tmp_path, fake, mix=str(mix), max_count=6, lemons={"n9": 1000.0},
                                pool=["n1", "n9"])
    injections = [r for r in ledger if r["kind"] == "injection"]
    outside = [r for r in injections if r.get("outside_job")]
    assert outside and all(r["fault"] == "gpu_xid" and r["node"] == "n9" and r["ok"] is False and not r.get("retries")
                           and r["why"] == "struck n9, a node outside job 42: its hardware fault costs the job nothing"
                           for r in outside)
    assert sorted(fake.calls) == sorted(r["fault"] for r in injections if not r.get("outside_job"))
    assert len(injections) == 6 and summary["failed_injections"] == len(outside)


def test_the_long_forms_attribution_window_is_compressed_as_its_stream(tmp_path):
    """benchmarks/chaos_lookback.py: 14 days is 0.041 of a healthy Llama 3 node's time between hardware failures
    (54 days x 2,048 nodes / (419 x 78 %) = 338 days); the long form's stream (a fault a minute, 77 % of
    llama3_local_cluster's faults hardware, three nodes, a lemon 20 times as likely) gives a healthy node one every
    60 / 0.773 x 22 = 1708 s, so its window is 71 s; the policy file is megatron_transient's with only that changed."""
    import sys

    import yaml

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from chaos_lookback import compressed_window_s, healthy_node_mtbf_days, write_policy

    from megatron_resilience.chaos.faults import fault
    from megatron_resilience.chaos.mix import load_mix
    from megatron_resilience.jobs.policies import load_policy

    assert round(healthy_node_mtbf_days(), 1) == 338.4
    share = sum(v for k, v in load_mix("llama3_local_cluster").weights_by_fault().items() if fault(k).hardware)
    assert round(share, 3) == 0.773
    window = compressed_window_s(mtbf_s=60, hardware_share=share, pool=3, lemon_weight=20)
    assert round(window, 1) == 70.6
    path = write_policy(str(tmp_path), "megatron_transient", window)
    shipped, compressed = load_policy("megatron_transient"), load_policy(path)
    assert compressed.exclude_nodes_within_s == pytest.approx(window)
    assert {k: v for k, v in compressed.to_dict().items() if k not in ("name", "description",
                                                                        "exclude_nodes_within_days")} == \
        {k: v for k, v in shipped.to_dict().items() if k not in ("name", "description", "exclude_nodes_within_days")}
    assert yaml.safe_load(open(path))["name"] == "megatron_transient_compressed"
