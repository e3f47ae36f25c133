"""Training metrics: a readable line on rank 0 and ``<run_dir>/metrics.jsonl`` for tools and plots.

Every JSON line has a ``kind``:

- ``"train"``: ``step, loss, lr, grad_norm, step_time_s, tokens_per_s, consumed_samples, time``;
- ``"eval"``: ``step, eval_loss, duration_s`` (the evaluation's wall time), ``time``;
- ``"start"``: ``step`` (the step training resumes from), ``consumed_samples``, ``resumed``,
  ``resumed_from`` (checkpoint step or null), ``resumed_tier`` ("memory", "local", "persistent" or null),
  ``attempt`` (``slurm_restart``, ``in_job_restart``, ``inprocess_restart`` (0 on a process's first
  call of the training function), ``job_id``), ``last_logged_step`` (the highest step logged before this
  start, or null), ``restart``, ``totals`` and, for a requeue the job-level classifier explained, ``cause``
  (``runtime/run_history.py``), ``versions`` (torch, megatron-core, nvidia-resiliency-ext, nemo-run),
  ``world_size``, ``tp``, ``pp``, ``dp``, ``dashboards`` (where TensorBoard / W&B files go), ``setup``
  (wall-clock marks, runtime/setup_timeline.py): one per (re)start, in-process restarts included;
- ``"inprocess_restart"``: one per in-process restart, written by rank 0 once the restarted training
  function has restored its state (just before its ``start`` record): ``iteration`` (k >= 1, the
  ``start`` record's ``attempt.inprocess_restart``), ``fault_time`` (epoch seconds when the first rank raised,
  or null: no rank raised, e.g. a stall), ``detected_time`` (the first rank's wrapper began to abort),
  ``cause`` (short: "exception on rank 1", "soft_timeout on ranks 0,1"), ``began_time`` (the restarted
  function began), ``restored_from``
  (``{"tier": "memory" | "local" | "persistent" | null, "step": N | null}``);
- ``"checkpoint"``: one per save, written when it became durable (committed): ``step``, ``reason``
  ("interval", "finished", a stop reason, ...), ``tier`` ("persistent", or "local" for the node-local
  tier), ``async``, ``start_time`` (requested), ``blocking_s`` (training held up), ``durable_time``,
  ``lag_s`` (request to durable), ``bytes``, ``first_in_process``, ``path``;
- ``"signal"``: the exit signal stopped the run: ``signal``, ``received_time`` and ``received_during``
  (rank 0's), ``first_received_time`` (any rank), ``count``, ``step``, ``before_training``;
- ``"checkpoint_interval"`` (``checkpoint.interval_policy=young_daly``): each interval the trainer chose:
  ``step``, ``after`` ("restart" or "save"), ``interval_steps``, ``tau_s``, ``c_s``, ``m_s``, ``m_source``,
  ``failures``, ``step_s``, ``expected_mtbf_s``;
- ``"end"``: ``step``, ``reason`` (as passed to ``hooks.on_exit``), ``exit_code``;
- ``"straggler"``: a straggler report: ``step``, ``scores`` ({score name: {rank: score}}), ``stragglers``
  (ranks below the thresholds);
- ``"retry"``: a call tried again on an error it waits out (``what``: ``wandb.init`` while the run id is still
  in use by the previous process's W&B service; ``why``, ``time``): none on a quiet run;
- other kinds written through :meth:`MetricsLogger.event`.

Floats are written with ``repr`` precision (``json`` round-trips them exactly), so
bitwise resume tests can compare losses. The file is appended to: a resumed or
restarted run continues it, and a step re-run after a restart appears again
(:func:`read_metrics` keeps the last record per step).

The same writer feeds the run's TensorBoard event files and W&B run (``sinks``, see
``megatron_resilience/dashboards/``): every record goes to them right after its line is written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Mapping, Sequence

from megatron_resilience.records.jsonl import read_jsonl
from megatron_resilience.records.names import METRICS_FILE
from megatron_resilience.runtime.run_history import _since_last_start, highest_logged_step, history_fields

log = logging.getLogger("megatron_resilience.metrics")



INPROCESS_RESTART_ENV = "MEGATRON_RESILIENCE_INPROCESS_RESTART"  # set per call by resilience/inprocess.py


def attempt_info(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Which attempt this process is: Slurm requeues (``SLURM_RESTART_COUNT``), in-job restarts by
    torchrun/ft_launcher (``TORCHELASTIC_RESTART_COUNT``), in-process restarts (the wrapper's iteration: 0 on
    the first call) and the Slurm job id."""
    env = os.environ if env is None else env
    return {"slurm_restart": int(env.get("SLURM_RESTART_COUNT") or 0),
            "in_job_restart": int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
            "inprocess_restart": int(env.get(INPROCESS_RESTART_ENV) or 0),
            "job_id": env.get("SLURM_JOB_ID") or None}


