"""What the run did before this (re)start, read from the tail of ``metrics.jsonl``: the highest step logged, and
the run's resilience totals so far, so that every ``start`` record carries them and charts need no second file.

A ``start`` record gets (rank 0, :class:`~megatron_resilience.runtime.metrics.MetricsLogger`):

- ``last_logged_step``: the highest step any earlier attempt logged (not merely the last one logged: an
  attempt that restarted from step 10 after step 28 and died at 24 still leaves 28 as the highest);
- ``restart``: what this start is relative to the previous one: ``"first"``, ``"in_job_restart"`` (the
  launcher restarted the worker group), ``"inprocess_restart"`` (nvidia-resiliency-ext's in-process
  wrapper re-ran the training function), ``"requeue"`` (a Slurm requeue, a resubmission, or a launch by
  hand on the same run_dir);
- ``totals``: counts since the run began, this start included: ``in_job_restarts``, ``inprocess_restarts``,
  ``requeues``, ``recomputed_steps`` (steps run again because they came after the checkpoint a restart
  resumed from), ``preemption_stops`` (``signal`` records), ``rerun_exits`` (ends with a rerun-state-machine
  exit code).

Only the records after the previous ``start`` are read (it carries the totals up to it), scanning from the
end of the file; within one attempt steps only grow, so its last ``train`` record is its highest.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from megatron_resilience.records.names import LEDGER_FILE

TOTALS = ("in_job_restarts", "inprocess_restarts", "requeues", "recomputed_steps", "preemption_stops", "rerun_exits")
_WANTED = (b'"kind": "start"', b'"kind": "signal"', b'"kind": "end"', b'"kind": "inprocess_restart"',
           b'"kind": "train"')


def _since_last_start(path: str, chunk: int = 1 << 16) -> tuple[dict | None, list[dict]]:
    """(the last ``start`` record or None, the records after it that matter here, in file order)."""
    if not os.path.exists(path):
        return None, []
    after: list[dict] = []
    seen_train = False
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        tail = b""
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            tail = f.read(end - start) + tail
            end = start
            lines = tail.split(b"\n")
            for line in reversed(lines[1:] if start > 0 else lines):
                kind = next((w for w in _WANTED if w in line), None)
                if kind is None or (kind == _WANTED[-1] and seen_train):
                    continue  # only the attempt's last train record: steps grow within an attempt
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("kind") == "start":
                    return record, after[::-1]
                seen_train = seen_train or record.get("kind") == "train"
                after.append(record)
            tail = lines[0] if start > 0 else b""
    return None, after[::-1]


def highest_logged_step(previous: dict | None, after: list[dict]) -> int | None:
    steps = [r["step"] for r in after if r.get("kind") == "train" and isinstance(r.get("step"), int)]
    if previous is not None and isinstance(previous.get("last_logged_step"), int):
        steps.append(previous["last_logged_step"])
    return max(steps, default=None)


def restart_kind(previous: dict | None, attempt: Mapping[str, Any]) -> str:
    if previous is None:
        return "first"
    before = previous.get("attempt") or {}
    if (attempt.get("slurm_restart"), attempt.get("job_id")) != (before.get("slurm_restart"), before.get("job_id")):
        return "requeue"
    if attempt.get("in_job_restart") != before.get("in_job_restart"):
        return "in_job_restart"
    if (attempt.get("inprocess_restart") or 0) != (before.get("inprocess_restart") or 0):
        return "inprocess_restart"
    return "requeue"  # the same job's same attempt started again: a launch by hand on the same run_dir


def requeue_cause(run_dir: str) -> str | None:
    """Why the previous Slurm attempt ended, as the job-level classifier put it in the run's ledger (its batch
    script's EXIT trap writes one ``attempt`` record per attempt), or None without a ledger."""
    from megatron_resilience.records.ledger import Ledger

    attempts = Ledger.in_run_dir(run_dir).attempts() if os.path.exists(os.path.join(run_dir, LEDGER_FILE)) \
        else []
    cls = (attempts[-1].get("classification") or {}) if attempts else {}
    if not cls.get("error_type"):
        return None
    return f"{cls['error_type']} ({cls.get('source', '?')})" + (f": {cls['reason']}" if cls.get("reason") else "")


def history_fields(path: str, *, step: int, attempt: Mapping[str, Any], ledger_dir: str | None = None
                   ) -> dict[str, Any]:
    """``last_logged_step``, ``restart``, ``totals`` (and ``cause`` for a requeue the job-level classifier
    explained in ``ledger_dir``'s ledger) for a ``start`` record resuming at ``step``."""
    previous, after = _since_last_start(path)
    highest = highest_logged_step(previous, after)
    totals = {name: int(((previous or {}).get("totals") or {}).get(name) or 0) for name in TOTALS}
    kind = restart_kind(previous, attempt)
    if kind != "first":
        totals[f"{kind}s"] += 1
    totals["recomputed_steps"] += max(0, (highest or 0) - step)
    totals["preemption_stops"] += sum(r.get("kind") == "signal" for r in after)
    totals["rerun_exits"] += sum(r.get("kind") == "end" and str(r.get("reason", "")).startswith("rerun")
                                 for r in after)
    fields = {"last_logged_step": highest, "restart": kind, "totals": totals}
    cause = requeue_cause(ledger_dir) if kind == "requeue" and ledger_dir else None
    return {**fields, "cause": cause} if cause else fields
