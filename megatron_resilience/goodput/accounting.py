"""Every second of every attempt's allocation in exactly one bucket, and what each interruption cost.

Input: the attempts' allocation windows (:class:`AttemptWindow`, built by :mod:`.report_inputs` from Slurm's
record, the ledger, or the trainer's records for a local run), the trainer's ``metrics.jsonl`` records,
and, when a chaos run injected them, the injected faults. Output: :class:`Accounting`, a list of spans
that tile each window exactly (so the buckets sum to the allocated time by construction) plus one
:class:`Interruption` per fault or preemption, each with its cost by bucket.

How a window is painted (the vocabulary follows Google's ml-goodput-measurement where it has a word):

1. fixed spans from timestamps the trainer wrote, highest priority first: checkpoint save stalls
   (``checkpoint`` records: ``start_time`` + ``blocking_s``), evaluation (``eval`` records'
   ``duration_s``), setup phases of every (re)start (``start`` record's ``setup`` marks: launch and
   imports, distributed init, model and optimizer build -> ``startup``; dataset build ->
   ``data_loading``; checkpoint load -> ``checkpoint_restore``), and around each fault: the work in
   progress since the last sign of life (``wasted_progress``), fault -> noticed
   (``failure_detection``), noticed -> the next start (``restart_inprocess`` / ``restart_process`` /
   ``restart_job``);
2. step compute (``train`` records: steps x ``step_time_s``), poured into the free time before each
   record: the first run of a step is ``productive``; a step run again after a restart is
   ``wasted_progress`` (it lies inside the interruption's recovery: fault -> first new step);
3. whatever is left is ``other`` (logging, hooks, teardown, gaps no record explains).

Each interruption owns the non-productive seconds from its fault (or the last sign of life before
it) to the first new productive step after it, queue wait included (reported beside, not
allocated): its cost, attributable to its classified cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_resilience.goodput.buckets import (
    MARK_BUCKETS,
    PLANNED,
    RESTART_BUCKET,
    Accounting,
    AttemptWindow,
    Interruption,
)
from megatron_resilience.goodput.charging import charge
from megatron_resilience.goodput.history import save_blocking
from megatron_resilience.goodput.spans import PRODUCTIVE, QUEUE, Span, paint, pour
from megatron_resilience.goodput.unstarted import cycle_numbers, setup_faults

# priorities of fixed spans (higher wins where they overlap)
_SAVE, _EVAL, _SETUP, _FAULT = 40, 30, 20, 10


# --- the trainer's records -------------------------------------------------------------------------------------


def train_windows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train records with the steps each covers (the trainer logs every ``log_interval`` steps)."""
    out, prev = [], None
    for rec in records:
        if rec.get("kind") == "start":
            prev = rec.get("resumed_from", rec.get("step", 0)) or 0
        elif rec.get("kind") == "train" and isinstance(rec.get("step"), int):
            first = (prev if prev is not None else rec["step"] - 1) + 1
            n = max(1, rec["step"] - first + 1)
            out.append({**rec, "_steps": n, "_first": first, "_seconds": float(rec.get("step_time_s") or 0.0) * n})
            prev = rec["step"]
    return out


def _t(rec: dict[str, Any]) -> float:
    return float(rec.get("time") or 0.0)


@dataclass
class _Cycle:
    index: int
    start: dict[str, Any]
    records: list[dict[str, Any]]
    inprocess: int = 0  # the in-process restart iteration this cycle is (0: a fresh process)
    ledger: int = 0  # its number among the attempt's in-job cycles (the ledger's: unstarted ones counted)
    own_start: float = 0.0  # where this cycle's own setup begins
    last_alive: float = 0.0


def _cycles(mine: list[dict[str, Any]]) -> list[_Cycle]:
    cycles: list[_Cycle] = []
    for rec in mine:
        if rec.get("kind") == "start":
            attempt = rec.get("attempt") if isinstance(rec.get("attempt"), dict) else {}
            cycles.append(_Cycle(len(cycles), rec, [], inprocess=int(attempt.get("inprocess_restart") or 0)))
        elif cycles:
            cycles[-1].records.append(rec)
    for c in cycles:
        c.last_alive = max([_t(c.start)] + [_t(r) for r in c.records])
    return cycles


# --- one attempt -------------------------------------------------------------------------------------------------


