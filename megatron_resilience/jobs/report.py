"""The run's chain of attempts as a table, its goodput and its badput by cause, from the ledger and metrics.

    python -m megatron_resilience.report RUN_DIR [--png FILE] [--logs] [--json]   (jobs/report_cli.py)
    nemo megatron_resilience report RUN_DIR

One row per in-job cycle of every Slurm attempt (ft_launcher/torchrun restarts inside a job, and
each requeue or resubmission), from ``job_ledger.jsonl`` (written by the batch script and the
watcher). A run without a ledger (a local run, ``make demo``) is read from the trainer's
``metrics.jsonl`` alone: its cycles are the trainer's ``start`` records.

Goodput is productive training time (the step time of every step that was kept) over the allocated
time (the wall time of every attempt, from its batch script's start to its end). Badput by cause:
setup (attempt start to the trainer's first ``start`` record: launch, imports, checkpoint load),
checkpoint stalls (the trainer's ``checkpoint`` records: time training was blocked), recomputed
steps (steps run again after a restart), restart downtime (last sign of life of a failed cycle to
the next cycle's ``start``, and a failed attempt's tail), other (eval, logging, teardown). Queue
wait (an attempt's end to the next one's start) is reported beside it, not allocated.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_resilience.jobs.evidence import read_json, read_metrics
from megatron_resilience.jobs.ledger import LEDGER_FILE, Ledger
from megatron_resilience.jobs.node_history import format_node_table

CATEGORIES = ("setup", "checkpoint", "recomputed", "restart_downtime", "other")


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
    evidence: list[str] = field(default_factory=list)
    log_files: list[str] = field(default_factory=list)


@dataclass
class Accounting:
    allocated: float = 0.0
    productive: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CATEGORIES})
    queue_wait: float = 0.0

    @property
    def goodput(self) -> float:
        return self.productive / self.allocated if self.allocated > 0 else 0.0


@dataclass
class RunReport:
    run_dir: str
    rows: list[Row]
    accounting: Accounting
    final: str
    policy: str
    segments: list[dict[str, Any]]  # for the timeline: {"row", "kind", "start", "end", "label"}

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "policy": self.policy, "final": self.final,
                "rows": [asdict(r) for r in self.rows],
                "accounting": {**asdict(self.accounting), "goodput": self.accounting.goodput}}


def _train_windows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train records with the span of steps each covers (the trainer logs every log_interval steps)."""
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


def build(run_dir: str, *, slurm_lookup: bool = True) -> RunReport:
    ledger = Ledger(os.path.join(run_dir, LEDGER_FILE))
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    windows = _train_windows(records)
    kept: dict[int, dict[str, Any]] = {}
    for w in windows:
        kept[w["step"]] = w  # the last run of a step is the one that counts
    acc = Accounting(productive=sum(w["_seconds"] for w in kept.values()))
    acc.badput["recomputed"] = sum(w["_seconds"] for w in windows) - acc.productive
    acc.badput["checkpoint"] = sum(float(r.get("blocking_seconds", r.get("seconds")) or 0.0)
                                   for r in records if r.get("kind") == "checkpoint")
    starts = [r for r in records if r.get("kind") == "start"]
    attempts = ledger.attempts()
    rows: list[Row] = []
    segments: list[dict[str, Any]] = []
    if attempts or ledger.records("attempt_start"):
        _from_ledger(ledger, attempts, records, rows, segments, acc, slurm_lookup)
        policy = (attempts[-1].get("policy") if attempts else None) or "-"
    else:
        _from_metrics(run_dir, records, starts, rows, segments, acc)
        policy = "- (no job-level ledger: a local run)"
    named = sum(acc.badput[c] for c in CATEGORIES if c != "other")
    acc.badput["other"] = max(0.0, acc.allocated - acc.productive - named)
    final = ledger.final()
    stop = read_json(os.path.join(run_dir, "stop_reason.json")) or {}
    if final:
        text = final.get("message") or final.get("outcome", "")
    elif not attempts:
        text = f"trainer ended: {stop.get('reason', 'no stop reason')} at step {stop.get('step', '?')}"
    else:
        text = f"no final record yet (running, or requeued); trainer: {stop.get('reason', 'no stop reason')}"
    return RunReport(run_dir=run_dir, rows=rows, accounting=acc, final=text, policy=policy, segments=segments)


