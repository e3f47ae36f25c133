"""The run's chain of attempts as a table, its goodput, its badput by bucket and by cause, and the optimum.

    python -m megatron_resilience.report RUN_DIR [--png FILE] [--logs] [--json]   (report/cli.py)
    nemo megatron_resilience report RUN_DIR

One row per in-job cycle of every Slurm attempt (ft_launcher/torchrun restarts inside a job, in-process
restarts, and each requeue or resubmission), from ``job_ledger.jsonl`` (written by the batch script and
the watcher). A run without a ledger (a local run, ``make demo``) is read from the trainer's
``metrics.jsonl`` alone: its cycles are the trainer's ``start`` records.

Goodput is productive training time (the first run of every step) over the allocated time (every
attempt's allocation: Slurm's Start -> End; a local run's launcher start -> last record). Every
allocated second is in exactly one bucket (:mod:`.accounting`): startup, data loading, checkpoint
restore, checkpoint save stalls, wasted progress, failure detection, restart downtime (in-process,
process, job), evaluation, other. Queue wait (an attempt's end to the next one's start) is reported
beside it, not allocated. Each interruption's cost (fault -> first new productive step) is charged to
its classified cause; :mod:`.optimum` compares the goodput with Daly's E* for the run's own C, R, M;
:mod:`.injected` lists what a chaos run injected and how each fault was classified.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_resilience.goodput.accounting import QUEUE, account
from megatron_resilience.goodput.buckets import BUCKETS, Accounting, AttemptWindow
from megatron_resilience.goodput.optimum import Optimum, format_optimum, measure
from megatron_resilience.jobs.evidence import read_json
from megatron_resilience.records.ledger import LEDGER_FILE, Ledger
from megatron_resilience.records.names import STOP_REASON_FILE
from megatron_resilience.report import injected as injected_faults
from megatron_resilience.report import inputs
from megatron_resilience.report.node_history import format_node_table


@dataclass
class Row:
    attempt: int
    cycle: int
    job_id: str
    restart: int
    nodes: str
    start: float | None
    end: float | None
    state: str
    exit_code: str
    ended: str  # error type (source) of this cycle's end
    decision: str
    steps: str
    resumed_from: int | None
    recomputed: int
    world_size: int | None = None
    tokens_per_s: float | None = None  # median over the cycle's train records
    evidence: list[str] = field(default_factory=list)
    log_files: list[str] = field(default_factory=list)


@dataclass
class RunReport:
    run_dir: str
    rows: list[Row]
    accounting: Accounting
    final: str
    policy: str
    windows: list[AttemptWindow] = field(default_factory=list)
    optimum: Optimum = field(default_factory=Optimum)
    injected: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "policy": self.policy, "final": self.final,
                "rows": [asdict(r) for r in self.rows], "accounting": self.accounting.to_dict(),
                "windows": [asdict(w) for w in self.windows], "optimum": self.optimum.to_dict(),
                "injected": self.injected}


def build(run_dir: str, *, slurm_lookup: bool = True, now: float | None = None) -> RunReport:
    ledger = Ledger(os.path.join(run_dir, LEDGER_FILE))
    records, trainer_logs = inputs.trainer_records(run_dir, ledger)
    attempts = ledger.attempts()
    if attempts or ledger.records("attempt_start"):
        windows, runs = inputs.ledger_windows(ledger, records, slurm_lookup=slurm_lookup, now=now)
        rows = _ledger_rows(attempts, windows, runs, records)
        policy = (attempts[-1].get("policy") if attempts else None) or "-"
        faults = inputs.injections(run_dir, {w.job_id for w in windows})
    else:
        window = inputs.local_window(records)
        if window is not None and trainer_logs:  # a foreign trainer's log: when its launcher noticed a failure
            window.detections = inputs.detection_times(trainer_logs)
        windows = [window] if window else []
        rows = _local_rows(run_dir, records, window) if window else []
        policy = "- (no job-level ledger: a local run)"
        faults = inputs.injections(run_dir)
    acc = account(windows, records, faults)
    final = ledger.final()
    stop = read_json(os.path.join(run_dir, STOP_REASON_FILE)) or {}
    ends = [r for r in records if r.get("kind") == "end"]
    if trainer_logs and not stop and ends:  # a foreign trainer: its log's last end
        stop = {"reason": ends[-1].get("reason"), "step": ends[-1].get("step")}
    if final:
        text = final.get("message") or final.get("outcome", "")
    elif not attempts:
        text = f"trainer ended: {stop.get('reason', 'no stop reason')} at step {stop.get('step', '?')}"
    else:
        text = f"no final record yet (running, or requeued); trainer: {stop.get('reason', 'no stop reason')}"
    return RunReport(run_dir=run_dir, rows=rows, accounting=acc, final=text, policy=policy, windows=windows,
                     optimum=measure(acc, records), injected=injected_faults.summarize(acc, faults, windows))


def _cycle_stats(records: list[dict[str, Any]], w: AttemptWindow) -> list[tuple[int | None, float | None]]:
    """(world size, median tokens/s) of each trainer (re)start inside the window."""
    out: list[tuple[int | None, list[float]]] = []
    for rec in records:
        if not w.start <= float(rec.get("time") or 0) <= w.end:
            continue
        if rec.get("kind") == "start":
            out.append((rec.get("world_size"), []))
        elif rec.get("kind") == "train" and out and isinstance(rec.get("tokens_per_s"), (int, float)):
            out[-1][1].append(float(rec["tokens_per_s"]))
    return [(ws, statistics.median(tps) if tps else None) for ws, tps in out]


def _ledger_rows(attempts: list[dict[str, Any]], windows: list[AttemptWindow],
                 runs: dict[tuple[str, int], dict[str, Any]], records: list[dict[str, Any]]) -> list[Row]:
    rows: list[Row] = []
    by_key = {(str(a.get("job_id")), int(a.get("slurm_restart") or 0)): a for a in attempts}
    for w in windows:
        a = by_key.get((w.job_id, w.restart)) or {}
        cls = a.get("classification") or {}
        decision = a.get("decision") or {}
        cycles = a.get("cycles") or [{"cycle": 0}]
        stats = _cycle_stats(records, w)
        state = (runs.get((w.job_id, w.restart)) or {}).get("state") or a.get("slurm_state") or \
            ("RUNNING" if w.running else "?")
        for k, cycle in enumerate(cycles):
            last = k == len(cycles) - 1
            inprocess = bool((cycle.get("ended") or {}).get("inprocess"))
            why = (f"{cls.get('error_type')} ({cls.get('source')})" if last and cls else
                   "in-process restart" if inprocess else
                   (cycle.get("ended") or {}).get("error_type", "in-job restart") if not last else "running")
            what = (_decision_text(decision) if last and decision else
                    ("in-process restart" if inprocess else "in-job restart") if not last else "-")
            first, lst = cycle.get("resumed_from"), cycle.get("last_step", a.get("last_step") if last else None)
            started = sum(1 for c in cycles[:k] if c.get("trainer_started") is not False)  # the trainer's cycle
            ws, tps = stats[started] if started < len(stats) and cycle.get("trainer_started") is not False \
                else (None, None)
            rows.append(Row(attempt=w.index, cycle=k, job_id=w.job_id, restart=w.restart, nodes=",".join(w.nodes),
                            start=cycle.get("start_time") or w.start,
                            end=w.end if last else (cycles[k + 1].get("start_time") if k + 1 < len(cycles) else None),
                            state=state if last else "-", exit_code=str(a.get("exit_code", "-")) if last else "-",
                            ended=why, decision=what, steps=f"{(first or 0) + 1}-{lst}" if lst is not None else "-",
                            resumed_from=first, recomputed=int(cycle.get("recomputed_steps") or 0),
                            world_size=ws, tokens_per_s=tps,
                            evidence=list(cls.get("evidence") or []) if last else
                            list((cycle.get("ended") or {}).get("evidence") or []),
                            log_files=list(a.get("log_files") or []) if last else []))
    return rows


def _decision_text(decision: dict[str, Any]) -> str:
    left = decision.get("budget_left")
    budget = ("; left " + "/".join(f"{m[0]}{n}" for m, n in left.items())) if left else ""
    applied, asked = decision.get("exclude_applied") or [], decision.get("exclude_requested") or []
    excl = (f" -x {','.join(applied)}" if applied else f" (-x {','.join(asked)} not applied)" if asked else "")
    return decision.get("action", "") + excl + budget


def _local_rows(run_dir: str, records: list[dict[str, Any]], w: AttemptWindow) -> list[Row]:
    """A run without a ledger (local): one attempt whose cycles are the trainer's (re)starts."""
    from megatron_resilience.goodput.accounting import train_windows

    windows = train_windows(records)
    starts = [r for r in records if r.get("kind") == "start"]
    ends = [r for r in records if r.get("kind") == "end"]
    stop = read_json(os.path.join(run_dir, STOP_REASON_FILE)) or \
        ({"reason": ends[-1].get("reason")} if ends and ends[-1] is records[-1] else {})  # a foreign log's end
    stats = _cycle_stats(records, w)
    rows = []
    for k, s in enumerate(starts):
        begin = float(s["time"])
        nxt = float(starts[k + 1]["time"]) if k + 1 < len(starts) else w.end
        mine = [x for x in windows if begin <= float(x["time"]) <= nxt]
        last = k == len(starts) - 1
        resumed = s.get("resumed_from", s.get("step"))
        before = max((x["step"] for x in windows if float(x["time"]) < begin), default=0)
        ws, tps = stats[k] if k < len(stats) else (None, None)
        rows.append(Row(attempt=0, cycle=k, job_id="local", restart=0, nodes=",".join(w.nodes),
                        start=w.start if k == 0 else begin, end=nxt, state="-",
                        exit_code=str(ends[-1].get("exit_code")) if last and ends else "-",
                        ended=(stop.get("reason", "?") if last else "in-job restart (worker group restarted)"),
                        decision="-", steps=f"{(resumed or 0) + 1}-{max((x['step'] for x in mine), default='-')}",
                        resumed_from=resumed, recomputed=max(0, before - (resumed or 0)), world_size=ws,
                        tokens_per_s=tps))
    return rows


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _dur(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _pct(seconds: float, total: float) -> str:
    return f"{100 * seconds / total:.1f}%" if total > 0 else "-"


def format_report(report: RunReport, *, evidence: bool = True) -> str:
    header = ("#", "job", "restart", "cycle", "nodes", "start", "duration", "state", "exit", "why it ended",
              "decision", "steps", "resumed", "recomputed", "ws", "tokens/s")
    table = [header]
    for r in report.rows:
        dur = _dur(r.end - r.start) if r.end and r.start else "-"
        table.append((str(r.attempt), r.job_id, str(r.restart), str(r.cycle), r.nodes, _clock(r.start), dur, r.state,
                      r.exit_code, r.ended, r.decision, r.steps, "-" if r.resumed_from is None else
                      str(r.resumed_from), str(r.recomputed), "-" if r.world_size is None else str(r.world_size),
                      "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"megatron_resilience report: {report.run_dir}", f"policy: {report.policy}", ""]
    lines += [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    if evidence:
        for r in report.rows:
            for line in r.evidence[:2]:
                lines.append(f"  attempt {r.attempt} cycle {r.cycle} evidence: {line[:160]}")
    lines += format_node_table(Ledger(os.path.join(report.run_dir, LEDGER_FILE)).attempts())
    acc = report.accounting
    lines += ["", f"goodput: {100 * acc.goodput:.1f}% (productive training {_dur(acc.productive)} of "
                  f"{_dur(acc.allocated)} allocated)"]
    parts = [f"{name.replace('_', ' ')} {_dur(acc.badput[name])} ({_pct(acc.badput[name], acc.allocated)})"
             for name in BUCKETS]
    lines.append("badput:  " + ", ".join(parts))
    lines.append(f"queue wait (not allocated): {_dur(acc.queue_wait)}")
    lines += _cost_lines(acc)
    lines += format_optimum(report.optimum, acc.goodput)
    lines += injected_faults.format_injected(report.injected)
    lines.append(f"final: {report.final}")
    return "\n".join(lines)


def _cost_lines(acc: Accounting) -> list[str]:
    """Each interruption's cost and the cost by cause ("node failures cost 7 % of this run")."""
    if not acc.interruptions:
        return []
    lines = ["interruptions (fault -> first new productive step):"]
    for i in acc.interruptions:
        parts = ", ".join(f"{b.replace('_', ' ')} {_dur(s)}" for b, s in sorted(i.cost.items(), key=lambda x: -x[1])
                          if s >= 0.05)
        queue = f" + queue {_dur(i.queue_wait)}" if i.queue_wait else ""
        lines.append(f"  {i.index}: {_clock(i.fault_time)} {i.cause} ({i.kind}, fault from {i.fault_source}): "
                     f"{_dur(i.total)}{queue} = {parts or '-'}")
    totals = sorted(((cause, sum(v for b, v in buckets.items() if b != QUEUE))
                     for cause, buckets in acc.by_cause.items() if cause != "-"),
                    key=lambda x: -x[1])
    lines.append("cost by cause: " + ", ".join(f"{cause} {_dur(s)} ({_pct(s, acc.allocated)})" for cause, s in totals))
    return lines

