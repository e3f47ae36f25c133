"""The root cause is the first failure in time: a peer's timeout or lost connection after another rank failed follows
from it, whatever its type.

A rank that raises a bug (``ValueError``) and exits leaves the others waiting in their next collective; minutes
later their watchdog reports ``Watchdog caught collective operation timeout`` and aborts. Ranked by type alone
(``taxonomy.ERROR_TYPES``: a collective timeout outranks an exception) the attempt reads as a transient NCCL
timeout and the bug is restarted in a loop. The launcher's first-failure line settles this when there is one
(``root_cause``); when there is none — Slurm's per-task lines, a launcher that died, a log that was cut — the
order of the lines does:

- two lines are ordered by their time stamps when both carry one (torch's glog ``[E1128 10:02:11.123456 ...]``,
  Python logging's ``2026-11-28 10:02:11,123``, ISO, syslog ``Nov 28 10:02:11``), else by their place in the same
  log (signals of one file come in line order; one merged ``srun`` output is in arrival order), else not at all;
- a peer symptom (``root_cause.PEER_SYMPTOMS``: collective timeout, NCCL error, lost connection, distributed
  timeout) of one rank that comes strictly after a failure of its own of *another* rank (an exception, an OOM, a
  hardware line) is a consequence and no longer decides;
- lines with no order between them keep the type order. The mirror case — a watchdog timeout first, then an
  exception raised while the process tears down — keeps the timeout: nothing of another kind came before it.
"""

from __future__ import annotations

import re
import time

from megatron_resilience.jobs.monitors import Signal
from megatron_resilience.jobs.root_cause import PEER_SYMPTOMS, rank_of

MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
                                      "Dec"), start=1)}
# (month, day, hour, minute, second, fraction) of each format; a year is dropped (glog and syslog have none)
_STAMPS = (
    re.compile(r"\b\d{4}-(?P<mo>\d{2})-(?P<d>\d{2})[ T](?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:[.,](?P<f>\d+))?"),
    re.compile(r"\[[EWIF](?P<mo>\d{2})(?P<d>\d{2}) (?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:\.(?P<f>\d+))?"),
    re.compile(r"\b(?P<mon>" + "|".join(MONTHS) + r") {1,2}(?P<d>\d{1,2}) (?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})"
               r"(?:\.(?P<f>\d+))?"),
)


def stamp(line: str) -> tuple[int, int, float] | None:
    """(month, day, seconds into the day) of the first time stamp in ``line``, else None."""
    for pattern in _STAMPS:
        m = pattern.search(line)
        if m:
            month = MONTHS[m["mon"]] if m.groupdict().get("mon") else int(m["mo"])
            seconds = int(m["h"]) * 3600 + int(m["mi"]) * 60 + int(m["s"]) + float(f"0.{m['f'] or 0}")
            return month, int(m["d"]), seconds
    return None


def local_stamp(epoch: float) -> tuple[int, int, float]:
    """(month, day, seconds into the day) of ``epoch`` in this machine's local time, as ``stamp`` reads a line that
    a process on this node logged at that moment."""
    t = time.localtime(epoch)
    return t.tm_mon, t.tm_mday, t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + epoch % 1


def before(a: Signal, b: Signal, position: dict[int, int]) -> bool:
    """Whether ``a`` certainly happened before ``b``: by time stamps when both have one, else by place in the same
    log (``position``: each signal's index in scan order, which is line order within one source)."""
    ta, tb = stamp(a.line), stamp(b.line)
    if ta is not None and tb is not None:
        return ta < tb
    return a.source == b.source and a.source.startswith("log:") and position[id(a)] < position[id(b)]


def later_symptoms(failures: list[Signal]) -> list[Signal]:
    """The peer symptoms among ``failures`` (fatal and error signals, in scan order) that follow another rank's
    own failure."""
    position = {id(s): i for i, s in enumerate(failures)}
    symptom_lines = {s.line for s in failures if s.error_type in PEER_SYMPTOMS}
    causes = [c for c in failures if c.error_type not in PEER_SYMPTOMS and c.line not in symptom_lines]
    out = []
    for s in failures:
        if s.error_type not in PEER_SYMPTOMS:
            continue
        rank = rank_of(s)
        if any(before(c, s, position) and (rank is None or rank_of(c) is None or rank_of(c) != rank)
               for c in causes):
            out.append(s)
    return out
