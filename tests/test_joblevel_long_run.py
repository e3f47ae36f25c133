"""A weeks-long run's chain of failures through the job-level decision: budgets that count failures without
progress, the same failure repeating without an advance, restart loops, node exclusions and how long they last."""

from __future__ import annotations

import pytest
from joblevel_chain import chain

from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.jobs.policies import load_policy

LONG_RUN_KINDS = ["node_fail", "xid_error", "nccl_timeout", "hang"]


@pytest.mark.parametrize("policy", ["default", "megatron_transient", "megatron_aggressive"])
def test_forty_failures_of_a_run_that_keeps_advancing_are_all_requeued(policy):
    """A weeks-long run's chain (Llama 3 405B met 466 interruptions in 54 days): node failures, Xids, NCCL
    timeouts and hangs, each attempt 500 steps further. Budgets count failures without progress, so none is
    spent twice: counting every failure, the same chain stopped after 4 (default), 5 (transient), 9 (aggressive)."""
    endings = [(kind, {"resumed_from": 500 * i, "checkpoint_step": 500 * (i + 1), "hosts": [f"n{i % 3 + 1}"],
                       "evidence": [f"line {i} of {kind}"]})
               for i, kind in enumerate(LONG_RUN_KINDS * 10)]
    decisions = chain(policy, endings)
    assert [d.action for d in decisions] == ["requeue"] * 40 and not any(d.final for d in decisions)
    full = load_policy(policy).max_restarts
    assert all(d.budget_left == {**full, d.spent: full[d.spent] - 1} for d in decisions), decisions
    assert all(d.repeats_without_progress == 1 for d in decisions)


@pytest.mark.parametrize("policy", ["default", "megatron_transient", "megatron_aggressive"])
def test_the_same_failure_three_times_without_progress_stops_naming_it(policy):
    """Recurrences are counted by fingerprint (type, node, first line with numbers masked): the watchdog's
    timestamps and sequence numbers differ each time, the failure does not."""
    line = "[rank0]:[E1128 10:0{i}:12.{i}] Watchdog caught collective operation timeout: SeqNum={i}{i}, Timeout=600000"
    endings = [("nccl_timeout", {"resumed_from": 500, "checkpoint_step": 500, "hosts": ["n2"],
                                 "evidence": [line.format(i=i)]}) for i in range(1, 6)]
    decisions = chain(policy, endings)
    assert [d.action for d in decisions] == ["requeue", "requeue", "stop"]
    assert [d.repeats_without_progress for d in decisions] == [1, 2, 3]
    assert decisions[-1].outcome == "no_progress"
    assert decisions[-1].reason == (
        "the same failure 3 times in a row without advancing the checkpoint: nccl_timeout @ n2: [rankN]:[EN N:N:N.N] "
        "Watchdog caught collective operation timeout: SeqNum=N, Timeout=N")
    assert decisions[-1].fingerprint in decisions[-1].reason  # the basis of the stop is on the ledger record


def test_an_advance_resets_the_count_of_a_recurring_failure():
    same = {"hosts": ["n2"], "evidence": ["NCCL watchdog timeout"]}
    stuck, advanced = {"resumed_from": 500, "checkpoint_step": 500}, {"resumed_from": 500, "checkpoint_step": 700}
    decisions = chain("megatron_aggressive", [("nccl_timeout", {**same, **stuck}), ("nccl_timeout", {**same, **stuck}),
                                              ("nccl_timeout", {**same, **advanced}),
                                              ("nccl_timeout", {**same, "resumed_from": 700, "checkpoint_step": 700})])
    assert [(d.action, d.repeats_without_progress) for d in decisions] == [("requeue", 1), ("requeue", 2),
                                                                          ("requeue", 1), ("requeue", 2)]


def test_budgets_count_the_failures_since_the_last_progress_per_mode():
    """Different failures with no progress seen (these attempts left no records) spend their mode's budget, and
    nothing refills it; a mode that runs out ends the chain."""
    decisions = chain("default", [("nccl_timeout", {}), ("hang", {}), ("watchdog_timeout", {})])
    assert [(d.action, d.spent, d.budget_left) for d in decisions] == [
        ("requeue", "stall", {"crash": 2, "stall": 1, "timeout": 2}),
        ("requeue", "stall", {"crash": 2, "stall": 0, "timeout": 2}),
        ("stop", None, {"crash": 2, "stall": 0, "timeout": 2}),
    ]
    assert decisions[-1].outcome == "budget_exhausted"
    assert decisions[-1].reason == ("retry budget exhausted: 2 of 2 stall restart(s) used since the run last "
                                    "advanced its checkpoint (watchdog_timeout, policy default); last failure "
                                    "watchdog_timeout @ -")
    # the first failure after an advance is free again: the attempt that advanced refilled every budget
    refilled = chain("default", [("nccl_timeout", {}), ("hang", {"resumed_from": 0, "checkpoint_step": 10}),
                                 ("watchdog_timeout", {"resumed_from": 10, "checkpoint_step": 10})])
    assert [d.budget_left["stall"] for d in refilled] == [1, 1, 1] and refilled[-1].action == "requeue"
    # megatron_conservative asks for a person
    exhausted = chain("megatron_conservative", [("node_fail", {}), ("node_fail", {})])
    assert [d.action for d in exhausted] == ["requeue", "stop"] and exhausted[-1].outcome == "budget_exhausted"


