"""Gather what is known about one Slurm attempt from the files it left: logs, metrics, cycle info, stop reason.

Logs: the job step's log of this attempt (``log-*_<job>_<restart>.out``, nemo_run's srun ``--output``),
ft_launcher's per-cycle application logs when the installed release writes them, and the batch
script's log (``sbatch_*_<job>.out``, appended across attempts with ``--open-mode=append``) from the
byte offset where this attempt began — read with the always-on Slurm monitors only (it also holds
the script's own echo). Only the last ``max_log_bytes`` of a file are read; a partial first line
(the cut, or the end of an earlier attempt killed mid-line) and a last line without its newline (a
process killed mid-write) are dropped, so a truncated line never matches.

In-job restart cycles come from ft_launcher's cycle-info files (nvidia-resiliency-ext >= 0.7:
``cycle_info.<job>.<attempt>.<cycle>`` JSON) when present, else from the launcher's
``restart_count=N`` lines (``launcher_log.py``), and the trainer's ``start`` records in ``metrics.jsonl``
(whose ``attempt``/``resumed_from`` fields are used when present, tolerated when absent); the restart
count pairs the two (``attempts._pairs``).
"""

from __future__ import annotations

import calendar
import glob
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.monitors import Monitor, Signal, scan
from megatron_resilience.records.checkpoint_layout import read_tracker
from megatron_resilience.records.jsonl import read_json, read_jsonl  # noqa: F401 (read_json: read from here too)
from megatron_resilience.records.launcher_log import (  # noqa: F401 (LAUNCHER_PREFIX, split_cycles: read from here)
    LAUNCHER_PREFIX,
    LauncherCycle,
    launcher_cycles,
    split_cycles,
    stamp_time,
)

CYCLE_TAG = re.compile(r"\[Cycle (\d+)\]")  # ft_launcher's rank monitor names the cycle (nvidia-resiliency-ext 0.7)


@dataclass
class LogText:
    path: str
    lines: list[str]
    truncated: bool = False  # only the tail was read


def read_tail(path: str, *, offset: int = 0, max_bytes: int) -> LogText:
    """Complete lines of ``path`` from ``offset`` (at most the last ``max_bytes``)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            start = max(offset, size - max_bytes)
            if start > 0:
                f.seek(start - 1)
                cut_mid_line = f.read(1) != b"\n"
            else:
                cut_mid_line = False
            data = f.read()
    except OSError:
        return LogText(path, [])
    lines = data.decode("utf-8", errors="replace").split("\n")
    if cut_mid_line and lines:
        lines = lines[1:]
    if lines and not data.endswith(b"\n"):
        lines = lines[:-1]  # the writer was killed mid-line (or is still writing it): not a whole line
    return LogText(path, [line.rstrip("\r") for line in lines if line.strip()], truncated=start > offset)


def step_logs(job_dir: str, job_id: str, restart: int) -> list[str]:
    return sorted(glob.glob(os.path.join(job_dir, f"log-*_{job_id}_{restart}.out")))


def batch_logs(job_dir: str, job_id: str) -> list[str]:
    return sorted(glob.glob(os.path.join(job_dir, f"sbatch_*_{job_id}.out")))


def cycle_infos(cycle_info_dir: str | None, job_id: str, restart: int) -> list[dict[str, Any]]:
    """ft_launcher's cycle-info records of this attempt, by cycle number (nvidia-resiliency-ext >= 0.7)."""
    if not cycle_info_dir or not os.path.isdir(cycle_info_dir):
        return []
    out = []
    for path in glob.glob(os.path.join(cycle_info_dir, f"cycle_info.{job_id}.{restart}.*")):
        if path.endswith(".current"):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        info["_file"] = path
        out.append(info)
    return sorted(out, key=lambda i: int(i.get("cycle_number") or 0))


@dataclass
class AttemptFiles:
    """The logs of one attempt, cut into in-job cycles, and the signals the monitors found in each."""

    cycles: list[list[Signal]] = field(default_factory=list)  # signals per cycle (job step + cycle logs)
    launcher: list[LauncherCycle] = field(default_factory=list)  # per cycle: restart count, start, failure noticed
    batch_signals: list[Signal] = field(default_factory=list)  # from the batch script's log (Slurm monitors)
    files: list[str] = field(default_factory=list)
    cycle_info: list[dict[str, Any]] = field(default_factory=list)

    def last_cycle_signals(self) -> list[Signal]:
        return (self.cycles[-1] if self.cycles else []) + self.batch_signals


