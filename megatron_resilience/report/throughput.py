"""Throughput per attempt: what running on fewer nodes costs, printed under the goodput.

One row per trainer start (a Slurm attempt, or an in-job cycle of it when an elastic launcher re-formed the
group at another size): the world and data-parallel size it ran at, the nodes it had (from the ledger), the
steps it trained, the median tokens/s of those steps, and that rate relative to the run's full size (the rows
of its largest world size). From the trainer's ``metrics.jsonl`` (``start`` and ``train`` records; a foreign
trainer's log lines when it has none) and the job ledger (which attempt and nodes a start belongs to); a run
without a ledger shows its starts alone.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from megatron_resilience.records.ledger import LEDGER_FILE, Ledger
from megatron_resilience.report.inputs import trainer_records


def rows(records: list[dict[str, Any]], attempts: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One dict per ``start`` record, in order, with the train records that follow it (until the next start)."""
    by_job = {(str(a.get("job_id")), int(a.get("slurm_restart") or 0)): a for a in attempts or []}
    out: list[dict[str, Any]] = []
    for rec in records:
        kind = rec.get("kind")
        if kind == "start":
            attempt = rec.get("attempt") if isinstance(rec.get("attempt"), dict) else {}
            ledger = by_job.get((str(attempt.get("job_id")), int(attempt.get("slurm_restart") or 0)), {})
            out.append({"attempt": ledger.get("attempt_index"), "job_id": attempt.get("job_id"),
                        "slurm_restart": attempt.get("slurm_restart"), "cycle": attempt.get("in_job_restart"),
                        "nodes": len(ledger["nodes"]) if ledger.get("nodes") else None,
                        "world_size": rec.get("world_size"), "dp": rec.get("dp"), "rates": [], "steps": []})
        elif kind == "train" and out and isinstance(rec.get("tokens_per_s"), (int, float)):
            out[-1]["rates"].append(float(rec["tokens_per_s"]))
            out[-1]["steps"].append(rec.get("step"))
    full = max((r["world_size"] or 0 for r in out if r["rates"]), default=0)
    full_rate = [statistics.median(r["rates"]) for r in out if r["rates"] and r["world_size"] == full]
    reference = statistics.median(full_rate) if full_rate else None
    for r in out:
        r["tokens_per_s"] = statistics.median(r["rates"]) if r["rates"] else None
        r["vs_full_size"] = r["tokens_per_s"] / reference if r["tokens_per_s"] and reference else None
    return out


def format_rows(table: list[dict[str, Any]]) -> str:
    header = ("attempt", "job", "restart", "cycle", "nodes", "world", "DP", "steps", "tokens/s", "vs full size")
    lines = [header]
    for r in table:
        steps = [s for s in r["steps"] if isinstance(s, int)]
        lines.append((_text(r["attempt"]), _text(r["job_id"]), _text(r["slurm_restart"]), _text(r["cycle"]),
                      _text(r["nodes"]), _text(r["world_size"]), _text(r["dp"]),
                      f"{min(steps)}-{max(steps)} ({len(steps)})" if steps else "-",
                      f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-",
                      f"{100 * r['vs_full_size']:.0f}%" if r["vs_full_size"] else "-"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    # Indented under its title like the report's other sub-lines: a row never reads as a row of the attempts
    # table above (whose rows start with the attempt number).
    body = ["  " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    return "\n".join(["throughput per attempt (median tokens/s of its steps; running small costs goodput):", *body])


def section(run_dir: str) -> str:
    """The report's throughput section for ``run_dir`` (empty when the trainer logged no start)."""
    path = os.path.join(run_dir, LEDGER_FILE)
    ledger = Ledger(path)
    attempts = ledger.attempts() if os.path.exists(path) else []
    table = rows(trainer_records(run_dir, ledger)[0], attempts)  # a foreign trainer's: read from its log
    return format_rows(table) if table else ""


def _text(value: Any) -> str:
    return "-" if value is None else str(value)
