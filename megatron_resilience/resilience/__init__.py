"""Resilience integrations on compute nodes: fault tolerance, faults, preemption, stragglers, rerun.

``build_hooks(config, rank=..., world_size=...)`` returns the ``TrainingHooks`` the
loop calls; the modules behind it: ``fault_tolerance`` (FT sections, learned
timeouts), ``simulated_fault``, ``preemption`` (distributed signal handler),
``straggler`` (Detector), ``exit_codes`` (the documented exit-code table).
Imports are lazy so that importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_resilience.config.pretrain import PretrainConfig
    from megatron_resilience.runtime.hooks import TrainingHooks

__all__ = ["build_hooks"]


def build_hooks(config: "PretrainConfig", *, rank: int, world_size: int) -> "TrainingHooks":
    """The hooks pretrain.py passes to the training loop (see ``resilience/hooks.py``)."""
    from megatron_resilience.resilience.hooks import build_hooks as _build

    return _build(config, rank=rank, world_size=world_size)
