"""Wall-clock marks of a process's setup, from its creation to its first step, for ``metrics.jsonl``.

A restart costs detection + process start + imports + distributed init + model + data + checkpoint
load + the first step; each has its own remedy, so each is recorded. Every ``start`` record (one per
(re)start, rank 0) carries ``setup`` = {``process_start``: the process's creation (from ``/proc``),
``launcher_start``: the creation of its launcher (torchrun/ft_launcher, the parent of a worker; absent
without one), ``marks``: {name: wall time (``time.time()``)} in order; each mark ends the phase it names}.
benchmarks/recovery.py turns them into the split; the report counts a local run's allocation from the
launcher's start (goodput/accounting.py).
"""

from __future__ import annotations

import os
import time


def process_start_time(pid: int | None = None) -> float | None:
    """Wall time at which process ``pid`` (default: this one) was created; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            boot = time.time() - float(f.read().split()[0])  # /proc/stat's btime is whole seconds only
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime in ticks
    except (OSError, ValueError, IndexError):
        return None


def launcher_start_time(env: dict[str, str] | None = None) -> float | None:
    """When this worker's launcher started: its parent, when torchrun/ft_launcher (torchelastic) started it."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    return process_start_time(os.getppid())


class SetupTimeline:
    """Ordered ``name -> wall time`` marks; ``record()`` is the ``setup`` record's fields."""

    def __init__(self) -> None:
        self.process_start = process_start_time()
        self.launcher_start = launcher_start_time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def record(self) -> dict:
        out = {"process_start": self.process_start, "marks": dict(self.marks)}
        if self.launcher_start is not None:
            out["launcher_start"] = self.launcher_start
        return out
