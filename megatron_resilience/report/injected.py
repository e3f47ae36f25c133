"""Injected vs classified: each fault a chaos run injected, the interruption it caused and how it was classified.

The chaos ledger (``chaos_ledger.jsonl``, :mod:`megatron_resilience.chaos`) says what was injected,
when and where, and which error types the job-level classifier is expected to call it; the accounting
matched each failed cycle to the faults injected into it: the one its classification names caused it,
any other landed before the cycle's failure was noticed and was absorbed by it (the allocation clock lets a
second fault land during the first one's detection or recovery, as the world does). The nodes the job-level
decision excluded come from the run's ledger.

The report prints, per fault kind, what each injected fault was classified as and where (the attempt and in-job
cycle whose ending it caused), the faults absorbed by another fault's ending apart (which ending), the hardware
faults that struck a node outside the job (``chaos --pool``: by design, they cost the job nothing) per node, and
the ones chaos could not carry out (why): a misclassification names the cycle to read.

Two verdicts: ``all_classified`` (every injected fault caused an interruption classified as its kind) and
``none_misread`` (no fault classified as another kind or matched to no interruption, and none left undone for
another reason than striking an idle node): absorbed faults are listed apart, never counted as classified.
"""

from __future__ import annotations

import time
from typing import Any

from megatron_resilience.goodput.buckets import Accounting, AttemptWindow


def summarize(acc: Accounting, injections: list[dict[str, Any]], windows: list[AttemptWindow]) -> dict[str, Any]:
    """Per injection: the interruption it caused and how that was classified, or the interruption that absorbed it
    (a second fault landed before the first was noticed, and the cycle ended once, for the fault it names)."""
    by_injection, by_time = {}, {}
    for i in acc.interruptions:
        for inj, role in [(i.injection, "caused")] + [(a, "absorbed") for a in i.absorbed]:
            if inj is not None:  # the accounting keeps the dicts it was given: by identity, then by time (a copy)
                by_injection[id(inj)] = by_time[float(inj.get("time") or 0)] = (i, role)
    rows, kinds = [], {}
    for inj in injections:
        intr, role = by_injection.get(id(inj)) or by_time.get(float(inj.get("time") or 0)) or (None, None)
        expected = list(inj.get("expected") or [])
        absorbed = role == "absorbed"
        classified = intr.cause if intr is not None and not absorbed else None
        ok = classified is not None and (not expected or classified in expected)
        excluded = []
        if intr is not None and not absorbed and intr.kind in ("job", "preemption") and intr.attempt < len(windows):
            excluded = list(windows[intr.attempt].decision.get("exclude_requested") or [])
        by = intr.injection if absorbed and intr is not None else None
        rows.append({"time": inj.get("time"), "fault": inj.get("fault"), "cause": inj.get("cause"),
                     "node": inj.get("node"), "rank": inj.get("rank"), "expected": expected,
                     "classified": classified, "match": ok, "interruption": intr.index if intr else None,
                     "attempt": intr.attempt if intr else None, "cycle": intr.cycle if intr else None,
                     "kind": intr.kind if intr else None, "exclusion_requested": excluded,
                     "hardware": bool(inj.get("hardware")), "done": inj.get("ok", True) is not False,
                     "outside_job": inj.get("ok") is False and bool(inj.get("outside_job")),
                     "absorbed_by": (by or {}).get("fault") if absorbed else None})
        _count(kinds.setdefault(str(inj.get("fault")), {
            "injected": 0, "classified_as_expected": 0, "as_expected": {}, "as_another": {}, "absorbed": [],
            "no_interruption": [], "not_done": [], "outside_job": {}}), rows[-1], inj, intr)
    applied: list[str] = []
    for w in windows:
        for node in w.decision.get("exclude_applied") or []:
            if node not in applied:
                applied.append(node)
    # An absorbed fault is counted apart, never as classified: its own classification is unknown (the cycle ended
    # once, named for another fault), so a misclassification cannot hide among them.
    return {"injections": rows, "by_fault": kinds, "excluded_nodes": applied,
            "all_classified": all(r["match"] for r in rows),
            "none_misread": bool(rows) and all(r["match"] or r["absorbed_by"] or r["outside_job"] for r in rows),
            "as_expected": sum(1 for r in rows if r["match"]),
            "absorbed": sum(1 for r in rows if r["absorbed_by"]),
            "as_another": sum(1 for r in rows if r["classified"] is not None and not r["match"]),
            "no_interruption": sum(1 for r in rows if r["done"] and r["interruption"] is None),
            "not_done": sum(1 for r in rows if not r["done"] and not r["outside_job"]),
            "outside_job": sum(1 for r in rows if r["outside_job"])}


