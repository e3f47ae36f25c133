"""The one adapter for differences between upstream versions.

Clusters run newer releases than the machines the tests run on (Python 3.12 containers with the newest
megatron-core and nvidia-resiliency-ext): every ``if version ...`` about nemo_run, nvidia-resiliency-ext,
torch's launchers or megatron-core lives in this package and nowhere else, one module per upstream:

- :mod:`.versions`            installed / requested versions as int tuples;
- :mod:`.nemorun`             ``import nemo_run`` without torch;
- :mod:`.launcher`            ft_launcher flag spellings per nvidia-resiliency-ext version, forwarded signals;
- :mod:`.nvrx_runtime`        nvidia-resiliency-ext on the compute node (module paths, rank-monitor internals);
- :mod:`.nvrx_inprocess`      its in-process restart wrapper (health checks, messages) - imported on demand;
- :mod:`.nvrx_local_checkpoint` its node-local checkpoints (replica fetch, groups, retention) - on demand;
- :mod:`.dist_checkpointing`  megatron-core's checkpoint writer: its results queue, async strategy;
- :mod:`.harmless_warnings`   upstream warnings that ask nothing of the user, silenced by their exact text;
- :mod:`.mcore`               megatron-core layer specs, attention process groups and limits;
- :mod:`.fsdp`                the data-parallel strategies (ddp, FSDP2, Megatron-FSDP) against the installed release;
- :mod:`.torch_fsdp2`         torch FSDP2 via Megatron-Core's adapter (device mesh, grad sync, optimizer map);
- :mod:`.pytorch`             torch features not every supported torch has.

Importing this package never imports torch or megatron.
"""

from megatron_resilience.upstream.dist_checkpointing import (
    checkpoint_async_calls_queue,
    checkpoint_save_kwargs,
    install_write_results_queue,
)
from megatron_resilience.upstream.launcher import (
    LAUNCHER_FORWARDED_SIGNALS,
    NEMO_RUN_FT_PARAM_FIELDS,
    NVRX_ASSUMED_VERSION,
    TORCHRUN_SHUTDOWN_TIMEOUT_ENV,
    ft_cfg_path_env,
    ft_launcher_accepts_ignore_missing_cfg,
    ft_launcher_accepts_nemo_run_flags,
    ft_launcher_args_parser,
    ft_param_flags,
    nemo_run_ft_param_flag,
    nvrx_version_for_rendering,
    unaccepted_ft_launcher_flags,
)
from megatron_resilience.upstream.nemorun import import_nemo_run
from megatron_resilience.upstream.nvrx_runtime import (
    ft_calculate_and_set_timeouts,
    ft_end_all_sections,
    ft_section_names,
    import_fault_tolerance,
    import_straggler,
    straggler_module_name,
)
from megatron_resilience.upstream.versions import installed_versions, package_version, parse_version

__all__ = [
    "LAUNCHER_FORWARDED_SIGNALS", "NEMO_RUN_FT_PARAM_FIELDS", "NVRX_ASSUMED_VERSION", "TORCHRUN_SHUTDOWN_TIMEOUT_ENV",
    "ft_calculate_and_set_timeouts", "ft_cfg_path_env", "ft_end_all_sections", "ft_launcher_accepts_ignore_missing_cfg",
    "ft_launcher_accepts_nemo_run_flags", "ft_launcher_args_parser", "ft_param_flags", "ft_section_names",
    "import_fault_tolerance", "import_nemo_run", "import_straggler", "nemo_run_ft_param_flag",
    "nvrx_version_for_rendering", "package_version", "parse_version", "install_write_results_queue",
    "checkpoint_async_calls_queue", "checkpoint_save_kwargs", "installed_versions",
    "straggler_module_name", "unaccepted_ft_launcher_flags",
]
