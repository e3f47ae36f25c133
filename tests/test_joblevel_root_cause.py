"""The first failed rank on several nodes: the launcher names a *local* rank, the lines a global one.

The corpus (tests/test_joblevel_corpus.py) runs the trap's code on whole attempts; here the classifier and the
attribution get the attempt's node list and ranks per node directly (``AttemptEvidence.nodes``/``ranks_per_node``),
to show each way the failed rank's global rank is found and what is left when none applies.
"""

from __future__ import annotations

from megatron_resilience.jobs.attribution import mentions, suspects
from megatron_resilience.jobs.classifier import AttemptEvidence, classify
from megatron_resilience.jobs.monitors import load_monitors, scan
from megatron_resilience.jobs.root_cause import first_failure

MONITORS = load_monitors(["megatron_production"])
GLOO = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[10.31.0.12]:40211")
TWO_NODES = ["nid001", "nid002"]


def signals(lines: list[str]):
    return scan([("log", line) for line in lines], MONITORS)


def test_the_node_list_and_ranks_per_node_turn_the_local_rank_into_the_global_one():
    """2 nodes x 2 ranks: rank 2 (nid002, local_rank 0) raised; rank 0 (nid001) lost its peer."""
    sigs = signals([
        "[default0]:[rank2]: KeyError: 'tokens'",
        f"[default0]:[rank0]: {GLOO}",
        "[2026-11-23 09:14:04,380] [ERROR] [ft_launcher2211@nid002] failed (exitcode: 1) local_rank: 0 (pid: 2290) "
        "of binary: /usr/bin/python",
    ])
    root = first_failure(sigs, TWO_NODES, 2)
    assert (root.rank, root.global_rank, root.host, root.label) == ("0", "2", "nid002", "rank 2")
    known = classify(AttemptEvidence(exit_code=1, signals=sigs, nodes=TWO_NODES, ranks_per_node=2))
    assert (known.error_type, known.fields["rank"], known.fields["exception"]) == ("python_exception", "2", "KeyError")
    assert known.evidence == ["[default0]:[rank2]: KeyError: 'tokens'"]  # rank 0's lost peer is not evidence
    # without the node list, local rank 0 is all there is: rank 0's gloo error reads as the failed rank's own
    unknown = classify(AttemptEvidence(exit_code=1, signals=sigs))
    assert (first_failure(sigs).global_rank, unknown.error_type) == (None, "communication_error")


def test_srun_label_names_the_node_of_a_torchrun_agent():
    """torchrun's line names no host; srun --label's task number is its node (one launcher per node)."""
    sigs = signals([
        f"0: [rank0]: {GLOO}",
        "1: E1123 09:14:04.380000 2290 site-packages/torch/distributed/elastic/multiprocessing/api.py:882] failed "
        "(exitcode: -9) local_rank: 0 (pid: 2290) of binary: /usr/bin/python",
    ])
    cls = classify(AttemptEvidence(exit_code=1, signals=sigs, nodes=TWO_NODES, ranks_per_node=1))
    assert (cls.error_type, cls.source, cls.signal) == ("killed", "launcher", "SIGKILL")
    assert cls.reason == ("rank 1 on nid002 was killed by SIGKILL (the launcher's report, exit code -9); rank(s) 0 "
                          "lost contact with another rank (communication_error: a consequence, 1 line(s))")
    found = mentions(sigs, TWO_NODES)
    assert [(m.host, m.node, m.role) for m in found][:1] == [("nid002", "nid002", "first_failure")]
    assert suspects(found, TWO_NODES) == (["nid002"], "nid002: first_failure (strongest of 1 host mention(s))")


def test_a_rank_that_aborted_itself_keeps_its_own_watchdog_timeout():
    """SIGABRT is how NCCL's watchdog ends its own rank after printing the timeout: no silent kill from outside, so
    with its global rank unknown the local rank decides what is its own (here: the timeout, not 'killed')."""
    sigs = signals([
        "[rank1]:[E305 22:21:03.556149837 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=331098, OpType=_ALLGATHER_BASE, NumelIn=40894464, NumelOut=163577856, "
        "Timeout(ms)=600000) ran for 600094 milliseconds before timing out.",
        "[2026-03-05 22:21:09,330] [ERROR] [ft_launcher4411@nid003118] failed (exitcode: -6) local_rank: 1 "
        "(pid: 88120) of binary: /usr/bin/python",
    ])
    cls = classify(AttemptEvidence(exit_code=1, signals=sigs))
    assert (cls.error_type, cls.signal, cls.fields["op"]) == ("nccl_timeout", "SIGABRT", "_ALLGATHER_BASE")
