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
    """One error type and every fact the rooms need of it, said once (a new type is one row)."""

    name: str
    mode: str | None
    subsystem: str
    meaning: str
    # what the failure points at: "machine" (the node's GPU or host: a hardware failure), "network" (the fabric to a
    # peer node), "" (neither); both count towards a node's exclusion (jobs/node_exclusion.py)
    points_at: str = ""
    # a line of this type names its host's hardware (jobs/attribution.py: the "hardware" role)
    names_its_host: bool = False
    # what a surviving rank raises because another rank is gone: a consequence, not a cause (jobs/root_cause.py)
    peer_symptom: bool = False
    # Slurm job states (``scontrol``/``sacct``) and job-step states (``sacct`` of a step) that mean this type
    slurm_states: tuple[str, ...] = ()
    step_states: tuple[str, ...] = ()


ERROR_TYPES: tuple[ErrorType, ...] = (
    # The trainer's own verdicts (stop_reason.json, exit code) and the scheduler's non-failures.
    ErrorType("finished", None, "trainer", "training reached train.max_steps"),
    ErrorType("preempted", None, "scheduler",
              "stopped on a signal (preemption, time-limit warning, straggler, duration) with or without "
              "a checkpoint; requeued without spending a retry"),
    ErrorType("user_cancel", None, "scheduler", "a person cancelled the job (scancel): never retried"),
    ErrorType("system_cancel", None, "scheduler", "cancelled or preempted by the scheduler without a checkpoint",
              slurm_states=("PREEMPTED",)),
    ErrorType("finished_but_alive", None, "trainer",
              "the trainer reported finished but the job's processes did not exit (watcher: scancel)"),
    ErrorType("rerun_failed_validation", "crash", "numerics",
              "Megatron's rerun state machine: result failed validation (exit 17); needs a person"),
    ErrorType("do_not_restart", "crash", "launcher",
              "ft_launcher decided the job must not restart (exit 93): an attribution STOP, or no progress "
              "across its cycles with no failure of their own in the log (else that failure is the type)"),
    ErrorType("rerun_resume", "crash", "numerics",
              "Megatron's rerun state machine asks to resume on different hardware (exit 16)", points_at="machine",
              names_its_host=True),
    # Hardware: most specific first, they explain the NCCL/CUDA errors that follow them.
    ErrorType("xid_error", "crash", "gpu", "NVIDIA driver Xid error that points at the GPU or node (fell off "
              "the bus, uncorrectable ECC, NVLink, GSP; failures/xid_codes.py)", points_at="machine",
              names_its_host=True),
    ErrorType("ecc_error", "crash", "gpu", "uncorrectable ECC error", points_at="machine", names_its_host=True),
    ErrorType("node_fail", "crash", "node", "Slurm NODE_FAIL: a node of the job stopped responding",
              points_at="machine", slurm_states=("NODE_FAIL", "BOOT_FAIL"), step_states=("NODE_FAIL",)),
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
    ErrorType("cpu_oom", "crash", "memory", "host out of memory (Slurm OUT_OF_MEMORY, oom-kill)",
              slurm_states=("OUT_OF_MEMORY",), step_states=("OUT_OF_MEMORY",)),
    ErrorType("nccl_timeout", "stall", "communication", "an NCCL collective timed out (ProcessGroupNCCL watchdog)",
              points_at="network", peer_symptom=True),
    ErrorType("nccl_error", "crash", "communication", "NCCL error (system/internal/remote error, IB completion)",
              points_at="network", peer_symptom=True),
    ErrorType("watchdog_timeout", "stall", "distributed",
              "a distributed (non-NCCL) timeout: c10d store, gloo, rendezvous, process-group watchdog",
              peer_symptom=True),
    ErrorType("communication_error", "crash", "network", "socket / connection error between ranks", peer_symptom=True),
    ErrorType("hang", "stall", "launcher",
              "a rank stopped reporting progress (nvidia-resiliency-ext section or heartbeat timeout)"),
    ErrorType("cuda_hang", "stall", "gpu", "a CUDA kernel never finished (launch timed out)", points_at="machine",
              names_its_host=True),
    ErrorType("cuda_error", "crash", "gpu", "CUDA error (illegal memory access, device-side assert, ...)",
              points_at="machine", names_its_host=True),
    ErrorType("nan_inf", "crash", "numerics", "NaN or Inf in the loss or gradients ended the run",
              names_its_host=True),
    ErrorType("python_exception", "crash", "application", "an uncaught Python exception in a training rank"),
    ErrorType("time_limit", "timeout", "scheduler", "the job hit its wall-clock limit without stopping cleanly",
              slurm_states=("TIMEOUT", "DEADLINE")),
    ErrorType("killed", "crash", "process", "a process was killed by a signal, nothing else explains it"),
    ErrorType("unknown", "crash", "unknown", "non-zero exit and no evidence of why"),
)

BY_NAME = {e.name: e for e in ERROR_TYPES}
NAMES = tuple(e.name for e in ERROR_TYPES)
# Subsystems a monitor or a policy rule may name ("config": the trainer rejected a setting at start).
SUBSYSTEMS = tuple(sorted({e.subsystem for e in ERROR_TYPES} | {"config"}))
NOT_FAILURES = tuple(e.name for e in ERROR_TYPES if e.mode is None)
# Failures of the machine (the vocabularies' "hardware" class).
MACHINE_TYPES = tuple(e.name for e in ERROR_TYPES if e.points_at == "machine")
# Failures that point at a node, its machine or its link: the evidence's hosts are candidates for exclusion.
HARDWARE_TYPES = tuple(e.name for e in ERROR_TYPES if e.points_at)
# A line of one of these names its host's hardware (the attribution's "hardware" role).
HOST_EVIDENCE_TYPES = tuple(e.name for e in ERROR_TYPES if e.names_its_host)
# What a surviving rank raises because another rank is gone (not a cause of its own).
PEER_SYMPTOMS = tuple(e.name for e in ERROR_TYPES if e.peer_symptom)
# Slurm job states that say why the job ended, whatever the logs say; job-step states sacct records.
SLURM_STATE_TYPES = {state: e.name for e in ERROR_TYPES for state in e.slurm_states}
STEP_STATE_TYPES = {state: (e.name, e.subsystem) for e in ERROR_TYPES for state in e.step_states}


def rank(name: str) -> int:
    """Position in ERROR_TYPES: lower = likelier root cause."""
    return NAMES.index(name)


def mode_of(name: str) -> str | None:
    return BY_NAME[name].mode
