"""Per node, across every attempt of a run: the failures attributed to it and the attempts that excluded it.

Read from the ledger's ``attempt`` records: the nodes each attempt ran on, the node(s) its
classification blamed (``classification.hosts``, chosen by ``attribution.py`` from every host the
evidence named) and those an in-job restart cycle's failure blamed (``cycles[k].ended.hosts``, shown as
``<attempt>.<cycle>``), and the exclusions its decision asked for (applied — on an attribution, or because
``sinfo`` showed the node unusable —, recorded but not applied because they would strand the job, or deferred:
one new blamed node per decision), with each node's share of the applied exclusions. A node named by evidence
but never blamed is not listed as failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NodeRow:
    node: str
    attempts: list[int] = field(default_factory=list)  # attempts that ran on it
    failures: list[tuple[str, str]] = field(default_factory=list)  # (attempt[.cycle], error type) blamed on it
    excluded_by: list[int] = field(default_factory=list)  # attempts whose decision excluded it (applied)
    not_excluded_by: list[int] = field(default_factory=list)  # asked for, not applied (it would strand the job)
    scheduler: dict[int, str] = field(default_factory=dict)  # attempt -> the sinfo state that excluded it
    deferred_by: list[int] = field(default_factory=list)  # blamed, left for a later decision (one new node each)


def node_rows(attempts: list[dict[str, Any]]) -> list[NodeRow]:
    rows: dict[str, NodeRow] = {}

    def row(node: str) -> NodeRow:
        return rows.setdefault(node, NodeRow(node))

    for index, a in enumerate(attempts):
        nodes = a.get("nodes") or []
        for node in nodes if isinstance(nodes, list) else str(nodes).split(","):
            if node:
                row(node).attempts.append(index)
        for cycle in a.get("cycles") or []:  # in-job restarts: no decision, but a failure on a node
            ended = cycle.get("ended") or {}
            for node in ended.get("hosts") or []:
                row(node).failures.append((f"{index}.{cycle.get('cycle')}", str(ended.get("error_type"))))
        cls = a.get("classification") or {}
        if cls.get("mode") is not None:
            for node in cls.get("hosts") or []:
                row(node).failures.append((str(index), str(cls.get("error_type"))))
        decision = a.get("decision") or {}
        applied = decision.get("exclude_applied") or []
        for node in decision.get("exclude_requested") or []:
            (row(node).excluded_by if node in applied else row(node).not_excluded_by).append(index)
        for node, state in (decision.get("exclude_scheduler") or {}).items():  # excluded for sinfo's state alone
            if node in (decision.get("exclude_requested") or []) and node not in (decision.get("exclude_blamed") or []):
                row(node).scheduler[index] = str(state)
        for node in decision.get("exclude_deferred") or []:
            row(node).deferred_by.append(index)
    return sorted(rows.values(), key=lambda r: r.node)


def format_node_table(attempts: list[dict[str, Any]]) -> list[str]:
    """The report's per-node lines ([] without attempts)."""
    rows = node_rows(attempts)
    if not rows:
        return []
    # at scale a few nodes cause most failures (a lemon): each node's share of the failures attributed to a node
    attributed = sum(len(r.failures) for r in rows)
    table = [("node", "attempts", "failures attributed (attempt[.cycle]: type)", "share", "excluded by attempt")]
    for r in rows:
        excluded = ([f"{i} (sinfo {r.scheduler[i]})" if i in r.scheduler else str(i) for i in r.excluded_by] +
                    [f"{i} (not applied)" for i in r.not_excluded_by] + [f"{i} (deferred)" for i in r.deferred_by])
        share = f"{100 * len(r.failures) / attributed:.0f}%" if r.failures else "-"
        table.append((r.node, ",".join(str(i) for i in r.attempts) or "-",
                      ", ".join(f"{i}: {t}" for i, t in r.failures) or "-", share, ", ".join(excluded) or "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["", "per node:"] + [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    # the exclusions a run paid for, per node: on a lemon they should go to the lemon
    applied = sum(len(r.excluded_by) for r in rows)
    if applied:
        lines.append("exclusions applied: " + ", ".join(
            f"{r.node} {len(r.excluded_by)} ({100 * len(r.excluded_by) / applied:.0f}%)"
            for r in sorted(rows, key=lambda r: (-len(r.excluded_by), r.node)) if r.excluded_by))
    return lines
