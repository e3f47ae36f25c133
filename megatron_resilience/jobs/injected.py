"""Injected vs classified: each fault a chaos run injected, the interruption it caused and how it was classified.

The chaos ledger (``chaos_ledger.jsonl``, :mod:`megatron_resilience.chaos`) says what was injected,
when and where, and which error types the job-level classifier is expected to call it; the accounting
matched each injection to the interruption that followed it (the latest injection inside the failed
cycle). The nodes the job-level decision excluded come from the run's ledger.
"""

from __future__ import annotations

from typing import Any

from megatron_resilience.jobs.accounting import Accounting, AttemptWindow


def summarize(acc: Accounting, injections: list[dict[str, Any]], windows: list[AttemptWindow]) -> dict[str, Any]:
    by_injection = {id(i.injection): i for i in acc.interruptions if i.injection is not None}
    # the accounting keeps the dict it was given: match by identity, then by time (a copy)
    by_time = {float(i.injection.get("time") or 0): i for i in acc.interruptions if i.injection is not None}
    rows, kinds = [], {}
    for inj in injections:
        intr = by_injection.get(id(inj)) or by_time.get(float(inj.get("time") or 0))
        expected = list(inj.get("expected") or [])
        classified = intr.cause if intr is not None else None
        ok = classified is not None and (not expected or classified in expected)
        excluded = []
        if intr is not None and intr.kind in ("job", "preemption") and intr.attempt < len(windows):
            excluded = list(windows[intr.attempt].decision.get("exclude_requested") or [])
        rows.append({"time": inj.get("time"), "fault": inj.get("fault"), "cause": inj.get("cause"),
                     "node": inj.get("node"), "rank": inj.get("rank"), "expected": expected,
                     "classified": classified, "match": ok, "interruption": intr.index if intr else None,
                     "kind": intr.kind if intr else None, "exclusion_requested": excluded,
                     "hardware": bool(inj.get("hardware"))})
        k = kinds.setdefault(str(inj.get("fault")), {"injected": 0, "classified_as_expected": 0, "as": {}})
        k["injected"] += 1
        k["classified_as_expected"] += int(ok)
        k["as"][str(classified)] = k["as"].get(str(classified), 0) + 1
    applied: list[str] = []
    for w in windows:
        for node in w.decision.get("exclude_applied") or []:
            if node not in applied:
                applied.append(node)
    return {"injections": rows, "by_fault": kinds, "excluded_nodes": applied,
            "all_classified": all(r["match"] for r in rows)}


def format_injected(summary: dict[str, Any]) -> list[str]:
    if not summary["injections"]:
        return []
    lines = [f"injected faults: {len(summary['injections'])} ({'all' if summary['all_classified'] else 'NOT all'} "
             "classified as injected)"]
    for fault, k in sorted(summary["by_fault"].items()):
        seen = ", ".join(f"{name} x{n}" for name, n in sorted(k["as"].items()))
        lines.append(f"  {fault}: injected {k['injected']}, classified as expected {k['classified_as_expected']} "
                     f"({seen})")
    lines.append(f"  nodes excluded by the job-level decision: {', '.join(summary['excluded_nodes']) or 'none'}")
    return lines
