"""Did a trainer that never touches the finished flag finish? Read the run's own evidence.

nemo_run's FT template (and so Megatron-Bridge's plugin, and the job-level decision) knows a run
finished only when the workload touched ``$FAULT_TOL_FINISHED_FLAG_FILE``. Our trainer and NeMo's
``FaultToleranceCallback(autoresume=True)`` do; Megatron-LM, Megatron-Bridge and a NeMo run without
that callback never do, so a finished run was requeued again and again. This module decides from
what those trainers leave behind, strongest evidence first:

1. the checkpoint tracker: Megatron's ``<save>/latest_checkpointed_iteration.txt`` (the same name in
   Megatron-LM, Megatron-Bridge and our trainer) at or past ``train_iters`` (``--train-iters``,
   ``train.train_iters``, ``trainer.max_steps``): the last checkpoint is the final one, nothing is
   left to train, whatever the exit code of a crash after it;
2. the trainer's end-of-training log line (Megatron-LM and Bridge: ``[after training is done]``,
   printed only when the loop reached its end, not on a signal, duration or interval exit; Lightning:
   ``Trainer.fit stopped: max_steps=N reached``) in this attempt's job-step log, with exit code 0.

Anything else (exit 0 without either: a trainer that saved and exited on a signal) is not finished.
The plugins put the checkpoint directory and ``train_iters`` into the job-level config at submit
time (``finished_evidence`` there); the batch script's EXIT trap calls :func:`detect` for each
attempt and, when finished, touches the finished flag so every later reader (nemo_run's template,
the fallback, the watcher) agrees.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from megatron_resilience.jobs import evidence as ev
from megatron_resilience.records.checkpoint_layout import read_tracker
from megatron_resilience.records.names import TRACKER_FILE

# The trainers' own last words when their loop ran to the end (not printed on a signal/duration exit).
END_OF_TRAINING = (
    ("Megatron-LM / Megatron-Bridge", re.compile(r"\[?after training is done\]?")),
    ("Lightning (NeMo 2.0)", re.compile(r"`?Trainer\.fit`? stopped: `?max_steps=\d+`? reached")),
)


@dataclass(frozen=True)
class Finished:
    """Why the run counts as finished, for the attempt record and the log."""

    source: str  # "checkpoint" | "log"
    reason: str
    step: int | None = None
    evidence: str = ""


def tracker_iteration(checkpoint_dir: str | None) -> int | None:
    """The iteration in Megatron's tracker file (``release`` and unreadable files: None)."""
    return read_tracker(checkpoint_dir)


def end_of_training_line(lines: list[str]) -> tuple[str, str] | None:
    """(trainer, line) of the last end-of-training line among ``lines``, or None."""
    for line in reversed(lines):
        for trainer, pattern in END_OF_TRAINING:
            if pattern.search(line):
                return trainer, line.strip()
    return None


def detect(*, checkpoint_dir: str | None, train_iters: int | None, exit_code: int | None,
           log_lines: list[str]) -> Finished | None:
    """The evidence that the run finished, or None (see the module docstring for the rules)."""
    step = tracker_iteration(checkpoint_dir)
    if step is not None and train_iters is not None and step >= train_iters:
        return Finished("checkpoint", f"checkpoint at iteration {step} of train_iters={train_iters} "
                        f"({os.path.join(checkpoint_dir or '', TRACKER_FILE)}); exit code {exit_code}", step=step,
                        evidence=f"{TRACKER_FILE}: {step}")
    if exit_code != 0:
        return None
    found = end_of_training_line(log_lines)
    if found is None:
        return None
    trainer, line = found
    return Finished("log", f"the job step exited 0 after the trainer's end-of-training line ({trainer})", step=step,
                    evidence=line[:300])


def detect_for_attempt(*, checkpoint_dir: str | None, train_iters: int | None, exit_code: int | None,
                       job_dir: str, job_id: str, restart: int, max_log_bytes: int) -> Finished | None:
    """:func:`detect` over this attempt's job-step logs (``log-*_<job>_<restart>.out``)."""
    lines: list[str] = []
    for path in ev.step_logs(job_dir, job_id, restart):
        lines += ev.read_tail(path, max_bytes=max_log_bytes).lines
    return detect(checkpoint_dir=checkpoint_dir, train_iters=train_iters, exit_code=exit_code, log_lines=lines)


def mark_finished(flag: str) -> bool:
    """Touch the finished flag (as a trainer that knows the contract would); False when it cannot be written."""
    try:
        os.makedirs(os.path.dirname(flag) or ".", exist_ok=True)
        with open(flag, "a", encoding="utf-8"):
            pass
    except OSError:
        return False
    return True


__all__ = ["END_OF_TRAINING", "Finished", "detect", "detect_for_attempt", "end_of_training_line", "mark_finished",
           "tracker_iteration"]
