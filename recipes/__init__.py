"""Fiddle GPT pretraining recipes and NeMo-Run CLI factories. Never imports torch or megatron.

``gpt_tiny``/``gpt_126m``/``gpt_350m``/``gpt_1_3b``/``gpt_7b`` return a ``run.Partial`` of
``megatron_resilience.entry.pretrain`` with fault tolerance, straggler detection, the
preemption exit handler and the rerun state machine turned on. The ``nemo`` CLI command
lives in :mod:`megatron_resilience.recipes.cli` (loaded by NeMo-Run through its entry point).
"""

from megatron_resilience.config.overrides import valid_keys
from megatron_resilience.recipes.gpt import (
    RECIPES,
    SIZES,
    gpt_1_3b,
    gpt_7b,
    gpt_126m,
    gpt_350m,
    gpt_tiny,
    run_dir_for,
    to_config,
    validate,
)
from megatron_resilience.recipes.overrides import apply_overrides

__all__ = [
    "RECIPES", "SIZES", "apply_overrides", "gpt_126m", "gpt_1_3b", "gpt_350m", "gpt_7b", "gpt_tiny", "run_dir_for",
    "to_config", "valid_keys", "validate",
]
