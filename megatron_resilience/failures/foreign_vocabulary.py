"""Error-type and subsystem names of the log-monitoring tool this room was modelled on, and what each means here.

That tool (a ``SlurmLogMonitor`` with ``log_signals``, ``SelectiveRestartPolicy`` restart policies) names
failures with a coarser vocabulary. Every place that takes an error type (policy rules,
``exclude_error_types``, a monitor's ``error_type``) accepts both; a foreign name stands for the set of
this package's types below. In that tool's own files its names mean its own thing (``hang`` covers CUDA
hangs too, ``watchdog_timeout`` NCCL's watchdog); in this package's files a name both vocabularies share
keeps this package's meaning. ``hardware`` names the class of failures that point at a machine, in both.

A monitor emits one type: a foreign name maps to the first type of its set, or to the one its
``subsystem`` says (``oom`` with subsystem ``cpu`` is a host OOM).
"""

from __future__ import annotations

from megatron_resilience.config.validate import ConfigError
from megatron_resilience.failures import taxonomy

# foreign name -> (this package's types, what it means)
ERROR_TYPES: dict[str, tuple[tuple[str, ...], str]] = {
    "oom": (("cuda_oom", "cpu_oom"), "CUDA out of memory and host out of memory"),
    "hang": (("hang", "cuda_hang"), "a rank stopped making progress, a CUDA kernel that never finished"),
    "deadlock": (("hang",), "a distributed deadlock: ranks that stop reporting progress"),
    "nccl": (("nccl_error",), "NCCL errors (system, internal, remote, IB completion)"),
    "nccl_timeout": (("nccl_timeout",), "an NCCL collective timed out (ProcessGroupNCCL watchdog)"),
    "nccl_collective": (("nccl_error", "nccl_timeout"), "an NCCL collective failed or timed out"),
    "distributed_timeout": (("watchdog_timeout",), "a process-group / c10d store / gloo timeout"),
    "communication": (("communication_error",), "socket and connection errors between ranks"),
    "watchdog_timeout": (("watchdog_timeout", "nccl_timeout"), "a watchdog timeout, NCCL's included"),
    "cancelled": (("system_cancel", "preempted"),
                  "cancelled or preempted by the system (never a person's scancel, which is never retried)"),
    "slurm_failure": (("node_fail", "batch_lost", "killed", "unknown"),
                      "Slurm ended the job (FAILED, NODE_FAIL) and no log line says why"),
    "timeout": (("time_limit",), "the job hit its wall-clock limit"),
    "numerical_instability": (("nan_inf",), "NaN or Inf in the loss or gradients"),
    "exception": (("python_exception",), "an uncaught Python exception (a bug)"),
    "torch": (("python_exception", "cuda_error"), "a PyTorch error (torch.*Error, CUDA errors it raises)"),
}
# A class in both vocabularies: failures that point at the machine the attempt ran on.
CLASSES: dict[str, tuple[tuple[str, ...], str]] = {
    # the GPU's types first: a foreign monitor's "hardware" line is read as the first type that matches it
    "hardware": (tuple(sorted(taxonomy.MACHINE_TYPES, key=lambda t: ("gpu", "node", "numerics").index(
        taxonomy.BY_NAME[t].subsystem))),
                 "the machine failed: Xid, ECC, CUDA errors and hangs, a node failure, Megatron's rerun machine"),
}
# (foreign subsystem, subsystem hint) -> the monitor's type for a foreign name with several
MONITOR_TYPE_BY_SUBSYSTEM = {("oom", "cpu"): "cpu_oom", ("oom", "host"): "cpu_oom", ("hang", "cuda"): "cuda_hang",
                             ("torch", "cuda"): "cuda_error"}
SUBSYSTEMS: dict[str, tuple[str, ...]] = {
    "distributed": ("communication", "distributed", "network"),
    "cuda": ("gpu", "memory"),
    "cpu": ("memory",),
    "slurm": ("scheduler", "node"),
}
SEVERITIES = {"critical": "fatal", "error": "error", "warning": "warning", "info": "info"}


def both_vocabularies() -> str:
    return (f"this package's error types {list(taxonomy.NAMES) + list(CLASSES)} or the log-monitoring tool's "
            f"{sorted(ERROR_TYPES)}")


def error_types(names: list[str], *, source: str, key: str, foreign: bool) -> tuple[tuple[str, ...], list[str]]:
    """Names of either vocabulary -> this package's types (in order, no repeats), and one note per foreign name.

    ``foreign``: the names come from that tool's own file, where its meaning of a shared name applies.
    """
    out: list[str] = []
    notes = []
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"{source}: {key}: must be a list of error type names, got {name!r}")
        if name in CLASSES:
            types = CLASSES[name][0]
        elif name in ERROR_TYPES and (foreign or name not in taxonomy.NAMES):
            types = ERROR_TYPES[name][0]
            notes.append(f"{key}: {name} -> {', '.join(types)} ({ERROR_TYPES[name][1]})")
        elif name in taxonomy.NAMES:
            types = (name,)
        else:
            raise ConfigError(f"{source}: {key}: unknown error type {name!r}; must be one of "
                              f"{both_vocabularies()}")
        out += [t for t in types if t not in out]
    return tuple(out), notes


def monitor_error_type(name: str, *, subsystem: str | None, source: str, key: str, foreign: bool) -> str:
    """One type for a monitor (a foreign name with several types: the first, or the one its subsystem says)."""
    types, _ = error_types([name], source=source, key=key, foreign=foreign)
    return MONITOR_TYPE_BY_SUBSYSTEM.get((name, subsystem or ""), types[0])


def subsystems(names: list[str], *, source: str, key: str, foreign: bool) -> tuple[tuple[str, ...], list[str]]:
    """Subsystem names of either vocabulary -> this package's, with a note per foreign one."""
    out: list[str] = []
    notes = []
    for name in names:
        if name in SUBSYSTEMS and (foreign or name not in taxonomy.SUBSYSTEMS):
            mapped: tuple[str, ...] = SUBSYSTEMS[name]
            notes.append(f"{key}: {name} -> {', '.join(mapped)}")
        elif name in taxonomy.SUBSYSTEMS:
            mapped = (name,)
        else:
            raise ConfigError(f"{source}: {key}: unknown subsystem {name!r}; must be one of this package's "
                              f"{list(taxonomy.SUBSYSTEMS)} or the log-monitoring tool's {sorted(SUBSYSTEMS)}")
        out += [s for s in mapped if s not in out]
    return tuple(out), notes
