"""Synthetic trainer records with known seconds per phase, for the goodput accounting and optimum tests.

Record kinds as the trainer writes them (``runtime/metrics.py``); times are offsets from ``T0``.
"""

from __future__ import annotations

import json

import pytest

from megatron_resilience.goodput.accounting import QUEUE

T0 = 1_800_000_000.0


def start(t, *, step=0, resumed_from=None, process_start=None, marks=None, launcher_start=None, job_id=None,
          restart=0, in_job=0, inprocess=None, world_size=1):
    attempt = {"slurm_restart": restart, "in_job_restart": in_job, "job_id": job_id}
    if inprocess is not None:
        attempt["inprocess_restart"] = inprocess
    setup = {"process_start": None if process_start is None else T0 + process_start,
             "marks": {k: T0 + v for k, v in (marks or {}).items()}}
    if launcher_start is not None:
        setup["launcher_start"] = T0 + launcher_start
    return {"kind": "start", "step": step, "resumed": resumed_from is not None, "resumed_from": resumed_from,
            "attempt": attempt, "world_size": world_size, "tp": 1, "pp": 1, "dp": world_size, "setup": setup,
            "time": T0 + t}


def steps(first, last, *, at, every, step_time):
    """Train records of steps first..last, the first at ``at``, then every ``every`` s (log_interval 1)."""
    return [{"kind": "train", "step": s, "loss": 1.0 / s, "step_time_s": step_time, "tokens_per_s": 1000.0,
             "time": T0 + at + every * (s - first)} for s in range(first, last + 1)]


def save(step, begin, blocking, reason="interval"):
    return {"kind": "checkpoint", "step": step, "reason": reason, "async": False, "start_time": T0 + begin,
            "blocking_s": blocking, "durable_time": T0 + begin + blocking, "time": T0 + begin + blocking}


def buckets(acc) -> dict[str, float]:
    """The non-empty buckets (epoch floats near 1.8e9 carry ~1e-7 s of rounding)."""
    return {k: v for k, v in acc.badput.items() if v > 1e-5}


def approx(expected: dict[str, float]):
    return pytest.approx(expected, abs=1e-5)


def assert_tiles(acc) -> None:
    """The spans tile the allocation: no gap, no overlap, and they sum to it."""
    allocated = sorted((s for s in acc.spans if s.bucket != QUEUE), key=lambda s: s.start)
    for a, b in zip(allocated, allocated[1:]):
        assert b.start >= a.end - 1e-9, (a, b)
    assert sum(s.seconds for s in allocated) == pytest.approx(acc.allocated, abs=1e-6)
    assert acc.productive + sum(acc.badput.values()) == pytest.approx(acc.allocated, abs=1e-6)


# One attempt of 60 s: setup, 6 steps with a save and an eval, a hang injected at 31 s that the launcher notices at
# 36 s, a new process at 38 s that resumes from step 4 and re-runs 5-6, then 7-10 and a final save.
HANG_RUN = [
    start(17, process_start=2, launcher_start=0, marks={"entered": 4, "imports": 10, "distributed": 11, "model": 12,
                                                         "optimizer": 13, "data": 15, "checkpoint_load": 16}),
    *steps(1, 4, at=19, every=2, step_time=1.5),
    save(4, 25.0, 0.4),
    *steps(5, 6, at=27, every=2, step_time=1.5),
    {"kind": "eval", "step": 6, "eval_loss": 2.0, "duration_s": 0.8, "time": T0 + 30.0},
    start(46, step=4, resumed_from=4, process_start=38, in_job=1,
          marks={"entered": 39, "imports": 42, "distributed": 43, "model": 43.5, "optimizer": 44, "data": 44.5,
                 "checkpoint_load": 45.5}),
    *steps(5, 10, at=48, every=2, step_time=1.5),
    save(10, 58.1, 0.3, reason="finished"),
    {"kind": "end", "step": 10, "reason": "finished", "exit_code": 0, "time": T0 + 58.5},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
