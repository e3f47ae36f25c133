"""NeMo-Run plugins (login node, submit time). Never imports torch or megatron.

``FaultTolerancePlugin`` runs the trainer under ft_launcher with in-job restarts and job retries;
``PreemptionPlugin`` makes Slurm signal the trainer before the time limit so it checkpoints and is
requeued; ``RestartPolicyPlugin`` decides per attempt, from why it ended, whether the job continues;
``preview`` renders the sbatch script a job would run without submitting it. For a ``run.Script``
running another trainer, ``script_args_converter_fn`` turns the plugins' ``...ScriptArgs`` into its
command-line arguments (Megatron-Bridge's API; ``megatron_lm_args`` and ``megatron_bridge_args`` are
built in and picked from what the script's arguments say, ``trainer_detect``); Megatron-Bridge and NeMo 2.0
``run.Partial`` tasks are configured where those projects keep their settings (``partial_trainers``).
Importing this package makes ``run.run``/``Experiment.add`` check our tasks with or without plugins
(``submit_check.py``).
"""

from megatron_resilience.plugins.fault_tolerance import FaultTolerancePlugin
from megatron_resilience.plugins.preemption import PreemptionPlugin
from megatron_resilience.plugins.preview import preview
from megatron_resilience.plugins.restart_policy import RestartPolicyPlugin
from megatron_resilience.plugins.script_args import (
    FaultTolerancePluginScriptArgs,
    PreemptionPluginScriptArgs,
    megatron_bridge_args,
    megatron_lm_args,
)
from megatron_resilience.plugins.submit_check import install as _install_submit_check

_install_submit_check()

__all__ = ["FaultTolerancePlugin", "FaultTolerancePluginScriptArgs", "PreemptionPlugin", "PreemptionPluginScriptArgs",
           "RestartPolicyPlugin", "megatron_bridge_args", "megatron_lm_args", "preview"]
