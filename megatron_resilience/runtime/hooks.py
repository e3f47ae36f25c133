"""The points in the training loop where resilience integrations act.

The loop (``runtime/loop.py``) calls these; ``megatron_resilience.resilience``
implements them (fault-tolerance sections, simulated faults, preemption,
stragglers). The base class does nothing, so the loop runs without them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

from megatron_resilience.runtime.state import TrainState


class TrainingHooks:
    def setup_section(self) -> AbstractContextManager:
        """Around distributed/model/optimizer/data setup and the checkpoint load."""
        return nullcontext()

    def after_setup(self, state: TrainState) -> None:
        """Setup is done and ``state.step`` is the step training resumes from."""

    def stop_requested(self, state: TrainState) -> str | None:
        """Before the first step, on every rank: a stop reason agreed already (a signal during setup), or None."""
        return None

    def step_section(self, step: int) -> AbstractContextManager:
        """Around one training iteration (``step`` = the 1-based step being run)."""
        return nullcontext()

    def wrap_train_step(self, train_step: Callable[[], Any]) -> Callable[[], Any]:
        """Lets straggler detection time the step; returns a callable with the same result."""
        return train_step

    def dataloader_worker_init(self, worker_id: int) -> None:
        """Runs in each data-loader worker process (``data.num_workers > 0``), e.g. to install a signal handler."""

    def eval_section(self) -> AbstractContextManager:
        """Around one evaluation pass."""
        return nullcontext()

    def checkpoint_section(self) -> AbstractContextManager:
        """Around a checkpoint save (and async finalisation)."""
        return nullcontext()

    def after_step(self, state: TrainState) -> str | None:
        """Called on every rank after each step; returns a stop reason agreed by all ranks, or None.

        A reason makes the loop save a checkpoint and stop: "signal", "straggler", "duration".
        """
        return None

    def signal_before_save(self, state: TrainState) -> str | None:
        """Called on every rank right before a periodic save; a stop reason agreed by all ranks, or None.

        A signal that came during the step must not wait behind a save that may outlast the grace period:
        the loop stops at once instead, and the stop's own save (after the stop is recorded) covers the step.
        """
        return None

    def take_records(self) -> list[tuple[str, dict]]:
        """After each step: metrics.jsonl records (kind, fields) the hooks produced since last time, e.g. a
        straggler report on rank 0."""
        return []

    def stop_record(self) -> tuple[str, dict] | None:
        """After a stop was agreed: a metrics.jsonl record about it (kind, fields), e.g. the signal; or None."""
        return None

    def record_stop(self, state: TrainState, reason: str, *, checkpoint_step: int | None,
                    checkpoint_at_stop: str) -> None:
        """A graceful stop is under way: say so durably before the checkpoint at the stop is saved."""

    def on_failure(self, err: BaseException) -> None:
        """This process leaves with ``err`` (it exits 1; not called under in-process restart, which trains again)."""

    def on_exit(self, state: TrainState, reason: str, *, checkpoint_step: int | None = None,
                checkpoint_at_stop: str | None = None) -> None:
        """Training is over for this process: reason is "finished" (max_steps) or the stop reason.

        Also "duration" (``train.exit_duration_in_mins``) and "rerun:16" / "rerun:17" when Megatron-Core's
        rerun state machine ends the run (the process then exits with that code). ``checkpoint_step`` is the
        newest complete checkpoint (where a next attempt resumes); ``checkpoint_at_stop`` says whether the
        checkpoint at a graceful stop was "saved", "already saved" or "failed".
        """
