"""Which nodes a requeue avoids (jobs/node_exclusion.py): nodes the scheduler drained, one new blamed node per
decision, attributions counted across in-job cycles and across runs that share a folder — and never a drained pool.

Decisions are taken through ``jobs.decision.decide`` with the shipped presets, as the batch script's trap takes
them; sinfo's view is given per decision (``Cluster``), and read through a stub ``sinfo`` on PATH where the parsing
is under test.
"""

from __future__ import annotations

import os

import pytest
from joblevel_chain import chain, cls

from megatron_resilience.jobs import shared_node_history, slurm
from megatron_resilience.jobs.decision import Cluster, decide
from megatron_resilience.jobs.node_exclusion import blames
from megatron_resilience.jobs.policies import load_policy

DAY = 24 * 3600.0
T0 = 1_800_000_000.0
POOL = ["n1", "n2", "n3", "n4", "n5", "n6"]


def view(**states: str) -> Cluster:
    """sinfo's view of POOL: every node idle unless named (a state Slurm keeps from work marks it unusable)."""
    full = {n: states.get(n, "idle") for n in POOL}
    return Cluster(nodes=list(POOL), partition="p", states=full,
                   unusable=[n for n, s in full.items() if not slurm.usable_at_all(s)])


def progress(k: int) -> dict:
    return {"end": T0 + k * 3600, "resumed_from": k * 100, "checkpoint_step": (k + 1) * 100}


def test_a_node_the_scheduler_drained_is_excluded_before_the_requeue_and_comes_back_when_it_is_usable():
    """In-job restarts reuse the allocation and never see a drain; the requeue does: the attempt's node sinfo shows
    drained is excluded (no attribution needed, no budget), and the first later decision that sees it idle lifts it."""
    decisions = chain("megatron_transient", [
        ("hang", {"nodes": ["n1", "n2"], "cluster": view(n2="drained"), **progress(0)}),
        ("hang", {"nodes": ["n1", "n3"], "cluster": view(n2="idle"), **progress(1)}),
    ])
    first, second = decisions
    assert (first.action, first.exclude_requested, first.exclude_applied, first.exclude_blamed) == \
        ("requeue", ["n2"], ["n2"], [])
    assert first.exclude_scheduler == {"n2": "drained"}
    assert "; the scheduler keeps n2 (drained) from work" in first.message()
    assert (second.exclude_requested, second.exclude_applied, second.exclude_lifted) == ([], [], ["n2"])
    assert "exclusion of n2 lifted (the scheduler shows it usable again; ExcNodeList=)" in second.message()


def test_every_state_slurm_keeps_from_work_is_excluded_and_a_node_sinfo_does_not_list_is_only_recorded():
    states = {"n1": "down", "n2": "drain", "n3": "failing", "n4": "idle*", "n5": "mixed"}
    [d] = chain("megatron_transient", [("hang", {"nodes": ["n1", "n2", "n3", "n4", "n5", "n9"],
                                                             "cluster": view(**states), **progress(0)})])
    assert d.exclude_scheduler == {"n1": "down", "n2": "drain", "n3": "failing", "n4": "idle*", "n9": "not listed"}
    # n9: Slurm gives the job no node outside its partition and rejects a name it does not know in ExcNodeList
    assert d.exclude_requested == ["n1", "n2", "n3", "n4"] and d.exclude_applied == ["n1", "n2", "n3", "n4"]


def test_when_sinfo_cannot_be_read_the_requeue_goes_on_and_the_ledger_says_so():
    [d] = chain("megatron_transient", [("hang", {"nodes": ["n1"], **progress(0)})],
                cluster=Cluster(partition="p", unread="sinfo -h -N -o %N|%T -p p failed or timed out"))
    assert (d.action, d.exclude_applied, d.exclude_scheduler) == ("requeue", [], {})
    assert d.scheduler_unread == ("sinfo could not be read (sinfo -h -N -o %N|%T -p p failed or timed out): nodes "
                                  "the scheduler drains were not checked")
    assert d.to_dict()["scheduler_unread"] == d.scheduler_unread and d.scheduler_unread in d.message()


