"""What the accounting needs, read from a run directory: each attempt's allocation window, its ending, the
faults a chaos run injected, and when the launcher noticed a failure.

Allocation windows: Slurm's record (``sacct`` Start -> End of each run of the job: a requeue adds a
run) when this machine has Slurm, else the ledger's ``attempt_start`` time and the batch script's
record of the end (the watcher's record is only the time of its poll, up to a poll interval late).
A window covers the trainer records that name its attempt up to 1 s after Slurm's End (``sacct`` has whole
seconds); a rank still writing on a node Slurm declared failed writes outside the allocation, which is not
counted. A run without a ledger (local) is one window from its launcher's start (the ``start`` record's
``setup.launcher_start``, else the process's creation) to its last record.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from megatron_resilience.goodput.buckets import PLANNED, AttemptWindow
from megatron_resilience.jobs.evidence import read_metrics, read_tail
from megatron_resilience.jobs.slurm import parse_slurm_time
from megatron_resilience.records import megatron_log
from megatron_resilience.records.launcher_log import detection_time
from megatron_resilience.records.ledger import CHAOS_LEDGER_FILE, Ledger
from megatron_resilience.records.names import METRICS_FILE


def trainer_records(run_dir: str, ledger: Ledger | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(the trainer's records, the trainer logs they were read from): this package's trainer's ``metrics.jsonl``;
    a run without one (Megatron-LM's or Megatron-Bridge's own trainer) is read from its log lines
    (:mod:`megatron_resilience.records.megatron_log`): the attempts' step logs the ledger names, else the log files
    in the run folder (or ``run_dir`` itself, a log file)."""
    if os.path.isdir(run_dir):
        records = read_metrics(os.path.join(run_dir, METRICS_FILE))
        if records:
            return records, []
    named = [p for a in (ledger.attempts() if ledger else []) for p in a.get("log_files") or []
             if os.path.basename(p).startswith("log")]
    paths = [p for p in named if os.path.exists(p)] or megatron_log.log_files(run_dir)
    return megatron_log.records_from_logs(paths), paths


def slurm_runs(job_ids: set[str], names: dict[str, str] | None = None) -> dict[tuple[str, int], dict[str, Any]]:
    """(job, restart) -> Slurm's state, start and end of that run, when this machine has Slurm; {} otherwise.

    ``names``: the job name the ledger knows for a job id; a job of another name (the same id on another
    cluster: ``SLURM_CONF`` points elsewhere) is not this run's and is ignored."""
    from megatron_resilience.jobs.slurm import sacct_runs

    if not shutil.which("sacct"):
        return {}
    out = {}
    for job in job_ids:
        runs = sacct_runs(job)
        expected = (names or {}).get(job)
        if expected and runs and runs[0].get("JobName") not in (None, "", expected):
            continue
        for restart, run in enumerate(runs):
            out[(job, restart)] = {"state": run["State"].split()[0], "start": parse_slurm_time(run.get("Start")),
                                   "end": parse_slurm_time(run.get("End"))}
    return out


def detection_times(paths: list[str], *, max_bytes: int = 8 << 20) -> list[float]:
    """Times of the launcher's "noticed a failure" lines in these logs (lines with a ``[YYYY-mm-dd HH:MM:SS,ms]``
    stamp, local time: ``launcher_log.detection_time``)."""
    found = (detection_time(line) for path in paths for line in read_tail(path, max_bytes=max_bytes).lines)
    return sorted(t for t in found if t is not None)


def injections(run_dir: str, job_ids: set[str] | None = None) -> list[dict[str, Any]]:
    """The faults a chaos run injected into this run's jobs (``chaos_ledger.jsonl``), oldest first."""
    found = Ledger(os.path.join(run_dir, CHAOS_LEDGER_FILE)).records("injection")
    if job_ids is not None:
        found = [r for r in found if str(r.get("job_id")) in job_ids or r.get("job_id") is None]
    return sorted(found, key=lambda r: float(r.get("time") or 0))


