"""nvidia-resiliency-ext's ft_launcher and torchrun: flag spellings per version, signals, shutdown timeout.

Owned by the plugins (rendering happens on the login node). No torch at import.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.upstream.versions import package_version, parse_version

# Rendering happens on the login node, the job runs ft_launcher from the cluster's container, whose
# nvidia-resiliency-ext is usually newer than the one installed here. The plugins therefore render for
# one explicit version: the FaultTolerancePlugin's ``nvrx_version`` field, else the installed one, else
# NVRX_ASSUMED_VERSION (the newest behaviour we know).
#
# | nvidia-resiliency-ext | ft param flags                      | --ignore-missing-fault-tol-cfg | cfg path flag / env            |
# |-----------------------|-------------------------------------|--------------------------------|--------------------------------|
# | <= 0.3                | --ft-param-<snake>                  | yes                            | --fault-tol-cfg-path / PET_FAULT_TOL_CFG_PATH |
# | 0.4.x                 | --ft-<kebab>, --ft-<snake>, --ft-param-<snake> | yes                 | --ft-cfg-path / PET_FT_CFG_PATH |
# | >= 0.5                | --ft-<kebab>, --ft-<snake>          | removed                        | --ft-cfg-path / PET_FT_CFG_PATH |
#
# nemo_run (0.11) renders every run.FaultTolerance field as ``--ft-<snake> VALUE`` (fields equal to 0
# or None are dropped), ``max_restarts`` as ``--max-restarts N``, and all-None fields as
# ``--ignore-missing-fault-tol-cfg``.

NVRX_ASSUMED_VERSION = (0, 7)

# run.FaultTolerance fields that nemo_run turns into ft_launcher FT-param flags.
NEMO_RUN_FT_PARAM_FIELDS = (
    "workload_check_interval", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
    "rank_termination_signal", "log_level",
)


# The oldest nvidia-resiliency-ext this package renders ft_launcher commands for and tests (0.4.1 here; the newest
# lane runs 0.7.0): an older release spells its flags ``--ft-param-*`` and lacks section timeouts.
NVRX_FLOOR = (0, 4)


def nvrx_version_for_rendering(override: str | None) -> tuple[tuple[int, ...], str]:
    """The nvidia-resiliency-ext version the ft_launcher command is rendered for, and where it came from."""
    if override is not None:
        return parse_version(override), "FaultTolerancePlugin.nvrx_version"
    installed = package_version("nvidia-resiliency-ext")
    if installed is not None:
        return installed, "installed nvidia-resiliency-ext"
    return NVRX_ASSUMED_VERSION, "assumed (nvidia-resiliency-ext not installed here)"


def ft_param_flags(field: str, version: tuple[int, ...]) -> tuple[str, ...]:
    """Every spelling of the FT-param flag for ``field`` that ft_launcher ``version`` accepts."""
    kebab = field.replace("_", "-")
    if version < (0, 4):
        return (f"--ft-param-{field}",)
    if version < (0, 5):
        return (f"--ft-{kebab}", f"--ft-{field}", f"--ft-param-{field}")
    return (f"--ft-{kebab}", f"--ft-{field}")


def nemo_run_ft_param_flag(field: str) -> str:
    """The spelling nemo_run renders for a run.FaultTolerance field."""
    return f"--ft-{field}"


def ft_launcher_accepts_nemo_run_flags(version: tuple[int, ...]) -> bool:
    """Whether ft_launcher ``version`` parses the FT-param flags nemo_run renders."""
    return all(nemo_run_ft_param_flag(f) in ft_param_flags(f, version) for f in NEMO_RUN_FT_PARAM_FIELDS)


def ft_launcher_accepts_ignore_missing_cfg(version: tuple[int, ...]) -> bool:
    return version < (0, 5)


def ft_cfg_path_env(version: tuple[int, ...]) -> str:
    """Environment variable ft_launcher reads the FT YAML path from (torch-elastic ``PET_<dest>``)."""
    return "PET_FAULT_TOL_CFG_PATH" if version < (0, 4) else "PET_FT_CFG_PATH"


def unaccepted_ft_launcher_flags(args: list[str], version: tuple[int, ...]) -> list[str]:
    """FT flags in a rendered ft_launcher argument list that ft_launcher ``version`` would reject."""
    known = {flag for field in NEMO_RUN_FT_PARAM_FIELDS for flag in ft_param_flags(field, (0, 4))}
    known |= {"--ft-param-" + f for f in NEMO_RUN_FT_PARAM_FIELDS}
    accepted = {flag for field in NEMO_RUN_FT_PARAM_FIELDS for flag in ft_param_flags(field, version)}
    bad = [a for a in args if a.split("=")[0] in known and a.split("=")[0] not in accepted]
    if "--ignore-missing-fault-tol-cfg" in args and not ft_launcher_accepts_ignore_missing_cfg(version):
        bad.append("--ignore-missing-fault-tol-cfg")
    return bad


# --- ft_launcher safety features beyond what nemo_run renders -------------------------------------------------
#
# nemo_run 0.11 renders only the run.FaultTolerance fields above. Every other ft_launcher setting reaches
# ft_launcher through one of three channels, per release:
#   "yaml": a key of the ``fault_tolerance:`` config file (PET_FT_CFG_PATH), read by FaultToleranceConfig;
#   "env":  an environment variable the release's argument parser reads for that flag (torch-elastic PET_<dest>);
#   "flag": only the command line; the plugins add it to the ft_launcher command of the sbatch script.
# Read from each release's own source (launcher.py, cli_args.py, config.py at tags v0.4.1, v0.5.0, v0.6.0 and
# the 0.7.0 wheel); the tests check the 0.4.1 and 0.7.0 rows against those releases' real parsers. The table is
# ``LAUNCHER_SETTINGS`` below (field, flag, first release, channel, what it protects against); docs/plugins.md
# points at it.
#
# Meaning changes handled here, not in the plugins: 0.6 dropped --ft-use-infra-group-rank (SLURM_PROCID is
# always used when set) and the min-healthy restart policy (--ft-restart-policy is a deprecated no-op that
# accepts only any-failed); in 0.6.x the command-line defaults of the progress flags (2 and 1) override
# the config file, so there they go on the command line. The --ft-attrsvc-host/--ft-attrsvc-port flags
# of the usage guide existed only on the development branch between 0.5.0 and 0.6.0 (never released);
# released versions take --ft-attribution-endpoint.


@dataclass(frozen=True)
class LauncherSetting:
    """One ft_launcher setting: which releases have it, how it reaches them, what it protects against."""

    field: str
    flag: str | None  # None: an environment variable only (gpus_per_numa)
    since: tuple[int, ...]
    protects: str
    removed: tuple[int, ...] | None = None
    yaml_key: str | None = None
    env: str | None = None
    flag_only_before: tuple[int, ...] | None = None  # releases >= since and < this ignore the YAML value

    def available(self, version: tuple[int, ...]) -> bool:
        return version >= self.since and (self.removed is None or version < self.removed)

    def channel(self, version: tuple[int, ...]) -> str:
        if self.yaml_key and not (self.flag_only_before and version < self.flag_only_before):
            return "yaml"
        return "env" if self.env else "flag"


# ft_launcher's exit code when it decides the job must not restart (progress tracker, attribution STOP); >= 0.7.
NO_RESTART_EXIT_CODE_DEFAULT = 93

LAUNCHER_SETTINGS: tuple[LauncherSetting, ...] = (
    LauncherSetting(field="restart_policy", flag="--ft-restart-policy", since=(0, 4),
                    protects="which failure restarts the worker group (min-healthy: only when too few nodes "
                             "are left)"),
    LauncherSetting(field="use_infra_group_rank", flag="--ft-use-infra-group-rank", since=(0, 5), removed=(0, 6),
                    yaml_key="use_infra_group_rank",
                    protects="ranks reshuffled across restarts (rank = SLURM_PROCID, not rendezvous order)"),
    LauncherSetting(field="node_health_check_endpoint", flag="--ft-node-health-check-endpoint", since=(0, 6),
                    protects="restarting onto a node its health service reports sick (checked before rendezvous)"),
    LauncherSetting(field="enable_dist_storage_healthcheck", flag="--ft-enable-dist-storage-healthcheck",
                    since=(0, 6), yaml_key="enable_dist_storage_healthcheck",
                    protects="starting on a node with a broken Lustre/NFS mount (checked before rendezvous)"),
    LauncherSetting(field="storage_health_check_paths", flag="--ft-storage-health-check-path", since=(0, 6),
                    yaml_key="storage_healthcheck_path",
                    protects="starting when the checkpoint or data directory is missing or unreadable"),
    LauncherSetting(field="gpu_memory_reclaim_timeout", flag="--ft-gpu-memory-reclaim-timeout", since=(0, 6),
                    yaml_key="gpu_memory_reclaim_timeout",
                    protects="restarted ranks running out of GPU memory still held by the killed ones"),
    LauncherSetting(field="gpu_memory_tolerance_mb", flag="--ft-gpu-memory-tolerance-mb", since=(0, 6),
                    yaml_key="gpu_memory_tolerance_mb", protects="(with gpu_memory_reclaim_timeout)"),
    LauncherSetting(field="gpu_memory_poll_interval", flag="--ft-gpu-memory-poll-interval", since=(0, 6),
                    yaml_key="gpu_memory_poll_interval", protects="(with gpu_memory_reclaim_timeout)"),
    LauncherSetting(field="gpus_per_numa", flag=None, since=(0, 6), env="NVRX_GPUS_PER_NUMA",
                    protects="ranks on the wrong NUMA node (slow host-device copies); needs numactl"),
    LauncherSetting(field="numa_bind_strict", flag="--ft-numa-bind-strict", since=(0, 6),
                    yaml_key="numa_bind_strict", protects="(with gpus_per_numa) memory bound to the same node"),
    LauncherSetting(field="attribution_endpoint", flag="--ft-attribution-endpoint", since=(0, 6),
                    yaml_key="attribution_endpoint",
                    protects="restarting blindly: the attribution service analyses each cycle's log"),
    LauncherSetting(field="per_cycle_logs", flag="--ft-per-cycle-applog-prefix", since=(0, 6),
                    env="PET_FT_PER_CYCLE_APPLOG_PREFIX",
                    protects="one log mixing every restart: one application log per restart cycle"),
    LauncherSetting(field="cycle_info", flag="--ft-cycle-info-dir", since=(0, 6), yaml_key="cycle_info_dir",
                    protects="restart history only in logs: machine-readable cycle_info files"),
    LauncherSetting(field="max_no_progress_cycles", flag="--ft-max-no-progress-cycles", since=(0, 6),
                    yaml_key="max_no_progress_cycles", flag_only_before=(0, 7),
                    protects="burning the allocation on restarts that never get past the same checkpoint"),
    LauncherSetting(field="min_progress_iterations", flag="--ft-min-progress-iterations", since=(0, 6),
                    yaml_key="min_progress_iterations", flag_only_before=(0, 7),
                    protects="(with max_no_progress_cycles) what counts as progress"),
    LauncherSetting(field="checkpoint_iteration_file", flag="--ft-checkpoint-iteration-file", since=(0, 6),
                    yaml_key="checkpoint_iteration_file",
                    protects="(with max_no_progress_cycles) where progress is read: the checkpoint tracker file"),
    LauncherSetting(field="attribution_stop_action", flag="--ft-attribution-stop-action", since=(0, 7),
                    yaml_key="attribution_stop_action",
                    protects="(with attribution_endpoint) 'log' only records a STOP verdict (shadow mode); "
                             "'no-restart' ends the job"),
    LauncherSetting(field="no_restart_exit_code", flag="--ft-no-restart-exit-code", since=(0, 7),
                    protects="requeueing a job ft_launcher decided not to restart: its own exit code for that"),
)

# ft_launcher's default where the progress tracker is on (>= 0.6): used by checks that need the effective value.
NVRX_DEFAULT_MAX_NO_PROGRESS_CYCLES = 2


def launcher_setting(field: str) -> LauncherSetting:
    return next(s for s in LAUNCHER_SETTINGS if s.field == field)


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def restart_policies(version: tuple[int, ...]) -> tuple[str, ...]:
    """Values --ft-restart-policy accepts; from 0.6 only "any-failed", a deprecated no-op."""
    return ("any-failed",) if version >= (0, 6) else ("any-failed", "min-healthy")


def progress_tracking_default_on(version: tuple[int, ...]) -> bool:
    """ft_launcher >= 0.6 tracks progress by default (max_no_progress_cycles=2) once it has an iteration file."""
    return version >= (0, 6)


# Signals a launcher catches and forwards to its workers (then SIGKILL after a grace period). Any other
# signal Slurm sends to the launcher kills the launcher itself, and the trainer never sees it.
# ft_launcher 0.4.1 installs handlers for exactly these; torchrun's default is the same (recent torch,
# e.g. 2.13 here, can add more with --signals-to-handle; older torch on clusters cannot).
LAUNCHER_FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Grace period before torchrun SIGKILLs workers it forwarded a signal to: 30 s unless this env var is
# set (read by recent torch, e.g. 2.13 here; older torch ignores it). ft_launcher 0.4.1 waits
# --term-timeout (default 1800 s).
TORCHRUN_SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


# ``--nnodes=MIN:MAX`` per release: what the rendezvous does with a node range (read from each release's
# rendezvous; 0.4.1, 0.6.0 and 0.7.0 were run here with two agents on one machine):
# - <= 0.4: the legacy rendezvous (NVIDIA's copy of torch's dynamic rendezvous): elastic. The world is the nodes
#   that joined (MIN..MAX); after a node is lost the survivors' next round closes without it, once MIN have
#   joined and ``last_call_timeout`` (rdzv conf, 30 s default) has passed.
# - 0.5: ``--ft-rdzv-impl`` legacy (the default, elastic as above) or barrier (not run here: 0.5.0 needs
#   nv_one_logger to import).
# - 0.6: barrier by default: MIN active nodes, the others hot spares (standby). Legacy is deprecated and fails
#   at worker start in 0.6.0 (AttributeError: 'FtRendezvousHandler' object has no attribute
#   '_attribution_service').
# - 0.7: barrier only: MIN active nodes (world size MIN x nproc), the others hot spares.


def elastic_node_range(version: tuple[int, ...]) -> bool:
    """Whether ft_launcher ``version`` re-forms the world from the nodes that are left within ``--nnodes=MIN:MAX``
    (True), or reads the range as MIN active nodes plus hot spares (False)."""
    return version < (0, 6)


def ft_launcher_args_parser():
    """The installed ft_launcher's own argparse parser (imports torch: tests and compute nodes only)."""
    from nvidia_resiliency_ext.fault_tolerance import launcher

    return launcher.get_args_parser()
