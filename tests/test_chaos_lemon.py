"""A lemon node in the chaos stream (``--lemon NODE=WEIGHT``): faults that pick a node pick it more often.

The acceptance run of issue 34 needs one node that fails repeatedly; the job-level decision must avoid it after
its repeats and never a healthy node (tests/test_joblevel_node_exclusion.py proves the decision side).
"""

from __future__ import annotations

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
