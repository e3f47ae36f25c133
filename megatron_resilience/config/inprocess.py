"""In-process restart (nvidia-resiliency-ext's ``inprocess.Wrapper``): restart training inside the same processes.

On a fault the healthy ranks stay alive: the wrapper aborts the process groups, runs the trainer's
finalize, and calls the training function again, which restores the newest checkpoint (in memory,
node-local, or persistent) and continues. No interpreter start, no imports. Names and defaults follow
Megatron-LM's ``--inprocess-*`` flags (Megatron-Bridge's ``InProcessRestartConfig``); seconds throughout.

What cannot be restarted in-process falls through to ft_launcher's process restart (see
``resilience/inprocess.py``): a rank that died or was terminated by the hard timeout, and an exhausted
``max_iterations`` budget. Unlike Megatron-LM and Bridge there is always a budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.config.validate import check_choice, check_int, check_positive, check_types, fail

GRANULARITIES = ("node", "rank")
# Fields whose names and meaning are Megatron-Bridge's InProcessRestartConfig's (config/aliases.py).
BRIDGE_FIELDS = ("enabled", "max_iterations", "monitor_thread_interval", "monitor_process_interval",
                 "progress_watchdog_interval", "heartbeat_interval", "soft_timeout", "hard_timeout",
                 "heartbeat_timeout", "barrier_timeout", "completion_timeout", "last_call_wait",
                 "termination_grace_time", "granularity", "empty_cuda_cache")


@dataclass(kw_only=True)
class InProcessConfig:
    enabled: bool = False
    # Calls of the training function in one process, the first included (3: up to 2 in-process restarts); then
    # the ranks exit and ft_launcher restarts the processes (past its budget, the job-level decision decides).
    max_iterations: int = 3
    soft_timeout: float = 60.0  # no progress for this long: every rank aborts and restarts in-process
    hard_timeout: float = 90.0  # still no progress: the rank is terminated (a dead process: process restart)
    heartbeat_interval: float = 30.0  # how often ranks tell each other they are alive
    heartbeat_timeout: float = 60.0  # a rank silent this long is treated as lost
    barrier_timeout: float = 120.0  # the wrapper's own barriers (restart, termination)
    completion_timeout: float = 120.0  # every rank must return from training within this of the first
    monitor_thread_interval: float = 1.0
    # The monitor process checks the soft and hard timeouts only when no progress message came within its
    # interval (nvidia-resiliency-ext 0.4.1-0.7.0): with the progress watchdog sending one per interval of its
    # own, an equal interval (Megatron-LM's 1.0/1.0) postpones the checks indefinitely. Hence the order below.
    monitor_process_interval: float = 0.5
    progress_watchdog_interval: float = 1.0
    last_call_wait: float = 1.0  # after a fault, time for other ranks to report theirs (one restart for all)
    termination_grace_time: float = 5.0  # SIGTERM -> SIGKILL of a rank past the hard timeout
    granularity: str = "node"  # a terminated rank takes out its whole node ("node") or only itself ("rank")
    empty_cuda_cache: bool = True  # free cached GPU memory between iterations (no effect on CPU)

    def __post_init__(self) -> None:
        check_types(self, "inprocess")
        check_int("inprocess.max_iterations", self.max_iterations, minimum=1)
        for name in ("soft_timeout", "hard_timeout", "heartbeat_interval", "heartbeat_timeout", "barrier_timeout",
                     "completion_timeout", "monitor_thread_interval", "monitor_process_interval",
                     "progress_watchdog_interval", "last_call_wait", "termination_grace_time"):
            check_positive(f"inprocess.{name}", getattr(self, name))
        check_choice("inprocess.granularity", self.granularity, GRANULARITIES)
        # The wrapper's own ordering (nvidia-resiliency-ext asserts these without naming the settings).
        for smaller, larger in (("soft_timeout", "hard_timeout"), ("hard_timeout", "barrier_timeout"),
                                ("heartbeat_interval", "heartbeat_timeout"),
                                ("heartbeat_timeout", "barrier_timeout"),
                                ("monitor_process_interval", "heartbeat_timeout"),
                                ("monitor_process_interval", "soft_timeout"),
                                ("monitor_thread_interval", "soft_timeout"),
                                ("progress_watchdog_interval", "soft_timeout"),
                                ("monitor_process_interval", "progress_watchdog_interval")):
            if not getattr(self, smaller) < getattr(self, larger):
                fail(f"inprocess.{smaller}", f"must be < inprocess.{larger}={getattr(self, larger):g}",
                     getattr(self, smaller))

    def group_timeout_seconds(self, backend: str) -> float:
        """Timeout of every process group the training function creates, per backend.

        NCCL: longer than the hard timeout, so NCCL's watchdog never ends a rank the wrapper can still
        abort (an abort frees a rank blocked in a collective). gloo has no abort: a survivor blocked in a
        gloo collective whose peer neither answers nor closes its connection is freed only by the group
        timeout, and must be freed before its own hard timeout terminates it; halfway between the soft
        and the hard timeout (a healthy wait longer than the soft timeout would restart anyway).
        """
        if backend == "nccl":
            return max(600.0, 2 * self.hard_timeout)
        return (self.soft_timeout + self.hard_timeout) / 2
