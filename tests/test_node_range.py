"""Issue 25, section 3, the decision's arithmetic: how many nodes a requeued attempt asks for, the exclusion a node
range makes possible, the world and DP size each attempt records, and the report's throughput per attempt.

Slurm's view is given as ``sinfo`` would report it (node -> state), so each case is exact; the same code runs
against the real cluster in ``tests/slurm/test_elastic_on_slurm.py``.
"""

from __future__ import annotations

import json
import os

from megatron_resilience.jobs import requeue_size
from megatron_resilience.jobs.classifier import Classification
from megatron_resilience.jobs.decision import Cluster, Decision, decide
from megatron_resilience.jobs.jobconfig import JobLevelConfig
from megatron_resilience.jobs.policies import load_policy
from megatron_resilience.report import throughput as attempt_throughput


def cfg(min_nodes=1, nodes=2, **kw):
    return JobLevelConfig(job_name="gpt", job_dir="/j", ledger="/r/job_ledger.jsonl", finished_flag="/j/f",
                          min_nodes=min_nodes, nodes=nodes, **kw)


def requeue(exclude=()):
    return Decision("requeue", "node_fail: requeue", exclude_applied=list(exclude))


def test_a_lost_node_without_a_spare_shrinks_the_next_attempt():
    states = {"mn1": "allocated", "mn2": "allocated", "mn3": "down"}  # mn1: another job; mn2: ours, freed on requeue
    count = requeue_size.plan(cfg(), {"nodes": ["mn2", "mn3"]}, requeue(), [], partition="faults", states=states)
    assert count == {"nodes": 1, "was": 2, "full": 2, "min_nodes": 1, "available": ["mn2"], "tasks": 1,
                     "reason": "1 node(s) can take it now (mn2): shrinks to 1 of 2 (min_nodes=1) instead of waiting "
                               "for a replacement"}
    assert requeue_size.resize_command("42", count) == ["scontrol", "update", "JobId=42", "NumNodes=1", "NumTasks=1"]


def test_a_later_attempt_grows_back_once_nodes_return_and_never_onto_excluded_ones():
    states = {"mn1": "idle", "mn2": "allocated", "mn3": "idle"}
    grown = requeue_size.plan(cfg(), {"nodes": ["mn2"]}, requeue(), [], partition="faults", states=states)
    assert (grown["nodes"], grown["available"]) == (2, ["mn1", "mn2", "mn3"])
    assert grown["reason"].endswith("grows back to 2 of 2")
    history = [{"decision": {"exclude_requested": ["mn1"], "exclude_applied": ["mn1"]}}]
    # a decision's exclude_applied is the job's whole list: mn1 (excluded earlier, standing) and mn3 (now)
    kept = requeue_size.plan(cfg(nodes=3), {"nodes": ["mn2"]}, requeue(["mn1", "mn3"]), history, partition="p",
                           states=states)
    assert kept is None  # mn1 and mn3 are idle but not for this job: stays at 1
    # a decision that leaves the list as it was: the earlier exclusion still stands
    assert requeue_size.plan(cfg(nodes=2), {"nodes": ["mn2"]}, requeue(), history, partition="p",
                           states={"mn1": "idle", "mn2": "allocated"}) is None


def test_nothing_changes_without_a_range_a_requeue_or_a_different_count():
    states = {"mn1": "idle", "mn2": "idle"}
    assert requeue_size.plan(cfg(min_nodes=None), {"nodes": ["mn1"]}, requeue(), [], partition="p", states=states) \
        is None
    assert requeue_size.plan(cfg(), {"nodes": ["mn1"]}, Decision("stop", "finished"), [], partition="p",
                           states=states) is None
    assert requeue_size.plan(cfg(), {"nodes": ["mn1", "mn2"]}, requeue(), [], partition="p", states=states) is None
    # Fewer usable nodes than min_nodes: it asks for min_nodes and waits for them.
    waits = requeue_size.plan(cfg(min_nodes=2, nodes=3, ntasks_per_node=4), {"nodes": ["a", "b", "c"]}, requeue(),
                            [], partition="p", states={"a": "down", "b": "drain", "c": "allocated"})
    assert (waits["nodes"], waits["tasks"], waits["available"]) == (2, 8, ["c"])


SINFO_LINES = ["mn1|IDLE*", "mn2|allocated", "mn3|idle~", "mn4|idle-", "mn5|mixed$", "mn6|idle", "mn6|allocated",
               "mn7|drained*", "mn8|idle#"]