def test_preemptions_between_failures_spend_nothing():
    decisions = chain("megatron_conservative", [("node_fail", {}), ("preempted", {}), ("system_cancel", {}),
                                                ("node_fail", {})])
    assert [(d.action, d.spent) for d in decisions] == [("requeue", "crash"), ("requeue", None), ("requeue", None),
                                                       ("stop", None)]


def test_a_restart_loop_without_progress_stops():
    # every restart resumes from the checkpoint at step 20 and dies before saving another, a different way each time
    stuck = {"resumed_from": 20, "checkpoint_step": 20, "last_step": 24}
    kinds = ["nccl_error", "hang", "nccl_error", "hang", "nccl_error", "hang"]
    decisions = chain("megatron_aggressive", [("nccl_error", {"resumed_from": 0, "checkpoint_step": 20,
                                                              "last_step": 24})] + [(k, dict(stuck)) for k in kinds])
    assert [d.action for d in decisions] == ["requeue"] * 4 + ["stop"]
    assert decisions[-1].outcome == "no_progress" and decisions[-1].attempts_without_progress == 4
    assert "4 failed attempt(s) in a row did not advance the checkpoint" in decisions[-1].reason
    assert decisions[-1].reason.endswith("last failure hang @ -")


def test_repeated_hardware_errors_on_one_host_exclude_it_and_an_impossible_exclusion_is_not_applied():
    decisions = chain("megatron_transient", [("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"]}),
                                             ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"]})])
    assert [d.exclude_applied for d in decisions] == [[], ["n2"]]  # exclude_nodes_after: 2
    only = chain("megatron_transient", [("xid_error", {"hosts": ["n1.cluster.local"], "nodes": ["n1"]})],
                 cluster=Cluster(nodes=["n1"], partition="p"))
    assert only[0].action == "requeue" and only[0].exclude_requested == ["n1"] and only[0].exclude_applied == []
    assert only[0].exclude_not_applied.startswith("excluding n1 would leave 0 usable node(s) in partition p (n1) "
                                                  "and the job needs 1")
    down = chain("megatron_transient", [("xid_error", {"hosts": ["n1"], "nodes": ["n1"]})],
                 cluster=Cluster(nodes=["n1", "n2"], unusable=["n2"], partition="p"))
    assert down[0].exclude_applied == [] and "would leave 0 usable node(s)" in down[0].exclude_not_applied


# --- exclusions over a weeks-long run -----------------------------------------------------------------------------

DAY = 24 * 3600.0


def test_an_exclusion_is_lifted_two_weeks_after_it_was_last_asked_for_and_the_pool_does_not_shrink_for_ever():
    """A node repaired during a weeks-long run comes back: after EXCLUSION_LOOKBACK_S (14 days) with no new
    attribution its exclusion ends (the job's ExcNodeList is rewritten without it), and it is said on the record."""
    from megatron_resilience.jobs.decision import EXCLUSION_LOOKBACK_S

    assert EXCLUSION_LOOKBACK_S == 14 * DAY
    t0 = 1_800_000_000.0
    decisions = chain("megatron_aggressive", [
        ("xid_error", {"hosts": ["n2"], "nodes": ["n2"], "end": t0, "resumed_from": 0, "checkpoint_step": 500}),
        ("xid_error", {"hosts": ["n3"], "nodes": ["n3"], "end": t0 + 3 * DAY, "resumed_from": 500,
                       "checkpoint_step": 900}),
        ("node_fail", {"nodes": ["n1", "n4"], "end": t0 + 15 * DAY, "resumed_from": 900, "checkpoint_step": 1500}),
        ("node_fail", {"nodes": ["n1", "n4"], "end": t0 + 18 * DAY, "resumed_from": 1500, "checkpoint_step": 2000}),
    ], cluster=Cluster(nodes=["n1", "n2", "n3", "n4", "n5"], partition="p"))
    assert [(d.exclude_applied, d.exclude_lifted) for d in decisions] == [
        (["n2"], []), (["n2", "n3"], []),
        (["n3"], ["n2"]),  # n2: last asked for 15 days ago; n3: 12 days ago, still standing
        ([], ["n3"]),  # n3: 15 days: the job's ExcNodeList is emptied
    ]
    assert "exclusion of n2 lifted (asked for last more than 14 days ago; ExcNodeList=n3)" in decisions[2].message()


def test_hardware_attributions_older_than_two_weeks_do_not_add_up_to_an_exclusion():
    t0 = 1_800_000_000.0
    apart = chain("megatron_transient", [  # exclude_nodes_after: 2
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0, "resumed_from": 0, "checkpoint_step": 10}),
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0 + 15 * DAY, "resumed_from": 10,
                        "checkpoint_step": 20})])
    close = chain("megatron_transient", [
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0, "resumed_from": 0, "checkpoint_step": 10}),
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0 + 13 * DAY, "resumed_from": 10,
                        "checkpoint_step": 20})])
    assert [d.exclude_applied for d in apart] == [[], []]
    assert [d.exclude_applied for d in close] == [[], ["n2"]]