def _setup_items(c: _Cycle, begin: float) -> list[tuple]:
    """The cycle's setup phases from ``begin`` to its ``start`` record, by the marks the trainer wrote."""
    setup = c.start.get("setup") if isinstance(c.start.get("setup"), dict) else {}
    marks = [(name, float(t)) for name, t in (setup.get("marks") or {}).items() if isinstance(t, (int, float))]
    items, prev = [], begin
    for name, t in sorted(marks, key=lambda m: m[1]):
        if t > prev:
            items.append((prev, min(t, _t(c.start)), _SETUP, MARK_BUCKETS.get(name, "startup"), c.ledger, None))
            prev = min(t, _t(c.start))
    if _t(c.start) > prev:
        items.append((prev, _t(c.start), _SETUP, "startup", c.ledger, None))
    return items


def _own_start(c: _Cycle, floor: float) -> float:
    """Where a fresh process's setup begins: its launcher's or its own creation (not before ``floor``)."""
    setup = c.start.get("setup") if isinstance(c.start.get("setup"), dict) else {}
    t = setup.get("launcher_start") if c.index == 0 else None
    t = t if isinstance(t, (int, float)) else setup.get("process_start")
    t = float(t) if isinstance(t, (int, float)) else _t(c.start)
    return min(max(t, floor), _t(c.start))


def _first_mark_after(c: _Cycle, t: float) -> float:
    setup = c.start.get("setup") if isinstance(c.start.get("setup"), dict) else {}
    later = [float(v) for v in (setup.get("marks") or {}).values() if isinstance(v, (int, float)) and v >= t]
    return min(later + [_t(c.start)])


def _injections_in(injections: list[dict[str, Any]], begin: float, end: float) -> list[dict[str, Any]]:
    """The faults injected into a cycle, oldest first (an injection its chaos run could not carry out is none)."""
    return [i for i in injections if begin <= float(i.get("time") or 0) <= end and i.get("ok", True)]


def _matched(found: list[dict[str, Any]], cause: str) -> dict[str, Any] | None:
    """Of the faults injected into one failed cycle, the one its classification names (else the newest): on the
    allocation clock a second fault can land before the first one was noticed (a hang, then a rank killed
    before the hang's timeout), and the cycle ends once, for the fault that ended it."""
    named = [i for i in found if cause in (i.get("expected") or [])]
    return (named or found or [None])[-1]


def _inprocess_record(inprocess: list[dict[str, Any]], c: _Cycle, nxt: _Cycle) -> dict[str, Any] | None:
    """The ``inprocess_restart`` record of the restart from ``c`` to ``nxt``: its iteration, written by ``nxt``
    between ``c``'s start and ``nxt``'s. Iterations count from 1 again in every process of a run (after a
    process restart or a requeue), so the number alone would charge one restart with another's times."""
    found = [r for r in inprocess if int(r.get("iteration") or 0) == nxt.inprocess and
             _t(c.start) <= _t(r) <= _t(nxt.start)]
    return found[-1] if found else None


