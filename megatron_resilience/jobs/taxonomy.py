"""The error types an attempt can end with: the vocabulary shared by monitors, the classifier and policies.

An error type says *why* an attempt ended; its ``mode`` says which retry budget a restart spends
(``crash``: a process died with an error, ``stall``: something stopped making progress and was
killed by a timeout, ``timeout``: the job hit its wall-clock limit without stopping cleanly).
Types with mode ``None`` are not failures: a finished run, a run that stopped with a checkpoint
(preemption warning, time-limit warning, straggler stop), a job cancelled by a person or by the
system. Every policy ends a finished run, never retries a person's ``scancel``, and requeues a
run that stopped with a checkpoint without spending a retry.

The order of ``ERROR_TYPES`` is the classifier's tie-break among log signals of one attempt: the
earlier type is the likelier root cause (a rank's CUDA OOM makes the other ranks' NCCL
collectives time out; an Xid makes NCCL fail), so it wins.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("crash", "stall", "timeout")
SEVERITIES = ("info", "warning", "error", "fatal")
# nvidia-resiliency-ext >= 0.6: ft_launcher's exit code when it decided the job must not restart
# (no progress across restarts, attribution STOP); ``--ft-no-restart-exit-code`` changes it.
NVRX_NO_RESTART_EXIT_CODE = 93


@dataclass(frozen=True)
class ErrorType:
    name: str
    mode: str | None
    subsystem: str
    meaning: str


ERROR_TYPES: tuple[ErrorType, ...] = (
    # The trainer's own verdicts (stop_reason.json, exit code) and the scheduler's non-failures.
    ErrorType("finished", None, "trainer", "training reached train.max_steps"),
    ErrorType("preempted", None, "scheduler",
              "stopped on a signal (preemption, time-limit warning, straggler, duration) with or without "
              "a checkpoint; requeued without spending a retry"),
    ErrorType("user_cancel", None, "scheduler", "a person cancelled the job (scancel): never retried"),
    ErrorType("system_cancel", None, "scheduler", "cancelled or preempted by the scheduler without a checkpoint"),
    ErrorType("finished_but_alive", None, "trainer",
              "the trainer reported finished but the job's processes did not exit (watcher: scancel)"),
    ErrorType("rerun_failed_validation", "crash", "numerics",
              "Megatron's rerun state machine: result failed validation (exit 17); needs a person"),
    ErrorType("do_not_restart", "crash", "launcher",
              "ft_launcher decided the job must not restart (no progress, attribution STOP; exit 93)"),
    ErrorType("rerun_resume", "crash", "numerics",
              "Megatron's rerun state machine asks to resume on different hardware (exit 16)"),
    # Hardware: most specific first, they explain the NCCL/CUDA errors that follow them.
    ErrorType("xid_error", "crash", "gpu", "NVIDIA driver Xid error that points at the GPU or node (fell off "
              "the bus, uncorrectable ECC, NVLink, GSP; jobs/xid_codes.py)"),
    ErrorType("ecc_error", "crash", "gpu", "uncorrectable ECC error"),
    ErrorType("node_fail", "crash", "node", "Slurm NODE_FAIL: a node of the job stopped responding"),
    ErrorType("batch_lost", "crash", "node",
              "the batch script ended without recording a decision (killed, host lost)"),
    # This package's own errors on a compute node: it knows exactly why it stopped, so these outrank what follows.
    ErrorType("checkpoint_refused", "crash", "checkpoint",
              "the trainer refused to resume: no complete checkpoint to load, or none it could read; needs a person"),
    ErrorType("config_rejected", "crash", "config",
              "the trainer rejected a setting at start (names the key and the allowed values); needs a person"),
    ErrorType("port_in_use", "crash", "distributed",
              "rank 0 could not bind the job's own store port: another job or service holds it"),
    ErrorType("store_unreachable", "crash", "distributed",
              "a rank could not reach rank 0's store (rank 0 did not start it in time, or died)"),
    ErrorType("cuda_oom", "crash", "memory", "CUDA out of memory"),
    ErrorType("cpu_oom", "crash", "memory", "host out of memory (Slurm OUT_OF_MEMORY, oom-kill)"),
    ErrorType("nccl_timeout", "stall", "communication", "an NCCL collective timed out (ProcessGroupNCCL watchdog)"),
    ErrorType("nccl_error", "crash", "communication", "NCCL error (system/internal/remote error, IB completion)"),
    ErrorType("watchdog_timeout", "stall", "distributed",
              "a distributed (non-NCCL) timeout: c10d store, gloo, rendezvous, process-group watchdog"),
    ErrorType("communication_error", "crash", "network", "socket / connection error between ranks"),
    ErrorType("hang", "stall", "launcher",
              "a rank stopped reporting progress (nvidia-resiliency-ext section or heartbeat timeout)"),
    ErrorType("cuda_hang", "stall", "gpu", "a CUDA kernel never finished (launch timed out)"),
    ErrorType("cuda_error", "crash", "gpu", "CUDA error (illegal memory access, device-side assert, ...)"),
    ErrorType("nan_inf", "crash", "numerics", "NaN or Inf in the loss or gradients ended the run"),
    ErrorType("python_exception", "crash", "application", "an uncaught Python exception in a training rank"),
    ErrorType("time_limit", "timeout", "scheduler", "the job hit its wall-clock limit without stopping cleanly"),
    ErrorType("killed", "crash", "process", "a process was killed by a signal, nothing else explains it"),
    ErrorType("unknown", "crash", "unknown", "non-zero exit and no evidence of why"),
)

BY_NAME = {e.name: e for e in ERROR_TYPES}
NAMES = tuple(e.name for e in ERROR_TYPES)
# Subsystems a monitor or a policy rule may name ("config": the trainer rejected a setting at start).
SUBSYSTEMS = tuple(sorted({e.subsystem for e in ERROR_TYPES} | {"config"}))
NOT_FAILURES = tuple(e.name for e in ERROR_TYPES if e.mode is None)
# Errors that point at the hardware the attempt ran on: the evidence's hosts are candidates for exclusion.
HARDWARE_TYPES = ("xid_error", "ecc_error", "node_fail", "nccl_error", "nccl_timeout", "cuda_error", "rerun_resume")


def rank(name: str) -> int:
    """Position in ERROR_TYPES: lower = likelier root cause."""
    return NAMES.index(name)


def mode_of(name: str) -> str | None:
    return BY_NAME[name].mode
