"""What an accounting of allocated time holds: the buckets every non-productive second goes to, one allocation's
window, one interruption and its cost, and the totals. A new bucket is a name in ``BUCKETS`` (and, for a restart
kind, a row of ``RESTART_BUCKET``); :mod:`.accounting` fills these, :mod:`.charging` charges each interruption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_resilience.goodput.spans import Span

BUCKETS = ("startup", "data_loading", "checkpoint_restore", "checkpoint_save", "wasted_progress",
           "failure_detection", "restart_inprocess", "restart_process", "restart_job", "eval", "other")
RESTART_BUCKET = {"inprocess": "restart_inprocess", "process": "restart_process", "job": "restart_job",
                  "preemption": "restart_job"}
PLANNED = ("preempted", "system_cancel")  # attempt endings that are interruptions but not failures
# setup marks (runtime/setup_timeline.py): the phase that ENDS at the mark; any other mark is startup
MARK_BUCKETS = {"data": "data_loading", "checkpoint_load": "checkpoint_restore"}


@dataclass
class AttemptWindow:
    """One allocation: a Slurm attempt (Start -> End) or a local run (launcher start -> last record)."""

    index: int
    start: float
    end: float
    job_id: str = "local"
    restart: int = 0
    ending: str = "finished"  # the error type that ended the attempt (its last cycle)
    failure: bool = False  # the ending is a failure (classification mode set)
    running: bool = False
    cycle_endings: dict[int, str] = field(default_factory=dict)  # in-job cycle k (not the last) -> error type
    # in-job cycles whose workers died in their setup, before the trainer's start record (the ledger's
    # ``trainer_started: false``): {"cycle": k, "start": the launcher's rendezvous, "noticed": time, "cause": type}
    unstarted: list[dict[str, Any]] = field(default_factory=list)
    detections: list[float] = field(default_factory=list)  # when the launcher logged noticing a failure
    nodes: list[str] = field(default_factory=list)
    decision: dict[str, Any] = field(default_factory=dict)  # the job-level decision after it (ledger)


@dataclass
class Interruption:
    index: int
    attempt: int
    cycle: int
    kind: str  # inprocess | process | job | preemption
    cause: str  # classified error type
    fault_time: float
    fault_source: str  # injected | trainer | signal | last sign of life
    last_alive: float
    detected: float
    restarted: float | None = None  # the next cycle's first training step began (Daly's R ends here)
    resumed: float | None = None  # the first new productive step began (the cost ends here)
    cost: dict[str, float] = field(default_factory=dict)  # allocated seconds by bucket
    queue_wait: float = 0.0
    restart_seconds: float | None = None  # allocated seconds fault -> restarted (R)
    injection: dict[str, Any] | None = None  # the injected fault its classification names
    absorbed: list[dict[str, Any]] = field(default_factory=list)  # faults injected before it was noticed

    @property
    def total(self) -> float:
        return sum(self.cost.values())


@dataclass
class Accounting:
    allocated: float = 0.0
    productive: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: {b: 0.0 for b in BUCKETS})
    queue_wait: float = 0.0
    spans: list[Span] = field(default_factory=list)
    interruptions: list[Interruption] = field(default_factory=list)
    by_cause: dict[str, dict[str, float]] = field(default_factory=dict)  # cause -> bucket -> seconds

    @property
    def goodput(self) -> float:
        return self.productive / self.allocated if self.allocated > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"allocated": self.allocated, "productive": self.productive, "goodput": self.goodput,
                "badput": dict(self.badput), "queue_wait": self.queue_wait, "by_cause": self.by_cause,
                "interruptions": [{**vars(i), "total": i.total} for i in self.interruptions]}