def _attempt(w: AttemptWindow, mine: list[dict[str, Any]], injections: list[dict[str, Any]],
             inprocess: list[dict[str, Any]], acc: Accounting, done: list[int],
             late_saves: list[dict[str, Any]] = ()) -> list[Span]:
    cycles = _cycles(mine)
    for c, number in zip(cycles, cycle_numbers(len(cycles), w.unstarted)):
        c.ledger = number
    items: list[tuple] = []
    segments: list[tuple[float, float, float, float, int]] = []
    if not cycles:  # the trainer never started in this window: all of it is startup (or a failed start)
        if w.failure or w.ending in PLANNED:
            # what was injected while it set up ended it (a hang, then the preemption that found it hung; an ECC
            # error before the first record): the fault the classification names, the others absorbed by it
            found = _injections_in(injections, w.start, w.end + 1.0)  # Slurm's End has whole seconds
            injected = _matched(found, w.ending)
            fault = min(float(injected["time"]), w.end) if injected is not None else w.start
            acc.interruptions.append(Interruption(len(acc.interruptions), w.index, 0, _kind_of_ending(w), w.ending,
                                                  fault, "injected" if injected else "last sign of life", w.start,
                                                  w.start, injection=injected,
                                                  absorbed=[i for i in found if i is not injected]))
            items.append((w.start, w.end, _FAULT, RESTART_BUCKET[_kind_of_ending(w)], 0, None))
        else:
            items.append((w.start, w.end, _SETUP, "startup", 0, None))
        return [_attach(s, w.index) for s in paint(w.start, w.end, items)]
    floor = w.start
    for c in cycles:
        if c.inprocess and c.index > 0:
            c.own_start = max(floor, min(_first_mark_after(c, floor), _t(c.start)))
        else:
            c.own_start = _own_start(c, floor)
        if c.index == 0 and c.own_start > w.start:  # launch: batch script, srun, launcher
            items.append((w.start, c.own_start, _SETUP, "startup", c.ledger, None))
        items += _setup_items(c, c.own_start)
        for rec in c.records:
            kind = rec.get("kind")
            if kind == "checkpoint" and rec.get("start_time") is not None and save_blocking(rec) is not None:
                begin = float(rec["start_time"])
                items.append((begin, begin + save_blocking(rec), _SAVE, "checkpoint_save", c.ledger, None))
            elif kind == "eval" and rec.get("duration_s") is not None:
                items.append((_t(rec) - float(rec["duration_s"]), _t(rec), _EVAL, "eval", c.ledger, None))
        anchor = _t(c.start)
        for win in train_windows([c.start] + c.records):
            wasted = sum(1 for s in range(win["_first"], win["step"] + 1) if s <= done[0])
            per_step = win["_seconds"] / win["_steps"]
            segments.append((anchor, _t(win), per_step * (win["_steps"] - wasted), per_step * wasted, c.ledger))
            done[0] = max(done[0], win["step"])
            anchor = _t(win)
        nxt = cycles[c.index + 1] if c.index + 1 < len(cycles) else None
        if nxt is not None:
            kind = "inprocess" if nxt.inprocess > c.inprocess else "process"
            rec = _inprocess_record(inprocess, c, nxt) if kind == "inprocess" else None
            cause = w.cycle_endings.get(c.ledger) or (rec or {}).get("cause") or "unknown"
            boundary = _own_start(nxt, c.last_alive) if kind == "process" else None
            setups = sorted((u for u in w.unstarted if c.ledger < int(u["cycle"]) < nxt.ledger and
                             u.get("start") is not None and kind == "process"), key=lambda u: int(u["cycle"]))
            floor = _fault(w, c, kind, cause, injections, rec, boundary, nxt, acc, items, setups)
        elif not w.running and (w.failure or w.ending in PLANNED):
            _fault(w, c, _kind_of_ending(w), w.ending, injections, None, w.end, None, acc, items)
    for rec in late_saves:  # begun inside the window, recorded after its end: its part inside is a save stall
        begin = float(rec["start_time"])
        items.append((begin, begin + save_blocking(rec), _SAVE, "checkpoint_save", cycles[-1].ledger, None))
    spans = pour(paint(w.start, w.end, items), segments)
    for s in spans:
        if s.bucket is None:
            s.bucket = "other"
    return [_attach(s, w.index) for s in spans]


def _kind_of_ending(w: AttemptWindow) -> str:
    return "preemption" if w.ending in PLANNED and not w.failure else "job"