def test_sinfo_is_read_with_its_states_and_a_failing_sinfo_is_named(tmp_path, monkeypatch):
    (tmp_path / "sinfo").write_text("#!/bin/bash\nprintf 'n1|idle\\nn2|drained\\nn3|down*\\nn3|allocated\\n"
                                    "n4|IDLE*\\n'\n")
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    c = slurm.cluster("p")
    assert (c.nodes, c.unusable, c.states, c.unread) == (
        ["n1", "n2", "n3", "n4"], ["n2", "n3", "n4"], {"n1": "idle", "n2": "drained", "n3": "down*", "n4": "idle*"},
        None)
    (tmp_path / "sinfo").write_text("#!/bin/bash\necho 'slurm_load_partitions: Unable to contact controller' >&2\n"
                                    "exit 1\n")
    assert slurm.cluster("p").unread == "sinfo -h -N -o %N|%T -p p failed or timed out"


def test_one_new_blamed_node_per_decision_the_others_come_back_if_blamed_again():
    """A correlated event (a leaf switch) blames three nodes at once: one is excluded, the others are deferred; a
    node blamed again later is excluded then. The pool does not lose three nodes to one event."""
    event = {"hosts": ["n2", "n3", "n4"], "nodes": ["n1", "n2", "n3", "n4"]}
    decisions = chain("megatron_transient", [
        ("node_fail", {**event, "cluster": view(), **progress(0)}),
        ("nccl_error", {"hosts": ["n3"], "nodes": ["n1", "n3", "n4", "n5"], "cluster": view(), **progress(1)}),
    ])
    first, second = decisions
    assert (first.exclude_requested, first.exclude_blamed, first.exclude_deferred, first.exclude_applied) == \
        (["n2"], ["n2"], ["n3", "n4"], ["n2"])
    assert "; n3,n4 also blamed, not excluded now (one new node per decision)" in first.message()
    assert (second.exclude_requested, second.exclude_applied) == (["n3"], ["n2", "n3"])  # n3: 2 attributions


def test_the_most_blamed_node_is_the_one_excluded_first():
    """``exclude_nodes_after`` (2) reached by two nodes in one decision: the one with more attributions goes first."""
    decisions = chain("megatron_transient", [
        ("nccl_error", {"hosts": ["n4"], "nodes": ["n1", "n4"], "cluster": view(), **progress(0)}),
        ("nccl_error", {"hosts": ["n4"], "nodes": ["n1", "n4"], "cluster": view(), **progress(1)}),
        ("nccl_error", {"hosts": ["n3"], "nodes": ["n1", "n3"], "cluster": view(), **progress(2)}),
        ("nccl_error", {"hosts": ["n3", "n4"], "nodes": ["n3", "n4"], "cluster": view(), **progress(3)}),
    ])
    assert [d.exclude_applied for d in decisions] == [[], ["n4"], [], ["n4", "n3"]]  # []: the job's list unchanged
    assert (decisions[3].exclude_requested, decisions[3].exclude_deferred) == (["n4", "n3"], [])  # n4: standing
    six = chain("megatron_transient", [
        ("nccl_error", {"hosts": ["n3"], "nodes": ["n1", "n3"], "cluster": view(), **progress(0)}),
        ("nccl_error", {"hosts": ["n4"], "nodes": ["n1", "n4"], "cluster": view(), **progress(1)}),
        ("nccl_error", {"hosts": ["n4"], "nodes": ["n1", "n4"], "cluster": view(), "end": T0 + 9000}),
        ("nccl_error", {"hosts": ["n3", "n4"], "nodes": ["n3", "n4"], "cluster": view(), **progress(3)}),
    ])
    # the third decision excludes n4 (2 attributions); the fourth: n4 at 3 stands, n3 at 2 is the one new node
    assert [d.exclude_applied for d in six] == [[], [], ["n4"], ["n4", "n3"]]


