"""ft_launcher's safety features on the FaultTolerancePlugin: validation, version check, rendering.

The fields (node health check, storage checks, GPU memory reclaim, rank assignment, NUMA binding,
attribution, per-cycle logs, cycle info, progress tracking, the no-restart exit code, the restart
policy) are plain data on the plugin; their defaults are ft_launcher's own (None / False: not rendered).
Which nvidia-resiliency-ext release has which, and whether it reaches ft_launcher through the FT config
file, an environment variable or the command line, is the table in ``megatron_resilience.upstream.launcher``;
this module only applies it:

* a field the target release lacks is an error before submission naming the field, the release that has
  it and ``nvrx_version=`` (the release the cluster runs);
* wiring that makes the features useful for this repo's runs: the storage check checks the run's
  checkpoint and data directories unless told otherwise; the progress tracker reads the checkpoint
  tracker file (``latest_checkpointed_iteration.txt``) and, with the rerun state machine validating
  results, must allow the replay cycle after its exit 16 (a cycle without checkpoint progress by design);
  cycle-info files and per-cycle logs go to ``<job dir>/ft_cycle_info/`` and ``<job dir>/ft_cycle_logs/cycle``.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from megatron_resilience.config import ConfigError
from megatron_resilience.config.validate import fail
from megatron_resilience.upstream.launcher import (
    NO_RESTART_EXIT_CODE_DEFAULT,
    NVRX_DEFAULT_MAX_NO_PROGRESS_CYCLES,
    launcher_setting,
    progress_tracking_default_on,
    restart_policies,
    version_text,
)

log = logging.getLogger("megatron_resilience.plugins")

NAME = "FaultTolerancePlugin"
CYCLE_INFO_DIR = "ft_cycle_info"
CYCLE_LOG_PREFIX = os.path.join("ft_cycle_logs", "cycle")
RESTART_POLICIES = ("any-failed", "min-healthy")
ATTRIBUTION_STOP_ACTIONS = ("log", "no-restart")
RERUN_EXIT_CODES = (16, 17)  # the trainer's rerun state machine exits; the batch script tells them apart
_ENDPOINT = re.compile(r"^(https?|grpc)://[A-Za-z0-9._-]+:\d{1,5}(/.*)?$")


def _key(name: str) -> str:
    return f"{NAME}.{name}"


def _absolute(name: str, path: Any) -> None:
    if not isinstance(path, str) or not os.path.isabs(path) or "," in path:
        fail(_key(name), "must be an absolute path without commas", path)


def _number(name: str, value: Any, minimum: float, strict: bool) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        fail(_key(name), f"must be a finite number {'>' if strict else '>='} {minimum:g} (or None)", value)


def _integer(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (maximum and value > maximum):
        fail(_key(name), f"must be an integer {minimum}..{maximum}" if maximum else
             f"must be an integer >= {minimum}", value)


def validate(p: Any) -> None:
    """Field checks that need no task, executor or version (called from the plugin's __post_init__)."""
    for name in ("enable_dist_storage_healthcheck", "storage_health_check", "per_cycle_logs", "cycle_info"):
        if not isinstance(getattr(p, name), bool):
            fail(_key(name), "must be true or false", getattr(p, name))
    for name in ("use_infra_group_rank", "numa_bind_strict"):
        if getattr(p, name) is not None and not isinstance(getattr(p, name), bool):
            fail(_key(name), "must be true, false or None (ft_launcher's default)", getattr(p, name))
    if p.restart_policy is not None and p.restart_policy not in RESTART_POLICIES:
        fail(_key("restart_policy"), f"must be one of {list(RESTART_POLICIES)} (or None)", p.restart_policy)
    endpoint = p.node_health_check_endpoint
    if endpoint is not None and not (isinstance(endpoint, str) and os.path.isabs(endpoint.removeprefix("unix://"))):
        fail(_key("node_health_check_endpoint"), "must be a Unix socket: an absolute path or unix:///path", endpoint)
    if p.storage_health_check_paths is not None:
        if not p.storage_health_check:
            fail(_key("storage_health_check_paths"), "needs storage_health_check=True", p.storage_health_check_paths)
        if not isinstance(p.storage_health_check_paths, list) or not p.storage_health_check_paths:
            fail(_key("storage_health_check_paths"), "must be a non-empty list of absolute paths",
                 p.storage_health_check_paths)
        for path in p.storage_health_check_paths:
            _absolute("storage_health_check_paths", path)
    _number("gpu_memory_reclaim_timeout", p.gpu_memory_reclaim_timeout, 0, strict=True)
    _number("gpu_memory_tolerance_mb", p.gpu_memory_tolerance_mb, 0, strict=False)
    _number("gpu_memory_poll_interval", p.gpu_memory_poll_interval, 0, strict=True)
    _integer("gpus_per_numa", p.gpus_per_numa, 1)
    if p.numa_bind_strict is not None and p.gpus_per_numa is None:
        fail(_key("numa_bind_strict"), "needs gpus_per_numa (NUMA binding is on only with NVRX_GPUS_PER_NUMA)",
             p.numa_bind_strict)
    attribution = p.attribution_endpoint
    if attribution is not None and not (attribution == "localhost" or (isinstance(attribution, str) and (
            _ENDPOINT.match(attribution) or (attribution.startswith("unix://") and os.path.isabs(attribution[7:]))))):
        fail(_key("attribution_endpoint"), "must be 'localhost' (ft_launcher starts the service), "
             "http(s)://host:port, grpc://host:port or unix:///path", attribution)
    if p.attribution_stop_action is not None:
        if p.attribution_stop_action not in ATTRIBUTION_STOP_ACTIONS:
            fail(_key("attribution_stop_action"), f"must be one of {list(ATTRIBUTION_STOP_ACTIONS)} (or None)",
                 p.attribution_stop_action)
        if attribution is None:
            fail(_key("attribution_stop_action"), "needs attribution_endpoint", p.attribution_stop_action)
    _integer("max_no_progress_cycles", p.max_no_progress_cycles, -1)
    _integer("min_progress_iterations", p.min_progress_iterations, 1)
    if p.checkpoint_iteration_file is not None:
        _absolute("checkpoint_iteration_file", p.checkpoint_iteration_file)
    _integer("no_restart_exit_code", p.no_restart_exit_code, 1, 255)
    if p.no_restart_exit_code in RERUN_EXIT_CODES:
        fail(_key("no_restart_exit_code"), f"must differ from the rerun state machine's exit codes "
             f"{list(RERUN_EXIT_CODES)}, which the batch script treats on their own", p.no_restart_exit_code)


@dataclass
class LauncherExtras:
    """What the features add: FT config keys, environment variables, command-line flags, directories."""

    yaml: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    host_dirs: list[str] = field(default_factory=list)  # the batch script creates these (a fresh checkpoint dir)
    derived: set[str] = field(default_factory=set)  # YAML keys the plugin filled in itself (not asked for)


@dataclass
class JobPlace:
    """Where the job's own files live: the same folder seen from the batch shell and from the job step."""

    step_dir: str
    host_dir: str | None  # None: no batch script creates directories (non-Slurm executors)


class _Renderer:
    def __init__(self, plugin: Any, version: tuple[int, ...], source: str, profile: Any):
        self.p, self.version, self.source, self.profile = plugin, version, source, profile
        self.out = LauncherExtras()

    def _missing(self, name: str) -> ConfigError:
        setting = launcher_setting(name)
        what = f"ft_launcher {setting.flag}" if setting.flag else setting.env
        if setting.removed is not None and self.version >= setting.removed:
            return ConfigError(f"{_key(name)}: nvidia-resiliency-ext {version_text(setting.removed)} removed {what}, "
                               f"and the job is rendered for {version_text(self.version)} ({self.source}); "
                               f"it exists in {version_text(setting.since)}.x only")
        return ConfigError(f"{_key(name)}: needs nvidia-resiliency-ext >= {version_text(setting.since)} ({what}), "
                           f"but the job is rendered for {version_text(self.version)} ({self.source}); if the "
                           f"cluster runs a newer release, say which: FaultTolerancePlugin(nvrx_version="
                           f"'{version_text(setting.since)}')")

    def put(self, name: str, value: Any) -> None:
        setting = launcher_setting(name)
        if not setting.available(self.version):
            raise self._missing(name)
        channel = setting.channel(self.version)
        if channel == "yaml":
            self.out.yaml[setting.yaml_key] = value
        elif channel == "env":
            self.out.env[setting.env] = str(value)
        else:
            if not self.profile.command_flags:
                raise ConfigError(
                    f"{_key(name)}: nvidia-resiliency-ext {version_text(self.version)} reads it only from the "
                    f"ft_launcher command line ({setting.flag}), which nemo_run cannot extend; the plugin adds it "
                    f"in the sbatch script, so it needs a SlurmExecutor (got {self.profile.name})")
            text = str(value).lower() if isinstance(value, bool) else str(value)
            self.out.flags += [setting.flag, text]


def render(p: Any, version: tuple[int, ...], source: str, profile: Any, paths: Any, place: JobPlace,
           ) -> LauncherExtras:
    """The features of plugin ``p`` for ft_launcher ``version`` on ``profile``'s executor; errors before submission."""
    r = _Renderer(p, version, source, profile)
    if p.restart_policy is not None:
        if p.restart_policy not in restart_policies(version):
            raise ConfigError(f"{_key('restart_policy')}: nvidia-resiliency-ext {version_text(version)} accepts only "
                              f"{list(restart_policies(version))} ({source}); the min-healthy policy exists up to 0.5")
        if version >= (0, 6):
            log.info("%s: restart_policy=%r not rendered: nvidia-resiliency-ext %s always restarts when any "
                     "worker group fails (--ft-restart-policy is a deprecated no-op there)", NAME, p.restart_policy,
                     version_text(version))
        else:
            r.put("restart_policy", p.restart_policy)
    if p.use_infra_group_rank is not None:
        if version >= (0, 6) and p.use_infra_group_rank:
            log.info("%s: use_infra_group_rank=True not rendered: nvidia-resiliency-ext %s always takes ranks from "
                     "SLURM_PROCID when it is set", NAME, version_text(version))
        else:
            r.put("use_infra_group_rank", p.use_infra_group_rank)
    if p.node_health_check_endpoint is not None:
        r.put("node_health_check_endpoint", p.node_health_check_endpoint)
    if p.enable_dist_storage_healthcheck:
        r.put("enable_dist_storage_healthcheck", True)
    if p.storage_health_check:
        _storage_paths(r, paths, place)
    for name in ("gpu_memory_reclaim_timeout", "gpu_memory_tolerance_mb", "gpu_memory_poll_interval"):
        if getattr(p, name) is not None:
            r.put(name, float(getattr(p, name)))
    if p.gpus_per_numa is not None:
        r.put("gpus_per_numa", p.gpus_per_numa)
    if p.numa_bind_strict is not None:
        r.put("numa_bind_strict", p.numa_bind_strict)
    for name in ("attribution_endpoint", "attribution_stop_action"):
        if getattr(p, name) is not None:
            r.put(name, getattr(p, name))
    if p.cycle_info:  # ft_launcher creates both folders itself
        r.put("cycle_info", os.path.join(place.step_dir, CYCLE_INFO_DIR))
    if p.per_cycle_logs:
        r.put("per_cycle_logs", os.path.join(place.step_dir, CYCLE_LOG_PREFIX))
    _progress(r, paths)
    if p.no_restart_exit_code is not None:
        r.put("no_restart_exit_code", p.no_restart_exit_code)
    return r.out


def no_restart_exit_code(p: Any, version: tuple[int, ...]) -> int | None:
    """The exit code ft_launcher ends with when it decides the job must not restart (None: no such code)."""
    if version < launcher_setting("no_restart_exit_code").since:
        return None
    return p.no_restart_exit_code or NO_RESTART_EXIT_CODE_DEFAULT


def _storage_paths(r: _Renderer, paths: Any, place: JobPlace) -> None:
    chosen = r.p.storage_health_check_paths
    if chosen is None:
        chosen = paths.storage_dirs()
        if not chosen:
            raise ConfigError(f"{_key('storage_health_check')}: the task names no checkpoint or data directory the "
                              f"plugin can read; set storage_health_check_paths=[...] (absolute paths)")
        log.info("%s: storage_health_check: ft_launcher checks %s before rendezvous (the run's checkpoint and data "
                 "directories)", NAME, chosen)
    r.put("storage_health_check_paths", ",".join(chosen))
    if paths.checkpoint_save in chosen:
        if place.host_dir:
            r.out.host_dirs.append(paths.checkpoint_save)  # a fresh run's checkpoint directory does not exist yet
        else:
            log.info("%s: storage_health_check: %s must exist before the job starts (%s runs no batch script "
                     "that could create it)", NAME, paths.checkpoint_save, r.profile.name)


def progress_tracked(p: Any, version: tuple[int, ...]) -> bool:
    """Whether ft_launcher ``version`` stops restarting a worker group that makes no progress (given a file)."""
    return progress_tracking_default_on(version) and (p.max_no_progress_cycles is None or p.max_no_progress_cycles > 0)


def progress_iteration_file(p: Any, version: tuple[int, ...], paths: Any) -> str | None:
    """The file ft_launcher's progress tracker reads the last checkpoint's iteration from (None: no tracking)."""
    if not progress_tracked(p, version):
        return None
    return p.checkpoint_iteration_file or paths.tracker_file or None


def _progress(r: _Renderer, paths: Any) -> None:
    p, version = r.p, r.version
    for name in ("max_no_progress_cycles", "min_progress_iterations"):
        if getattr(p, name) is not None:
            r.put(name, getattr(p, name))
    tracking = progress_tracked(p, version)
    iteration_file = p.checkpoint_iteration_file
    if iteration_file is None and tracking and paths.tracker_file:
        iteration_file = paths.tracker_file
        log.info("%s: ft_launcher's progress tracker reads the checkpoint tracker file %s (no restart cycle may "
                 "pass without a newer checkpoint more than %s times in a row)", NAME, iteration_file,
                 p.max_no_progress_cycles or NVRX_DEFAULT_MAX_NO_PROGRESS_CYCLES)
    if iteration_file is not None:
        r.put("checkpoint_iteration_file", iteration_file)
        if p.checkpoint_iteration_file is None:
            r.out.derived.add("checkpoint_iteration_file")
    limit = p.max_no_progress_cycles if p.max_no_progress_cycles is not None else NVRX_DEFAULT_MAX_NO_PROGRESS_CYCLES
    if iteration_file and tracking and paths.rerun_mode == "validate_results" and limit < 2:
        raise ConfigError(
            f"{_key('max_no_progress_cycles')}: must be >= 2 (or <= 0: off) while the rerun state machine validates "
            f"results (rerun_mode=validate_results): after its exit 16 the next cycle replays the suspicious step "
            f"from the same checkpoint, a cycle without checkpoint progress by design; got {limit}")


__all__ = ["CYCLE_INFO_DIR", "CYCLE_LOG_PREFIX", "JobPlace", "LauncherExtras", "no_restart_exit_code",
           "progress_iteration_file", "progress_tracked", "render", "validate"]
