"""The accounting's last pass: each interruption's cost, every non-productive second from its fault (or the last sign
of life before it) to the first new productive step after it, stopped where the next interruption's begins.

:mod:`.accounting` paints each allocation with spans (the fault's own phases already carry their interruption);
this pass tags the rest of the recovery (the next cycle's setup, the queue between attempts) with the interruption
it belongs to, and sums each one's cost by bucket and its restart time (Daly's R: fault -> the next cycle's first
step).
"""

from __future__ import annotations

from megatron_resilience.goodput.buckets import Accounting
from megatron_resilience.goodput.spans import PRODUCTIVE, QUEUE, Span


def charge(acc: Accounting) -> None:
    """Tag every non-productive second from each fault to the first new productive step after it."""
    spans = acc.spans
    firsts = [s for s in spans if s.bucket in (PRODUCTIVE, "wasted_progress") and s.cycle is not None]
    for k, intr in enumerate(acc.interruptions):
        begin = min(intr.fault_time, intr.last_alive)
        same = (intr.attempt, intr.cycle)
        after = [s for s in firsts if (s.attempt, s.cycle) > same and s.start >= intr.detected]
        intr.restarted = after[0].start if after else None
        new = [s for s in after if s.bucket == PRODUCTIVE]
        intr.resumed = new[0].start if new else None
        end = intr.resumed if intr.resumed is not None else max(s.end for s in spans)
        if k + 1 < len(acc.interruptions):
            nxt = acc.interruptions[k + 1]
            end = min(end, min(nxt.fault_time, nxt.last_alive))
        out: list[Span] = []
        for s in spans:
            if s.bucket == PRODUCTIVE or s.end <= begin or s.start >= end or \
                    (s.interruption is not None and s.interruption != k):
                out.append(s)
                continue
            for a, b, mine in ((s.start, max(s.start, begin), False), (max(s.start, begin), min(s.end, end), True),
                               (min(s.end, end), s.end, False)):
                if b > a:
                    out.append(Span(a, b, s.bucket, s.attempt, s.cycle, k if mine else s.interruption))
        spans = out
    acc.spans = spans
    for intr in acc.interruptions:
        mine = [s for s in spans if s.interruption == intr.index]
        for s in mine:
            if s.bucket == QUEUE:
                intr.queue_wait += s.seconds
            else:
                intr.cost[s.bucket] = intr.cost.get(s.bucket, 0.0) + s.seconds
        if intr.restarted is not None:
            intr.restart_seconds = sum(min(s.end, intr.restarted) - max(s.start, intr.fault_time) for s in spans
                                       if s.bucket != QUEUE and s.end > intr.fault_time and s.start < intr.restarted)