def account_attempt(acc: Accounting, *, start: float, end: float, cycle_starts: list[float],
                    windows: list[dict[str, Any]], failed: bool) -> None:
    """Setup before the first cycle; downtime from each cycle's last sign of life to the next cycle (and to the
    end of a failed attempt). The allocated time is added by the caller."""
    if not cycle_starts:
        acc.badput["setup" if not failed else "restart_downtime"] += max(0.0, end - start)
        return
    acc.badput["setup"] += max(0.0, cycle_starts[0] - start)
    bounds = cycle_starts + [end]
    for k, begin in enumerate(cycle_starts):
        alive = [float(w["time"]) for w in windows if begin <= float(w.get("time", 0)) <= bounds[k + 1]]
        last_alive = max(alive, default=begin)
        if k + 1 < len(cycle_starts) or failed:
            acc.badput["restart_downtime"] += max(0.0, bounds[k + 1] - last_alive)


def _from_ledger(ledger: Ledger, attempts: list[dict[str, Any]], records: list[dict[str, Any]], rows: list[Row],
                 segments: list[dict[str, Any]], acc: Accounting, slurm_lookup: bool) -> None:
    windows = _train_windows(records)
    starts_by_key = {}
    for s in ledger.records("attempt_start"):
        starts_by_key[(str(s.get("job_id")), int(s.get("slurm_restart") or 0))] = s
    ended = {(str(a.get("job_id")), int(a.get("slurm_restart") or 0)) for a in attempts}
    slurm_states = _slurm_states({str(a.get("job_id")) for a in attempts}) if slurm_lookup else {}
    running = [s for key, s in starts_by_key.items() if key not in ended]
    previous_end = None
    for index, a in enumerate(attempts + [{"_running": True, **s} for s in running]):
        key = (str(a.get("job_id")), int(a.get("slurm_restart") or 0))
        start = a.get("start") or (starts_by_key.get(key) or {}).get("time")
        end = a.get("end") if not a.get("_running") else time.time()
        if start is not None and end is not None:
            acc.allocated += max(0.0, float(end) - float(start))
        if previous_end is not None and start is not None:
            acc.queue_wait += max(0.0, float(start) - previous_end)
            segments.append({"row": None, "kind": "queue", "start": previous_end, "end": float(start), "label": ""})
        previous_end = float(end) if end is not None else previous_end
        cls = a.get("classification") or {}
        decision = a.get("decision") or {}
        cycles = a.get("cycles") or [{"cycle": 0}]
        cycle_starts = [c["start_time"] for c in cycles if c.get("start_time")]
        if start is not None and end is not None:
            account_attempt(acc, start=float(start), end=float(end), cycle_starts=cycle_starts, windows=windows,
                            failed=cls.get("mode") is not None)
        state = slurm_states.get(key) or a.get("slurm_state") or ("RUNNING" if a.get("_running") else "?")
        for k, cycle in enumerate(cycles):
            last = k == len(cycles) - 1
            why = (f"{cls.get('error_type')} ({cls.get('source')})" if last and cls else
                   (cycle.get("ended") or {}).get("error_type", "in-job restart") if not last else "running")
            if last and decision:
                left = decision.get("budget_left")
                budget = ("; left " + "/".join(f"{m[0]}{n}" for m, n in left.items())) if left else ""
                applied, asked = decision.get("exclude_applied") or [], decision.get("exclude_requested") or []
                excl = (f" -x {','.join(applied)}" if applied else
                        f" (-x {','.join(asked)} not applied)" if asked else "")
                what = decision.get("action", "") + excl + budget
            else:
                what = "in-job restart" if not last else "-"
            first, lst = cycle.get("resumed_from"), cycle.get("last_step", a.get("last_step") if last else None)
            steps = f"{(first or 0) + 1}-{lst}" if lst is not None else "-"
            rows.append(Row(attempt=index, cycle=k, job_id=str(a.get("job_id")), restart=key[1],
                            nodes=",".join(a.get("nodes") or []) if isinstance(a.get("nodes"), list)
                            else str(a.get("nodes") or ""), start=cycle.get("start_time") or start,
                            end=end if last else (cycles[k + 1].get("start_time") if k + 1 < len(cycles) else None),
                            state=state if last else "-", exit_code=str(a.get("exit_code", "-")) if last else "-",
                            ended=why, decision=what, steps=steps, resumed_from=first,
                            recomputed=int(cycle.get("recomputed_steps") or 0),
                            evidence=list(cls.get("evidence") or []) if last else
                            list((cycle.get("ended") or {}).get("evidence") or []),
                            log_files=list(a.get("log_files") or []) if last else []))
        if start is not None and end is not None:
            segments.append({"row": len(rows) - 1, "kind": "attempt", "start": float(start), "end": float(end),
                             "label": cls.get("error_type", "running"), "cycle_starts": cycle_starts})