def scan_attempt(*, job_dir: str, job_id: str, restart: int, monitors: list[Monitor], batch_offset: int = 0,
                 cycle_info_dir: str | None = None, max_log_bytes: int = 8 << 20) -> AttemptFiles:
    out = AttemptFiles(cycle_info=cycle_infos(cycle_info_dir, job_id, restart))
    cycle_logs = [i.get("cycle_log_file") for i in out.cycle_info if i.get("cycle_log_file")]
    if cycle_logs and all(os.path.exists(p) for p in cycle_logs):
        texts = [read_tail(p, max_bytes=max_log_bytes) for p in cycle_logs]
        step_text = [read_tail(p, max_bytes=max_log_bytes) for p in step_logs(job_dir, job_id, restart)]
        launcher = [(f"log:{t.path}", line) for t in step_text for line in t.lines]
        out.launcher = [LauncherCycle(int(i.get("cycle_number") or 0), iso_time(i.get("cycle_start_time")),
                                      iso_time(i.get("cycle_end_time"))) for i in out.cycle_info]
        own = _launcher_lines_by_cycle(launcher, out.launcher)  # the launcher's lines (timeouts it saw, failures)
        out.cycles = [scan(mine, monitors) + scan([(f"log:{t.path}", line) for line in t.lines], monitors)
                      for mine, t in zip(own, texts)]
        out.files = [t.path for t in step_text + texts]
    else:
        lines: list[tuple[str, str]] = []
        for path in step_logs(job_dir, job_id, restart):
            text = read_tail(path, max_bytes=max_log_bytes)
            out.files.append(path)
            lines += [(f"log:{path}", line) for line in text.lines]
        out.launcher = launcher_cycles([line for _, line in lines])
        sources = iter(source for source, _ in lines)
        out.cycles = [scan([(next(sources), line) for line in cycle.lines], monitors) for cycle in out.launcher]
    slurm_monitors = [m for m in monitors if m.reads_batch_log]
    for path in batch_logs(job_dir, job_id):
        text = read_tail(path, offset=batch_offset, max_bytes=max_log_bytes)
        out.files.append(path)
        out.batch_signals += scan([(f"log:{path}", line) for line in text.lines], slurm_monitors)
    return out


def _launcher_lines_by_cycle(lines: list[tuple[str, str]], cycles: list[LauncherCycle]) \
        -> list[list[tuple[str, str]]]:
    """The job step's launcher lines of each per-cycle log's cycle: the cycle a line names (the rank monitor's
    ``[Cycle N]``), else the one running at its stamp (an unstamped line follows the line before it); without the
    cycles' start times, the last cycle (the one the attempt ended in)."""
    out: list[list[tuple[str, str]]] = [[] for _ in cycles]
    if not cycles:
        return out
    by_number = {c.count: k for k, c in enumerate(cycles)}
    timed = all(c.started is not None for c in cycles)
    current = 0 if timed else len(cycles) - 1
    for source, line in lines:
        when = stamp_time(line) if timed else None
        if when is not None:
            current = max([k for k, c in enumerate(cycles) if c.started <= when], default=0)
        named = CYCLE_TAG.search(line)
        out[by_number.get(int(named.group(1)), current) if named else current].append((source, line))
    return out


