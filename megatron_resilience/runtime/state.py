"""What a checkpoint holds and the loop advances. Shared by the loop, checkpointing and resilience."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class TrainState:
    model: list[Any]  # Megatron model chunks (DDP-wrapped), one per virtual pipeline stage
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer
    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    step: int = 0  # completed optimizer steps
    consumed_samples: int = 0  # global samples consumed; the data position to resume from
    global_batch_size: int | None = None  # samples per step (recorded in checkpoints: a resume at another DP keeps it)
    micro_batch_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # small JSON-able extras saved with the checkpoint
