"""The data-parallel strategies (ddp, torch_fsdp2, megatron_fsdp) against the installed megatron-core.

What the config alone can refuse (FSDP2 with pipeline parallelism, the distributed optimizer, fp16, tied
embeddings; Megatron-FSDP with another checkpoint format) is in ``config/``. What depends on the megatron-core
release, or on what this package's trainer implements so far, is decided here, once the job's size is known:
at submit time (``plugins/task_check.py``, ``recipes/gpt.py``) and again by the trainer before torch loads.
Facts measured on CPU with gloo, 2 ranks, a tiny GPT (issue 33):

- megatron-core 0.16.1: Megatron-FSDP at data-parallel size 1 computes wrong gradients (grad norm 2x to 3.14x
  DDP's, losses diverge from step 2); 0.19.2 computes them right. Refused below 0.19 by version.
- Sharding strategies at DP=2 against DDP's losses over 10 steps: 0.16.1: ``optim``, ``optim_grads`` and
  ``optim_grads_params`` within 1.5e-7 relative; ``no_shard`` fails at the first optimizer step
  (``AttributeError: 'NoneType' object has no attribute 'fetch_bucket'`` in ``start_param_sync``): refused below
  0.19. 0.19.2: ``no_shard``, ``optim_grads`` and ``optim_grads_params`` bitwise DDP's; ``optim`` computes other
  gradients (grad norm 0.69 at step 1 where DDP's is 0.86; losses 2e-3 apart by step 10): refused from 0.19 (the
  first release measured wrong; 0.17/0.18 were not measured).
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
# Megatron-FSDP sharding strategies by the releases they fail on (module doc): (strategy, first bad, first good).
BROKEN_SHARDING = (("no_shard", None, (0, 19)), ("optim", (0, 19), None))
# Strategies this package's trainer runs.
TRAINER_STRATEGIES = ("ddp", "torch_fsdp2", "megatron_fsdp")

_ALTERNATIVE = ("use parallel.data_parallel_strategy='torch_fsdp2' (weights, gradients and optimizer state sharded) "
                "or 'ddp' with parallel.use_distributed_optimizer=true (the optimizer state sharded)")


def _version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def _sharding_refusal(sharding: str, mcore_version: tuple[int, ...]) -> str | None:
    for name, bad_from, good_from in BROKEN_SHARDING:
        if sharding != name or (bad_from is not None and mcore_version < bad_from) \
                or (good_from is not None and mcore_version >= good_from):
            continue
        what = ("fails at the first optimizer step" if name == "no_shard" else
                "computes other gradients than DDP (grad norm 0.69 vs 0.86 at step 1)")
        return (f"parallel.data_parallel_sharding_strategy: {name!r} with 'megatron_fsdp' {what} on megatron-core "
                f"{_version_text(mcore_version)}; use 'optim_grads' or 'optim_grads_params', got {name!r}")
    return None


def strategy_refusal(strategy: str, data_parallel_size: int, mcore_version: tuple[int, ...] | None,
                     sharding: str | None = None) -> str | None:
    """Why ``strategy`` (with Megatron-FSDP's ``sharding`` strategy) cannot run at ``data_parallel_size`` on
    ``mcore_version`` (None: unknown, e.g. a login node without megatron-core; the trainer checks again), as
    ``"<key>: <why>, got <value>"``; None when it can."""
    key = "parallel.data_parallel_strategy"
    if strategy == "megatron_fsdp" and sharding is not None and mcore_version is not None:
        why = _sharding_refusal(sharding, mcore_version)
        if why is not None:
            return why
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
                           package_version("megatron-core"), parallel.sharding_strategy)
    if why is not None:
        raise ConfigError(why)