def describe_attempt(attempt: Mapping[str, Any]) -> str:
    job = f" of job {attempt['job_id']}" if attempt.get("job_id") else ""
    inprocess = f", in-process restart {attempt['inprocess_restart']}" if attempt.get("inprocess_restart") else ""
    return f"in-job restart {attempt['in_job_restart']}{inprocess}, requeue {attempt['slurm_restart']}{job}"


def describe_resume(step: int, resumed: bool, last_logged_step: int | None) -> str:
    """What a (re)start lost: the steps logged before it that come after the point it starts from."""
    where = f"checkpoint at step {step}" if resumed else "no checkpoint"
    if last_logged_step is None:
        return f"{where}; nothing logged before"
    if last_logged_step <= step:
        return f"{where}; nothing lost (last logged step {last_logged_step})"
    lost = last_logged_step - step
    return (f"{where}; lost: steps {step + 1}-{last_logged_step} logged before this start "
            f"({lost} step{'s' if lost != 1 else ''}, recomputed now)")


def last_logged_step(run_dir: str) -> int | None:
    """The highest step logged in ``<run_dir>/metrics.jsonl`` (read from the end, back to the last start), or None."""
    return highest_logged_step(*_since_last_start(os.path.join(run_dir, METRICS_FILE)))


def format_duration(seconds: float) -> str:
    """``3725`` -> ``'1h02m'``, ``185`` -> ``'3m05s'``, ``12.3`` -> ``'12s'``."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class MetricsLogger:
    """Writes only on the process that owns the log (``enabled``, i.e. global rank 0)."""

    def __init__(self, run_dir: str, *, enabled: bool, max_steps: int, sinks: Sequence[Any] = ()) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self.sinks = list(sinks) if enabled else []  # dashboards: write(record), close()
        self.max_steps = max_steps
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._file = None
        self._last: tuple[int, float] | None = None  # (step, wall time) of the previous progress line
        self._seconds_per_step: float | None = None  # all-in (eval, checkpoints included), smoothed
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.write(record)

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (``start``, ``checkpoint``, ...); JSON-able values only.

        A ``start`` record gets the run's history so far (``runtime/run_history.py``) from the file's tail."""
        if kind == "start" and self._file is not None:
            fields = {**fields, **history_fields(self.path, step=int(fields.get("step") or 0),
                                                 attempt=fields.get("attempt") or attempt_info(),
                                                 ledger_dir=self.run_dir)}
        self._write({"kind": kind, **fields, "time": time.time()})

    def train(self, *, step: int, loss: float, lr: float, grad_norm: float | None, step_time_s: float,
              tokens_per_s: float, consumed_samples: int, **extra: Any) -> None:
        if not self.enabled:
            return
        grad = "n/a" if grad_norm is None else f"{grad_norm:.4f}"
        log.info("step %d/%d | loss %.4f | lr %.3e | grad_norm %s | step_time %.1f ms | tokens/s %.0f | ETA %s",
                 step, self.max_steps, loss, lr, grad, step_time_s * 1e3, tokens_per_s,
                 format_duration(self._eta(step, step_time_s)))
        self._write({
            "kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s, "consumed_samples": consumed_samples,
            **extra, "time": time.time(),
        })

    def _eta(self, step: int, step_time_s: float) -> float:
        """Seconds to max_steps at the wall-clock rate between progress lines (eval and saves included)."""
        now = time.monotonic()
        if self._last is not None and step > self._last[0]:
            rate = (now - self._last[1]) / (step - self._last[0])
            self._seconds_per_step = rate if self._seconds_per_step is None else \
                0.7 * self._seconds_per_step + 0.3 * rate
        self._last = (step, now)
        return (self.max_steps - step) * (self._seconds_per_step or step_time_s)

    def eval(self, *, step: int, eval_loss: float, duration_s: float | None = None) -> None:
        if not self.enabled:
            return
        log.info("eval at step %d | eval_loss %.4f", step, eval_loss)
        self._write({"kind": "eval", "step": step, "eval_loss": eval_loss, "duration_s": duration_s,
                     "time": time.time()})

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(run_dir: str, kind: str | None = "train", *, last_per_step: bool = True) -> list[dict[str, Any]]:
    """Records of ``kind`` (None: all) from ``<run_dir>/metrics.jsonl``, in file order.

    With ``last_per_step`` (and a kind), a step logged twice (re-run after a
    restart) keeps its last record, and the result is sorted by step.
    """
    records = read_jsonl(os.path.join(run_dir, METRICS_FILE))  # a torn last line (rank 0 killed) is skipped
    if kind is None:
        return records
    records = [r for r in records if r.get("kind") == kind]
    if last_per_step and records and all("step" in r for r in records):
        by_step = {r["step"]: r for r in records}
        records = [by_step[s] for s in sorted(by_step)]
    return records
