"""Training metrics: a readable line on rank 0 and ``<run_dir>/metrics.jsonl`` for tools and plots.

Every JSON line has a ``kind``:

- ``"train"``: ``step, loss, lr, grad_norm, step_time_s, tokens_per_s, consumed_samples, time``;
- ``"eval"``: ``step, eval_loss, time``;
- ``"start"``: ``step`` (the step training resumes from), ``consumed_samples``, ``resumed``,
  ``world_size``, ``tp``, ``pp``, ``dp``: one per (re)start;
- ``"checkpoint"``: ``step``, ``reason`` ("interval", "finished", a stop reason, ...), ``seconds``;
- ``"end"``: ``step``, ``reason`` (as passed to ``hooks.on_exit``), ``exit_code``;
- other kinds written through :meth:`MetricsLogger.event`.

Floats are written with ``repr`` precision (``json`` round-trips them exactly), so
bitwise resume tests can compare losses. The file is appended to: a resumed or
restarted run continues it, and a step re-run after a restart appears again
(:func:`read_metrics` keeps the last record per step).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("megatron_resilience.metrics")

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Writes only on the process that owns the log (``enabled``, i.e. global rank 0)."""

    def __init__(self, run_dir: str, *, enabled: bool, max_steps: int) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._file = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (``start``, ``checkpoint``, ...); JSON-able values only."""
        self._write({"kind": kind, **fields, "time": time.time()})

    def train(self, *, step: int, loss: float, lr: float, grad_norm: float | None, step_time_s: float,
              tokens_per_s: float, consumed_samples: int, **extra: Any) -> None:
        if not self.enabled:
            return
        grad = "n/a" if grad_norm is None else f"{grad_norm:.4f}"
        log.info("step %d/%d | loss %.4f | lr %.3e | grad_norm %s | step_time %.1f ms | tokens/s %.0f",
                 step, self.max_steps, loss, lr, grad, step_time_s * 1e3, tokens_per_s)
        self._write({
            "kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s, "consumed_samples": consumed_samples,
            **extra, "time": time.time(),
        })

    def eval(self, *, step: int, eval_loss: float) -> None:
        if not self.enabled:
            return
        log.info("eval at step %d | eval_loss %.4f", step, eval_loss)
        self._write({"kind": "eval", "step": step, "eval_loss": eval_loss, "time": time.time()})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(run_dir: str, kind: str | None = "train", *, last_per_step: bool = True) -> list[dict[str, Any]]:
    """Records of ``kind`` (None: all) from ``<run_dir>/metrics.jsonl``, in file order.

    With ``last_per_step`` (and a kind), a step logged twice (re-run after a
    restart) keeps its last record, and the result is sorted by step.
    """
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if kind is None:
        return records
    records = [r for r in records if r.get("kind") == kind]
    if last_per_step and records and all("step" in r for r in records):
        by_step = {r["step"]: r for r in records}
        records = [by_step[s] for s in sorted(by_step)]
    return records
