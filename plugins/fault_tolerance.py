"""FaultTolerancePlugin: run the trainer under nvidia-resiliency-ext's ft_launcher with restarts and retries.

What ``setup`` does (on nemo_run's clones of the task and executor, before anything is submitted):

* task: ``ft.enabled`` (= ``enable_ft_package``) and ``ft.calc_ft_timeouts``;
* executor.launcher: ``run.FaultTolerance`` with every FT field explicit (never nemo_run's all-None
  form, which renders ``--ignore-missing-fault-tol-cfg``, removed in nvidia-resiliency-ext 0.5) and
  ``max_restarts = num_in_job_restarts``; rendezvous settings of a user's torchrun launcher carried over;
* SlurmExecutor: executor.retries = ``num_job_retries_on_failure + 1``. It only becomes
  ``TORCHX_MAX_RETRIES`` in the sbatch script, and nemo_run's FT teardown stops requeueing once that
  many attempts *in a row* failed (0 = never requeue); so a job whose every attempt fails runs
  ``1 + num_job_retries_on_failure`` times. A preempted attempt (exit 0, not finished) is recorded as a
  success and breaks the row. (LocalExecutor: nemo_run has no job-level retries; executor.retries is left alone.)
* SlurmExecutor: an EXIT trap (``EXIT_STATUS_BLOCK``) makes the batch script end with the job step's
  exit code when the teardown does not requeue: nemo_run's teardown then falls off the end of the
  script (exit 0), and Slurm would record the last failed attempt as COMPLETED;
* the complete FT config, incl. section timeouts that nemo_run has no field for, as YAML that
  ft_launcher reads through ``PET_FT_CFG_PATH`` (see ``ft_config``);
* nsys profiling requested on the launcher or the task is turned off, with a warning.

``ft.mode`` of the task decides heartbeat vs section timeouts (see ``ft_config``). Every change to a
user setting is logged on ``megatron_resilience.plugins``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_resilience.config import CATCHABLE_SIGNALS, ConfigError
from megatron_resilience.config._validate import check_int, check_positive, fail
from megatron_resilience.upstream import (
    NEMO_RUN_FT_PARAM_FIELDS, ft_cfg_path_env, ft_launcher_accepts_nemo_run_flags, import_nemo_run,
    nemo_run_ft_param_flag, nvrx_version_for_rendering, parse_version, unaccepted_ft_launcher_flags,
)
from megatron_resilience.plugins import ft_config
from megatron_resilience.plugins._executor import (
    check_signal_reaches_trainer, claim, disable_nsys, executor_kind, set_env, set_setup_block, slurm_job_file,
)
from megatron_resilience.plugins._task import task_editor

run = import_nemo_run()
log = logging.getLogger("megatron_resilience.plugins")

NAME = "FaultTolerancePlugin"
TERMINATION_SIGNALS = CATCHABLE_SIGNALS + ("SIGKILL",)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FT_CFG_BLOCK = "FaultTolerancePlugin ft_launcher config"
PREEMPT_REQUEUE_BLOCK = "PreemptionPlugin requeue"  # nemo_run's FT teardown requeues instead (see preemption.py)
EXIT_STATUS_BLOCK = "FaultTolerancePlugin exit status"


def exit_status_block() -> str:
    """sbatch lines: when nemo_run's FT teardown does not requeue, end the script with the step's exit code.

    The teardown ends with ``if ! (finished || failures limit reached); then requeue; exit $exitcode; fi``:
    when it does not requeue, the script falls off its end with status 0 and Slurm records the job
    COMPLETED even after the last allowed attempt failed. The trap changes only that case (script
    status 0, step status non-zero); a requeued attempt and a finished one (step exit 0) end as before.
    The rerun state machine's exit 17 (touches the finished flag, never requeued) now ends FAILED too:
    a result that failed validation is for a person to look at. The trap replaces an EXIT trap that a
    user's ``setup_lines`` set before it (bash keeps one per signal).
    ``exitcode`` is the variable nemo_run's script sets from the srun; set here so an inherited
    environment variable of that name cannot leak in when the script exits before the srun.
    """
    return (
        "# nemo_run's FT teardown falls off the end of this script (status 0) when it does not requeue; then end\n"
        "# with the job step's exit code, so Slurm records a failed last attempt as FAILED, not COMPLETED\n"
        "exitcode=0\n"
        "megatron_resilience_exit_with_step_code() {\n"
        "    local status=$?\n"
        '    if [ "$status" = 0 ] && [ "$exitcode" != 0 ]; then\n'
        '        echo "Not requeued: the batch script exits with the job step\'s exit code $exitcode"\n'
        '        exit "$exitcode"\n'
        "    fi\n"
        "}\n"
        "trap megatron_resilience_exit_with_step_code EXIT"
    )


@dataclass(kw_only=True)
class FaultTolerancePlugin(run.Plugin):
    """Fault tolerance for ``megatron_resilience`` pretraining on Slurm or the local machine.

    Timeouts are seconds. Section timeouts apply with the trainer's ``ft.mode=sections`` (default),
    heartbeat timeouts with ``ft.mode=heartbeats``; a section timeout of None means no limit.
    ``nvrx_version`` is the nvidia-resiliency-ext version of the cluster's container, used to render
    ft_launcher's flags; None -> the version installed where you submit.
    """

    enable_ft_package: bool = True
    calc_ft_timeouts: bool = True
    num_in_job_restarts: int = 3
    num_job_retries_on_failure: int = 2
    initial_rank_heartbeat_timeout: float = 1800.0
    rank_heartbeat_timeout: float = 300.0
    setup_timeout: float | None = 600.0
    step_timeout: float | None = 180.0
    checkpointing_timeout: float | None = 420.0
    out_of_section_timeout: float | None = 300.0
    workload_check_interval: float = 5.0
    rank_termination_signal: str = "SIGKILL"
    log_level: str = "INFO"
    nvrx_version: str | None = None

    def __post_init__(self) -> None:
        for name in ("enable_ft_package", "calc_ft_timeouts"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{NAME}.{name}", "must be true or false", getattr(self, name))
        check_int(f"{NAME}.num_in_job_restarts", self.num_in_job_restarts, minimum=0)
        check_int(f"{NAME}.num_job_retries_on_failure", self.num_job_retries_on_failure, minimum=0)
        for name in ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "workload_check_interval"):
            check_positive(f"{NAME}.{name}", getattr(self, name))
        for name in ("setup_timeout", "step_timeout", "checkpointing_timeout", "out_of_section_timeout"):
            check_positive(f"{NAME}.{name}", getattr(self, name), allow_none=True)
        if self.rank_termination_signal not in TERMINATION_SIGNALS:
            fail(f"{NAME}.rank_termination_signal", f"must be one of {list(TERMINATION_SIGNALS)}",
                 self.rank_termination_signal)
        if self.log_level not in LOG_LEVELS:
            fail(f"{NAME}.log_level", f"must be one of {list(LOG_LEVELS)}", self.log_level)
        if self.nvrx_version is not None:
            try:
                parse_version(self.nvrx_version)
            except ValueError:
                fail(f"{NAME}.nvrx_version", "must be a version like '0.7' or '0.4.1' (or None: the installed one)",
                     self.nvrx_version)

    # ----------------------------------------------------------------------------------------------------------
    def setup(self, task: Any, executor: Any) -> None:
        kind = executor_kind(executor, NAME)
        claim(executor, NAME)
        editor = task_editor(task, NAME)
        version, source = nvrx_version_for_rendering(self.nvrx_version)

        editor.set("ft.enabled", self.enable_ft_package, "enable_ft_package")
        editor.set("ft.calc_ft_timeouts", self.calc_ft_timeouts, "calc_ft_timeouts")
        mode = editor.get("ft.mode")

        executor.launcher = self._launcher(executor.launcher, mode, version)
        check_signal_reaches_trainer(executor, NAME)
        executor._launcher_setup = False  # nemo_run derives the FT file paths when it sets the launcher up
        rendered = [nemo_run_ft_param_flag(f) for f in NEMO_RUN_FT_PARAM_FIELDS if getattr(executor.launcher, f)]
        bad = unaccepted_ft_launcher_flags(rendered, version)
        if bad:  # cannot happen by construction; a guard against nemo_run changing its spelling
            raise ConfigError(f"{NAME}: ft_launcher of nvidia-resiliency-ext {'.'.join(map(str, version))} "
                              f"would reject {bad}")
        if kind == "slurm":
            self._check_ranks_per_node(executor)
        disable_nsys(executor, editor, NAME, "nsys would wrap ft_launcher and be restarted with it, and "
                     "signals and in-job restarts would not reach the training ranks")
        if kind == "slurm":
            self._set_retries(executor)

        yaml_text = ft_config.render_yaml(ft_config.ft_settings(self, mode))
        env = ft_cfg_path_env(version)
        if kind == "slurm":
            host_path, step_path = slurm_job_file(executor, f"{executor.job_name}_ft_cfg.yml")
            set_setup_block(executor, FT_CFG_BLOCK, ft_config.sbatch_block(host_path, yaml_text))
            set_setup_block(executor, EXIT_STATUS_BLOCK, exit_status_block())
            set_setup_block(executor, PREEMPT_REQUEUE_BLOCK, None)
        else:
            from nemo_run.config import get_nemorun_home

            step_path = ft_config.write_local(get_nemorun_home(), yaml_text)
        self._set_env(executor, env, step_path)
        log.info("%s: ft_launcher rendered for nvidia-resiliency-ext %s (%s); ft.mode=%s; FT config at %s",
                 NAME, ".".join(map(str, version)), source, mode, step_path)

    # ----------------------------------------------------------------------------------------------------------
    def _wanted_fields(self, mode: str, version: tuple[int, ...]) -> dict[str, Any]:
        heartbeats = mode == "heartbeats"
        fields = {
            "workload_check_interval": float(self.workload_check_interval),
            "initial_rank_heartbeat_timeout": float(self.initial_rank_heartbeat_timeout) if heartbeats else None,
            "rank_heartbeat_timeout": float(self.rank_heartbeat_timeout) if heartbeats else None,
            "rank_termination_signal": self.rank_termination_signal,
            "log_level": self.log_level,
            "max_restarts": self.num_in_job_restarts,
        }
        if not heartbeats:
            log.info("%s: ft.mode=sections: heartbeat timeouts are not set (section messages do not reset the "
                     "heartbeat timer); hangs are caught by the section timeouts setup=%s step=%s "
                     "checkpointing=%s out-of-section=%s", NAME, self.setup_timeout, self.step_timeout,
                     self.checkpointing_timeout, self.out_of_section_timeout)
        if not ft_launcher_accepts_nemo_run_flags(version):
            for name in NEMO_RUN_FT_PARAM_FIELDS:
                fields[name] = None
            log.info("%s: nvidia-resiliency-ext %s does not accept nemo_run's --ft-<field> flags: all FT settings "
                     "go through the FT config file only", NAME, ".".join(map(str, version)))
        return fields

    def _launcher(self, current: Any, mode: str, version: tuple[int, ...]) -> Any:
        from nemo_run.core.execution.launcher import LAUNCHER_MAP, Launcher

        if isinstance(current, str):
            if current not in LAUNCHER_MAP:
                raise ConfigError(f"{NAME}: unknown executor.launcher {current!r}; known: {sorted(LAUNCHER_MAP)}")
            current = LAUNCHER_MAP[current]()
        wanted = self._wanted_fields(mode, version)
        carry: dict[str, Any] = {}
        if current is None or type(current) is Launcher:
            log.info("%s: executor.launcher: %s -> ft_launcher (run.FaultTolerance)", NAME,
                     "None" if current is None else "Launcher()")
        elif isinstance(current, run.FaultTolerance):
            for name, value in wanted.items():
                user = getattr(current, name)
                if user is not None and user != value:
                    raise ConfigError(
                        f"conflicting settings: executor.launcher.{name}={user!r} but {NAME} needs {value!r} "
                        f"(ft.mode={mode}); configure fault tolerance on the {NAME} only")
        elif type(current) is run.Torchrun:
            log.info("%s: executor.launcher: torchrun -> ft_launcher (run.FaultTolerance); rendezvous settings kept",
                     NAME)
        else:
            raise ConfigError(
                f"conflicting launcher: executor.launcher is {type(current).__name__}, but {NAME} needs ft_launcher "
                f"(run.FaultTolerance); use launcher=None, 'torchrun' or 'ft'")
        if current is not None:
            carry = {k: getattr(current, k) for k in ("rdzv_backend", "rdzv_port", "rdzv_id") if hasattr(current, k)}
            carry.update({k: getattr(current, k) for k in (
                "nsys_profile", "nsys_folder", "nsys_filename", "nsys_trace", "nsys_extra_args", "nsys_gpu_metrics")})
        return run.FaultTolerance(**carry, **wanted)

    def _set_retries(self, executor: Any) -> None:
        # nemo_run writes executor.retries into the sbatch script as TORCHX_MAX_RETRIES (nothing else reads it
        # for a SlurmExecutor); its FT teardown stops requeueing once that many attempts in a row failed.
        retries = self.num_job_retries_on_failure + 1
        if executor.retries != retries:
            log.info("%s: executor.retries: %r -> %r (num_job_retries_on_failure=%d: nemo_run's FT sbatch script "
                     "stops requeueing once TORCHX_MAX_RETRIES=executor.retries attempts in a row failed, so a "
                     "failing job runs 1 + %d times)", NAME, executor.retries, retries,
                     self.num_job_retries_on_failure, self.num_job_retries_on_failure)
            executor.retries = retries

    @staticmethod
    def _check_ranks_per_node(executor: Any) -> None:
        # nemo_run starts one ft_launcher per node with --nproc-per-node = torchrun_nproc_per_node or
        # ntasks_per_node (then forces ntasks_per_node=1): ntasks_per_node=1 with 8 GPUs means 1 rank per node.
        nproc = executor.torchrun_nproc_per_node or executor.ntasks_per_node
        gpus = executor.gpus_per_node
        if gpus and nproc != gpus:
            log.warning("%s: ft_launcher will start %s rank(s) per node but executor.gpus_per_node=%s; set "
                        "ntasks_per_node=%s (nemo_run turns it into --nproc-per-node)", NAME, nproc, gpus, gpus)

    @staticmethod
    def _set_env(executor: Any, env: str, path: str) -> None:
        current = executor.env_vars.get(env)
        if current is not None and current != path:
            raise ConfigError(f"conflicting settings: executor.env_vars[{env!r}]={current!r}, but {NAME} points "
                              f"ft_launcher at its own FT config {path!r}; remove the env var")
        set_env(executor, env, path)
