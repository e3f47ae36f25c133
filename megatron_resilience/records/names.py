"""The names of the files a run and its job leave on disk, and the checkpoint folder's layout.

``<run_dir>/``: ``metrics.jsonl`` (rank 0's records: ``start``, ``train``, ``checkpoint``, ``eval``, ``end``, ...),
``stop_reason.json`` (why the trainer stopped, its exit code), ``job_ledger.jsonl`` (the chain of Slurm
attempts), ``chaos_ledger.jsonl`` (faults a chaos stream injected). A checkpoint folder holds ``iter_NNNNNNN/``
(at least seven digits, Megatron-LM's layout) and the tracker ``latest_checkpointed_iteration.txt`` naming the newest
complete one.
"""

from __future__ import annotations

import os
import re

METRICS_FILE = "metrics.jsonl"
STOP_REASON_FILE = "stop_reason.json"
LEDGER_FILE = "job_ledger.jsonl"
CHAOS_LEDGER_FILE = "chaos_ledger.jsonl"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter_(\d{7,})$")  # seven digits, more past step 9,999,999


def iter_dir_name(step: int) -> str:
    """The folder of the checkpoint saved after ``step`` (``iter_0000500``)."""
    return f"iter_{step:07d}"


def step_of_iter_dir(name: str) -> int | None:
    """``iter_0000500`` -> 500; None for any other name."""
    match = ITER_DIR.match(os.path.basename(name.rstrip("/")))
    return int(match.group(1)) if match else None


def tracker_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, TRACKER_FILE)
