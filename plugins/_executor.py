"""Executor-side helpers shared by the plugins: supported executors, conflicts, nsys, sbatch blocks, paths.

Plugins run at submit time on clones of the executor (``Experiment._add_single_job`` assigns the
executor first, so ``job_dir``, ``job_name`` and ``tunnel.job_dir`` are final here).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins.job_plan import plan_of
from megatron_resilience.upstream import LAUNCHER_FORWARDED_SIGNALS, import_nemo_run

log = logging.getLogger("megatron_resilience.plugins")

_BLOCK_BEGIN = "# >>> megatron_resilience {name} >>>"
_BLOCK_END = "# <<< megatron_resilience {name} <<<"


def claim(executor: Any, plugin: str) -> None:
    """Reject a second plugin of the same kind on one job: their settings would silently fight.

    The mark is in the job's plan (``job_plan.py``): it never reaches the sbatch script or the serialized executor.
    """
    claims = plan_of(executor).claims
    if plugin in claims:
        raise ConfigError(f"conflicting plugins: {plugin} is given twice for the same job; "
                          f"pass one {plugin} with all its settings")
    claims.append(plugin)


def disable_nsys(executor: Any, editor: Any, plugin: str, reason: str) -> None:
    """Turn off nsys requested on the launcher or in the task, with a warning saying why."""
    launcher = executor.launcher
    if launcher is not None and not isinstance(launcher, str) and getattr(launcher, "nsys_profile", False):
        launcher.nsys_profile = False
        log.warning("%s: turned off nsys profiling requested on executor.launcher (nsys_profile=True -> False): %s",
                    plugin, reason)
    if editor is not None and editor.drop_nsys():
        log.warning("%s: removed the 'nsys' wrapper from the task's trainer command: %s", plugin, reason)


def set_setup_block(executor: Any, name: str, body: str | None) -> None:
    """Add, replace or (body None) remove our named block in ``executor.setup_lines``.

    setup_lines run in the sbatch script after the exports and before nemo_run's FT setup and the
    srun; the user's own lines are kept as they are.
    """
    begin, end = _BLOCK_BEGIN.format(name=name), _BLOCK_END.format(name=name)
    current = executor.setup_lines or ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    current = pattern.sub("", current)
    if body is not None:
        block = f"{begin}\n{body.rstrip()}\n{end}\n"
        current = (current.rstrip("\n") + "\n" + block) if current.strip() else block
    executor.setup_lines = current or None


def has_setup_block(executor: Any, name: str) -> bool:
    return _BLOCK_BEGIN.format(name=name) in (executor.setup_lines or "")


def slurm_job_file(executor: Any, filename: str) -> tuple[str, str]:
    """(path in the batch shell, path inside the job step) of a file in the job's directory on the cluster.

    The batch shell runs on the host, where the job directory is ``<tunnel.job_dir>/<job dir name>``
    (the directory that holds the sbatch logs, so it exists on shared storage before the job starts).
    Job steps see it as ``/nemo_run`` in containers; without a container nemo_run rewrites
    ``/nemo_run`` in the sbatch script to the host path, so the second path is right in both modes.
    """
    import_nemo_run()
    from nemo_run.config import RUNDIR_NAME

    host_dir = os.path.join(executor.tunnel.job_dir, Path(executor.job_dir).name)
    return os.path.join(host_dir, filename), os.path.join("/", RUNDIR_NAME, filename)


# Env vars the plugins set, exported after the user's own in this order whatever order the plugins ran in.
PLUGIN_ENV_ORDER = ("PET_FT_CFG_PATH", "PET_FAULT_TOL_CFG_PATH", "PET_FT_PER_CYCLE_APPLOG_PREFIX", "NVRX_GPUS_PER_NUMA",
                    "PET_RDZV_CONF", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "MEGATRON_RESILIENCE_JOB_PORT",
                    "TORCH_NCCL_RETHROW_CUDA_ERRORS", "NCCL_NVLS_ENABLE", "TORCH_CPP_LOG_LEVEL",
                    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")


def set_env(executor: Any, key: str, value: str) -> None:
    env = {**executor.env_vars, key: value}
    ours = [k for k in PLUGIN_ENV_ORDER if k in env]
    executor.env_vars = {**{k: v for k, v in env.items() if k not in ours}, **{k: env[k] for k in ours}}


def launcher_name(launcher: Any) -> str | None:
    """"ft_launcher" / "torchrun" for the launchers that start the trainer as their child, else None."""
    run = import_nemo_run()
    if launcher == "ft" or isinstance(launcher, run.FaultTolerance):
        return "ft_launcher"
    if launcher == "torchrun" or isinstance(launcher, run.Torchrun):
        return "torchrun"
    return None


def remember_preemption_signal(executor: Any, signal: str) -> None:
    plan_of(executor).preemption_signal = signal


def check_signal_reaches_trainer(executor: Any, plugin: str) -> None:
    """The preemption signal must be one the launcher forwards; called by both plugins (any order)."""
    signal, name = plan_of(executor).preemption_signal, launcher_name(executor.launcher)
    if signal and name and signal not in LAUNCHER_FORWARDED_SIGNALS:
        raise ConfigError(
            f"{plugin}: PreemptionPlugin.signal={signal} would not reach the trainer: {name} forwards only "
            f"{', '.join(LAUNCHER_FORWARDED_SIGNALS)} to the training ranks (any other signal ends {name} "
            f"itself); use one of those")
