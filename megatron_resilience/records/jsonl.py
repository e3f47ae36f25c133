"""Reading the run's JSON-lines files (metrics, ledgers) and JSON files, tolerant of what a killed writer leaves.

Writers append whole lines (``O_APPEND``, one ``write`` each), but a process killed mid-write on a filesystem
without that guarantee can leave a torn last line, and a reader on the login node may read while the trainer
writes. So a line that is not a JSON object is skipped, and a missing file reads as empty: a report, a decision or a
restart never fails on a record it cannot read.
"""

from __future__ import annotations

import json
import os
from typing import Any


def read_jsonl(path: str | None, kind: str | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file in file order (of ``kind`` only, when given); [] without a file."""
    if not path or not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and (kind is None or rec.get("kind") == kind):
                out.append(rec)
    return out


def read_json(path: str | None) -> dict[str, Any] | None:
    """A JSON object file (``stop_reason.json``); None when it is missing, unreadable or not an object."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
