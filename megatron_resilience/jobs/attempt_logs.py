"""Each attempt's own log lines, for ``report --logs`` (nemo_run's ``exp.logs()`` shows only the first attempt's).

A job step's log (``log-*_<job>_<restart>.out``) belongs to one attempt. The batch script's log
(``sbatch_*_<job>.out``) is appended to by every requeue of the job (``--open-mode=append``): an attempt's
part runs from the byte offset its ``attempt_start`` ledger record noted to the offset the job's next
attempt noted (or the end of the file), so each heading shows that attempt's lines, not the last one's.
"""

from __future__ import annotations

import os
import re
from typing import Any

from megatron_resilience.records.ledger import Ledger

BATCH_LOG = re.compile(r"sbatch_.*_(\d+)\.out$")


def _offsets(ledger: Ledger) -> dict[tuple[str, int], int]:
    return {(str(s.get("job_id")), int(s.get("slurm_restart") or 0)): int(s.get("batch_log_offset") or 0)
            for s in ledger.records("attempt_start")}


def _span(path: str, job_id: str, restart: int, offsets: dict[tuple[str, int], int]) -> tuple[int, int | None]:
    """(first byte, end byte or None = end of file) of this attempt's part of ``path``."""
    if not BATCH_LOG.search(os.path.basename(path)):
        return 0, None
    start = offsets.get((job_id, restart), 0)
    later = sorted(o for (job, r), o in offsets.items() if job == job_id and r > restart and o >= start)
    return start, (later[0] if later else None)


def read_part(path: str, start: int, end: int | None) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
    except OSError as err:
        return [f"<unreadable: {err}>"]
    return data.decode("utf-8", errors="replace").splitlines()


def attempt_logs(run_dir: str, rows: list[Any], *, tail_lines: int = 40) -> str:
    """The tail of every attempt's own part of each of its log files, under a heading per attempt and file."""
    offsets = _offsets(Ledger.in_run_dir(run_dir))
    out = []
    for r in rows:
        for path in r.log_files:
            start, end = _span(path, r.job_id, r.restart, offsets)
            lines = read_part(path, start, end)
            part = "" if (start, end) == (0, None) else f" bytes {start}-{'end' if end is None else end}"
            out.append(f"==> attempt {r.attempt} (job {r.job_id}, restart {r.restart}): {path}{part} "
                       f"[last {min(tail_lines, len(lines))} of {len(lines)} lines] <==")
            out += lines[-tail_lines:]
    return "\n".join(out)