def _fault(w: AttemptWindow, c: _Cycle, kind: str, cause: str, injections: list[dict[str, Any]],
           inprocess_rec: dict[str, Any] | None, boundary: float | None, nxt: _Cycle | None, acc: Accounting,
           items: list[tuple], setups: list[dict[str, Any]] = ()) -> float:
    """Paint how cycle ``c`` ended (work lost, detection, restart) and record the interruption; then the same for
    each cycle of ``setups`` (``AttemptWindow.unstarted``) that the restart went through: a fault that killed the
    restarted workers in their setup ended a cycle of its own, it is not absorbed by the one before.

    Returns where the next cycle's own setup may begin."""
    last = c.last_alive
    limit = boundary if boundary is not None else (_t(nxt.start) if nxt is not None else w.end)
    # Slurm's End has whole seconds: a fault that ended the attempt (a node set DOWN) may lie just past it
    found = _injections_in(injections, c.own_start, limit + (1.0 if nxt is None and kind == "job" else 0.0))
    later = setup_faults(setups, found, limit)
    found = [i for i in found if not later or float(i["time"]) < float(later[0][0]["start"])]  # c's own
    injected = _matched(found, cause)
    signal = next((r for r in c.records if r.get("kind") == "signal"), None)
    if injected is not None:  # the first fault that broke the cycle starts its cost
        fault, source = float(found[0]["time"]), "injected"
    elif inprocess_rec and isinstance(inprocess_rec.get("fault_time"), (int, float)):
        fault, source = float(inprocess_rec["fault_time"]), "trainer"
    elif kind == "preemption" and signal is not None:
        fault = float(signal.get("first_received_time") or signal.get("received_time") or last)
        source = "signal"
    else:
        fault, source = last, "last sign of life"
    fault = min(max(fault, _t(c.start)), limit)
    if kind == "inprocess":
        noticed = inprocess_rec.get("detected_time") if inprocess_rec else None
        if not isinstance(noticed, (int, float)):
            noticed = min(float((inprocess_rec or {}).get("time") or limit), _first_mark_after(nxt, fault))
        detected = min(max(float(noticed), fault, last), limit)
    elif kind == "preemption":
        detected = min(max(fault, last), limit)
    else:
        seen = [t for t in w.detections if fault - 2.0 <= t <= limit]
        detected = min(max([fault, last] + ([min(seen)] if seen else [])), limit)
    if nxt is not None and kind == "inprocess":
        boundary = max(detected, min(_first_mark_after(nxt, detected), _t(nxt.start)))
    boundary = limit if boundary is None else boundary
    index = len(acc.interruptions)
    if fault > last:
        items.append((last, fault, _FAULT, "wasted_progress", c.ledger, index))
    if detected > max(fault, last):
        items.append((max(fault, last), detected, _FAULT, "failure_detection", c.ledger, index))
    stop = later[0][2] if later else boundary  # the restart ends where a fault in the next setup begins
    if min(boundary, stop) > max(detected, last):
        items.append((max(detected, last), min(boundary, stop), _FAULT, RESTART_BUCKET[kind], c.ledger, index))
    acc.interruptions.append(Interruption(index, w.index, c.ledger, kind, cause, fault, source, last, detected,
                                          injection=injected, absorbed=[i for i in found if i is not injected]))
    for k, (u, mine, at, seen) in enumerate(later):
        index, cycle, cause = len(acc.interruptions), int(u["cycle"]), str(u.get("cause") or "unknown")
        items.append((at, seen, _FAULT, "failure_detection", cycle, index))
        items.append((seen, later[k + 1][2] if k + 1 < len(later) else boundary, _FAULT, "restart_process", cycle,
                      index))
        matched = _matched(mine, cause)
        acc.interruptions.append(Interruption(index, w.index, cycle, "process", cause, at,
                                              "injected" if matched else "last sign of life", at, seen,
                                              injection=matched, absorbed=[i for i in mine if i is not matched]))
    return boundary



def _attach(span: Span, attempt: int) -> Span:
    span.attempt = attempt
    return span


# --- the whole run -----------------------------------------------------------------------------------------------


def account(windows: list[AttemptWindow], records: list[dict[str, Any]],
            injections: list[dict[str, Any]] | None = None) -> Accounting:
    """The accounting of a run: its attempts' windows (allocation), the trainer's records, injected faults."""
    acc = Accounting()
    injections = sorted(injections or [], key=_t)
    records = sorted((r for r in records if r.get("time") is not None), key=_t)
    inprocess = [r for r in records if r.get("kind") == "inprocess_restart"]
    done = [0]  # the highest step run so far (a step run again is wasted progress)
    previous_end = None
    for w in sorted(windows, key=lambda w: w.start):
        if previous_end is not None and w.start > previous_end:
            acc.spans.append(Span(previous_end, w.start, QUEUE))
            acc.queue_wait += w.start - previous_end
        mine = [r for r in records if w.start <= _t(r) <= w.end and r.get("kind") != "inprocess_restart"]
        # a save the window's end cut (Slurm's End has whole seconds; a node declared failed): its record comes later
        late = [r for r in records if r.get("kind") == "checkpoint" and _t(r) > w.end and save_blocking(r) is not None
                and r.get("start_time") is not None and w.start <= float(r["start_time"]) < w.end]
        acc.spans += _attempt(w, mine, injections, inprocess, acc, done, late)
        acc.allocated += w.end - w.start
        previous_end = w.end if previous_end is None else max(previous_end, w.end)
    charge(acc)
    for s in acc.spans:
        if s.bucket == PRODUCTIVE:
            acc.productive += s.seconds
        elif s.bucket in acc.badput:
            acc.badput[s.bucket] += s.seconds
        if s.bucket != PRODUCTIVE:
            cause = acc.interruptions[s.interruption].cause if s.interruption is not None else "-"
            row = acc.by_cause.setdefault(cause, {})
            row[s.bucket] = row.get(s.bucket, 0.0) + s.seconds
    return acc

