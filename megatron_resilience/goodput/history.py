"""A run's checkpoint cost, seconds per step and failure rate, read from its own records (stdlib only).

Used by the trainer's ``checkpoint.interval_policy=young_daly`` (rank 0, at every restart) and by the
report (:mod:`megatron_resilience.goodput.optimum`). Inputs are the records of ``metrics.jsonl`` (kinds in
``runtime/metrics.py``) and, when the run has one, ``job_ledger.jsonl`` (``records/ledger.py``).
"""

from __future__ import annotations

from typing import Any

from megatron_resilience.goodput.mtbf import MIN_FAILURES, Mtbf, choose  # noqa: F401 (MIN_FAILURES: read from here too)
from megatron_resilience.records.jsonl import read_jsonl  # noqa: E402,F401 (read from here too)


def save_blocking(rec: dict[str, Any]) -> float | None:
    """A checkpoint record's blocking seconds (``blocking_s``; older records: ``blocking_seconds``/``seconds``)."""
    for key in ("blocking_s", "blocking_seconds", "seconds"):
        if rec.get(key) is not None:
            return float(rec[key])
    return None


def periodic_save_seconds(records: list[dict[str, Any]]) -> list[float]:
    """Blocking seconds of the periodic saves (``reason=interval``); of every save when there is none."""
    saves = [r for r in records if r.get("kind") == "checkpoint" and save_blocking(r) is not None]
    periodic = [r for r in saves if r.get("reason") == "interval"] or saves
    return [save_blocking(r) for r in periodic]


def between_saves(records: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(compute seconds, steps) between consecutive periodic saves requested in one trainer cycle: the wall time
    between their requests minus the earlier one's stall."""
    out: list[tuple[float, int]] = []
    previous = None
    for rec in records:
        if rec.get("kind") == "start":
            previous = None
        elif rec.get("kind") == "checkpoint" and rec.get("reason") == "interval" and rec.get("start_time"):
            if previous is not None and int(rec.get("step") or 0) > int(previous.get("step") or 0):
                seconds = float(rec["start_time"]) - float(previous["start_time"]) - (save_blocking(previous) or 0)
                if seconds > 0:
                    out.append((seconds, int(rec["step"]) - int(previous["step"])))
            previous = rec
    return out


def wall_seconds_per_step(records: list[dict[str, Any]]) -> float | None:
    """The median wall time between the ``train`` records of consecutive steps of one cycle (log_interval 1)."""
    import statistics

    gaps, previous = [], None
    for rec in records:
        if rec.get("kind") == "start":
            previous = None
        elif rec.get("kind") == "train" and isinstance(rec.get("step"), int) and rec.get("time") is not None:
            if previous is not None and rec["step"] == previous[0] + 1:
                gaps.append(float(rec["time"]) - previous[1])
            previous = (rec["step"], float(rec["time"]))
    return statistics.median(gaps) if gaps else None


def save_spacing(records: list[dict[str, Any]]) -> int | None:
    """The steps between periodic saves (a fixed interval: the smallest gap between their distinct steps)."""
    steps = sorted({int(r["step"]) for r in records if r.get("kind") == "checkpoint" and r.get("reason") == "interval"
                    and isinstance(r.get("step"), int)})
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return min(gaps) if gaps else (steps[0] if len(steps) == 1 else None)


def _failed_cycles(records: list[dict[str, Any]], *, new_cycle: bool = False) -> list[tuple[float, float]]:
    """(start, end) of trainer cycles that were interrupted, i.e. did not finish (``end`` record with reason
    ``finished``) and were followed by another start: killed, hung, crashed, exited with an error, or stopped on
    a preemption signal (as unplanned for the job as a failure, and it costs a restart too). ``new_cycle``: a
    trainer is starting now (its ``start`` record not written yet), so the last cycle is followed by one too."""
    out, begin, clean, last = [], None, False, None
    for rec in records:
        kind = rec.get("kind")
        if kind == "start":
            if begin is not None and not clean:
                out.append((begin, last))
            begin, clean = float(rec.get("time") or 0), False
        elif kind == "end":
            clean = rec.get("reason") == "finished"
        if rec.get("time") is not None:
            last = float(rec["time"])
    if new_cycle and begin is not None and not clean:
        out.append((begin, last))
    return out


def allocated_seconds(records: list[dict[str, Any]], *, now: float | None = None) -> float:
    """The time the run's trainers were alive or being restarted: per Slurm attempt (``start`` records' ``attempt``),
    from its first setup start to its last record (``now`` for the current one)."""
    spans: dict[tuple, list[float]] = {}
    order: list[tuple] = []
    for rec in records:
        if rec.get("time") is None:
            continue
        if rec.get("kind") == "start":
            attempt = rec.get("attempt") if isinstance(rec.get("attempt"), dict) else {}
            key = (attempt.get("job_id"), int(attempt.get("slurm_restart") or 0))
            if key not in spans:
                setup = rec.get("setup") if isinstance(rec.get("setup"), dict) else {}
                begin = setup.get("launcher_start") or setup.get("process_start") or rec["time"]
                spans[key] = [float(begin), float(rec["time"])]
                order.append(key)
        if order:
            span = spans[order[-1]]
            span[1] = max(span[1], float(rec["time"]))
    if order and now is not None:
        spans[order[-1]][1] = max(spans[order[-1]][1], now)
    return sum(max(0.0, end - begin) for begin, end in spans.values())


def failures(records: list[dict[str, Any]], ledger: list[dict[str, Any]] = (), *, new_cycle: bool = False) -> int:
    """Interruptions so far: interrupted trainer cycles, and Slurm attempts the ledger classified as failures
    whose last trainer cycle still ended cleanly (a node failure whose surviving rank saved on Slurm's SIGTERM)."""
    failed = {begin for begin, _ in _failed_cycles(records, new_cycle=new_cycle)}
    starts = [float(r["time"]) for r in records if r.get("kind") == "start" and r.get("time") is not None]
    count = len(failed)
    for a in ledger:
        if a.get("kind") != "attempt" or (a.get("classification") or {}).get("mode") is None:
            continue
        begin, end = float(a.get("start") or 0), float(a.get("end") or 0)
        mine = [t for t in starts if begin <= t <= end]
        if not mine or mine[-1] not in failed:
            count += 1
    return count


def mtbf(records: list[dict[str, Any]], ledger: list[dict[str, Any]] = (), *, estimate_s: float | None = None,
         now: float | None = None, new_cycle: bool = False) -> Mtbf:
    """M as the trainer knows it at a restart: its records' allocated time and interruptions, by the one rule of
    :func:`megatron_resilience.goodput.mtbf.choose`."""
    return choose(allocated_s=allocated_seconds(records, now=now),
                  interruptions=failures(records, ledger, new_cycle=new_cycle), estimate_s=estimate_s)
