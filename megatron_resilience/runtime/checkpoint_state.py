"""What goes into a checkpoint and how it comes back: TrainState <-> dist_checkpointing state dict.

One sharded state dict holds everything exact resume needs:

- ``model`` (or ``model0``, ``model1``, ... for virtual pipeline chunks): the
  Megatron ``sharded_state_dict`` of each unwrapped chunk, so TP/PP shards are
  written once and can be read back under another data-parallel size;
- ``optimizer``: ``optimizer.sharded_state_dict(model_sd)`` (Adam moments keyed
  by the same global parameter shards);
- ``rng_state``: one ``ShardedObject`` per global rank holding Python, NumPy,
  torch CPU, accelerator and tensor-parallel tracker RNG states; dropout draws
  differ per rank, so each rank gets its own back;
- common (saved once by rank 0): step, consumed samples, scheduler state,
  ``TrainState.extra`` and the world size the RNG states belong to.

The same metadata is passed to ``sharded_state_dict`` when saving and loading
and is stored in the checkpoint (``content_metadata``), so a checkpoint is read
with the sharding format it was written with.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from megatron_resilience.runtime.state import TrainState

log = logging.getLogger(__name__)

FORMAT = "megatron_resilience"
FORMAT_VERSION = 1

# Sharding choices handed to Megatron's sharded_state_dict methods. "dp_reshardable" is Megatron-LM's
# default for the distributed optimizer: each rank writes its own buffer shard, no gather on rank 0.
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "chained_optim_avoid_prefix": True,
    "singleton_local_shards": False,
}


def content_metadata() -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **SHARDING_METADATA}


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPT module inside Megatron DDP / Float16Module wrappers (their own keys would add ``module.``)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    wrappers: tuple[type, ...] = (DistributedDataParallel, Float16Module)
    try:
        from megatron.core.distributed import TorchFullyShardedDataParallel

        wrappers += (TorchFullyShardedDataParallel,)
    except ImportError:
        pass
    while isinstance(module, wrappers):
        module = module.module
    return module


def _model_keys(state: TrainState) -> list[str]:
    return ["model"] if len(state.model) == 1 else [f"model{i}" for i in range(len(state.model))]


# --- RNG -------------------------------------------------------------------------------------------------------


def _has_device_rng() -> bool:
    """CUDA, or the CPU stand-in for it that cpu_compat installs (the TP tracker then holds CPU states)."""
    if torch.cuda.is_available():
        return True
    from megatron_resilience.runtime import cpu_compat

    return cpu_compat.is_installed()


def capture_rng() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if _has_device_rng():
        states["device"] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states["tracker"] = {name: s.clone() for name, s in tracker.get_states().items()}
    return states


def restore_rng(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "device" in states and _has_device_rng():
        torch.cuda.set_rng_state(states["device"])
    if states.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states({n: s.clone() for n, s in states["tracker"].items()})


# --- state dict ------------------------------------------------------------------------------------------------


def build_sharded_state_dict(state: TrainState, *, is_loading: bool,
                             metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sharded state dict to save ``state`` (or the template to load into it, ``is_loading=True``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    metadata = dict(SHARDING_METADATA if metadata is None else metadata)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sharded: dict[str, Any] = {}
    for key, chunk in zip(_model_keys(state), state.model):
        sharded[key] = unwrap(chunk).sharded_state_dict(metadata=dict(metadata))
    sharded["optimizer"] = state.optimizer.sharded_state_dict(sharded, is_loading=is_loading, metadata=dict(metadata))
    sharded["rng_state"] = ShardedObject("rng_state", None if is_loading else capture_rng(), (world,), (rank,),
                                         replica_id=0)
    sharded["step"] = state.step
    sharded["consumed_samples"] = state.consumed_samples
    sharded["scheduler"] = state.scheduler.state_dict()
    sharded["extra"] = dict(state.extra)
    sharded["world_size"] = world
    return sharded


# Megatron's DistributedOptimizer without Transformer Engine or Apex (CPU, or a bare GPU install) wraps
# torch.optim.Adam(W), and two of its checkpoint paths assume the fused optimizers' behaviour:
# - ``state_dict()`` asserts one common ``step`` over the per-parameter states, which torch's Adam only
#   creates at the first step: building the loading template fails on a fresh optimizer;
# - ``load_state_dict()`` gives every parameter the SAME ``step`` tensor, which torch's Adam increments in
#   place once per parameter; and its dp_reshardable parameter state then copies the template's placeholder
#   step over the loaded one. The step saved in the param groups is the true one: it is restored per parameter.


def _torch_adams_in_distributed_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    adams = (torch.optim.Adam, torch.optim.AdamW)
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(opt, DistributedOptimizer) and isinstance(opt.optimizer, adams)]


def _ensure_adam_step_state(optimizer: Any) -> None:
    """Placeholder state (zeros, step 0) so ``state_dict()`` works before step 1; the checkpoint overwrites it."""
    for inner in _torch_adams_in_distributed_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                slot = inner.state[param]
                if "step" not in slot:
                    slot.setdefault("exp_avg", torch.zeros_like(param.data))
                    slot.setdefault("exp_avg_sq", torch.zeros_like(param.data))
                    slot["step"] = torch.tensor(0.0)


def _restore_adam_steps(optimizer: Any) -> None:
    """Each parameter's own ``step`` tensor, set to the step saved in its param group."""
    for inner in _torch_adams_in_distributed_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                slot = inner.state[param]
                if group.get("step") is not None:
                    slot["step"] = torch.tensor(float(group["step"]))
                elif torch.is_tensor(slot.get("step")):
                    slot["step"] = slot["step"].clone()


def loading_template(state: TrainState, saved_metadata: dict[str, Any] | None, *,
                     saved_world_size: int) -> dict[str, Any]:
    """What to ask dist_checkpointing for: everything, minus the RNG shards when the world size changed."""
    _ensure_adam_step_state(state.optimizer)
    metadata = {k: v for k, v in (saved_metadata or {}).items() if k in SHARDING_METADATA} or None
    template = build_sharded_state_dict(state, is_loading=True, metadata=metadata)
    for key in ("step", "consumed_samples", "scheduler", "extra", "world_size"):
        del template[key]  # common values come back from the checkpoint's common.pt
    if saved_world_size != torch.distributed.get_world_size():
        del template["rng_state"]
    return template


def apply_loaded(state: TrainState, loaded: dict[str, Any]) -> None:
    """Copy a loaded state dict into the live model, optimizer, scheduler, RNG and counters."""
    for key, chunk in zip(_model_keys(state), state.model):
        unwrap(chunk).load_state_dict(loaded[key], strict=True)
    with torch.no_grad():  # DistributedOptimizer copies into views of fp32 params that require grad
        state.optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(state.optimizer)
    state.scheduler.load_state_dict(loaded["scheduler"])
    state.step = int(loaded["step"])
    state.consumed_samples = int(loaded["consumed_samples"])
    state.extra.clear()
    state.extra.update(loaded.get("extra") or {})
    if "rng_state" in loaded:
        restore_rng(loaded["rng_state"])
    else:
        log.warning("checkpoint: saved with world size %s, running with %d: RNG states not restored "
                    "(dropout draws will differ from an uninterrupted run)",
                    loaded.get("world_size"), torch.distributed.get_world_size())
