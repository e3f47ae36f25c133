"""``FaultTolerancePlugin(inprocess_restart=True, local_checkpoint_dir=...)``: in-process restart and node-local
checkpoints through NeMo-Run, task and executor together.

Why the FaultTolerancePlugin and not a plugin of its own: in-process restart is the first rung of the ladder
whose second rung is ft_launcher's process restart, and both are set up from the same facts (the launcher, its
restart policy, the FT timeouts it must be ordered with); two plugins would each own half of ft_launcher and
could contradict each other. Megatron-Bridge says its in-process restart does not work with its NeMo-Run Slurm
plugins because NeMo-Run's Slurm executor runs ``srun --kill-on-bad-exit=1``; this module is what makes it work.

Task side (what the trainer must do):

* our trainer: ``inprocess.enabled=true``; with ``local_checkpoint_dir``: ``checkpoint.local_dir``,
  ``checkpoint.local_interval``, ``checkpoint.replication_factor``, ``checkpoint.replication_jump``;
* Megatron-LM (``--inprocess-restart``, ``--non-persistent-ckpt-type local``, ``--non-persistent-local-ckpt-dir``,
  ``--non-persistent-save-interval``, ``--replication``/``--replication-jump``/``--replication-factor``) and
  Megatron-Bridge (``inprocess_restart.enabled``, ``checkpoint.non_persistent_*``, ``checkpoint.replication*``),
  through the converters of ``script_args`` (or the user's ``script_args_converter_fn``);
* a Megatron-Bridge ``run.Partial``: its ``ConfigContainer``'s ``inprocess_restart`` (an ``InProcessRestartConfig``
  created when None) and ``checkpoint`` fields of the same names;
* anything else (a NeMo 2.0 Partial included: NeMo has no in-process restart): one warning.

Executor side:

* SlurmExecutor: ``--kill-on-bad-exit=0`` appended to ``srun_args`` (rendered after nemo_run's forced ``=1``;
  srun takes the last one): a rank that dies must not make srun kill the ranks the wrapper keeps alive;
* the environment the wrapper needs: ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0`` (a CUDA error surfaces as an
  exception the wrapper can handle), ``NCCL_NVLS_ENABLE=0`` (NVLink SHARP buffers are not released by an
  abort), ``TORCH_CPP_LOG_LEVEL=error`` (c10d's store-poll warnings of the wrapper's waits), and NCCL's watchdog
  heartbeat (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``) longer than the in-process hard timeout, so the watchdog never
  ends a rank the wrapper can still abort (our trainer's process groups get such timeouts in code);
* ft_launcher's restart policy: ``min-healthy`` on nvidia-resiliency-ext 0.4.x/0.5.x (restart the workers only
  when fewer than ``--nnodes``' minimum of nodes are healthy: with a fixed node count, on any failed node, which
  is our ladder's rung 2); from 0.6 only ``any-failed`` exists: every dead process restarts every worker, which
  is the same ladder for a job of fixed size (a dead rank cannot be recovered in-process here: exact resume
  keeps the world size).

Refused before submission, naming the keys: nvidia-resiliency-ext < 0.4 (no restart policy to pair with);
FT timeouts not above the in-process hard timeout (ft_launcher would kill, as hung, a rank the wrapper
restarts); a replication factor larger than the node count (or not dividing it); in-process timeouts in the
wrong order (the trainer's own ``inprocess`` validation).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from megatron_resilience.config import ConfigError, InProcessConfig
from megatron_resilience.config.validate import check_int, fail
from megatron_resilience.plugins import megatron_lm_flags
from megatron_resilience.plugins._executor import set_env
from megatron_resilience.plugins.script_args import InProcessRestartPluginScriptArgs
from megatron_resilience.plugins.task_check import task_config
from megatron_resilience.plugins.task_settings import append_script_args, warn_unknown_trainer
from megatron_resilience.tasks import partial_trainers

log = logging.getLogger("megatron_resilience.plugins")

NAME = "FaultTolerancePlugin"
KILL_ON_BAD_EXIT = "--kill-on-bad-exit=0"
NCCL_HEARTBEAT_ENV = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
NCCL_HEARTBEAT_DEFAULT = 480  # torch's default, seconds
WRAPPER_ENV = {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_CPP_LOG_LEVEL": "error"}


def requested(p: Any) -> bool:
    return bool(p.inprocess_restart or p.local_checkpoint_dir)


def validate(p: Any) -> None:
    """Field checks (from the plugin's __post_init__)."""
    if not isinstance(p.inprocess_restart, bool):
        fail(f"{NAME}.inprocess_restart", "must be true or false", p.inprocess_restart)
    if p.local_checkpoint_dir is not None and (not isinstance(p.local_checkpoint_dir, str)
                                               or not os.path.isabs(p.local_checkpoint_dir)):
        fail(f"{NAME}.local_checkpoint_dir", "must be an absolute path on the nodes' local storage (or None)",
             p.local_checkpoint_dir)
    check_int(f"{NAME}.local_checkpoint_interval", p.local_checkpoint_interval, minimum=1, allow_none=True)
    if (p.local_checkpoint_dir is None) != (p.local_checkpoint_interval is None):
        fail(f"{NAME}.local_checkpoint_interval", "and local_checkpoint_dir go together (both or neither)",
             p.local_checkpoint_interval)
    check_int(f"{NAME}.replication_factor", p.replication_factor, minimum=1)
    check_int(f"{NAME}.replication_jump", p.replication_jump, minimum=1, allow_none=True)
    if p.replication_factor > 1 and p.local_checkpoint_dir is None:
        fail(f"{NAME}.replication_factor", "needs local_checkpoint_dir (replicas are of local checkpoints)",
             p.replication_factor)


def check_version(p: Any, version: tuple[int, ...], source: str) -> None:
    if p.inprocess_restart and version < (0, 4):
        raise ConfigError(
            f"{NAME}.inprocess_restart: needs nvidia-resiliency-ext >= 0.4 (ft_launcher's --ft-restart-policy, "
            f"which pairs its process restarts with the in-process wrapper), but the job is rendered for "
            f"{'.'.join(map(str, version))} ({source}); if the cluster runs a newer release, say which: "
            f"FaultTolerancePlugin(nvrx_version='0.4')")


def restart_policy(p: Any, version: tuple[int, ...]) -> str | None:
    """The ft_launcher restart policy to render (the user's own choice wins)."""
    if not p.inprocess_restart or p.restart_policy is not None:
        return p.restart_policy
    if version >= (0, 6):
        log.info("%s: inprocess_restart: nvidia-resiliency-ext %s restarts every worker when any worker process "
                 "fails (--ft-restart-policy any-failed is the only policy there): a dead process, the in-process "
                 "wrapper's hard-timeout kills included, is always a process restart of the whole job", NAME,
                 ".".join(map(str, version)))
        return None
    log.info("%s: inprocess_restart: restart_policy -> 'min-healthy' (ft_launcher restarts the workers only when too "
             "few nodes are healthy; the in-process wrapper handles faults of live ranks)", NAME)
    return "min-healthy"


def apply_task(p: Any, target: Any, executor: Any) -> tuple[InProcessConfig, int]:
    """Set the trainer up; returns the in-process settings and replication factor it will run with (for the
    checks): our trainer's own (after the plugin's changes), another trainer's from the plugin and its defaults."""
    if target.editor is not None:
        editor = target.editor
        if p.inprocess_restart:
            editor.set("inprocess.enabled", True, "inprocess_restart")
        if p.local_checkpoint_dir:
            editor.set("checkpoint.local_dir", p.local_checkpoint_dir, "local_checkpoint_dir")
            editor.set("checkpoint.local_interval", p.local_checkpoint_interval, "local_checkpoint_interval")
            editor.set("checkpoint.replication_factor", p.replication_factor, "replication_factor")
            if p.replication_jump is not None:
                editor.set("checkpoint.replication_jump", p.replication_jump, "replication_jump")
        config, _ = task_config(target.task)
        if config is not None:
            return config.inprocess, config.checkpoint.replication_factor
        return InProcessConfig(enabled=p.inprocess_restart), p.replication_factor
    if requested(p):
        jump = p.replication_jump or (executor.nproc_per_node() if p.replication_factor > 1 else None)
        args = InProcessRestartPluginScriptArgs(
            inprocess_restart=p.inprocess_restart, local_checkpoint_dir=p.local_checkpoint_dir,
            local_checkpoint_interval=p.local_checkpoint_interval, replication_factor=p.replication_factor,
            replication_jump=jump)
        if target.bridge is not None:
            partial_trainers.configure_bridge_inprocess(
                target.bridge, enabled=p.inprocess_restart, local_dir=p.local_checkpoint_dir,
                local_interval=p.local_checkpoint_interval, replication_factor=p.replication_factor,
                replication_jump=jump, plugin=NAME)
        elif target.converter is not None:
            append_script_args(target, NAME, args)
            megatron_lm_flags.check_inprocess_restart(target, NAME, p.megatron_core_version)
        elif target.nemo is not None:
            log.warning("%s: inprocess_restart/local_checkpoint_dir on a NeMo 2.0 task: NeMo has no in-process "
                        "restart nor Megatron-style node-local checkpoints to switch on; the executor is set up (srun "
                        "keeps the ranks alive), but the trainer must wrap its training function in "
                        "nvidia-resiliency-ext's in-process restart wrapper itself", NAME)
        else:
            warn_unknown_trainer(target, NAME, "wrap its training function in nvidia-resiliency-ext's in-process "
                                 "restart wrapper (inprocess_restart) and save node-local checkpoints "
                                 "(local_checkpoint_dir)")
    elif target.converter is not None:  # the user's own --inprocess-restart: refused where it cannot work either
        megatron_lm_flags.check_inprocess_restart(target, NAME, p.megatron_core_version, by_plugin=False)
    return InProcessConfig(enabled=p.inprocess_restart), p.replication_factor  # Megatron-LM's/Bridge's defaults


def check_timeouts(p: Any, mode: str, inprocess: InProcessConfig) -> None:
    """FT must not take a rank for hung before the in-process wrapper has had its turn."""
    if not inprocess.enabled:
        return
    hard = inprocess.hard_timeout
    names = ("setup_timeout", "step_timeout", "checkpointing_timeout", "out_of_section_timeout") \
        if mode == "sections" else ("rank_heartbeat_timeout",)
    for name in names:
        value = getattr(p, name)
        if value is not None and value <= hard:
            raise ConfigError(
                f"{NAME}.{name}: must be > inprocess.hard_timeout={hard:g} with inprocess_restart (ft_launcher "
                f"would end as hung a rank that the in-process restart recovers), got {value:g}")


def check_replication(p: Any, factor: int, executor: Any, profile: Any) -> None:
    nodes = executor.nnodes()
    key = f"{NAME}.replication_factor" if p.local_checkpoint_dir else "checkpoint.replication_factor"
    if factor > 1 and (factor > nodes or nodes % factor):
        raise ConfigError(f"{key}: must be <= the node count and divide it (each replica on another node), got "
                          f"{factor} for {nodes} node(s)")


def apply_executor(p: Any, executor: Any, profile: Any, inprocess: InProcessConfig) -> None:
    if not inprocess.enabled:
        return
    if profile.srun:
        srun_args = list(executor.srun_args or [])
        bad = [a for a in srun_args if a.startswith("--kill-on-bad-exit") and a != KILL_ON_BAD_EXIT]
        if bad:
            raise ConfigError(f"conflicting settings: executor.srun_args has {bad}, but inprocess_restart needs "
                              f"{KILL_ON_BAD_EXIT} (srun must not kill the ranks the in-process wrapper keeps alive)")
        if KILL_ON_BAD_EXIT not in srun_args:
            executor.srun_args = [*srun_args, KILL_ON_BAD_EXIT]
            log.info("%s: executor.srun_args += %r (nemo_run renders --kill-on-bad-exit=1 first; srun takes the last: "
                     "a rank that dies must not make srun kill the ranks the in-process wrapper keeps alive)", NAME,
                     KILL_ON_BAD_EXIT)
    heartbeat = str(max(NCCL_HEARTBEAT_DEFAULT, int(2 * inprocess.hard_timeout)))
    for key, value in {**WRAPPER_ENV, NCCL_HEARTBEAT_ENV: heartbeat}.items():
        current = executor.env_vars.get(key)
        if current is None:
            set_env(executor, key, value)
            log.info("%s: executor.env_vars[%r] = %r (in-process restart)", NAME, key, value)
        elif key == NCCL_HEARTBEAT_ENV and float(current) <= inprocess.hard_timeout:
            raise ConfigError(f"conflicting settings: executor.env_vars[{key!r}]={current!r} must be > "
                              f"inprocess.hard_timeout={inprocess.hard_timeout:g} (NCCL's watchdog would end a rank "
                              f"the in-process wrapper can still abort)")
        elif key != NCCL_HEARTBEAT_ENV and current != value:
            raise ConfigError(f"conflicting settings: executor.env_vars[{key!r}]={current!r}, but in-process restart "
                              f"needs {value!r}")
