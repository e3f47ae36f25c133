"""Model parallelism and the data-parallel strategy. Data parallelism is derived: world_size / (TP * PP).

``data_parallel_strategy`` names how the data-parallel ranks hold the model, with Megatron-LM's names:
``ddp`` (Megatron-Core DDP: every rank holds the whole model and its gradients; the optimizer state too unless
``use_distributed_optimizer``), ``torch_fsdp2`` (``--use-torch-fsdp2``: parameters, gradients and optimizer
state sharded by torch's ``fully_shard``) and ``megatron_fsdp`` (``--use-megatron-fsdp``, with
``--data-parallel-sharding-strategy``). The combinations Megatron-LM refuses are refused here, at submit time;
the ones that also need the job's size or the installed megatron-core are in ``upstream/fsdp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.config.validate import check_choice, check_int, check_types, fail

DATA_PARALLEL_STRATEGIES = ("ddp", "torch_fsdp2", "megatron_fsdp")
# Megatron-FSDP's --data-parallel-sharding-strategy: what it shards, from nothing to everything (ZeRO-3).
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# With megatron_fsdp and no sharding strategy set: everything sharded, what Megatron-Bridge's perf recipes use
# (Megatron-LM's flag defaults to no_shard, which shards nothing).
DEFAULT_SHARDING_STRATEGY = "optim_grads_params"


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    data_parallel_strategy: str = "ddp"
    # megatron_fsdp only; None -> DEFAULT_SHARDING_STRATEGY
    data_parallel_sharding_strategy: str | None = None

    def __post_init__(self) -> None:
        check_types(self, "parallel")
        check_int("parallel.tensor_model_parallel_size", self.tensor_model_parallel_size, minimum=1)
        check_int("parallel.pipeline_model_parallel_size", self.pipeline_model_parallel_size, minimum=1)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            fail("parallel.sequence_parallel", "needs parallel.tensor_model_parallel_size > 1", True)
        check_choice("parallel.data_parallel_strategy", self.data_parallel_strategy, DATA_PARALLEL_STRATEGIES)
        if self.data_parallel_sharding_strategy is not None:
            check_choice("parallel.data_parallel_sharding_strategy", self.data_parallel_sharding_strategy,
                         SHARDING_STRATEGIES)
            if self.data_parallel_strategy != "megatron_fsdp":
                fail("parallel.data_parallel_sharding_strategy",
                     "needs parallel.data_parallel_strategy='megatron_fsdp' (ddp shards the optimizer state with "
                     "parallel.use_distributed_optimizer; torch_fsdp2 shards everything)",
                     self.data_parallel_sharding_strategy)
        if self.data_parallel_strategy == "torch_fsdp2":
            if self.pipeline_model_parallel_size > 1:
                fail("parallel.pipeline_model_parallel_size",
                     "must be 1 with parallel.data_parallel_strategy='torch_fsdp2' (Megatron-LM has no pipeline "
                     "parallelism with torch FSDP2; use data_parallel_strategy 'ddp', with "
                     "use_distributed_optimizer=true to shard the optimizer state)",
                     self.pipeline_model_parallel_size)
            if self.use_distributed_optimizer:
                fail("parallel.use_distributed_optimizer",
                     "must be false with parallel.data_parallel_strategy='torch_fsdp2' (FSDP2 shards the optimizer "
                     "state itself; Megatron-LM refuses both)", True)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def sharding_strategy(self) -> str | None:
        """What Megatron-FSDP shards (None for the other strategies)."""
        if self.data_parallel_strategy != "megatron_fsdp":
            return None
        return self.data_parallel_sharding_strategy or DEFAULT_SHARDING_STRATEGY

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
