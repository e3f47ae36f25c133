"""The data-parallel strategies (ddp, torch_fsdp2, megatron_fsdp) against the installed megatron-core.

What the config alone can refuse (FSDP2 with pipeline parallelism, the distributed optimizer, fp16, tied
embeddings; Megatron-FSDP with another checkpoint format) is in ``config/``. What depends on the megatron-core
release, or on what this package's trainer implements so far, is decided here, once the job's size is known:
at submit time (``plugins/task_check.py``, ``recipes/gpt.py``) and again by the trainer before torch loads.
Facts measured on CPU with gloo, 2 ranks, a tiny GPT (issue 33):

- megatron-core 0.16.1: Megatron-FSDP at data-parallel size 1 computes wrong gradients (grad norm 2x to 3.14x
  DDP's, losses diverge from step 2); 0.19.2 computes them right. Refused below 0.19 by version.
- The trainer (``runtime/``) builds Megatron-Core DDP, torch FSDP2 (``upstream/torch_fsdp2.py``) and Megatron-FSDP
  (``upstream/megatron_fsdp.py``; fsdp_dtensor checkpoints in ``checkpointing/fsdp_dtensor.py``). At DP=2 it trains
  and resumes exactly on 0.16.1 and 0.19.2 (``tests/test_megatron_fsdp.py``). What its first slice does not run yet
  (bf16/fp16, TP/PP, async and node-local saves, in-process restart) is refused in ``config/pretrain.py``.
"""

from __future__ import annotations

from typing import Any

from megatron_resilience.config.validate import ConfigError
from megatron_resilience.upstream.versions import package_version

# The first megatron-core whose Megatron-FSDP computes correct gradients at data-parallel size 1.
MEGATRON_FSDP_DP1_CORRECT_FROM = (0, 19)
# Strategies this package's trainer runs.
TRAINER_STRATEGIES = ("ddp", "torch_fsdp2", "megatron_fsdp")

_ALTERNATIVE = ("use parallel.data_parallel_strategy='torch_fsdp2' (weights, gradients and optimizer state sharded) "
                "or 'ddp' with parallel.use_distributed_optimizer=true (the optimizer state sharded)")


def _version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def strategy_refusal(strategy: str, data_parallel_size: int, mcore_version: tuple[int, ...] | None) -> str | None:
    """Why ``strategy`` cannot run at ``data_parallel_size`` on ``mcore_version`` (None: unknown, e.g. a login
    node without megatron-core; the trainer checks again), as ``"<key>: <why>, got <value>"``; None when it can."""
    key = "parallel.data_parallel_strategy"
    if strategy == "megatron_fsdp" and data_parallel_size == 1 and mcore_version is not None \
            and mcore_version < MEGATRON_FSDP_DP1_CORRECT_FROM:
        return (f"{key}: 'megatron_fsdp' at data-parallel size 1 computes wrong gradients on megatron-core "
                f"{_version_text(mcore_version)} (grad norm 2x to 3.14x DDP's; correct from megatron-core "
                f"{_version_text(MEGATRON_FSDP_DP1_CORRECT_FROM)}); use 'ddp' or more data-parallel ranks, "
                f"got {strategy!r}")
    if strategy not in TRAINER_STRATEGIES:
        return (f"{key}: {strategy!r} is not supported by this package's trainer yet (it runs "
                f"{list(TRAINER_STRATEGIES)}); {_ALTERNATIVE}, got {strategy!r}")
    return None


def check_data_parallel_strategy(config: Any, world_size: int) -> None:
    """``strategy_refusal`` for a ``PretrainConfig`` on ``world_size`` ranks with the installed megatron-core;
    raises ConfigError."""
    parallel = config.parallel
    why = strategy_refusal(parallel.data_parallel_strategy, parallel.data_parallel_size(world_size),
                           package_version("megatron-core"))
    if why is not None:
        raise ConfigError(why)
