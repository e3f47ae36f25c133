"""``<run_dir>/stop_reason.json``: how a trainer process ended, for the job-level logic after it.

Keys: ``reason`` ("finished", "signal", "duration", "straggler", "rerun:16", "rerun:17"), ``step``,
``exit_code`` (the code the process exits with), ``finished``; ``checkpoint_step`` (the newest complete
checkpoint: where the next attempt resumes; null when there is none), ``lost_steps`` (steps of this attempt
the next one must redo), ``checkpoint_at_stop`` for a graceful stop ("pending" while the checkpoint at the
stop is being written, "saved", "already saved", "not needed", "not saved", "failed") and ``signal`` (name,
when received, during what, how many times) when the exit signal came.

Written with plain ``os`` calls (atomic replace, fsynced), so it is also safe from a signal handler, where
Python's buffered files may be in the middle of a write; and without torch, so it works during setup.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from megatron_resilience.records.names import METRICS_FILE, STOP_REASON_FILE


def write_stop_reason(run_dir: str, record: dict[str, Any]) -> str:
    """Atomically replace ``<run_dir>/stop_reason.json`` with ``record``; returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, STOP_REASON_FILE)
    tmp = f"{path}.tmp.{os.getpid()}.{time.monotonic_ns()}"  # unique: the signal handler may interrupt a write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def append_metrics_record(run_dir: str, kind: str, fields: dict[str, Any]) -> None:
    """One JSON line in ``<run_dir>/metrics.jsonl`` with a single ``write`` (for use before the logger exists)."""
    os.makedirs(run_dir, exist_ok=True)
    line = json.dumps({"kind": kind, **fields, "time": time.time()}) + "\n"
    fd = os.open(os.path.join(run_dir, METRICS_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