def test_hardware_failures_of_in_job_restart_cycles_count_towards_a_node_exclusion():
    """An Xid that ft_launcher recovered in-job (the allocation kept, no decision taken) is still an attribution: a
    second one on the same node at the attempt's end reaches ``exclude_nodes_after`` (2) at once."""
    cycles = [{"cycle": 0, "ended": {"error_type": "xid_error", "hosts": ["n2"], "time": T0 - 600}}, {"cycle": 1}]
    [d] = chain("megatron_transient", [("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "cycles": cycles,
                                                      "cluster": view(), **progress(0)})])
    assert d.exclude_applied == ["n2"]
    assert blames([{"nodes": ["n1", "n2"], "cycles": cycles, "classification": {"error_type": "hang"}}], view()) \
        == [("n2", T0 - 600)]


def test_a_preemption_after_in_job_restarts_for_one_nodes_gpu_requeues_without_that_node():
    """Seen in the long chaos run: three cycles of one attempt ended by the lemon's ECC and Xid errors (ft_launcher
    restarted them in the allocation), then a maintenance preemption ended the attempt. The requeue spends nothing
    and still leaves the lemon out; a preemption with one hardware cycle (below ``exclude_nodes_after``) does not,
    and neither excludes a node no cycle blamed."""
    lemon = [{"cycle": k, "ended": {"error_type": kind, "hosts": ["n3"], "time": T0 - 600 + k}}
             for k, kind in enumerate(("ecc_error", "xid_error", "xid_error"))] + [{"cycle": 3}]
    [d] = chain("megatron_transient", [("preempted", {"nodes": ["n3"], "cycles": lemon, "cluster": view(),
                                                     **progress(0)})])
    assert (d.action, d.spent, d.exclude_applied, d.exclude_blamed) == ("requeue", None, ["n3"], ["n3"])
    once = [lemon[0], {"cycle": 1}]
    [d] = chain("megatron_transient", [("preempted", {"nodes": ["n3"], "cycles": once, "cluster": view(),
                                                     **progress(0)})])
    assert (d.action, d.spent, d.exclude_applied) == ("requeue", None, [])


def test_runs_that_share_a_node_history_folder_count_each_others_attributions(tmp_path):
    """Run A meets an Xid on n3 and publishes it; run B's first Xid on n3 is the node's second attribution within
    the lookback, so B excludes it at once. A run never counts its own lines twice; lines older than 14 days and
    other nodes do not count."""
    folder = str(tmp_path / "team_nodes")
    a_attempt = {"job_id": "101", "attempt_index": 0, "nodes": ["n3", "n4"], "end": T0,
                 "classification": {"error_type": "xid_error", "hosts": ["n3"]}}
    assert shared_node_history.publish(folder, "/runs/a/job_ledger.jsonl", a_attempt, view()) is None
    old = {**a_attempt, "end": T0 - 15 * DAY, "classification": {"error_type": "ecc_error", "hosts": ["n5"]}}
    shared_node_history.publish(folder, "/runs/c/job_ledger.jsonl", old, view())
    lines = open(os.path.join(folder, "node_blames.jsonl")).read().splitlines()
    assert len(lines) == 2 and '"node": "n3"' in lines[0] and '"run": "/runs/a/job_ledger.jsonl"' in lines[0]
    now = T0 + 2 * DAY
    assert shared_node_history.others(folder, "/runs/b/job_ledger.jsonl", now) == [("n3", T0)]
    assert shared_node_history.others(folder, "/runs/a/job_ledger.jsonl", now) == []  # its own: from its ledger
    b = cls("nccl_error", ["n3"])  # restarted without exclusion under megatron_transient: excluded on repeats
    current = {"classification": b.to_dict(), "nodes": ["n1", "n3"], "end": now, **progress(0)}
    policy = load_policy("megatron_transient")
    alone = decide(b, policy, [], current, view())
    shared = decide(b, policy, [], current, view(), shared_blames=shared_node_history.others(
        folder, "/runs/b/job_ledger.jsonl", now))
    assert (alone.exclude_applied, shared.exclude_applied) == ([], ["n3"])


