"""The report's per-node table: the failures attributed to each node across a run's attempts, and which attempts
excluded it. The attempts are decided by the real trap code (``end_attempt``) on corpus cases of a 3-node job."""

from __future__ import annotations

from test_joblevel_corpus import CASES, UP, lay_out

from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.records.ledger import Ledger
from megatron_resilience.report.run_report import build, format_report


def test_the_report_lists_per_node_failures_and_exclusions(tmp_path):
    """A 3-node job on a 6-node partition; each attempt runs on nodes no earlier attempt excluded."""
    run_ledger = Ledger(str(tmp_path / "run" / "job_ledger.jsonl"))
    chain = [("xid_gathered_from_a_node_names_that_node", ("nid001", "nid002", "nid003")),  # nid002's GPU: Xid 48
             ("node_failure_srun_names_the_dead_node_not_the_batch_host",                # nid003 died (batch host
              ("nid001", "nid003", "nid004")),                                           # nid001 healthy)
             ("node_failure_naming_only_the_batch_host_excludes_nothing",                # no node blamed
              ("nid001", "nid004", "nid005")),
             ("healthy_megatron_finished", ("nid001", "nid004", "nid005"))]
    excluded: set[str] = set()
    for index, (name, nodes) in enumerate(chain):
        assert not excluded & set(nodes), (name, excluded)  # the fixture itself: no attempt on an excluded node
        c = {**CASES[name], "nodes": list(nodes)}
        node_info = {n: UP for n in nodes} if CASES[name]["node_info"] else {}
        cfg, ledger = lay_out(tmp_path / name, c, "megatron_transient")
        for record in run_ledger.attempts():  # the chain so far (budgets, exclusions already applied)
            ledger.append(record)
        ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=c["exit_code"], slurm_state=c["state"],
                             by="batch", node_info=node_info,
                             cluster_info=Cluster(nodes=["nid001", "nid002", "nid003", "nid004", "nid005", "nid006"],
                                                  partition="batch"))
        excluded |= set(ending.decision.exclude_applied)
        run_ledger.append({**ending.record, "job_id": "77", "slurm_restart": index})
    text = format_report(build(str(tmp_path / "run"), slurm_lookup=False), evidence=False)
    table = text.split("per node:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table == [
        "node   | attempts | failures attributed (attempt[.cycle]: type) | share | excluded by attempt",
        "nid001 | 0,1,2,3  | -                                           | -     | -",
        "nid002 | 0        | 0: xid_error                                | 50%   | 0",
        "nid003 | 0,1      | 1: node_fail                                | 50%   | 1",
        "nid004 | 1,2,3    | -                                           | -     | -",
        "nid005 | 2,3      | -                                           | -     | -",
        "exclusions applied: nid002 1 (50%), nid003 1 (50%)",
    ], text
    assert excluded == {"nid002", "nid003"}


def test_a_node_failure_naming_several_nodes_blames_each_and_an_address_maps_to_its_node():
    from megatron_resilience.jobs.attribution import expand_hostlist, mentions, suspects
    from megatron_resilience.jobs.monitors import load_monitors, scan

    assert expand_hostlist("nid[003-004,010],gpu7") == ["nid003", "nid004", "nid010", "gpu7"]
    lines = ["srun: error: Node failure on nid[003-004]",
             "slurmstepd: error: *** JOB 9 ON nid001 CANCELLED AT 2026-03-11T02:10:44 DUE TO NODE FAILURE, SEE ...",
             "nid001:41102:41377 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<48211> with status=12 "
             "opcode=0 len=0 vendor err 129 (Recv)"]
    nodes = ["nid001", "nid002", "nid003", "nid004"]
    found = mentions(scan([("log", line) for line in lines], load_monitors([])), nodes, {"nid002": "10.0.0.2"})
    assert [(m.host, m.node, m.role) for m in found] == [
        ("nid003", "nid003", "failed"), ("nid004", "nid004", "failed"), ("nid001", "nid001", "batch_host")]
    assert suspects(found, nodes) == (["nid003", "nid004"], "nid003,nid004: failed (strongest of 3 host mention(s))")
    with_nccl = mentions(scan([("log", line) for line in lines[2:]], load_monitors(["megatron_nccl"])), nodes,
                         {"nid002": "10.0.0.2"})
    assert [(m.host, m.node, m.role) for m in with_nccl][:2] == [("nid001", "nid001", "reporter"),
                                                                 ("10.0.0.2<48211>", "nid002", "peer")]
    assert suspects(with_nccl, nodes)[0] == ["nid002"]


