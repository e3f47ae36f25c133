"""``checkpoint.interval_policy=young_daly``: the trainer chooses its own save interval, Daly's optimum.

At every restart (after the checkpoint load) and after every save, rank 0 recomputes:

- C: the median blocking time of the run's periodic saves (this process's and the run's earlier ones,
  from ``metrics.jsonl``);
- the wall seconds per step between saves (this process's own measure once it has one, else the run's);
- M: allocated time / interruptions (failures and preemptions) from the run's records and ``job_ledger.jsonl``
  once the run has seen 3, ``checkpoint.expected_mtbf_hours`` before that
  (:func:`megatron_resilience.goodput.history.mtbf`);
- tau = Daly's interval for (C, M), within bounds: at least 2 C (never more than a third of the time in
  saves) and one step, at most M (save at least once per expected failure) and ``train.max_steps``.

The interval in steps is broadcast from rank 0 (one collective per decision, none per step), so every
rank saves the same step; the next save is due that many steps after the last one (or after the step
resumed from). Each change is logged on rank 0 with C, M and the interval, and written as a
``checkpoint_interval`` record. What is saved and how it is resumed do not change.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from typing import Any

from megatron_resilience.config import CheckpointConfig
from megatron_resilience.goodput import daly, history
from megatron_resilience.records.names import LEDGER_FILE, METRICS_FILE
from megatron_resilience.runtime import collectives

log = logging.getLogger(__name__)

KEEP = 20  # recent measurements per quantity


class AdaptiveInterval:
    """Rank 0 decides the interval in steps at restarts and after saves; every rank asks :meth:`due` each step."""

    def __init__(self, config: CheckpointConfig, *, run_dir: str, max_steps: int | None) -> None:
        self.run_dir = run_dir
        self.max_steps = max_steps
        self.estimate_s = float(config.expected_mtbf_hours) * 3600.0
        self.steps = int(config.save_interval)  # the first interval, until a save has been measured
        self.last_save_step = 0
        self._saves: list[float] = []  # this process's periodic save stalls
        self._per_step: list[float] = []  # this process's wall seconds per step between saves
        self._mark: tuple[int, float] | None = None  # (step, monotonic time) of the last decision
        self._events: list[dict[str, Any]] = []

    # --- every step -------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if self._mark is None:
            self._mark = (step - 1, time.monotonic())
        return step > 0 and step - self.last_save_step >= self.steps

    # --- decisions (collective) -------------------------------------------------------------------------------
    def after_restart(self, step: int) -> None:
        self.last_save_step = step
        self._decide(step, "restart")
        self._mark = None

    def after_save(self, step: int, blocking_s: float | None, *, periodic: bool) -> None:
        now = time.monotonic()
        if collectives.rank() == 0 and self._mark is not None and step > self._mark[0]:
            seconds = now - self._mark[1] - (blocking_s or 0.0)
            if seconds > 0:
                self._per_step = (self._per_step + [seconds / (step - self._mark[0])])[-KEEP:]
        if periodic and blocking_s is not None:
            self._saves = (self._saves + [float(blocking_s)])[-KEEP:]
        self.last_save_step = step
        self._decide(step, "save")
        self._mark = (step, time.monotonic())

    def take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    # --- rank 0 -------------------------------------------------------------------------------------------------
    def _decide(self, step: int, why: str) -> None:
        choice = self._choose(step, why) if collectives.rank() == 0 else None
        choice = collectives.broadcast_object(choice)
        if choice is None:
            return
        previous, self.steps = self.steps, int(choice["interval_steps"])
        if collectives.rank() == 0:
            self._events.append(choice)
            if self.steps != previous or why == "restart":
                log.info("checkpoint interval: %d steps (was %d) at step %d after a %s: tau %.2f s = Daly's "
                         "optimum for C %.3f s, M %.0f s (%s) at %.3f s/step", self.steps, previous, step, why,
                         choice["tau_s"], choice["c_s"], choice["m_s"], choice["m_source"], choice["step_s"])

    def _choose(self, step: int, why: str) -> dict[str, Any] | None:
        records = history.read_jsonl(os.path.join(self.run_dir, METRICS_FILE))
        ledger = history.read_jsonl(os.path.join(self.run_dir, LEDGER_FILE))
        saves = self._saves or history.periodic_save_seconds(records)[-KEEP:]
        per_step = self._per_step or [s / n for s, n in history.between_saves(records)][-KEEP:]
        if not per_step:
            per_step = [float(r["step_time_s"]) for r in records
                        if r.get("kind") == "train" and isinstance(r.get("step_time_s"), (int, float))][-KEEP:]
        if not saves or not per_step:
            return None  # nothing measured yet: keep the first interval
        c, step_s = statistics.median(saves), statistics.median(per_step)
        found = history.mtbf(records, ledger, estimate_s=self.estimate_s, now=time.time(),
                             new_cycle=why == "restart")
        m, source, failures = found.seconds, found.source, found.interruptions
        if m is None or c <= 0 or step_s <= 0:
            return None
        tau = daly.daly_interval(c, m)
        tau = min(max(tau, 2.0 * c), m)
        steps = max(1, int(round(tau / step_s)))
        if self.max_steps:
            steps = min(steps, self.max_steps)
        if not math.isfinite(tau):
            return None
        return {"step": step, "after": why, "policy": "young_daly", "interval_steps": steps, "tau_s": tau,
                "c_s": c, "m_s": m, "m_source": source, "failures": failures, "step_s": step_s,
                "expected_mtbf_s": self.estimate_s}
