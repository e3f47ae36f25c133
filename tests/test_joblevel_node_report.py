"""The report's per-node table: the failures attributed to each node across a run's attempts, and which attempts
excluded it. The attempts are decided by the real trap code (``end_attempt``) on corpus cases of a 4-node job."""

from __future__ import annotations

from test_joblevel_corpus import CASES, lay_out

from megatron_resilience.jobs.attempts import end_attempt
from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.jobs.ledger import Ledger
from megatron_resilience.jobs.report import build, format_report


def test_the_report_lists_per_node_failures_and_exclusions(tmp_path):
    run_ledger = Ledger(str(tmp_path / "run" / "job_ledger.jsonl"))
    chain = ["node_failure_srun_names_the_dead_node_not_the_batch_host",  # nid003 died (batch host nid001 healthy)
             "xid_gathered_from_a_node_names_that_node",                  # nid002's GPU: Xid 48
             "node_failure_naming_only_the_batch_host_excludes_nothing",  # no node blamed
             "healthy_megatron_finished"]
    for index, name in enumerate(chain):
        c = CASES[name]
        cfg, ledger = lay_out(tmp_path / name, c, "megatron_transient")
        for record in run_ledger.attempts():  # the chain so far (budgets, exclusions already applied)
            ledger.append(record)
        ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=c["exit_code"], slurm_state=c["state"],
                             by="batch", node_info=c["node_info"],
                             cluster_info=Cluster(nodes=["nid001", "nid002", "nid003", "nid004", "nid005", "nid006"],
                                                  partition="batch"))
        run_ledger.append({**ending.record, "job_id": "77", "slurm_restart": index})
    text = format_report(build(str(tmp_path / "run"), slurm_lookup=False), evidence=False)
    table = text.split("per node:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table == [
        "node    | attempts | failures attributed (attempt: type) | excluded by attempt",
        "nid001  | 0,1,2    | -                                   | -",
        "nid002  | 0,1,2    | 1: xid_error                        | 1",
        "nid003  | 0,1      | 0: node_fail                        | 0",
        "nid004  | 0        | -                                   | -",
        "node-01 | 3        | -                                   | -",
    ], text
