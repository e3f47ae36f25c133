"""Hardware attributions shared by the runs a user points at one folder (``RestartPolicyPlugin.node_history_dir``).

A lemon node fails whichever run lands on it. One run's ledger sees only its own attempts; runs of a team that
share a cluster (and a filesystem) can share what they learn: each decision appends, for every node its attempt's
evidence blamed on a hardware error (the attempt's ending and its in-job restart cycles), one line to
``<folder>/node_blames.jsonl``; each decision counts the other runs' lines within the lookback towards the policy's
``exclude_nodes_after`` (``jobs/node_exclusion.py``). A run's own lines are counted from its own ledger, never twice.

Appends are whole lines under a lock (the ledger's writer); a folder that cannot be read or written costs the run
nothing but the shared count, and the attempt's record says so.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_resilience.jobs.node_exclusion import EXCLUSION_LOOKBACK_S, Cluster, blames
from megatron_resilience.records.ledger import Ledger

FILE = "node_blames.jsonl"


def path(folder: str) -> str:
    return os.path.join(folder, FILE)


def publish(folder: str, run: str, attempt: dict[str, Any], cluster: Cluster) -> str | None:
    """Append the attempt's hardware attributions (node, time, error type) for the other runs; None, or why not."""
    found = blames([attempt], cluster)
    if not found:
        return None
    kind = (attempt.get("classification") or {}).get("error_type")
    try:
        ledger = Ledger(path(folder))
        for node, when in found:
            ledger.append({"kind": "node_blame", "node": node, "end": when, "run": run,
                           "job_id": attempt.get("job_id"), "attempt": attempt.get("attempt_index"),
                           "error_type": kind})
    except OSError as err:
        return f"{path(folder)}: {err}"
    return None


def others(folder: str, run: str, now: float, lookback_s: float = EXCLUSION_LOOKBACK_S) \
        -> list[tuple[str, float | None]]:
    """(node, time) of the other runs' attributions within ``lookback_s`` (the policy's) of ``now``."""
    try:
        records = Ledger(path(folder)).records("node_blame")
    except OSError:
        return []
    return [(str(r["node"]), r.get("end")) for r in records
            if r.get("run") != run and r.get("node") and now - (r.get("end") or now) < lookback_s]
