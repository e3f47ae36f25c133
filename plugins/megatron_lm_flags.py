"""What a Megatron-LM command line needs under the plugins beyond the flags they convert.

The converted flags (``script_args.megatron_lm_args``) switch Megatron-LM's own features on; restarting it needs
more, which its users forget because a single run never shows it (facts with their releases:
``megatron_resilience/upstream/megatron_lm.py``):

* ``--load`` when only ``--save`` is given (:func:`ensure_load`, both plugins): Megatron-LM resumes from ``--load``
  only, so an in-job restart or a requeue with ``--save`` alone trains again from step 0. The plugin adds
  ``--load <the --save folder>`` and says so in the log;
* a bound on learned FT timeouts (:func:`learned_timeout_settings`, FaultTolerancePlugin): with
  ``--calc-ft-timeouts`` Megatron-LM replaces the plugin's section timeouts by ``safety_factor`` x the longest
  interval seen, without a minimum; the factor in ft_launcher's FT config is the one bound a launcher can set,
  and for these tasks it is raised from nvidia-resiliency-ext's 5 to ``LEARNED_TIMEOUT_SAFETY_FACTOR`` (logged).

Only tasks whose arguments say Megatron-LM (``trainer_detect``) are touched; a Bridge or unknown script never is.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_resilience.plugins.trainer_detect import detect_script_trainer, flag_values
from megatron_resilience.upstream.megatron_lm import (
    LEARNED_TIMEOUT_SAFETY_FACTOR,
    NVRX_DEFAULT_SAFETY_FACTOR,
)

log = logging.getLogger("megatron_resilience.plugins")


def is_megatron_lm(target: Any) -> bool:
    """The target is a ``run.Script`` whose own arguments (or place) say Megatron-LM and that takes script args."""
    if target.converter is None:
        return False
    found = detect_script_trainer(target.task)
    return found is not None and found[0] == "megatron_lm"


def _args(target: Any) -> list[str]:
    return [str(a) for a in target.task.args]


def ensure_load(target: Any, plugin: str) -> list[str]:
    """Append ``--load <save>`` to a Megatron-LM task that gives ``--save`` and no ``--load``; returns what was
    appended (logged)."""
    if not is_megatron_lm(target):
        return []
    args = _args(target)
    save, load = flag_values(args, "--save"), flag_values(args, "--load")
    if not save or load or "--load" in args:
        return []
    added = ["--load", save[-1]]
    target.task.args = args + added
    log.info("%s: task args += %s: Megatron-LM resumes only from --load; with --save alone every in-job restart and "
             "requeue would train again from step 0", plugin, added)
    return added


def learned_timeout_settings(target: Any, plugin: str) -> dict[str, float]:
    """FT config keys for a Megatron-LM task that learns its timeouts (``--calc-ft-timeouts`` in its arguments,
    the plugin's or the user's own); {} for any other task."""
    if not is_megatron_lm(target) or "--calc-ft-timeouts" not in _args(target):
        return {}
    log.info("%s: FT config safety_factor=%s (nvidia-resiliency-ext's default %s): with --calc-ft-timeouts "
             "Megatron-LM sets each section timeout to safety_factor x the longest interval it saw, with no minimum "
             "(0.72 s per step measured with %s); the factor is the one bound ft_launcher passes to the ranks", plugin,
             LEARNED_TIMEOUT_SAFETY_FACTOR, NVRX_DEFAULT_SAFETY_FACTOR, NVRX_DEFAULT_SAFETY_FACTOR)
    return {"safety_factor": LEARNED_TIMEOUT_SAFETY_FACTOR}


__all__ = ["ensure_load", "is_megatron_lm", "learned_timeout_settings"]