def iso_time(text: str | None) -> float | None:
    """The epoch time of a cycle-info file's UTC time (``2026-11-23T05:13:23Z``), None when absent or unreadable."""
    try:
        return calendar.timegm(time.strptime(str(text), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None


# --- the trainer's files ---------------------------------------------------------------------------------------


def read_metrics(path: str | None) -> list[dict[str, Any]]:
    return read_jsonl(path)


def attempt_records(records: list[dict[str, Any]], *, job_id: str, restart: int, since: float | None,
                    until: float | None = None) -> list[dict[str, Any]]:
    """The metrics records written during one Slurm attempt.

    ``start`` records name their attempt (``attempt.job_id``/``slurm_restart``) when the trainer writes
    those fields; otherwise (and for the other kinds) the attempt's time window decides.
    """
    out = []
    current = False
    for rec in records:
        t = rec.get("time")
        in_window = t is not None and (since is None or t >= since) and (until is None or t <= until)
        if rec.get("kind") == "start":
            attempt = rec.get("attempt") if isinstance(rec.get("attempt"), dict) else None
            if attempt and attempt.get("job_id") is not None:
                current = (str(attempt.get("job_id")) == str(job_id)
                           and int(attempt.get("slurm_restart") or 0) == int(restart))
            else:
                current = in_window
        if current and (in_window or since is None):
            out.append(rec)
    return out


def progress(all_records: list[dict[str, Any]], mine: list[dict[str, Any]], checkpoint_dir: str | None) -> dict:
    """Steps and checkpoints of an attempt: last step, resumed from, checkpoint reached, recomputed, cycles."""
    cycles = []
    max_before: dict[int, int] = {}
    best = 0
    for i, rec in enumerate(all_records):
        if rec.get("kind") == "start":
            max_before[i] = best
        if rec.get("kind") == "train" and isinstance(rec.get("step"), int):
            best = max(best, rec["step"])
    index = {id(r): i for i, r in enumerate(all_records)}
    for rec in mine:
        if rec.get("kind") != "start":
            continue
        start = rec.get("resumed_from", rec.get("step"))
        before = max_before.get(index.get(id(rec), -1), 0)
        attempt = rec.get("attempt") if isinstance(rec.get("attempt"), dict) else {}
        cycles.append({"start_time": rec.get("time"), "resumed_from": start,
                       "in_job_restart": attempt.get("in_job_restart"),
                       "recomputed_steps": max(0, before - (start or 0))})
    steps = [r["step"] for r in mine if r.get("kind") == "train" and isinstance(r.get("step"), int)]
    saved = [r["step"] for r in all_records if r.get("kind") == "checkpoint" and isinstance(r.get("step"), int)
             and (not mine or r.get("time", 0) <= max(x.get("time", 0) for x in mine))]
    checkpoint = read_tracker(checkpoint_dir)
    if checkpoint is None and saved:
        checkpoint = max(saved)
    for k, cycle in enumerate(cycles):
        nxt = cycles[k + 1]["start_time"] if k + 1 < len(cycles) else None
        cyc_steps = [r["step"] for r in mine if r.get("kind") == "train" and isinstance(r.get("step"), int)
                     and r.get("time", 0) >= (cycle["start_time"] or 0) and (nxt is None or r.get("time", 0) < nxt)]
        cycle["last_step"] = max(cyc_steps) if cyc_steps else None
    signals = [r for r in mine if r.get("kind") == "signal"]
    return {"last_step": max(steps) if steps else None,
            "resumed_from": cycles[0]["resumed_from"] if cycles else None,
            "checkpoint_step": checkpoint,
            "recomputed_steps": sum(c["recomputed_steps"] for c in cycles),
            "cycles": cycles, "signals": signals}


def metrics_signals(mine: list[dict[str, Any]]) -> list[Signal]:
    """The trainer's ``signal`` records (a preemption signal arrived) as signals for the classifier."""
    out = []
    for rec in mine:
        if rec.get("kind") == "signal":
            name = str(rec.get("signal") or rec.get("name") or "")
            out.append(Signal(monitor="trainer_signal_record", error_type="preempted", subsystem="scheduler",
                              severity="fatal", line=json.dumps(rec)[:300], source="metrics",
                              fields={"signal": name, "step": str(rec.get("step"))}))
    return out


def batch_signal(name: str | None) -> list[Signal]:
    """The signal the batch shell received while the job step ran, as a preemption signal (none: [])."""
    if not name:
        return []
    signal = name if name.startswith("SIG") else f"SIG{name}"
    return [Signal(monitor="batch_shell_signal", error_type="preempted", subsystem="scheduler", severity="fatal",
                   line=f"the batch shell received {signal} while the job step ran (the scheduler stopped the job: "
                        "preemption, scancel --signal --full)", source="batch", fields={"signal": signal})]


# What Slurm's accounting says of a job step that the logs may not (taxonomy.STEP_STATE_TYPES): slurmstepd's cgroup
# OOM-kill and a node lost under the step. ``sacct`` records the step's state as soon as the step ends, while the job
# still reads RUNNING (the batch script decides then).
STEP_STATE_TYPES = taxonomy.STEP_STATE_TYPES


def step_state_signals(steps: list[dict[str, Any]], *, since: float | None) -> list[Signal]:
    """The attempt's job steps (``slurm.sacct_steps``, started at or after ``since``, the attempt's start) that Slurm
    ended OUT_OF_MEMORY or NODE_FAIL, as fatal signals. A step on one node names it (``failed_node`` for a lost
    node; an OOM is the job's memory, not the node's fault, and names none)."""
    out = []
    for step in steps:
        state = step.get("State", "").split()[0] if step.get("State") else ""
        if state not in STEP_STATE_TYPES:
            continue
        start = step.get("start_time")
        if since is not None and start is not None and start < float(since) - 5:
            continue  # an earlier run of the job (sacct -D lists them all)
        error_type, subsystem = STEP_STATE_TYPES[state]
        nodes = step.get("NodeList", "")
        single = nodes and "," not in nodes and "[" not in nodes
        fields = {"step": step.get("JobID", ""), "state": state}
        if error_type == "node_fail" and single:
            fields["failed_node"] = nodes
        out.append(Signal(monitor="slurm_step_state", error_type=error_type, subsystem=subsystem, severity="fatal",
                          line=f"sacct: step {step.get('JobID')} {state} on {nodes or '?'} (exit code "
                               f"{step.get('ExitCode', '?')})", source="slurm", fields=fields))
    return out
