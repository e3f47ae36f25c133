"""How ft_launcher's config file reaches the node, per executor: the behaviour behind a profile's ``ft_config``.

nemo_run renders only a few ft_launcher settings (``run.FaultTolerance``); section timeouts and the safety
features reach ft_launcher through its YAML config file (``PET_FT_CFG_PATH``), which the plugin has to put
where the job will read it. Each executor offers a different way, named by ``ExecutorProfile.ft_config``
(``plugins/executors.py``); this module is the one place that knows what each way does, so the plugin has no
per-executor branch and a new executor is a profile row plus, at most, one function here:

* ``sbatch``: the sbatch script writes the file into the job directory (a heredoc before the job step) and, where
  ft_launcher reads a feature only from its command line, wraps the step's ft_launcher with those flags;
* ``local_file``: a file under NEMORUN_HOME, which the local job reads directly;
* ``docker_volume`` / ``skypilot_file_mount``: that file, mounted read-only into the container / shipped as a
  SkyPilot file mount;
* ``lepton_pre_launch``: ``pre_launch_commands`` write it inside the job;
* None (DGX Cloud, Kubeflow): no way; settings that need the file are an error, the rest is a warning.

Every change to the executor is logged.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins import ft_config, ft_features, node_range
from megatron_resilience.plugins._executor import set_setup_block, slurm_job_file
from megatron_resilience.upstream.launcher import elastic_node_range

log = logging.getLogger("megatron_resilience.plugins")

NAME = "FaultTolerancePlugin"
FT_CFG_BLOCK = "FaultTolerancePlugin ft_launcher config"
FT_FLAGS_BLOCK = "FaultTolerancePlugin ft_launcher flags"
CONTAINER_FT_CFG_DIR = "/megatron_resilience/ft_configs"  # where Docker/SkyPilot jobs see the FT config file


def job_place(executor: Any, profile: Any) -> ft_features.JobPlace:
    """Where the job's own files live, seen from the batch shell (Slurm) and from the job step."""
    if profile.batch_script:
        host, step = slurm_job_file(executor, "")
        return ft_features.JobPlace(step_dir=step.rstrip("/"), host_dir=host.rstrip("/"))
    if profile.kind == "local":
        return ft_features.JobPlace(step_dir=executor.job_dir, host_dir=None)
    return ft_features.JobPlace(step_dir="/nemo_run", host_dir=None)  # nemo_run's job-dir mount in containers


def ship(executor: Any, profile: Any, version: tuple[int, ...], yaml_text: str,
         extras: ft_features.LauncherExtras) -> str | None:
    """Put the FT config where ft_launcher on ``profile``'s executor reads it; its path there (None: nowhere)."""
    way = _WAYS.get(profile.ft_config)
    if way is None:
        return _nowhere(profile, extras)
    return way(executor, version, yaml_text, extras)


def _by_sbatch(executor: Any, version: tuple[int, ...], yaml_text: str, extras: ft_features.LauncherExtras) -> str:
    host_path, path = slurm_job_file(executor, f"{executor.job_name}_ft_cfg.yml")
    set_setup_block(executor, FT_CFG_BLOCK, ft_config.sbatch_block(host_path, yaml_text, extras.host_dirs))
    ranged = node_range.remembered(executor)
    srun = {} if ranged is None else {"nnodes": node_range.ft_launcher_nnodes(ranged["min_nodes"], version),
                                      "keep_survivors": elastic_node_range(version)}
    set_setup_block(executor, FT_FLAGS_BLOCK,
                    ft_config.launcher_flags_block(extras.flags, **srun) if extras.flags or srun else None)
    return path


def _by_pre_launch(executor: Any, version: tuple[int, ...], yaml_text: str,
                   extras: ft_features.LauncherExtras) -> str:
    path = f"/tmp/megatron_resilience/{executor.job_name}_ft_cfg.yml"
    executor.pre_launch_commands = [*executor.pre_launch_commands, *ft_config.pre_launch_lines(path, yaml_text)]
    log.info("%s: executor.pre_launch_commands += writing the FT config to %s", NAME, path)
    return path


def _local_file(yaml_text: str) -> str:
    from nemo_run.config import get_nemorun_home

    return ft_config.write_local(get_nemorun_home(), yaml_text)


def _as_file(executor: Any, version: tuple[int, ...], yaml_text: str, extras: ft_features.LauncherExtras) -> str:
    return _local_file(yaml_text)


def _as_docker_volume(executor: Any, version: tuple[int, ...], yaml_text: str,
                      extras: ft_features.LauncherExtras) -> str:
    local = _local_file(yaml_text)
    volume = f"{os.path.dirname(local)}:{CONTAINER_FT_CFG_DIR}:ro"
    if volume not in executor.volumes:
        executor.volumes = [*executor.volumes, volume]
        log.info("%s: executor.volumes += %r (the FT config file)", NAME, volume)
    return os.path.join(CONTAINER_FT_CFG_DIR, os.path.basename(local))


def _as_skypilot_mount(executor: Any, version: tuple[int, ...], yaml_text: str,
                       extras: ft_features.LauncherExtras) -> str:
    local = _local_file(yaml_text)
    path = os.path.join(CONTAINER_FT_CFG_DIR, os.path.basename(local))
    executor.file_mounts = {**(executor.file_mounts or {}), path: local}
    log.info("%s: executor.file_mounts[%r] = %r (the FT config file)", NAME, path, local)
    return path


def _nowhere(profile: Any, extras: ft_features.LauncherExtras) -> None:
    asked = sorted(set(extras.yaml) - extras.derived)
    if asked:
        raise ConfigError(f"{NAME}: {', '.join(asked)} reach ft_launcher only through its config "
                          f"file, and nemo_run gives plugins no way to ship a file to {profile.name}; use a "
                          f"SlurmExecutor, LocalExecutor, DockerExecutor, SkypilotExecutor or LeptonExecutor")
    log.warning("%s: %s: nemo_run gives plugins no way to ship ft_launcher's config file there, so the "
                "section timeouts do not apply (ft_launcher gets only the heartbeat timeouts, check interval, "
                "termination signal and log level nemo_run renders); with mode=sections hangs are not "
                "detected there, crashes are%s", NAME, profile.name,
                f"; not applied either: {', '.join(sorted(extras.derived))}" if extras.derived else "")
    return None


_WAYS: dict[str, Callable[..., str]] = {
    "sbatch": _by_sbatch, "local_file": _as_file, "docker_volume": _as_docker_volume,
    "skypilot_file_mount": _as_skypilot_mount, "lepton_pre_launch": _by_pre_launch,
}

__all__ = ["CONTAINER_FT_CFG_DIR", "FT_CFG_BLOCK", "FT_FLAGS_BLOCK", "job_place", "ship"]
