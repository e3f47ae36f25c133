"""Model parallelism. Data parallelism is derived: world_size / (TP * PP)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.config.validate import check_int, check_types, fail


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        check_types(self, "parallel")
        check_int("parallel.tensor_model_parallel_size", self.tensor_model_parallel_size, minimum=1)
        check_int("parallel.pipeline_model_parallel_size", self.pipeline_model_parallel_size, minimum=1)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            fail("parallel.sequence_parallel", "needs parallel.tensor_model_parallel_size > 1", True)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; errors name the fields that do not fit."""
        if world_size % self.model_parallel_size:
            fail(
                "parallel",
                f"tensor_model_parallel_size * pipeline_model_parallel_size = {self.model_parallel_size} "
                f"must divide the world size {world_size}",
                self.model_parallel_size,
            )
        return world_size // self.model_parallel_size