def _last_record_by_attempt(records: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """The latest metrics record time of each Slurm attempt named by the trainer's ``start`` records."""
    out: dict[tuple[str, int], float] = {}
    key = None
    for rec in records:
        if rec.get("kind") == "start":
            attempt = rec.get("attempt") if isinstance(rec.get("attempt"), dict) else {}
            key = (str(attempt.get("job_id")), int(attempt.get("slurm_restart") or 0)) \
                if attempt.get("job_id") is not None else None
        if key is not None and rec.get("time") is not None:
            out[key] = max(out.get(key, 0.0), float(rec["time"]))
    return out


def ledger_windows(ledger: Ledger, records: list[dict[str, Any]], *, slurm_lookup: bool = True,
                   now: float | None = None) -> tuple[list[AttemptWindow], dict[tuple[str, int], dict[str, Any]]]:
    """One window per Slurm attempt of the chain (recorded, or still running), and Slurm's runs by attempt."""
    attempts = ledger.attempts()
    starts = {(str(s.get("job_id")), int(s.get("slurm_restart") or 0)): s for s in ledger.records("attempt_start")}
    recorded = {(str(a.get("job_id")), int(a.get("slurm_restart") or 0)) for a in attempts}
    names = {str(s.get("job_id")): str(s["job_name"]) for s in ledger.records("attempt_start") if s.get("job_name")}
    runs = slurm_runs({k[0] for k in starts} | {k[0] for k in recorded}, names) if slurm_lookup else {}
    last_record = _last_record_by_attempt(records)
    chain_ended = ledger.final() is not None
    now = time.time() if now is None else now
    windows = []
    live = [{"_running": not chain_ended, **s} for k, s in starts.items() if k not in recorded]
    for a in attempts + live:
        key = (str(a.get("job_id")), int(a.get("slurm_restart") or 0))
        run = runs.get(key) or {}
        begin = run.get("start") or a.get("start") or (starts.get(key) or {}).get("time")
        if begin is None:
            continue
        if run.get("end"):
            # Slurm's End has whole seconds: the trainer's last record may lie up to 1 s after it. Records later
            # than that (a rank still writing on a node Slurm declared failed) are outside the allocation.
            end = max(float(run["end"]), min(last_record.get(key, 0.0), float(run["end"]) + 1.0))
        else:
            end = now if a.get("_running") else (a.get("end") if a.get("end") is not None else a.get("time"))
            end = max(float(end or begin), last_record.get(key, 0.0))
        cls = a.get("classification") or {}
        cycles = a.get("cycles") or []
        windows.append(AttemptWindow(
            index=len(windows), start=float(begin), end=end, job_id=key[0], restart=key[1],
            ending=cls.get("error_type") or ("running" if a.get("_running") else "unknown"),
            failure=cls.get("mode") is not None, running=bool(a.get("_running")),
            cycle_endings={k: (c.get("ended") or {}).get("error_type") for k, c in enumerate(cycles)
                           if (c.get("ended") or {}).get("error_type")},
            unstarted=_unstarted(cycles),
            detections=detection_times([p for p in a.get("log_files") or [] if os.path.basename(p).startswith("log")]),
            nodes=list(a.get("nodes") or []) if isinstance(a.get("nodes"), list)
            else [n for n in str(a.get("nodes") or "").split(",") if n], decision=dict(a.get("decision") or {})))
    return windows, runs


def _unstarted(cycles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attempt's in-job cycles whose workers died in their setup and were restarted (the last cycle ended the
    attempt: its ending is the attempt's)."""
    return [{"cycle": k, "start": c.get("start_time"), "noticed": (c.get("ended") or {}).get("time"),
             "cause": (c.get("ended") or {}).get("error_type")}
            for k, c in enumerate(cycles[:-1]) if c.get("trainer_started") is False]


def local_window(records: list[dict[str, Any]]) -> AttemptWindow | None:
    """A run without a ledger: one window from the launcher's start to the last record."""
    timed = [r for r in records if r.get("time") is not None]
    if not timed:
        return None
    starts = [r for r in timed if r.get("kind") == "start"]
    begin = min(float(r["time"]) for r in timed)
    if starts:
        setup = starts[0].get("setup") if isinstance(starts[0].get("setup"), dict) else {}
        for key in ("launcher_start", "process_start"):
            if isinstance(setup.get(key), (int, float)):
                begin = min(begin, float(setup[key]))
                break
    end = max(float(r["time"]) for r in timed)
    ends = [r for r in timed if r.get("kind") == "end"]
    final = ends[-1] if ends and float(ends[-1]["time"]) >= end else None  # the run's last word was its end
    if final is None:
        ending, failure, running = "running", False, True
    elif final.get("reason") == "finished":
        ending, failure, running = "finished", False, False
    elif int(final.get("exit_code") or 0) == 0:
        ending, failure, running = PLANNED[0], False, False
    else:
        ending, failure, running = f"exit code {final.get('exit_code')}", True, False
    # a process restart ended every cycle but those an in-process restart ended (their record names the cause)
    endings = {k: "in_job_restart" for k, nxt in enumerate(starts[1:])
               if nxt.get("restart") != "inprocess_restart"}
    return AttemptWindow(index=0, start=begin, end=end, job_id="local", ending=ending, failure=failure,
                         running=running, cycle_endings=endings,
                         nodes=[os.uname()[1]])
