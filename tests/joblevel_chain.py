"""Deciding attempt after attempt as the batch script's trap does: the helper the job-level decision tests share."""

from __future__ import annotations

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.classifier import Classification
from megatron_resilience.jobs.decision import Cluster, decide
from megatron_resilience.jobs.policies import load_policy


def cls(error_type: str, hosts=(), evidence=()) -> Classification:
    kind = taxonomy.BY_NAME[error_type]
    return Classification(error_type=error_type, subsystem=kind.subsystem, severity="fatal", mode=kind.mode,
                          source="log", reason="", hosts=list(hosts), evidence=list(evidence))


def chain(policy_name: str, endings: list[tuple[str, dict]], cluster: Cluster | None = None, shared=()):
    """Decide attempt after attempt, recording each as the trap does; returns the decisions. An ending's ``cluster``
    is sinfo's view at that decision (else ``cluster``); ``shared``: other runs' (node, time) attributions."""
    policy, history, out = load_policy(policy_name), [], []
    for error_type, extra in endings:
        c = cls(error_type, extra.pop("hosts", ()), extra.pop("evidence", ()))
        current = {"classification": c.to_dict(), "nodes": extra.pop("nodes", ["n1"]), **extra}
        view = current.pop("cluster", None) or cluster or Cluster(nodes=["n1", "n2", "n3"], partition="p")
        d = decide(c, policy, history, current, view, shared_blames=list(shared))
        out.append(d)
        history.append({**current, "decision": d.to_dict()})
        if d.final:
            break
    return out
