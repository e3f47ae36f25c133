"""Did the save at a preemption signal finish, and how much of ``preempt_time`` was left? Measured per attempt.

A preempted attempt's ledger record gets ``preemption``: ``signal_time`` (the first rank that got it),
``checkpoint_at_stop`` (the trainer's word: "saved", "already saved", "failed", ...), ``saved_at_signal``,
``save_done_time`` (the checkpoint at the stop became durable), ``exit_time`` (the attempt ended: the
launcher and the trainer had shut down), ``needed_s`` (signal -> exit: the step in flight, the save, the
shutdown), ``preempt_time`` (what the job asked Slurm for: ``--signal=SIG@N``) and ``margin_s``
(preempt_time - needed_s; negative: Slurm's kill would have come first). ``PreemptionPlugin`` warns at
submit time when a run's ``preempt_time`` is below the most it ever needed (:func:`needed_seconds`).
"""

from __future__ import annotations

from typing import Any

from megatron_resilience.config.slurm_signal import parse_slurm_signal
from megatron_resilience.config.validate import ConfigError
from megatron_resilience.records.names import METRICS_FILE

SAVED = ("saved", "already saved", "not needed")


def preempt_time_of(signal_setting: str | None) -> int | None:
    """``SIGTERM@60`` (``#SBATCH --signal``, ``B:``/``R:`` allowed) -> 60, and ``TERM`` -> 60: without ``@<time>``
    Slurm sends the signal 60 s before the limit (``sbatch(1)``), so that is the margin the job asked for; read
    as Slurm reads it (``config/slurm_signal.py``). None when not set or not a value Slurm would accept."""
    if signal_setting is None or signal_setting == "":
        return None
    try:
        return parse_slurm_signal(signal_setting).seconds
    except ConfigError:
        return None


def measure(stop_reason: dict[str, Any] | None, records: list[dict[str, Any]], *, exit_time: float,
            preempt_time: int | None) -> dict[str, Any] | None:
    """The ``preemption`` fields of an attempt that stopped on a signal (None when no signal is on record)."""
    stop = stop_reason or {}
    signals = [r for r in records if r.get("kind") == "signal"]
    sig = signals[-1] if signals else {}
    described = stop.get("signal") if isinstance(stop.get("signal"), dict) else {}
    signal_time = sig.get("first_received_time") or sig.get("received_time") or described.get("received_time")
    if signal_time is None:
        return None
    signal_time = float(signal_time)
    at_stop = stop.get("checkpoint_at_stop")
    reason = stop.get("reason")
    saves = [r for r in records if r.get("kind") == "checkpoint" and float(r.get("start_time") or 0) >= signal_time
             and (reason is None or r.get("reason") == reason)]
    done = max((float(r.get("durable_time") or r.get("time") or 0) for r in saves), default=None)
    needed = max(0.0, exit_time - signal_time)
    return {"signal_time": signal_time, "checkpoint_at_stop": at_stop, "saved_at_signal": at_stop in SAVED,
            "save_done_time": done, "exit_time": exit_time, "needed_s": needed, "preempt_time": preempt_time,
            "margin_s": None if preempt_time is None else preempt_time - needed}


def needed_seconds(attempts: list[dict[str, Any]]) -> float | None:
    """The most any preempted attempt of the run needed from the signal to its exit (None: none measured)."""
    found = [float((a.get("preemption") or {}).get("needed_s")) for a in attempts
             if isinstance((a.get("preemption") or {}).get("needed_s"), (int, float))]
    return max(found) if found else None


def estimate_from_metrics(records: list[dict[str, Any]]) -> float | None:
    """Before any preemption: the slowest step plus the slowest save the run's records show (no shutdown)."""
    steps = [float(r["step_time_s"]) for r in records if r.get("kind") == "train"
             and isinstance(r.get("step_time_s"), (int, float))]
    saves = [float(r["blocking_s"]) for r in records if r.get("kind") == "checkpoint"
             and isinstance(r.get("blocking_s"), (int, float))]
    if not steps or not saves:
        return None
    return max(steps) + max(saves)


def preempt_time_warning(preempt_time: int, run_dir: str, *, key: str = "PreemptionPlugin.preempt_time") -> str | None:
    """A warning when ``preempt_time`` is below what this run needed after a signal (its ledger), or, before any
    preemption, below its slowest step plus its slowest save (its metrics; launcher shutdown not included)."""
    import os

    from megatron_resilience.jobs.evidence import read_metrics
    from megatron_resilience.records.ledger import LEDGER_FILE, Ledger

    needed = needed_seconds(Ledger(os.path.join(run_dir, LEDGER_FILE)).attempts())
    what = "this run's ledger measured {:.0f} s from the signal to the exit (a step, the save, the launcher's shutdown)"
    if needed is None:
        needed = estimate_from_metrics(read_metrics(os.path.join(run_dir, METRICS_FILE)))
        what = "this run's slowest step plus its slowest save took {:.0f} s (the launcher's shutdown comes on top)"
    if needed is None or preempt_time >= needed:
        return None
    return (f"{key}={preempt_time} s is below what a stop at the signal needs: {what.format(needed)}; the save at "
            f"the signal may not finish before Slurm's kill: raise {key} above {int(needed) + 1}")
