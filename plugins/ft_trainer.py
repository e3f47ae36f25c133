"""FaultTolerancePlugin's task side: switch FT on in whichever trainer the task runs; the FT mode that fits it.

* our trainer: ``ft.enabled``, ``ft.calc_ft_timeouts`` (and ``ft.mode`` when the plugin sets one); the mode
  is the trainer's;
* a Megatron-LM / Megatron-Bridge script (or any script with ``script_args_converter_fn``): the converted
  ``FaultTolerancePluginScriptArgs``; sections mode (what both report); Megatron-LM also ``--load`` when it gives
  ``--save`` only (``megatron_lm_flags``);
* a Megatron-Bridge ``run.Partial``: ``config.ft`` (created when None) as Bridge's plugin set it; sections;
* a NeMo 2.0 ``run.Partial``: NeMo's ``FaultToleranceCallback(autoresume=True, calculate_timeouts=...,
  exp_dir=<log dir>)`` in ``trainer.callbacks``, and heartbeats mode: that callback sends heartbeats only,
  so under section timeouts a healthy worker would be killed after the out-of-section timeout;
* anything else: one warning saying what the trainer must do itself; sections unless ``mode`` says.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins import megatron_lm_flags
from megatron_resilience.plugins.script_args import FaultTolerancePluginScriptArgs
from megatron_resilience.plugins.task_settings import TrainerTarget, append_script_args, warn_unknown_trainer
from megatron_resilience.tasks import partial_trainers

log = logging.getLogger("megatron_resilience.plugins")
NAME = "FaultTolerancePlugin"


def _nemo(plugin: Any, target: TrainerTarget) -> str:
    if plugin.mode == "sections":
        raise ConfigError(f"{NAME}.mode: 'sections' cannot monitor a NeMo 2.0 task: NeMo's FaultToleranceCallback "
                          "sends heartbeats only, and ft_launcher would kill a healthy worker after the out-of-section "
                          "timeout; use mode='heartbeats' or leave mode=None")
    if plugin.enable_ft_package:
        callback = partial_trainers.callback_config(
            partial_trainers.NEMO_FT_CALLBACK, NAME, autoresume=True, calculate_timeouts=plugin.calc_ft_timeouts,
            exp_dir=partial_trainers.nemo_log_dir(target.task))
        partial_trainers.merge_callbacks(target.nemo, [callback], NAME)
    else:
        log.info("%s: enable_ft_package=False: no FaultToleranceCallback is added to the NeMo trainer", NAME)
    log.info("%s: mode=heartbeats for a NeMo 2.0 task: NeMo's FaultToleranceCallback sends heartbeats only (under "
             "section timeouts ft_launcher would kill a healthy worker after the out-of-section timeout); its "
             "autoresume touches $FAULT_TOL_FINISHED_FLAG_FILE when training finished", NAME)
    return "heartbeats"


def enable_ft(plugin: Any, target: TrainerTarget, *, batch_script: bool) -> str:
    """Enable FT in the task's trainer (logged); returns the FT mode the launcher is set up for."""
    if target.editor is not None:
        editor = target.editor
        editor.set("ft.enabled", plugin.enable_ft_package, "enable_ft_package")
        editor.set("ft.calc_ft_timeouts", plugin.calc_ft_timeouts, "calc_ft_timeouts")
        if plugin.mode is not None:
            editor.set("ft.mode", plugin.mode, "mode")
        return editor.get("ft.mode")
    if target.nemo is not None:
        return _nemo(plugin, target)
    if target.bridge is not None:
        partial_trainers.configure_bridge_ft(target.bridge, enable_ft_package=plugin.enable_ft_package,
                                             calc_ft_timeouts=plugin.calc_ft_timeouts, plugin=NAME)
    elif target.converter is not None:
        append_script_args(target, NAME, FaultTolerancePluginScriptArgs(
            enable_ft_package=plugin.enable_ft_package, calc_ft_timeouts=plugin.calc_ft_timeouts))
        megatron_lm_flags.ensure_load(target, NAME)
    else:
        warn_unknown_trainer(target, NAME, "talk to ft_launcher's rank monitor (nvidia-resiliency-ext's "
                             "RankMonitorClient: sections setup/step/checkpointing, or heartbeats with "
                             "mode='heartbeats'), i.e. enable_ft_package, and learn timeouts if wanted "
                             "(calc_ft_timeouts)")
    if batch_script:
        log.info("%s: on Slurm a trainer that never touches $FAULT_TOL_FINISHED_FLAG_FILE (nvidia-resiliency-ext's "
                 "autoresume contract) is judged finished by the job-level decision from its checkpoint tracker "
                 "against train_iters or its end-of-training line; a trainer it cannot read is requeued until the "
                 "failure limit", NAME)
    if plugin.mode is None:
        log.info("%s: mode=sections for a trainer other than megatron_resilience (Megatron-LM and "
                 "Megatron-Bridge report setup/step/checkpointing sections); set mode='heartbeats' for one "
                 "that sends heartbeats", NAME)
    return plugin.mode or "sections"


__all__ = ["enable_ft"]
