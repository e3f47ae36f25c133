"""Resilience sections of the config: fault tolerance, straggler detection, rerun state machine.

Launcher-side settings (timeouts, restarts, retries) belong to the NeMo-Run
``FaultTolerancePlugin``; these are the settings the trainer itself acts on.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.config.validate import (
    check_choice,
    check_fraction,
    check_int,
    check_non_negative,
    check_positive,
    check_types,
    fail,
)

FT_MODES = ("sections", "heartbeats")
# rank_stalled: the rank stops making progress but stays alive and responsive (a wait that never ends in Python);
# nan: one of the rank's weights becomes NaN (its loss is NaN). What an in-process restart recovers; rank_hung
# (SIGSTOP) and rank_killed end the process's usefulness.
SIMULATED_FAULT_TYPES = ("rank_hung", "rank_killed", "random", "exception", "rank_stalled", "nan")
# What a rank with simulated_fault_type=exception dies of (printed and exited like the real thing).
SIMULATED_EXCEPTIONS = ("cuda_oom", "nccl_timeout", "nccl_error")
SIMULATED_FAULT_SECTIONS = ("step", "checkpointing")
# How a simulated straggler spends its delay: "compute" burns the rank's own CPU time (a slower device: the same
# share of the step however busy the host is), "wait" sleeps (a device whose host CPU is idle: a long step that
# costs no CPU, for chaos runs and tests on a shared machine).
SIMULATED_STRAGGLER_MODES = ("compute", "wait")
RERUN_MODES = ("disabled", "validate_results", "report_stats")
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """nvidia-resiliency-ext rank monitoring, driven by ft_launcher."""

    enabled: bool = False  # enable_ft_package
    mode: str = "sections"  # sections: setup/step/checkpointing; heartbeats: one beat per step
    calc_ft_timeouts: bool = False  # learn timeouts from observed intervals, persist in ft_state.json
    # Seconds: every learned timeout (sections, out-of-section, heartbeats) is raised to at least this. Learned
    # values are safety_factor x the longest interval seen, far below 1 s for fast steps; a GC pause, a slow
    # filesystem or a busier node would otherwise get healthy ranks killed as hung.
    min_learned_timeout: float = 60.0
    simulate_fault: bool = False
    simulated_fault_type: str = "random"
    simulated_fault_rank: int | None = None  # None -> a random rank
    simulated_fault_base_delay: float = 0.0  # seconds after setup before the fault (plus up to 1 s jitter)
    simulated_fault_step: int | None = None  # if set, fault at the start of this step instead of after a delay
    # With simulated_fault_step: "step" faults at the start of that step, "checkpointing" inside the first
    # checkpoint save at or after it. Faults fire only on a job's first attempt (see resilience/simulated_fault.py).
    simulated_fault_section: str = "step"
    # With simulated_fault_type=exception: a CUDA OOM (uncaught torch.OutOfMemoryError, exit 1), an NCCL
    # watchdog timeout (the watchdog's lines, then SIGABRT) or an NCCL error (uncaught DistBackendError).
    simulated_fault_exception: str = "cuda_oom"
    # Fire on every attempt (in-job restarts and requeues too), ft.simulated_fault_step steps after the step
    # the attempt resumed from: a failure that recurs, to test retry budgets and restart loops.
    simulated_fault_repeat: bool = False

    def __post_init__(self) -> None:
        check_types(self, "ft")
        check_choice("ft.mode", self.mode, FT_MODES)
        check_positive("ft.min_learned_timeout", self.min_learned_timeout)
        check_choice("ft.simulated_fault_type", self.simulated_fault_type, SIMULATED_FAULT_TYPES)
        check_int("ft.simulated_fault_rank", self.simulated_fault_rank, minimum=0, allow_none=True)
        check_non_negative("ft.simulated_fault_base_delay", self.simulated_fault_base_delay)
        check_int("ft.simulated_fault_step", self.simulated_fault_step, minimum=1, allow_none=True)
        check_choice("ft.simulated_fault_section", self.simulated_fault_section, SIMULATED_FAULT_SECTIONS)
        if self.simulated_fault_section != "step" and self.simulated_fault_step is None:
            fail("ft.simulated_fault_section", "needs ft.simulated_fault_step to be set", self.simulated_fault_section)
        check_choice("ft.simulated_fault_exception", self.simulated_fault_exception, SIMULATED_EXCEPTIONS)
        if not isinstance(self.simulated_fault_repeat, bool):
            fail("ft.simulated_fault_repeat", "must be true or false", self.simulated_fault_repeat)
        at_a_step = self.simulated_fault_type in ("exception", "rank_stalled", "nan")
        for needs_step, value in (("simulated_fault_type", at_a_step),
                                  ("simulated_fault_repeat", self.simulated_fault_repeat)):
            if value and self.simulated_fault_step is None:
                fail(f"ft.{needs_step}", "needs ft.simulated_fault_step to be set (the fault fires at a step)",
                     getattr(self, needs_step))


@dataclass(kw_only=True)
class StragglerConfig:
    """nvidia-resiliency-ext straggler ``Detector`` around the train step."""

    enabled: bool = False
    report_time_interval: float = 300.0  # seconds between reports
    calc_relative_gpu_perf: bool = True
    calc_individual_gpu_perf: bool = True
    num_gpu_perf_scores_to_print: int = 5
    gpu_relative_perf_threshold: float = 0.7
    gpu_individual_perf_threshold: float = 0.7
    stop_if_detected: bool = False
    enable_logging: bool = True
    profiling_interval: int = 1
    logger_name: str = "megatron_resilience.straggler"
    # Test your setup: this rank spends `simulated_straggler_delay` extra seconds in every step, computing or
    # waiting (`simulated_straggler_mode`).
    simulated_straggler_rank: int | None = None
    simulated_straggler_delay: float = 0.0
    simulated_straggler_mode: str = "compute"

    def __post_init__(self) -> None:
        check_types(self, "straggler")
        check_positive("straggler.report_time_interval", self.report_time_interval)
        check_int("straggler.num_gpu_perf_scores_to_print", self.num_gpu_perf_scores_to_print, minimum=0)
        check_fraction("straggler.gpu_relative_perf_threshold", self.gpu_relative_perf_threshold)
        check_fraction("straggler.gpu_individual_perf_threshold", self.gpu_individual_perf_threshold)
        check_int("straggler.profiling_interval", self.profiling_interval, minimum=1)
        check_int("straggler.simulated_straggler_rank", self.simulated_straggler_rank, minimum=0, allow_none=True)
        check_non_negative("straggler.simulated_straggler_delay", self.simulated_straggler_delay)
        check_choice("straggler.simulated_straggler_mode", self.simulated_straggler_mode, SIMULATED_STRAGGLER_MODES)


@dataclass(kw_only=True)
class RerunConfig:
    """Megatron-Core ``RerunStateMachine``: re-run suspicious steps to tell transient from persistent faults."""

    rerun_mode: str = "disabled"
    check_for_nan_in_loss: bool = True
    check_for_spiky_loss: bool = False
    # After a move to other hardware, Megatron-Core re-runs the suspicious step from its checkpoint; when this GPU
    # does not reproduce the first GPU's NaN/Inf (Megatron's "Possible persistent error": the first GPU computed
    # wrong, and the job has left it), keep this GPU's result and train on instead of exiting 17 for a person.
    # A result reproduced on the other GPU (the data or the code, not the chip) still exits 17.
    continue_after_persistent_error: bool = True
    error_injection_rate: int = 0  # inject an error once every N checks on average; 0 disables
    error_injection_type: str = "transient_error"
    result_rejected_tracker_filename: str | None = None
    # Testing aid, like ft.simulate_fault: honour `python -m megatron_resilience.chaos`'s NaN (silent data corruption)
    # trigger, <run_dir>/chaos_nan.json: while it names this attempt and rank, the loss is NaN (runtime/chaos_nan.py).
    accept_chaos_nan: bool = False

    def __post_init__(self) -> None:
        check_types(self, "rerun")
        check_choice("rerun.rerun_mode", self.rerun_mode, RERUN_MODES)
        if self.accept_chaos_nan and self.rerun_mode != "validate_results":
            fail("rerun.rerun_mode", "must be 'validate_results' with rerun.accept_chaos_nan=true (the rerun state "
                 "machine is what catches the NaN)", self.rerun_mode)
        check_choice("rerun.error_injection_type", self.error_injection_type, ERROR_INJECTION_TYPES)
        check_int("rerun.error_injection_rate", self.error_injection_rate, minimum=0)
