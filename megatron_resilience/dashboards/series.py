"""What TensorBoard and W&B show: ``metrics.jsonl`` records turned into points on one step axis.

Scalar names are Megatron-LM's, so existing dashboards and habits carry over:

=========================================  ==================================================================
``lm loss``, ``learning-rate``,             every ``train`` record (``loss-scale`` with fp16 only)
``grad-norm``, ``iteration-time`` (s),
``throughput/tokens-per-sec``,
``throughput`` (TFLOP/s per GPU),
``loss-scale``, ``consumed-samples``
``lm loss validation``                      every ``eval`` record
``checkpoint/save-seconds``                 each durable save: the time training was blocked (``blocking_s``)
``checkpoint/load-seconds``                 the first new step of a resumed (re)start: its checkpoint load
``resilience/in-job-restarts``,             running totals since the run began (``start`` records' ``totals``,
``resilience/inprocess-restarts``,          see ``runtime/run_history.py``), on every ``train`` point, so
``resilience/requeues``,                    each draws a staircase that steps up where training went on after
``resilience/recomputed-steps``,            the event
``resilience/preemption-stops``,
``resilience/rerun-exits``
``resilience/restart-resumed-from``,        once per (re)start, at its first new step: the checkpoint step it
``resilience/restart-recomputed``           resumed from and the steps it had to run again
``resilience/events`` (text)                the same, in words, with the cause where known
``straggler/<score>/rank-<r>``,             each straggler report (``straggler`` records): every rank's score,
``straggler/<score>/min``,                  the worst, and how many ranks were below the thresholds
``straggler/stragglers``
=========================================  ==================================================================

``throughput`` is Megatron-LM's tag and figure (model TFLOP/s per GPU, :mod:`.flops`): written when the sink
knows the model's shape (the trainer's does) and the attempt's ``start`` record its ``world_size``.

One step axis across attempts: a (re)start resumes from a checkpoint at or before the highest step logged
so far (``last_logged_step`` of its ``start`` record); the steps it runs again are already on the chart, so
their points are left out (they are in ``metrics.jsonl``, and the ``recomputed`` counts say how many). No
step is ever written twice for a tag, so curves never go back (TensorBoard draws overwritten steps as
zig-zags; W&B drops a step below its current one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_resilience.dashboards.flops import tflops_per_gpu

TRAIN_SCALARS = (("lm loss", "loss"), ("learning-rate", "lr"), ("grad-norm", "grad_norm"),
                 ("iteration-time", "step_time_s"), ("throughput/tokens-per-sec", "tokens_per_s"),
                 ("loss-scale", "loss_scale"), ("consumed-samples", "consumed_samples"))
TOTAL_TAGS = {"in_job_restarts": "resilience/in-job-restarts", "inprocess_restarts": "resilience/inprocess-restarts",
              "requeues": "resilience/requeues", "recomputed_steps": "resilience/recomputed-steps",
              "preemption_stops": "resilience/preemption-stops", "rerun_exits": "resilience/rerun-exits"}
EVENT_TEXT_TAG = "resilience/events"
_RESTART_WORDS = {"in_job_restart": "in-job restart (worker group restarted)",
                  "inprocess_restart": "in-process restart", "requeue": "requeue"}


@dataclass(frozen=True)
class Point:
    tag: str
    value: float | str  # a str is a text entry (TensorBoard's text tab, a W&B string)
    step: int


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def describe_start(record: dict[str, Any], cause: str | None = None) -> str:
    """``requeue (slurm restart 1, job 42): resumed from checkpoint step 10; steps 11-12 recomputed; ...``"""
    attempt = record.get("attempt") or {}
    kind = record.get("restart", "first")
    where = (f"slurm restart {attempt.get('slurm_restart', 0)}, in-job restart {attempt.get('in_job_restart', 0)}"
             + (f", job {attempt['job_id']}" if attempt.get("job_id") else ""))
    resumed = record.get("resumed_from")
    words = [f"resumed from checkpoint step {resumed}" if resumed is not None else "no checkpoint: from step 0"]
    high, step = record.get("last_logged_step"), int(record.get("step") or 0)
    if isinstance(high, int) and high > step:
        words.append(f"step {high} recomputed" if high == step + 1 else f"steps {step + 1}-{high} recomputed")
    if cause:
        words.append(f"cause: {cause}")
    return f"{_RESTART_WORDS.get(kind, kind)} ({where}): " + "; ".join(words)


class Series:
    """Stateful: feed it every record in file order (:meth:`points`); it returns what to draw."""

    def __init__(self, *, flops_per_token: float | None = None) -> None:
        self.flops_per_token = flops_per_token  # the model's (flops.flops_per_token); None: no `throughput` tag
        self.world_size: int | None = None  # the current attempt's, from its `start` record
        self.resume_high = -1  # steps <= this were on the chart before this attempt started
        self.last_step: dict[str, int] = {}  # per tag, within this process: never a step twice
        self.totals: dict[str, int] = {}
        self.pending: list[tuple[str, float | str]] = []  # for the first new step of this attempt

    def _emit(self, out: list[Point], tag: str, value: float | str | None, step: int) -> None:
        if value is None or step <= self.resume_high or step <= self.last_step.get(tag, -1):
            return
        self.last_step[tag] = step
        out.append(Point(tag, value, step))

    def points(self, record: dict[str, Any]) -> list[Point]:
        kind, out = record.get("kind"), []
        step = record.get("step")
        if kind == "start":
            self._start(record)
        elif kind == "train" and isinstance(step, int):
            for tag, key in TRAIN_SCALARS:
                self._emit(out, tag, _number(record.get(key)), step)
            tokens_per_s = _number(record.get("tokens_per_s"))
            if self.flops_per_token and self.world_size and tokens_per_s is not None:
                self._emit(out, "throughput", tflops_per_gpu(self.flops_per_token, tokens_per_s, self.world_size),
                           step)
            if out:  # a new step: the running totals, and what this (re)start was
                for name, tag in TOTAL_TAGS.items():
                    self._emit(out, tag, float(self.totals.get(name, 0)), step)
                for tag, value in self.pending:
                    self._emit(out, tag, value, step)
                self.pending = []
        elif kind == "eval" and isinstance(step, int):
            self._emit(out, "lm loss validation", _number(record.get("eval_loss")), step)
        elif kind == "checkpoint" and isinstance(step, int):
            self._emit(out, "checkpoint/save-seconds", _number(record.get("blocking_s")), step)
        elif kind == "straggler" and isinstance(step, int):
            for score, by_rank in sorted((record.get("scores") or {}).items()):
                values = {int(r): v for r, s in by_rank.items() if (v := _number(s)) is not None}
                for rank, value in sorted(values.items()):
                    self._emit(out, f"straggler/{score}/rank-{rank}", value, step)
                if values:
                    self._emit(out, f"straggler/{score}/min", min(values.values()), step)
            self._emit(out, "straggler/stragglers", float(len(record.get("stragglers") or [])), step)
        elif kind == "inprocess_restart":
            restored = record.get("restored_from") or {}
            text = (f"in-process restart {record.get('iteration')}: cause: {record.get('cause', 'unknown')}; "
                    f"restored from the {restored.get('tier', '?')} checkpoint of step {restored.get('step', '?')}")
            self.pending.append((EVENT_TEXT_TAG + "/inprocess", text))
        return out

    def _start(self, record: dict[str, Any]) -> None:
        world_size = record.get("world_size")
        self.world_size = world_size if isinstance(world_size, int) and world_size > 0 else None
        high = record.get("last_logged_step")
        self.resume_high = max(self.resume_high, high if isinstance(high, int) else -1)
        self.totals = dict(record.get("totals") or {})
        if record.get("restart", "first") == "first" and not record.get("resumed"):
            return
        load = (record.get("setup") or {}).get("marks") or {}
        pending: list[tuple[str, float | str]] = []
        if record.get("resumed") and "checkpoint_load" in load and "data" in load:
            pending.append(("checkpoint/load-seconds", float(load["checkpoint_load"]) - float(load["data"])))
        if record.get("restart", "first") != "first":
            step = int(record.get("step") or 0)
            pending.append(("resilience/restart-resumed-from", float(step)))
            pending.append(("resilience/restart-recomputed",
                            float(max(0, (high if isinstance(high, int) else step) - step))))
        pending.append((EVENT_TEXT_TAG, describe_start(record, record.get("cause"))))
        # a second (re)start before any new step replaces the first one's entries (a tag gets one point per step)
        self.pending = [p for p in self.pending if p[0] not in {tag for tag, _ in pending}] + pending
