"""Other projects' spellings of our override keys: Megatron-Bridge and Megatron-LM users keep theirs.

A Megatron-Bridge user writes ``ft.enable_ft_package=true`` (Bridge's ``FaultToleranceConfig``) where
our trainer says ``ft.enabled=true``; ``nvrx_straggler.*`` where we say ``straggler.*``;
``rerun_state_machine.*`` for our ``rerun.*``; Megatron-LM's ``train_iters`` for our ``max_steps``.
Only settings with the same meaning are listed (a key whose meaning differs is better rejected than
silently mapped). :func:`canonical_key` is applied by ``config.overrides.parse_override`` before the
key is resolved, so every reader (``python -m megatron_resilience``, the recipes, the CLI) accepts
both spellings, and the final config (printed by ``--dryrun``) carries only the canonical name.

Plain data, stdlib only.
"""

from __future__ import annotations

from megatron_resilience.config.inprocess import BRIDGE_FIELDS

# Bridge's NVRxStragglerDetectionConfig and our StragglerConfig share these fields one to one.
_STRAGGLER_FIELDS = (
    "enabled", "report_time_interval", "calc_relative_gpu_perf", "calc_individual_gpu_perf",
    "num_gpu_perf_scores_to_print", "gpu_relative_perf_threshold", "gpu_individual_perf_threshold",
    "stop_if_detected", "enable_logging", "profiling_interval", "logger_name",
)
# Megatron-LM's / Bridge's RerunStateMachineConfig and our RerunConfig share these fields.
_RERUN_FIELDS = ("rerun_mode", "check_for_nan_in_loss", "check_for_spiky_loss", "error_injection_rate",
                 "error_injection_type")
_INPROCESS_FIELDS = BRIDGE_FIELDS

KEY_ALIASES: dict[str, str] = {
    "ft.enable_ft_package": "ft.enabled",  # Megatron-Bridge FaultToleranceConfig / Megatron-LM --enable-ft-package
    "train.train_iters": "train.max_steps",  # Megatron-LM --train-iters, Bridge train.train_iters
    **{f"nvrx_straggler.{name}": f"straggler.{name}" for name in _STRAGGLER_FIELDS},
    **{f"rerun_state_machine.{name}": f"rerun.{name}" for name in _RERUN_FIELDS},
    # Megatron-Bridge's InProcessRestartConfig is our inprocess section (same field names and meanings).
    **{f"inprocess_restart.{name}": f"inprocess.{name}" for name in _INPROCESS_FIELDS},
    # Megatron-Bridge's CheckpointConfig spelling of the non-persistent (local) tier.
    "checkpoint.non_persistent_local_ckpt_dir": "checkpoint.local_dir",
    "checkpoint.non_persistent_save_interval": "checkpoint.local_interval",
}

# Values that other projects spell differently for the same setting, per canonical key.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "rerun.rerun_mode": {"report_determinism_stats": "report_stats"},  # Megatron-Bridge's name
}


def canonical_key(key: str) -> str:
    """Our name for ``key`` (unchanged when it already is ours or is unknown)."""
    return KEY_ALIASES.get(key, key)


def canonical_value(key: str, raw: str) -> str:
    """Our spelling of a value another project writes differently for canonical ``key``."""
    return VALUE_ALIASES.get(key, {}).get(raw.strip(), raw)


__all__ = ["KEY_ALIASES", "VALUE_ALIASES", "canonical_key", "canonical_value"]
