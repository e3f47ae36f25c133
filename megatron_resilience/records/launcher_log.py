"""The launcher's log cut into its restart cycles: each cycle's lines, its restart count, when it began and when the
launcher noticed its end.

torchrun and ft_launcher print the rendezvous' result, ``restart_count=N``, each time they (re)start the worker group
(ft_launcher 0.7 with torch's glog-style prefix on the line); their workers get the same N as
``TORCHELASTIC_RESTART_COUNT``, which the trainer writes in its ``start`` record (``attempt.in_job_restart``). The
count, not the position, pairs a launcher cycle with the trainer's: a fault that kills the workers during their setup
ends a launcher cycle the trainer never started.

A dying rank's last lines may follow the launcher's failure line (its tail of the rank's output is drained when it
stops the workers), but never the next ``restart_count`` mark: the launcher prints that only after the drain, so
the lines up to the next mark are the cycle's own.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

# torch's elastic agent logs the rendezvous' result; under nvidia-resiliency-ext 0.7 its lines carry torch's glog-style
# prefix (``I1129 05:54:51.830000 12131 .../agent/server/api.py:553]   restart_count=1``), before that none.
CYCLE_MARK = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\])?\s*restart_count=(\d+)\s*$")
LAUNCHER_PREFIX = re.compile(r"^(?:\d+: )?(?:\[default\d+\]:)?")
RANK_LINE = re.compile(r"^(?:\d+: )?\[default\d+\]:")  # a worker's line, as the launcher's --tee prints it
# Python logging's stamp at the start of a launcher line (local time), e.g. ``[2026-11-23 05:20:01,002]``.
STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[,.](\d+))?\]?")
# Lines a launcher or rank monitor writes when it notices a failure (ft_launcher, its rank monitor, torchelastic).
DETECTION = re.compile(r"has been open for [\d.]+ seconds|Did not get (?:initial|subsequent) heartbeat|"
                       r"failed \(exitcode: |Worker group FAILED|Terminating rank \d+|will restart worker group")


def stamp_time(line: str) -> float | None:
    """The epoch time of the line's leading logging stamp (read as local time, as the launcher wrote it)."""
    found = STAMP.match(LAUNCHER_PREFIX.sub("", line))
    if not found:
        return None
    try:
        base = time.mktime(time.strptime(found.group(1).replace("T", " "), "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return None
    frac = found.group(2) or "0"
    return base + int(frac) / 10 ** len(frac)


def detection_time(line: str) -> float | None:
    """When the launcher noticed a failure, if ``line`` is one of its stamped lines saying so."""
    return stamp_time(line) if DETECTION.search(LAUNCHER_PREFIX.sub("", line)) else None


@dataclass
class LauncherCycle:
    """One (re)start of the worker group."""

    count: int  # the launcher's restart count (the workers' TORCHELASTIC_RESTART_COUNT)
    started: float | None = None  # the rendezvous that started it (its launcher line's stamp)
    noticed: float | None = None  # the launcher's first line about its failure
    lines: list[str] = field(default_factory=list)


def launcher_cycles(lines: list[str]) -> list[LauncherCycle]:
    """The log cut where a ``restart_count=N`` starts a new cycle N. A multi-node job step's log holds every node's
    agent, each printing the same ``restart_count`` for the same round: only the first mark of a count starts its
    cycle (else one 2-node run reads as 2 cycles). A log with no mark is one cycle, count 0."""
    cycles = [LauncherCycle(0)]
    highest = None
    launcher_stamp = None  # the newest launcher line's stamp (the rendezvous' own line, at a mark)
    for line in lines:
        mark = CYCLE_MARK.match(LAUNCHER_PREFIX.sub("", line))
        if mark and (highest is None or int(mark.group(1)) > highest):
            if highest is not None:
                cycles.append(LauncherCycle(0))
            highest = int(mark.group(1))
            cycles[-1].count, cycles[-1].started = highest, launcher_stamp
        cycles[-1].lines.append(line)
        if not RANK_LINE.match(line):
            launcher_stamp = stamp_time(line) or launcher_stamp
            if cycles[-1].noticed is None:
                cycles[-1].noticed = detection_time(line)
    return cycles


def split_cycles(lines: list[str]) -> list[list[str]]:
    """The lines of each launcher cycle (:func:`launcher_cycles`)."""
    return [c.lines for c in launcher_cycles(lines)]