def test_a_folder_that_cannot_be_written_costs_the_run_only_the_shared_count(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    attempt = {"nodes": ["n1"], "end": T0, "classification": {"error_type": "xid_error", "hosts": ["n1"]}}
    why = shared_node_history.publish(str(blocker / "sub"), "/runs/a/l", attempt, view())
    assert why is not None and why.startswith(f"{blocker / 'sub' / 'node_blames.jsonl'}: ")
    assert shared_node_history.others(str(blocker / "sub"), "/runs/b/l", T0) == []
    # the ledger record of the attempt says so (the batch trap and the watcher share through attempt_end.share)
    from megatron_resilience.jobs.attempt_end import share
    from megatron_resilience.jobs.jobconfig import JobLevelConfig

    cfg = JobLevelConfig(job_name="j", job_dir=str(tmp_path), ledger="/runs/a/l", finished_flag=str(tmp_path / "f"),
                         node_history_dir=str(blocker / "sub"))
    record = dict(attempt)
    share(cfg, record, view())
    assert record["node_history_not_shared"] == why
    share(JobLevelConfig(job_name="j", job_dir=str(tmp_path), ledger="/runs/a/l", finished_flag="f",
                         node_history_dir=str(tmp_path / "shared")), record := dict(attempt), view())
    assert "node_history_not_shared" not in record
    assert [r["node"] for r in shared_node_history.Ledger(shared_node_history.path(str(tmp_path / "shared")))
            .records("node_blame")] == ["n1"]


def test_a_long_run_on_a_pool_with_a_lemon_excludes_the_lemon_and_never_strands_the_job():
    """Sixty failures over 30 days on a 6-node pool, the job needs 4: a lemon (n6) blamed by an NCCL error every
    third failure; NCCL errors on the healthy nodes, each at most once per two weeks; hangs between. The lemon is
    excluded at its second attribution and stays out while it keeps failing; no healthy node is excluded; the job
    always keeps 4 usable nodes; every failure is requeued (each attempt advanced its checkpoint)."""
    healthy = ["n1", "n2", "n3", "n4", "n5"]
    endings = []
    for k in range(60):
        extra = {"nodes": ["n1", "n2", "n3", "n4"], **progress(k), "end": T0 + k * 12 * 3600}
        if k % 3 == 0:
            endings.append(("nccl_error", {**extra, "hosts": ["n6"], "nodes": ["n6", "n1", "n2", "n3"]}))
        elif k % 12 == 1:
            endings.append(("nccl_error", {**extra, "hosts": [healthy[(k // 12) % 5]]}))
        else:
            endings.append(("hang", extra))
    decisions = chain("megatron_transient", endings, cluster=view())
    assert len(decisions) == 60 and all(d.action == "requeue" for d in decisions)
    assert [d.exclude_applied for d in decisions[:4]] == [[], [], [], ["n6"]]
    assert {n for d in decisions for n in d.exclude_applied} == {"n6"}
    assert all(len([n for n in POOL if n not in d.exclude_applied]) >= 4 for d in decisions)


def test_a_requeue_that_spends_nothing_still_lifts_a_drain_and_a_resized_job_grows_back_onto_the_node():
    """The elastic chain on Slurm: a node failure (the node DOWN: excluded), then a preemption to grow back once the
    node returns. The preemption's decision lifts the exclusion, and the node count counts the node again."""
    from types import SimpleNamespace

    from megatron_resilience.jobs import requeue_size

    decisions = chain("megatron_transient", [
        ("node_fail", {"nodes": ["n1", "n2"], "cluster": view(n2="down"), **progress(0)}),
        ("preempted", {"nodes": ["n1"], "cluster": view(), **progress(1)}),
    ])
    assert (decisions[0].exclude_applied, decisions[0].exclude_scheduler) == (["n2"], {"n2": "down"})
    assert (decisions[1].action, decisions[1].spent, decisions[1].exclude_applied, decisions[1].exclude_lifted) == \
        ("requeue", None, [], ["n2"])
    cfg = SimpleNamespace(min_nodes=1, nodes=2, ntasks_per_node=1)
    history = [{"nodes": ["n1", "n2"], "end": T0, "decision": decisions[0].to_dict()}]
    states = {"n1": "allocated", "n2": "idle", "n3": "allocated"}
    grown = requeue_size.plan(cfg, {"nodes": ["n1"], "end": T0 + 3600}, decisions[1], history, partition="p",
                            states=states)
    assert (grown["nodes"], grown["was"], grown["available"]) == (2, 1, ["n1", "n2"])
    still = chain("megatron_transient", [
        ("node_fail", {"nodes": ["n1", "n2"], "cluster": view(n2="down"), **progress(0)}),
        ("preempted", {"nodes": ["n1"], "cluster": view(n2="down"), **progress(1)}),
    ])
    assert (still[1].exclude_applied, still[1].exclude_lifted) == ([], [])  # unchanged: n2 stays excluded
    assert requeue_size.plan(cfg, {"nodes": ["n1"], "end": T0 + 3600}, still[1],
                           [{"nodes": ["n1", "n2"], "end": T0, "decision": still[0].to_dict()}], partition="p",
                           states={**states, "n2": "down"}) is None


def test_the_policys_lookback_decides_which_attributions_count_and_how_long_an_exclusion_stands(tmp_path):
    """``exclude_nodes_within_days`` (default 14, nvidia-resiliency-ext's lookback): megatron_transient with half a
    day. Two NCCL errors that blame n2 13 hours apart are not a repeat; two within an hour are, and n2 is excluded;
    half a day after the last decision that asked for it, the exclusion ends (lifted, saying why). A value that is
    not a positive number of days names the key."""
    import yaml

    from megatron_resilience.config.validate import ConfigError
    from megatron_resilience.jobs.policies import PRESET_DIR, load_policy

    with open(os.path.join(PRESET_DIR, "megatron_transient.yaml")) as f:
        data = yaml.safe_load(f)
    assert load_policy("megatron_transient").exclude_nodes_within_days == 14.0
    path = tmp_path / "half_day.yaml"
    path.write_text(yaml.safe_dump({**data, "name": "half_day", "exclude_nodes_within_days": 0.5}))
    hour = 3600.0
    at = [0.0, 13 * hour, 13.5 * hour, 26 * hour]
    endings = [("nccl_error", {"hosts": ["n2"], "nodes": ["n2"], "cluster": view(), "end": T0 + t,
                              "resumed_from": k * 100, "checkpoint_step": (k + 1) * 100})
               for k, t in enumerate(at[:3])]
    endings.append(("hang", {"nodes": ["n1"], "cluster": view(), "end": T0 + at[3], "resumed_from": 300,
                             "checkpoint_step": 400}))
    decisions = chain(str(path), endings)
    assert [d.exclude_applied for d in decisions] == [[], [], ["n2"], []]
    assert decisions[3].exclude_lifted == ["n2"]
    assert decisions[3].exclude_lifted_why == {"n2": "asked for last more than 0.5 days ago"}
    for bad in (0, -1, "14d", True):
        path.write_text(yaml.safe_dump({**data, "name": "bad", "exclude_nodes_within_days": bad}))
        with pytest.raises(ConfigError, match=r"exclude_nodes_within_days: must be a number of days > 0 "
                                              r"\(e\.g\. 14, or 0\.5 for 12 hours\), got "):
            load_policy(str(path))
