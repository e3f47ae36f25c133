"""What a plugin asks of a trainer it does not know, as command-line arguments: Megatron-Bridge's converter API.

Megatron-Bridge's plugins hand a ``PreemptionPluginScriptArgs`` / ``FaultTolerancePluginScriptArgs`` to a
``script_args_converter_fn`` that returns the arguments to append to a ``run.Script``'s ``args``; a user
whose script takes other flags writes their own function. Ours take the same dataclasses (the same field
names first; our extra fields come after, with defaults) and the same kind of function, so a converter
written for Megatron-Bridge works here unchanged.

Built in:

* :func:`megatron_bridge_args`: Megatron-Bridge's Hydra-style overrides (``ft.enable_ft_package=true``,
  ``train.exit_signal_handler=True`` ...), what Bridge's plugins append by default;
* :func:`megatron_lm_args`: Megatron-LM's ``pretrain_gpt.py`` flags (``--enable-ft-package``,
  ``--calc-ft-timeouts``, ``--exit-signal-handler``, ``--exit-signal-handler-for-dataloader``,
  ``--exit-signal``), as its argument definitions spell them (``megatron/training/arguments.py`` and the
  ``TrainingConfig`` dataclass its parser is built from). They are ``store_true`` flags: a setting
  that is off is expressed by leaving the flag out, and ``--exit-signal`` is given only for a signal
  other than SIGTERM (older Megatron-LM releases do not have that flag; SIGTERM is their default).

:func:`detect_converter` picks one of them for a ``run.Script`` whose arguments look like that
trainer's command line; anything else gets no converter (and one warning from the plugin).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable

# Megatron-Bridge's ConfigContainer sections: the first part of its Hydra-style override keys.
BRIDGE_SECTIONS = (
    "rng", "rerun_state_machine", "train", "model", "optimizer", "ddp", "validation", "scheduler", "dataset",
    "logger", "tokenizer", "checkpoint", "dist", "ft", "straggler", "nvrx_straggler", "profiling", "peft",
    "comm_overlap", "mixed_precision", "tensor_inspect", "inprocess_restart",
)
# Flags every Megatron-LM pretraining command line carries (megatron/training/arguments.py).
MEGATRON_LM_FLAGS = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size", "--global-batch-size",
    "--train-iters", "--train-samples", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
)
_BRIDGE_OVERRIDE = re.compile(r"^\+{0,2}(" + "|".join(BRIDGE_SECTIONS) + r")\.[A-Za-z_][\w.]*=")


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
    """Megatron-Bridge's Hydra-style overrides, spelled as Bridge's own default converters spell them."""
    if isinstance(args, InProcessRestartPluginScriptArgs):  # Bridge's InProcessRestartConfig and CheckpointConfig
        out = ["inprocess_restart.enabled=true"] if args.inprocess_restart else []
        if args.local_checkpoint_dir:
            out += ["checkpoint.non_persistent_ckpt_type=local",
                    f"checkpoint.non_persistent_local_ckpt_dir={args.local_checkpoint_dir}",
                    f"checkpoint.non_persistent_save_interval={args.local_checkpoint_interval}"]
        if args.replication_factor > 1:
            out += ["checkpoint.replication=true", f"checkpoint.replication_jump={args.replication_jump}",
                    f"checkpoint.replication_factor={args.replication_factor}"]
        return out
    if isinstance(args, FaultTolerancePluginScriptArgs):
        return [f"ft.enable_ft_package={str(args.enable_ft_package).lower()}",
                f"ft.calc_ft_timeouts={str(args.calc_ft_timeouts).lower()}"]
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
    if task.inline:
        return None
    args = [str(a) for a in task.args]
    script = os.path.basename(str(task.path))
    megatron_lm = [a.split("=")[0] for a in args if a.split("=")[0] in MEGATRON_LM_FLAGS]
    if megatron_lm:
        return megatron_lm_args, f"Megatron-LM command line (flags {', '.join(megatron_lm[:3])})"
    bridge = [a.split("=")[0] for a in args if _BRIDGE_OVERRIDE.match(a)]
    if bridge:  # Bridge's recipe scripts are named pretrain_*.py too: its overrides decide first
        return megatron_bridge_args, f"Megatron-Bridge Hydra-style overrides ({', '.join(bridge[:3])})"
    if re.fullmatch(r"pretrain_\w+\.py", script):
        return megatron_lm_args, f"Megatron-LM command line (script {script})"
    return None


def converter_name(converter: Converter) -> str:
    return getattr(converter, "__qualname__", None) or repr(converter)


__all__ = [
    "FaultTolerancePluginScriptArgs", "InProcessRestartPluginScriptArgs", "PreemptionPluginScriptArgs",
    "converter_name", "detect_converter",
    "megatron_bridge_args", "megatron_lm_args",
]