def test_a_node_that_does_not_respond_or_is_kept_from_new_work_is_not_counted_free(tmp_path, monkeypatch):
    """sinfo's suffixes (man sinfo, NODE STATE CODES) are kept: ``idle*`` (not responding), ``idle-`` (planned for
    a higher-priority job) and ``mixed$`` (maintenance reservation) cannot take the job now; ``idle~`` (powered
    off) and ``idle#`` (powering up) can, as Slurm boots them for it. Read through a stub ``sinfo`` on PATH."""
    from megatron_resilience.jobs import slurm

    (tmp_path / "sinfo.out").write_text("".join(line + "\n" for line in SINFO_LINES))
    (tmp_path / "sinfo").write_text(f"#!/bin/bash\ncat {tmp_path / 'sinfo.out'}\n")
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    states = slurm.partition_node_states("faults")
    assert states == {"mn1": "idle*", "mn2": "allocated", "mn3": "idle~", "mn4": "idle-", "mn5": "mixed$",
                      "mn6": "idle", "mn7": "drained*", "mn8": "idle#"}
    count = requeue_size.plan(cfg(nodes=5), {"nodes": ["mn2", "mn7"]}, requeue(), [], partition="faults")
    assert count == {"nodes": 4, "was": 2, "full": 5, "min_nodes": 1, "available": ["mn2", "mn3", "mn6", "mn8"],
                     "tasks": 4, "reason": "4 node(s) can take it now (mn2,mn3,mn6,mn8): grows back to 4 of 5"}
    assert slurm.cluster("faults").unusable == ["mn1", "mn5", "mn7"]  # mn4 is only busy for now
    assert {flag: (slurm.usable_at_all(f"idle{flag}"), slurm.usable_now(f"idle{flag}")) for flag in "*~#!%$@^-"} \
        == {"*": (False, False), "~": (True, True), "#": (True, True), "!": (True, False), "%": (True, False),
            "$": (False, False), "@": (True, False), "^": (True, False), "-": (True, False)}
    # A node of the attempt that just ended is not counted once it stops responding (it did: allocated*).
    gone = requeue_size.plan(cfg(), {"nodes": ["mn1", "mn2"]}, requeue(), [], partition="p",
                           states={"mn1": "completing*", "mn2": "allocated"})
    assert (gone["nodes"], gone["available"]) == (1, ["mn2"])


def test_a_node_range_lets_the_decision_exclude_a_node_the_partition_cannot_replace():
    policy = load_policy("megatron_transient")
    cls = Classification(error_type="node_fail", subsystem="node", severity="fatal", mode="crash", source="slurm",
                         reason="NODE_FAIL", hosts=["mn3"])
    cluster = Cluster(nodes=["mn1", "mn2", "mn3"], unusable=["mn1"], partition="faults")
    current = {"nodes": ["mn2", "mn3"]}
    fixed = decide(cls, policy, [], current, cluster)
    assert fixed.exclude_applied == [] and "would leave 1 usable node(s)" in fixed.exclude_not_applied
    ranged = decide(cls, policy, [], {**current, "min_nodes": 1}, cluster)
    assert (ranged.action, ranged.exclude_applied, ranged.exclude_not_applied) == ("requeue", ["mn3"], None)


def test_each_attempt_records_its_world_and_data_parallel_size():
    mine = [{"kind": "start", "world_size": 2, "tp": 1, "pp": 1, "dp": 2}, {"kind": "train", "step": 1},
            {"kind": "start", "world_size": 1, "tp": 1, "pp": 1, "dp": 1}]
    assert requeue_size.attempt_sizes(mine) == {
        "world_size": 1, "dp": 1, "sizes": [{"world_size": 2, "tp": 1, "pp": 1, "dp": 2},
                                            {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}]}
    assert requeue_size.attempt_sizes([{"kind": "train"}]) == {}


def test_the_report_shows_throughput_per_attempt_against_the_full_size(tmp_path):
    def start(job, restart, world, cycle=0):
        return {"kind": "start", "world_size": world, "dp": world,
                "attempt": {"job_id": job, "slurm_restart": restart, "in_job_restart": cycle}}

    def train(step, rate):
        return {"kind": "train", "step": step, "tokens_per_s": rate}

    records = [start("7", 0, 2), train(1, 1000.0), train(2, 1200.0), train(3, 1100.0),
               start("7", 1, 1), train(3, 600.0), train(4, 500.0),
               start("7", 2, 2), train(5, 1050.0), train(6, 1150.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ledger = [{"kind": "attempt", "attempt_index": i, "job_id": "7", "slurm_restart": i, "nodes": nodes}
              for i, nodes in enumerate((["mn2", "mn3"], ["mn2"], ["mn2", "mn3"]))]
    (tmp_path / "job_ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    lines = attempt_throughput.section(str(tmp_path)).splitlines()
    # Report readers pick the attempts table's rows by their leading attempt number (test_joblevel_on_slurm.py):
    # this section's rows are indented so they never pass for those.
    assert not [line for line in lines if line[:2] in ("0 ", "1 ", "2 ")], lines
    assert lines == [
        "throughput per attempt (median tokens/s of its steps; running small costs goodput):",
        "  attempt | job | restart | cycle | nodes | world | DP | steps   | tokens/s | vs full size",
        "  0       | 7   | 0       | 0     | 2     | 2     | 2  | 1-3 (3) | 1100     | 100%",
        "  1       | 7   | 1       | 0     | 1     | 1     | 1  | 3-4 (2) | 550      | 50%",
        "  2       | 7   | 2       | 0     | 2     | 2     | 2  | 5-6 (2) | 1100     | 100%",
    ]


def test_a_multi_node_step_log_is_one_cycle_per_rendezvous_round_not_per_agent():
    """Every node's ft_launcher prints the rendezvous result (``restart_count=N``) into the one job-step log: two
    agents at round 0 are one cycle (a 2-node attempt once read as an in-job restart), a round 1 is a second."""
    from megatron_resilience.jobs.evidence import split_cycles

    def result(pid, count):  # the lines of ft_launcher's "Rendezvous complete for workers. Result:" block
        return [f"  restart_count={count}", "  master_addr=localhost", f"  group_rank={pid}"]

    both_at_0 = [*result(1, 0), "[default0]:step 1", *result(2, 0), "[default0]:step 2"]
    assert split_cycles(both_at_0) == [both_at_0]
    restarted = [*result(1, 1), "[default0]:resumed", *result(2, 1)]
    assert split_cycles(both_at_0 + restarted) == [both_at_0, restarted]
    survivor = [*result(1, 1), "[default0]:resumed at DP=1"]  # the elastic range: one agent left for round 1
    assert split_cycles(both_at_0 + survivor) == [both_at_0, survivor]
