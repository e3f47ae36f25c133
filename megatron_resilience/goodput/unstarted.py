"""In-job cycles the trainer never saw: the launcher restarted the workers, and a fault killed them in their setup,
before the trainer's ``start`` record (the ledger's ``trainer_started: false``, ``jobs/attempt_end.py``).

On a dense fault stream (chaos on the allocation clock) a fault comes due during a restart as often as during
training. Such a cycle ended in a restart of its own: the accounting (:mod:`.accounting`) gives it its own
interruption, charged from its fault, instead of counting its fault as absorbed by the failure before it; and the
trainer's cycles keep the ledger's numbers, so each is paired with its own ending.
"""

from __future__ import annotations

from typing import Any


def cycle_numbers(count: int, unstarted: list[dict[str, Any]]) -> list[int]:
    """The in-job cycle number of each of the trainer's ``count`` cycles: its place among the attempt's cycles,
    the unstarted ones counted."""
    skip = {int(u["cycle"]) for u in unstarted}
    return [n for n in range(count + len(skip)) if n not in skip][:count]


def setup_faults(setups: list[dict[str, Any]], found: list[dict[str, Any]], limit: float) -> list[tuple]:
    """(cycle, the faults injected into it, its fault's time, when the launcher noticed it) of each unstarted cycle
    in ``setups`` (in order), given the faults ``found`` in the restart they interrupted (which ends at ``limit``).
    Its workers left no sign of life: it broke at the first fault injected after it began, else at its start (the
    launcher's rendezvous)."""
    out = []
    for k, u in enumerate(setups):
        begin, end = float(u["start"]), float(setups[k + 1]["start"]) if k + 1 < len(setups) else None
        mine = [i for i in found if begin <= float(i["time"]) and (end is None or float(i["time"]) < end)]
        at = min(float(mine[0]["time"]) if mine else begin, limit)
        noticed = u.get("noticed")
        seen = float(noticed) if isinstance(noticed, (int, float)) else at
        out.append((u, mine, at, min(max(seen, at), limit)))
    return out