def test_an_exclusion_that_was_not_applied_says_so_in_the_node_table():
    from megatron_resilience.report.node_history import format_node_table

    attempts = [{"nodes": ["n1"], "classification": {"mode": "crash", "error_type": "xid_error", "hosts": ["n1"]},
                 "decision": {"exclude_requested": ["n1"], "exclude_applied": []}}]
    assert format_node_table(attempts)[2:] == [
        "node | attempts | failures attributed (attempt[.cycle]: type) | share | excluded by attempt",
        "n1   | 0        | 0: xid_error                                | 100%  | 0 (not applied)"]


def test_an_in_job_restarts_failure_is_attributed_to_its_node_as_attempt_dot_cycle():
    """An Xid on mn1 ended cycle 0 of attempt 1 (ft_launcher restarted in the job, no job-level decision); the
    attempt then ended preempted: mn1 shows the Xid as 1.0, and no exclusion."""
    from megatron_resilience.report.node_history import format_node_table

    attempts = [
        {"nodes": ["mn3"], "classification": {"mode": "crash", "error_type": "node_fail", "hosts": ["mn3"]},
         "decision": {"exclude_requested": ["mn3"], "exclude_applied": ["mn3"]}, "cycles": [{"cycle": 0}]},
        {"nodes": ["mn1"], "classification": {"mode": None, "error_type": "preempted", "hosts": []},
         "decision": {}, "cycles": [{"cycle": 0, "ended": {"error_type": "xid_error", "hosts": ["mn1"]}},
                                    {"cycle": 1}]}]
    assert format_node_table(attempts)[2:] == [
        "node | attempts | failures attributed (attempt[.cycle]: type) | share | excluded by attempt",
        "mn1  | 1        | 1.0: xid_error                              | 50%   | -",
        "mn3  | 0        | 0: node_fail                                | 50%   | 0",
        "exclusions applied: mn3 1 (100%)"]


def test_the_node_table_says_why_a_node_was_excluded_and_each_nodes_share_of_the_exclusions():
    """A lemon (n2) blamed twice, excluded once on attribution (drained too: the attribution is the reason shown);
    n3 excluded for the scheduler's drain alone; n1 blamed in the same decision as n2 and deferred (one new blamed
    node per decision)."""
    from megatron_resilience.report.node_history import format_node_table

    xid = {"mode": "crash", "error_type": "xid_error"}
    attempts = [
        {"nodes": ["n1", "n2"], "classification": {**xid, "hosts": ["n2"]}, "decision": {}},
        {"nodes": ["n1", "n2", "n3"], "classification": {**xid, "hosts": ["n1", "n2"]},
         "decision": {"exclude_requested": ["n2", "n3"], "exclude_applied": ["n2", "n3"], "exclude_blamed": ["n2"],
                      "exclude_scheduler": {"n2": "drained", "n3": "drained"}, "exclude_deferred": ["n1"]}}]
    assert format_node_table(attempts)[2:] == [
        "node | attempts | failures attributed (attempt[.cycle]: type) | share | excluded by attempt",
        "n1   | 0,1      | 1: xid_error                                | 33%   | 1 (deferred)",
        "n2   | 0,1      | 0: xid_error, 1: xid_error                  | 67%   | 1",
        "n3   | 1        | -                                           | -     | 1 (sinfo drained)",
        "exclusions applied: n2 1 (50%), n3 1 (50%)"]


def test_without_scontrol_a_compact_node_list_is_still_every_node(monkeypatch):
    """sacct's NodeList read where ``scontrol show hostnames`` is unavailable: one expander, no node dropped."""
    from megatron_resilience.jobs import slurm

    monkeypatch.setattr(slurm, "_run", lambda cmd: None)
    assert slurm.expand_nodes("nid[003-004,010],gpu7") == ["nid003", "nid004", "nid010", "gpu7"]
    assert slurm.expand_nodes("None assigned") == []
