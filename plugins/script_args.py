"""What a plugin asks of a trainer it does not know, as command-line arguments: Megatron-Bridge's converter API.

Megatron-Bridge's plugins hand a ``PreemptionPluginScriptArgs`` / ``FaultTolerancePluginScriptArgs`` to a
``script_args_converter_fn`` that returns the arguments to append to a ``run.Script``'s ``args``; a user
whose script takes other flags writes their own function. Ours take the same dataclasses (the same field
names first; our extra fields come after, with defaults) and the same kind of function, so a converter
written for Megatron-Bridge works here unchanged.

Built in:

* :func:`megatron_bridge_args`: Megatron-Bridge's Hydra-style overrides. The exit handler as Bridge's own
  converter spells it (``train.exit_signal_handler=True`` ...). FT as ``++ft._target_=<FaultToleranceConfig>
  ++ft.enable_ft_package=true ++ft.calc_ft_timeouts=true``: Bridge's own ``ft.enable_ft_package=true``
  raises ``OverridesError`` on every recipe (their ``ConfigContainer.ft`` is None, and Hydra cannot set a
  key under None), ``+ft.`` gives a plain dict instead of a ``FaultToleranceConfig``; ``++`` with
  ``_target_`` builds the real config whether the recipe left ``ft`` None or set it (checked with Bridge's
  own parser, ``tests/test_peers_bridge.py``);
* :func:`megatron_lm_args`: Megatron-LM's ``pretrain_gpt.py`` flags (``--enable-ft-package``,
  ``--calc-ft-timeouts``, ``--exit-signal-handler``, ``--exit-signal-handler-for-dataloader``,
  ``--exit-signal``), as its argument parser spells them (``megatron/training/arguments.py``, checked
  with that parser). They are ``store_true`` flags: a setting that is off is expressed by leaving the
  flag out, and ``--exit-signal`` is given only for a signal other than SIGTERM (older Megatron-LM
  releases do not have that flag; SIGTERM is their default).

:func:`detect_converter` recognises the trainer from what the arguments say (``trainer_detect``); a
script nobody can recognise gets no converter, so no argument it might choke on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# The class Bridge's ``_target_`` override builds (megatron/bridge/training/config.py).
BRIDGE_FT_CONFIG = "megatron.bridge.training.config.FaultToleranceConfig"
BRIDGE_INPROCESS_CONFIG = "megatron.bridge.training.config.InProcessRestartConfig"  # also None in every recipe


@dataclass
class PreemptionPluginScriptArgs:
    """Arguments for PreemptionPlugin to pass to run.Script (Megatron-Bridge's fields, then ours)."""

    enable_exit_handler: bool
    enable_exit_handler_for_data_loader: bool
    exit_signal: str = "SIGTERM"


@dataclass
class FaultTolerancePluginScriptArgs:
    """Arguments for FaultTolerancePlugin to pass to run.Script (Megatron-Bridge's fields)."""

    enable_ft_package: bool
    calc_ft_timeouts: bool


@dataclass
class InProcessRestartPluginScriptArgs:
    """What ``FaultTolerancePlugin(inprocess_restart=..., local_checkpoint_*=...)`` asks of a run.Script trainer
    (ours: no Bridge counterpart; a converter gets it only when one of these is requested). ``replication_jump``
    is resolved (the executor's ranks per node when the plugin's is None)."""

    inprocess_restart: bool
    local_checkpoint_dir: str | None = None
    local_checkpoint_interval: int | None = None
    replication_factor: int = 1
    replication_jump: int | None = None


ScriptArgs = PreemptionPluginScriptArgs | FaultTolerancePluginScriptArgs | InProcessRestartPluginScriptArgs
Converter = Callable[[Any], list[str]]


def _signal_number(name: str) -> int:
    import signal

    return int(getattr(signal, name))


def megatron_bridge_args(args: ScriptArgs) -> list[str]:
    """Megatron-Bridge's Hydra-style overrides (FT in the form that parses on Bridge's recipes: module docstring)."""
    if isinstance(args, InProcessRestartPluginScriptArgs):  # Bridge's InProcessRestartConfig and CheckpointConfig
        out = [f"++inprocess_restart._target_={BRIDGE_INPROCESS_CONFIG}", "++inprocess_restart.enabled=true"] \
            if args.inprocess_restart else []
        if args.local_checkpoint_dir:
            out += ["checkpoint.non_persistent_ckpt_type=local",
                    f"checkpoint.non_persistent_local_ckpt_dir={args.local_checkpoint_dir}",
                    f"checkpoint.non_persistent_save_interval={args.local_checkpoint_interval}"]
        if args.replication_factor > 1:
            out += ["checkpoint.replication=true", f"checkpoint.replication_jump={args.replication_jump}",
                    f"checkpoint.replication_factor={args.replication_factor}"]
        return out
    if isinstance(args, FaultTolerancePluginScriptArgs):
        return [f"++ft._target_={BRIDGE_FT_CONFIG}", f"++ft.enable_ft_package={str(args.enable_ft_package).lower()}",
                f"++ft.calc_ft_timeouts={str(args.calc_ft_timeouts).lower()}"]
    out = [f"train.exit_signal_handler={args.enable_exit_handler}",
           f"train.exit_signal_handler_for_dataloader={args.enable_exit_handler_for_data_loader}"]
    if args.exit_signal != "SIGTERM":  # Bridge's TrainingConfig.exit_signal is a signal number (SIGTERM default)
        out.append(f"train.exit_signal={_signal_number(args.exit_signal)}")
    return out


def megatron_lm_args(args: ScriptArgs) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` flags; a setting that is off is left out (they are store_true flags)."""
    if isinstance(args, InProcessRestartPluginScriptArgs):  # --inprocess-*, --non-persistent-*, --replication*
        out = ["--inprocess-restart"] if args.inprocess_restart else []
        if args.local_checkpoint_dir:
            out += ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", args.local_checkpoint_dir,
                    "--non-persistent-save-interval", str(args.local_checkpoint_interval)]
        if args.replication_factor > 1:
            out += ["--replication", "--replication-jump", str(args.replication_jump), "--replication-factor",
                    str(args.replication_factor)]
        return out
    if isinstance(args, FaultTolerancePluginScriptArgs):
        return [flag for flag, on in (("--enable-ft-package", args.enable_ft_package),
                                      ("--calc-ft-timeouts", args.calc_ft_timeouts)) if on]
    out = [flag for flag, on in (("--exit-signal-handler", args.enable_exit_handler),
                                 ("--exit-signal-handler-for-dataloader", args.enable_exit_handler_for_data_loader))
           if on]
    if args.exit_signal != "SIGTERM":
        out += ["--exit-signal", args.exit_signal]
    return out


def detect_converter(task: Any) -> tuple[Converter, str] | None:
    """(converter, why) for a ``run.Script`` that runs a Megatron-LM or Megatron-Bridge trainer, else None."""
    from megatron_resilience.tasks.trainer_detect import detect_script_trainer

    found = detect_script_trainer(task)
    if found is None:
        return None
    kind, why = found
    return (megatron_lm_args if kind == "megatron_lm" else megatron_bridge_args), why


def converter_name(converter: Converter) -> str:
    return getattr(converter, "__qualname__", None) or repr(converter)


__all__ = [
    "BRIDGE_FT_CONFIG", "FaultTolerancePluginScriptArgs", "PreemptionPluginScriptArgs", "converter_name",
    "detect_converter", "megatron_bridge_args", "megatron_lm_args",
    "converter_name", "detect_converter",
    "megatron_bridge_args", "megatron_lm_args",
]