def _count(k: dict[str, Any], row: dict[str, Any], inj: dict[str, Any], intr: Any) -> None:
    """Add one injection to its kind's tally: as expected (by type), as another type (where: the cycle to read),
    absorbed (by which fault's ending), matched to no interruption (when), or not carried out (why)."""
    k["injected"] += 1
    where = f"attempt {row['attempt']} cycle {row['cycle']}"
    if row["outside_job"]:  # chaos --pool: a node the job does not hold failed (no fault happened to the job)
        node = str(inj.get("node") or "?")
        k["outside_job"][node] = k["outside_job"].get(node, 0) + 1
    elif inj.get("ok") is False:  # chaos could not carry it out: no fault happened, and the ledger says why
        k["not_done"].append(str(inj.get("why") or inj.get("output") or "no reason recorded")[:160])
    elif intr is not None and row["classified"] is None:  # absorbed by the interruption of another fault
        k["absorbed"].append(f"by the {row['absorbed_by'] or 'fault'} that ended {where}")
    elif row["classified"] is None:
        k["no_interruption"].append(row["time"])
    elif row["match"]:
        k["classified_as_expected"] += 1
        k["as_expected"][row["classified"]] = k["as_expected"].get(row["classified"], 0) + 1
    else:
        k["as_another"].setdefault(row["classified"], []).append(where)


def format_injected(summary: dict[str, Any]) -> list[str]:
    """The summary as text: a headline, then one line per fault kind (the kinds' tallies, :func:`_count`)."""
    if not summary["injections"]:
        return []
    absorbed = summary.get("absorbed") or 0
    counts = [f"{summary.get('as_expected', 0)} classified as injected"]
    counts += [f"{summary['as_another']} as another type"] if summary.get("as_another") else []
    counts += [f"{absorbed} absorbed by a fault that landed before they were noticed (counted apart)"] \
        if absorbed else []
    counts += [f"{summary['no_interruption']} matched to no interruption"] if summary.get("no_interruption") else []
    counts += [f"{summary['not_done']} not done"] if summary.get("not_done") else []
    counts += [f"{summary['outside_job']} struck a node outside the job"] if summary.get("outside_job") else []
    verdict = "all classified as injected" if summary["all_classified"] else \
        "none misread" if summary.get("none_misread") else "NOT all classified as injected"
    lines = [f"injected faults: {len(summary['injections'])} ({verdict}: {', '.join(counts)})"]
    for fault, k in sorted(summary["by_fault"].items()):
        types = sorted(k["as_expected"].items())
        named = types[0][0] if len(types) == 1 else ", ".join(f"{t} {n}" for t, n in types)
        parts = [f"injected {k['injected']}, classified as expected {k['classified_as_expected']}"
                 + (f" ({named})" if types else "")]
        parts += [f"as {t} {len(where)} ({', '.join(where)})" for t, where in sorted(k["as_another"].items())]
        parts += [f"absorbed {len(k['absorbed'])} ({', '.join(k['absorbed'])})"] if k["absorbed"] else []
        parts += [f"matched to no interruption {len(k['no_interruption'])} (injected at "
                  f"{', '.join(_clock(t) for t in k['no_interruption'])})"] if k["no_interruption"] else []
        parts += [f"not done {len(k['not_done'])} ({', '.join(k['not_done'])})"] if k["not_done"] else []
        outside = k.get("outside_job") or {}
        parts += [f"struck a node outside the job {sum(outside.values())} (" + ", ".join(
            f"{node} {n}" for node, n in sorted(outside.items())) + ")"] if outside else []
        lines.append(f"  {fault}: " + "; ".join(parts))
    lines.append(f"  nodes excluded by the job-level decision: {', '.join(summary['excluded_nodes']) or 'none'}")
    return lines


def _clock(t: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(float(t))) if isinstance(t, (int, float)) else "?"