def _slurm_states(job_ids: set[str]) -> dict[tuple[str, int], str]:
    """Slurm's final state of every run of these jobs (sacct), when this machine has Slurm; {} otherwise."""
    import shutil

    from megatron_resilience.jobs.slurm import sacct_runs

    if not shutil.which("sacct"):
        return {}
    out = {}
    for job in job_ids:
        for restart, run in enumerate(sacct_runs(job)):
            out[(job, restart)] = run["State"].split()[0]
    return out


def _from_metrics(run_dir: str, records: list[dict[str, Any]], starts: list[dict[str, Any]], rows: list[Row],
                  segments: list[dict[str, Any]], acc: Accounting) -> None:
    """A run without a ledger (local): one attempt whose cycles are the trainer's (re)starts."""
    if not records:
        return
    windows = _train_windows(records)
    t0 = min(float(r["time"]) for r in records if r.get("time") is not None)
    first_train = windows[0] if windows else None
    begin = min(t0, float(first_train["time"]) - first_train["_seconds"]) if first_train else t0
    end = max(float(r["time"]) for r in records if r.get("time") is not None)
    acc.allocated = end - begin
    cycle_starts = [float(s["time"]) for s in starts]
    account_attempt(acc, start=begin, end=end, cycle_starts=cycle_starts, windows=windows, failed=False)
    stop = read_json(os.path.join(run_dir, "stop_reason.json")) or {}
    ends = [r for r in records if r.get("kind") == "end"]
    for k, s in enumerate(starts):
        nxt = cycle_starts[k + 1] if k + 1 < len(starts) else end
        mine = [w for w in windows if cycle_starts[k] <= float(w["time"]) <= nxt]
        last = k == len(starts) - 1
        resumed = s.get("resumed_from", s.get("step"))
        before = max((w["step"] for w in windows if float(w["time"]) < cycle_starts[k]), default=0)
        rows.append(Row(attempt=0, cycle=k, job_id="local", restart=0, nodes=os.uname()[1], start=cycle_starts[k],
                        end=nxt, state="-", exit_code=str(ends[-1].get("exit_code")) if last and ends else "-",
                        ended=(stop.get("reason", "?") if last else "in-job restart (worker group restarted)"),
                        decision="-", steps=f"{(resumed or 0) + 1}-{max((w['step'] for w in mine), default='-')}",
                        resumed_from=resumed, recomputed=max(0, before - (resumed or 0))))
    segments.append({"row": 0, "kind": "attempt", "start": begin, "end": end, "label": stop.get("reason", ""),
                     "cycle_starts": cycle_starts})


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _dur(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def format_report(report: RunReport, *, evidence: bool = True) -> str:
    header = ("#", "job", "restart", "cycle", "nodes", "start", "duration", "state", "exit", "why it ended",
              "decision", "steps", "resumed", "recomputed")
    table = [header]
    for r in report.rows:
        dur = _dur(r.end - r.start) if r.end and r.start else "-"
        table.append((str(r.attempt), r.job_id, str(r.restart), str(r.cycle), r.nodes, _clock(r.start), dur, r.state,
                      r.exit_code, r.ended, r.decision, r.steps, "-" if r.resumed_from is None else
                      str(r.resumed_from), str(r.recomputed)))
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
    parts = [f"{name.replace('_', ' ')} {_dur(v)} ({100 * v / acc.allocated:.1f}%)" if acc.allocated else
             f"{name} {_dur(v)}" for name, v in acc.badput.items()]
    lines.append("badput:  " + ", ".join(parts))
    lines.append(f"queue wait (not allocated): {_dur(acc.queue_wait)}")
    lines.append(f"final: {report.final}")
    return "\n".join(lines)

