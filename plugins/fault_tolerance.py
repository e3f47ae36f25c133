"""FaultTolerancePlugin: run the trainer under nvidia-resiliency-ext's ft_launcher with restarts and retries.

What ``setup`` does (on nemo_run's clones of the task and executor, before anything is submitted).
Executor side, the same for every task:

* executor.launcher: ``run.FaultTolerance`` with every FT field explicit (never nemo_run's all-None
  form, which renders ``--ignore-missing-fault-tol-cfg``, removed in nvidia-resiliency-ext 0.5) and
  ``max_restarts = num_in_job_restarts``; rendezvous settings of a user's torchrun launcher carried over;
* job retries (``executor.py`` says per executor): on Slurm ``executor.retries = num_job_retries_on_failure
  + 1``. It only becomes ``TORCHX_MAX_RETRIES`` in the sbatch script, and nemo_run's FT teardown stops
  requeueing once that many attempts *in a row* failed (0 = never requeue); so a job whose every attempt
  fails runs ``1 + num_job_retries_on_failure`` times. A preempted attempt (exit 0, not finished) is
  recorded as a success and breaks the row. On Docker it is the restart count (N);
* SlurmExecutor: the job-level decision block (``batch_decision``) decides the requeue when an attempt
  ends, and ends the batch script with the job step's exit code when it does not requeue (so Slurm
  records a failed last attempt as FAILED, not COMPLETED);
* the complete FT config, incl. section timeouts that nemo_run has no field for, as YAML that
  ft_launcher reads through ``PET_FT_CFG_PATH`` (see ``ft_config``), plus ft_launcher's safety features
  (``ft_features``) as config keys, environment variables or, where ft_launcher reads them only from its
  command line, flags the sbatch script adds;
* SlurmExecutor with nodes > 1: ``PET_RDZV_CONF=join_timeout=<rdzv_join_timeout>`` (ft_launcher's
  ``--rdzv-conf``): how long the agents wait for every node at a rendezvous, so also how long the
  surviving agents wait after a node is lost before they exit non-zero and the job is requeued. Without
  it the wait is whatever the container's nvidia-resiliency-ext picks (900 s in 0.4, 300 s in 0.7);
* nsys profiling requested on the launcher or the task is turned off, with a warning.

Task side (``ft_trainer``): our trainer gets ``ft.enabled`` (= ``enable_ft_package``) and
``ft.calc_ft_timeouts``; a Megatron-LM or Megatron-Bridge script (or any script, with
``script_args_converter_fn``) gets the converted ``FaultTolerancePluginScriptArgs``; a Bridge Partial its
``config.ft``; a NeMo 2.0 Partial NeMo's ``FaultToleranceCallback`` and heartbeats mode; anything else is
left alone with one warning. Heartbeat vs section timeouts follow ``mode`` (default: our trainer's
``ft.mode``; sections for other trainers, which is what Megatron-LM and Megatron-Bridge monitor).
Every change to a user setting is logged on ``megatron_resilience.plugins``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from megatron_resilience.config import CATCHABLE_SIGNALS, ConfigError
from megatron_resilience.config.validate import check_int, check_positive, fail
from megatron_resilience.plugins import (
    batch_decision,
    ft_config,
    ft_config_delivery,
    ft_features,
    ft_trainer,
    in_job_restarts,
    inprocess_restart,
    job_ports,
    megatron_lm_flags,
    node_range,
)
from megatron_resilience.plugins._executor import (
    check_signal_reaches_trainer,
    claim,
    disable_nsys,
    set_env,
)
from megatron_resilience.plugins.executors import executor_profile
from megatron_resilience.plugins.script_args import FaultTolerancePluginScriptArgs
from megatron_resilience.plugins.task_check import INPROCESS_SETUP_PLUGINS, check_task
from megatron_resilience.plugins.task_settings import remember_finished_evidence, trainer_paths, trainer_target
from megatron_resilience.upstream import (
    NEMO_RUN_FT_PARAM_FIELDS,
    ft_cfg_path_env,
    ft_launcher_accepts_nemo_run_flags,
    import_nemo_run,
    nemo_run_ft_param_flag,
    nvrx_version_for_rendering,
    parse_version,
    unaccepted_ft_launcher_flags,
)
from megatron_resilience.upstream.launcher import NVRX_FLOOR

run = import_nemo_run()
log = logging.getLogger("megatron_resilience.plugins")

NAME = "FaultTolerancePlugin"
TERMINATION_SIGNALS = CATCHABLE_SIGNALS + ("SIGKILL",)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FT_MODES = ("sections", "heartbeats")
RDZV_CONF_ENV = "PET_RDZV_CONF"


@dataclass(kw_only=True)
class FaultTolerancePlugin(run.Plugin):
    """Fault tolerance (nvidia-resiliency-ext's ft_launcher) for any trainer on any NeMo-Run executor.

    The first fields and their defaults are Megatron-Bridge's and NeMo 2.0's, but for ``num_in_job_restarts``:
    None (theirs: 3) picks by release, ``in_job_restarts.py`` says why (3 where ft_launcher cannot tell progress
    from a loop; where it can, only cycles without a newer checkpoint end the in-job restarts). Timeouts are seconds;
    section timeouts apply with ``mode="sections"``, heartbeat timeouts with ``mode="heartbeats"``; a
    section timeout of None means no limit. ``nvrx_version`` is the nvidia-resiliency-ext release of the
    cluster's container, used to render ft_launcher's settings; None -> the one installed where you submit.
    ``megatron_core_version`` likewise names the cluster's megatron-core, against which a Megatron-LM task's
    ``inprocess_restart`` is checked (``megatron_lm_flags.check_inprocess_restart``).
    ``rdzv_join_timeout`` (whole seconds, multi-node Slurm jobs): every node must join each rendezvous round
    (the first and the one after every in-job restart) within it; after a node is lost the other agents
    give up after it (exit 1) and the job is requeued. It must cover the nodes' start-up skew.
    ``min_nodes`` (Slurm): the fewest nodes the job may run on (NeMo-Run's and torchrun's ``nnodes=MIN:MAX``,
    MAX = ``executor.nodes``): a lost node without a spare shrinks the job instead of stopping it
    (``node_range.py``). The remaining fields are ft_launcher's safety features (docs/plugins.md: which release
    has which); None or False leaves ft_launcher's own default.
    """

    enable_ft_package: bool = True
    calc_ft_timeouts: bool = True
    num_in_job_restarts: int | None = None
    num_job_retries_on_failure: int = 2
    initial_rank_heartbeat_timeout: float = 1800.0
    rank_heartbeat_timeout: float = 300.0
    script_args_converter_fn: Callable[[FaultTolerancePluginScriptArgs], list[str]] | None = None
    setup_timeout: float | None = 600.0
    step_timeout: float | None = 180.0
    checkpointing_timeout: float | None = 420.0
    out_of_section_timeout: float | None = 300.0
    workload_check_interval: float = 5.0
    rank_termination_signal: str = "SIGKILL"
    log_level: str = "INFO"
    mode: str | None = None
    nvrx_version: str | None = None
    rdzv_join_timeout: int = 600
    min_nodes: int | None = None
    # ft_launcher safety features
    restart_policy: str | None = None
    use_infra_group_rank: bool | None = None
    node_health_check_endpoint: str | None = None
    enable_dist_storage_healthcheck: bool = False
    storage_health_check: bool = False
    storage_health_check_paths: list[str] | None = None
    gpu_memory_reclaim_timeout: float | None = None
    gpu_memory_tolerance_mb: float | None = None
    gpu_memory_poll_interval: float | None = None
    gpus_per_numa: int | None = None
    numa_bind_strict: bool | None = None
    attribution_endpoint: str | None = None
    attribution_stop_action: str | None = None
    per_cycle_logs: bool = False
    cycle_info: bool = False
    max_no_progress_cycles: int | None = None
    min_progress_iterations: int | None = None
    checkpoint_iteration_file: str | None = None
    no_restart_exit_code: int | None = None
    # in-process restart and node-local checkpoints (plugins/inprocess_restart.py)
    inprocess_restart: bool = False
    local_checkpoint_dir: str | None = None
    local_checkpoint_interval: int | None = None
    replication_factor: int = 1
    replication_jump: int | None = None
    # the cluster's megatron-core, for Megatron-LM's --inprocess-restart (megatron_lm_flags.check_inprocess_restart)
    megatron_core_version: str | None = None

    def __post_init__(self) -> None:
        for name in ("enable_ft_package", "calc_ft_timeouts"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{NAME}.{name}", "must be true or false", getattr(self, name))
        check_int(f"{NAME}.num_in_job_restarts", self.num_in_job_restarts, minimum=0, allow_none=True)
        check_int(f"{NAME}.num_job_retries_on_failure", self.num_job_retries_on_failure, minimum=0)
        check_int(f"{NAME}.rdzv_join_timeout", self.rdzv_join_timeout, minimum=1)
        check_int(f"{NAME}.min_nodes", self.min_nodes, minimum=1, allow_none=True)
        for name in ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "workload_check_interval"):
            check_positive(f"{NAME}.{name}", getattr(self, name))
        for name in ("setup_timeout", "step_timeout", "checkpointing_timeout", "out_of_section_timeout"):
            check_positive(f"{NAME}.{name}", getattr(self, name), allow_none=True)
        if self.rank_termination_signal not in TERMINATION_SIGNALS:
            fail(f"{NAME}.rank_termination_signal", f"must be one of {list(TERMINATION_SIGNALS)}",
                 self.rank_termination_signal)
        if self.log_level not in LOG_LEVELS:
            fail(f"{NAME}.log_level", f"must be one of {list(LOG_LEVELS)}", self.log_level)
        if self.mode is not None and self.mode not in FT_MODES:
            fail(f"{NAME}.mode", f"must be one of {list(FT_MODES)} (or None: the trainer's own)", self.mode)
        if self.script_args_converter_fn is not None and not callable(self.script_args_converter_fn):
            fail(f"{NAME}.script_args_converter_fn", "must be a function of FaultTolerancePluginScriptArgs",
                 self.script_args_converter_fn)
        if self.nvrx_version is not None:
            floor = ".".join(map(str, NVRX_FLOOR))
            allowed = f"must be a version string from '{floor}' on, like '0.7' or '0.4.1' (or None: the installed one)"
            if not isinstance(self.nvrx_version, str):  # 0.10 as a number is 0.1
                fail(f"{NAME}.nvrx_version", allowed + "; a number loses digits, quote it", self.nvrx_version)
            try:
                version = parse_version(self.nvrx_version)
            except ValueError:
                fail(f"{NAME}.nvrx_version", allowed, self.nvrx_version)
            if version < NVRX_FLOOR:
                fail(f"{NAME}.nvrx_version", allowed + f"; older releases are not supported by {NAME}",
                     self.nvrx_version)
        ft_features.validate(self)
        inprocess_restart.validate(self)
        megatron_lm_flags.validate_megatron_core_version(f"{NAME}.megatron_core_version", self.megatron_core_version)

    # ----------------------------------------------------------------------------------------------------------
    def setup(self, task: Any, executor: Any) -> None:
        profile = executor_profile(executor, NAME)
        claim(executor, NAME)
        check_task(task, executor)  # the same submit-time check as preview() and the CLI
        version, source = nvrx_version_for_rendering(self.nvrx_version)
        inprocess_restart.check_version(self, version, source)
        target = trainer_target(task, NAME, self.script_args_converter_fn)
        mode = ft_trainer.enable_ft(self, target, batch_script=profile.batch_script)
        policy = inprocess_restart.restart_policy(self, version)  # logs when in-process restart chooses it
        node_range.setup(self.min_nodes, editor=target.editor, executor=executor, profile=profile, version=version,
                         restart_policy=policy,
                         inprocess_restart=self.inprocess_restart and self.restart_policy is None)
        inprocess, replication = inprocess_restart.apply_task(self, target, executor)
        megatron_lm_flags.no_learned_timeouts_with_local_saves(target, NAME)
        inprocess_restart.check_timeouts(self, mode, inprocess)
        inprocess_restart.check_replication(self, replication, executor, profile)

        restarts = in_job_restarts.resolve(self.num_in_job_restarts, version, ft_features.progress_iteration_file(
            self, version, trainer_paths(target)))
        executor.launcher = self._launcher(executor.launcher, mode, version, profile, restarts)
        check_signal_reaches_trainer(executor, NAME)
        job_ports.install(executor, profile, NAME)
        executor._launcher_setup = False  # nemo_run derives the FT file paths when it sets the launcher up
        rendered = [nemo_run_ft_param_flag(f) for f in NEMO_RUN_FT_PARAM_FIELDS if getattr(executor.launcher, f)]
        bad = unaccepted_ft_launcher_flags(rendered, version)
        if bad:  # cannot happen by construction; a guard against nemo_run changing its spelling
            raise ConfigError(f"{NAME}: ft_launcher of nvidia-resiliency-ext {'.'.join(map(str, version))} "
                              f"would reject {bad}")
        disable_nsys(executor, target.editor, NAME, "nsys would wrap ft_launcher and be restarted with it, and "
                     "signals and in-job restarts would not reach the training ranks")
        self._set_retries(executor, profile)

        place = ft_config_delivery.job_place(executor, profile)
        features = self if policy == self.restart_policy else dataclasses.replace(self, restart_policy=policy)
        extras = ft_features.render(features, version, source, profile, trainer_paths(target), place)
        yaml_text = ft_config.render_yaml({**ft_config.ft_settings(self, mode), **extras.yaml,
                                           **megatron_lm_flags.learned_timeout_settings(target, NAME)})
        path = ft_config_delivery.ship(executor, profile, version, yaml_text, extras)
        if path is not None:
            self._set_env(executor, ft_cfg_path_env(version), path)
        for key, value in extras.env.items():
            self._set_env(executor, key, value)
        if profile.srun and executor.nnodes() > 1:  # srun starts one agent per node, each at its own time
            self._set_rdzv_join_timeout(executor)
        inprocess_restart.apply_executor(self, executor, profile, inprocess)
        code = ft_features.no_restart_exit_code(self, version)
        if profile.batch_script:
            if code is not None:  # the batch script's decision does not requeue a job ft_launcher gave up on
                batch_decision.remember_no_restart_exit_code(executor, code)
            remember_finished_evidence(executor, target)
            batch_decision.install(executor, target.editor)
        log.info("%s: ft_launcher rendered for nvidia-resiliency-ext %s (%s); mode=%s; FT config at %s",
                 NAME, ".".join(map(str, version)), source, mode, path)

    # ----------------------------------------------------------------------------------------------------------
    def _wanted_fields(self, mode: str, version: tuple[int, ...], profile: Any, restarts: int) -> dict[str, Any]:
        heartbeats = mode == "heartbeats"
        fields = {
            "workload_check_interval": float(self.workload_check_interval),
            "initial_rank_heartbeat_timeout": float(self.initial_rank_heartbeat_timeout) if heartbeats else None,
            "rank_heartbeat_timeout": float(self.rank_heartbeat_timeout) if heartbeats else None,
            "rank_termination_signal": self.rank_termination_signal,
            "log_level": self.log_level,
            "max_restarts": restarts,
        }
        if not heartbeats:
            log.info("%s: mode=sections: heartbeat timeouts are not set (section messages do not reset the "
                     "heartbeat timer); hangs are caught by the section timeouts setup=%s step=%s "
                     "checkpointing=%s out-of-section=%s", NAME, self.setup_timeout, self.step_timeout,
                     self.checkpointing_timeout, self.out_of_section_timeout)
        if not ft_launcher_accepts_nemo_run_flags(version):
            for name in NEMO_RUN_FT_PARAM_FIELDS:
                fields[name] = None
            log.info("%s: nvidia-resiliency-ext %s does not accept nemo_run's --ft-<field> flags: all FT settings "
                     "go through the FT config file only", NAME, ".".join(map(str, version)))
        if not profile.max_restarts:
            log.info("%s: num_in_job_restarts=%d does not apply on %s: nemo_run drops ft_launcher's --max-restarts "
                     "there", NAME, restarts, profile.name)
        return fields

    def _launcher(self, current: Any, mode: str, version: tuple[int, ...], profile: Any, restarts: int) -> Any:
        from nemo_run.core.execution.launcher import LAUNCHER_MAP, Launcher

        if isinstance(current, str):
            if current not in LAUNCHER_MAP:
                raise ConfigError(f"{NAME}: unknown executor.launcher {current!r}; known: {sorted(LAUNCHER_MAP)}")
            current = LAUNCHER_MAP[current]()
        wanted = self._wanted_fields(mode, version, profile, restarts)
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
                        f"(mode={mode}); configure fault tolerance on the {NAME} only")
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

    def _set_retries(self, executor: Any, profile: Any) -> None:
        n = self.num_job_retries_on_failure
        if profile.retries is None:
            if n:
                log.info("%s: num_job_retries_on_failure=%d does not apply on %s: nemo_run has no job-level "
                         "retries there (use the platform's own restart settings)", NAME, n, profile.name)
            return
        # Slurm: nemo_run writes executor.retries into the sbatch script as TORCHX_MAX_RETRIES (nothing else reads
        # it); its FT teardown stops requeueing once that many attempts in a row failed. Docker: restart count.
        retries = n + 1 if profile.retries == "slurm" else n
        why = (f"num_job_retries_on_failure={n}: nemo_run's FT sbatch script stops requeueing once "
               f"TORCHX_MAX_RETRIES=executor.retries attempts in a row failed, so a failing job runs 1 + {n} times"
               if profile.retries == "slurm" else
               f"num_job_retries_on_failure={n}: Docker's on-failure restart count")
        if executor.retries != retries:
            log.info("%s: executor.retries: %r -> %r (%s)", NAME, executor.retries, retries, why)
            executor.retries = retries

    def _set_rdzv_join_timeout(self, executor: Any) -> None:
        # ft_launcher reads --rdzv-conf from PET_RDZV_CONF (all versions); nemo_run has no field for it.
        user = executor.env_vars.get(RDZV_CONF_ENV, "")
        entries = [e for e in user.split(",") if e.strip()]
        if any(e.split("=", 1)[0].strip() == "join_timeout" for e in entries):
            raise ConfigError(f"conflicting settings: executor.env_vars[{RDZV_CONF_ENV!r}]={user!r} sets join_timeout, "
                              f"but {NAME}.rdzv_join_timeout={self.rdzv_join_timeout} does; set it on the {NAME} only")
        value = ",".join(entries + [f"join_timeout={self.rdzv_join_timeout}"])
        log.info("%s: %s=%s: the %d nodes' agents wait at most %d s for each other at every rendezvous; after a "
                 "node is lost the others exit non-zero after that long and the job is requeued", NAME,
                 RDZV_CONF_ENV, value, executor.nodes, self.rdzv_join_timeout)
        set_env(executor, RDZV_CONF_ENV, value)

    @staticmethod
    def _set_env(executor: Any, env: str, value: str) -> None:
        current = executor.env_vars.get(env)
        if current is not None and current != value:
            raise ConfigError(f"conflicting settings: executor.env_vars[{env!r}]={current!r}, but {NAME} sets it to "
                              f"{value!r}; remove the env var")
        set_env(executor, env, value)


INPROCESS_SETUP_PLUGINS.append(FaultTolerancePlugin)  # in-process restart on Slurm needs it in the job (task_check)
