"""Tiling a time window with spans: fixed items by priority, then step compute poured into the free time.

The accounting (:mod:`.accounting`) paints each attempt's allocation with what the trainer's records place
exactly (saves, evaluation, setup phases, the phases of a fault), then pours each logged window of steps into
the free time before its record, and calls whatever is left ``other``: every instant is in exactly one span.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

PRODUCTIVE = "productive"
QUEUE = "queue_wait"  # between two attempts: reported beside the allocation, never in it


@dataclass
class Span:
    start: float
    end: float
    bucket: str
    attempt: int | None = None  # None: queue wait between attempts
    cycle: int | None = None
    interruption: int | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


def paint(start: float, end: float, items: list[tuple]) -> list[Span]:
    """Tile [start, end] with the highest-priority item covering each instant; gaps get bucket None.

    ``items``: (begin, finish, priority, bucket, cycle, interruption).
    """
    clipped = [(max(start, a), min(end, b), p, bucket, cyc, intr) for a, b, p, bucket, cyc, intr in items
               if min(end, b) > max(start, a)]
    points = sorted({start, end} | {x for it in clipped for x in it[:2]})
    by_begin: dict[float, list[int]] = {}
    for k, it in enumerate(clipped):
        by_begin.setdefault(it[0], []).append(k)
    heap: list[tuple[int, int]] = []
    spans: list[Span] = []
    for a, b in zip(points, points[1:]):
        for k in by_begin.get(a, ()):
            heapq.heappush(heap, (-clipped[k][2], k))
        while heap and clipped[heap[0][1]][1] <= a:
            heapq.heappop(heap)
        top = clipped[heap[0][1]] if heap else None
        bucket, cyc, intr = (top[3], top[4], top[5]) if top else (None, None, None)
        if spans and spans[-1].bucket == bucket and spans[-1].cycle == cyc and spans[-1].interruption == intr \
                and spans[-1].end == a:
            spans[-1].end = b
        else:
            spans.append(Span(a, b, bucket, cycle=cyc, interruption=intr))
    return spans


def pour(spans: list[Span], segments: list[tuple[float, float, float, float, int]]) -> list[Span]:
    """Fill each segment's compute (productive, then wasted) into its free time, backwards from its end.

    ``segments``: (begin, end, productive seconds, wasted seconds, cycle), in time order, disjoint.
    """
    out: list[Span] = []
    queue = list(spans)
    i = 0
    for a, b, productive, wasted, cyc in segments:
        while i < len(queue) and queue[i].end <= a:
            out.append(queue[i])
            i += 1
        inside: list[Span] = []
        while i < len(queue) and queue[i].start < b:
            s = queue[i]
            if s.start < a:
                out.append(Span(s.start, a, s.bucket, cycle=s.cycle, interruption=s.interruption))
                s = Span(a, s.end, s.bucket, cycle=s.cycle, interruption=s.interruption)
            if s.end > b:
                inside.append(Span(s.start, b, s.bucket, cycle=s.cycle, interruption=s.interruption))
                queue[i] = Span(b, s.end, s.bucket, cycle=s.cycle, interruption=s.interruption)
                break
            inside.append(s)
            i += 1
        amounts = [[PRODUCTIVE, productive], ["wasted_progress", wasted]]
        filled: list[Span] = []
        for s in reversed(inside):
            if s.bucket is not None:
                filled.append(s)
                continue
            right = s.end
            for entry in amounts:
                take = min(entry[1], right - s.start)
                if take > 0:
                    filled.append(Span(right - take, right, entry[0], cycle=cyc))
                    right -= take
                    entry[1] -= take
            if right > s.start:
                filled.append(Span(s.start, right, None, cycle=s.cycle))
        out.extend(reversed(filled))
    out.extend(queue[i:])
    return out
