"""Megatron-FSDP (``megatron.core.distributed.fsdp``, ``parallel.data_parallel_strategy='megatron_fsdp'``): what
each release needs on the compute node. Imported by ``runtime/model.py``, ``runtime/optimizer.py`` and
``checkpointing/fsdp_dtensor.py`` only for that strategy; torch and megatron load inside the functions.

Work-arounds, each for a fact measured on CPU with gloo, 2 ranks, a tiny GPT (issue 33), on megatron-core 0.16.1 and
0.19.2:

- The adapter (``mcore_fsdp_adapter.FullyShardedDataParallel``) builds its mesh with
  ``DeviceMesh.from_group(..., device_type="cuda")`` and, without a ``device``, puts its buffers on
  ``cuda:<current_device>``: on a CPU run the mesh is built on the CPU and the run's device is passed.
- gloo has no ``ReduceOp.PREMUL_SUM``, which Megatron-FSDP's gradient reduce-scatter uses to fold the division by
  the data-parallel size into the reduction (``gradient_reduce_div_fusion``, on by default): off on gloo, so the
  gradients are summed, then divided.
- Megatron-FSDP needs Megatron's distributed optimizer (Megatron-LM forces ``--use-distributed-optimizer`` with
  ``--use-megatron-fsdp``): ``ddp_config`` and the optimizer config say so.
- Megatron-LM #4910 (open in 0.19.2): a parameter whose local shard is empty on a rank (its elements all fall on the
  other ranks; e.g. a layer-norm weight of 64 elements in a bucket split over 2 ranks) gets no Adam state there
  (``_init_optimizer_states_with_dummy_values`` and torch's Adam skip empty tensors). The optimizer's fsdp_dtensor
  state dict then holds different keys on different ranks, torch distributed checkpoint's per-DTensor collectives
  do not match, and the save hangs. :func:`fill_empty_shard_state` gives every such parameter zero moments and the
  step of the rank's other parameters, and rebuilds ``optimizer.state`` in ``param_groups`` order, so every rank
  offers the same keys in the same order; save and resume are then exact. The step is set again at every save:
  Adam never steps an empty shard, and DCP writes a replicated (plain tensor) ``step`` from one rank only, so a
  stale one on the empty rank would come back on the rank that holds the data (measured: a resume from a process's
  second save diverged at the first step it trained).
"""

from __future__ import annotations

import contextlib
from typing import Any

# megatron-core's fsdp_dtensor optimizer sharding (DistributedOptimizer.sharded_state_dict's metadata key).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fsdp_dtensor"}


@contextlib.contextmanager
def _mesh_on(device_type: str):
    """The adapter's ``DeviceMesh.from_group(..., device_type="cuda")`` on ``device_type`` while it is built."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    real = adapter.DeviceMesh

    class _Mesh:
        @staticmethod
        def from_group(group, device_type_ignored=None, *args, **kwargs):
            kwargs["device_type"] = device_type
            return real.from_group(group, *args, **kwargs)

    adapter.DeviceMesh = _Mesh
    try:
        yield
    finally:
        adapter.DeviceMesh = real


def ddp_config_fields(sharding_strategy: str, *, backend: str) -> dict[str, Any]:
    """What ``DistributedDataParallelConfig`` needs for Megatron-FSDP on ``backend`` (see the module doc)."""
    return {"use_megatron_fsdp": True, "use_distributed_optimizer": True,
            "data_parallel_sharding_strategy": sharding_strategy,
            "gradient_reduce_div_fusion": backend != "gloo"}


def wrap(tconfig: Any, ddp_config: Any, module: Any, *, device: Any):
    """``module`` sharded by Megatron-FSDP (Megatron-Core's adapter) on ``device``."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    with _mesh_on(device.type):
        return FullyShardedDataParallel(config=tconfig, ddp_config=ddp_config, module=module, device=device)


def is_megatron_fsdp(module: Any) -> bool:
    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(module, FullyShardedDataParallel)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _local_numel(param: Any) -> int:
    local = getattr(param, "_local_tensor", None)
    return (param if local is None else local).numel()


def fill_empty_shard_state(optimizer: Any) -> int:
    """Megatron-LM #4910 (module doc): zero Adam state for every parameter without one, then ``state`` rebuilt in
    ``param_groups`` order. Returns how many parameters were filled (0 once every rank has trained a step)."""
    import torch

    filled = 0
    for dist_opt in _inner_optimizers(optimizer):
        inner = dist_opt.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        steps = [slot["step"] for param, slot in inner.state.items() if "step" in slot and _local_numel(param)]
        step = steps[0] if steps else torch.tensor(0.0)
        ordered = {}
        for group in inner.param_groups:
            for param in group["params"]:
                slot = inner.state.get(param) or {}
                if "exp_avg" not in slot:
                    slot = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
                    filled += 1
                if "step" not in slot or not _local_numel(param):  # never stepped here: its step goes stale
                    slot["step"] = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))
                ordered[param] = slot
        inner.state.clear()
        inner.state.update(ordered)
    return filled


def model_state_dict(model: Any) -> dict[str, Any]:
    """The model's DTensors by name (what Megatron-LM's fsdp_dtensor checkpoint holds under ``model``)."""
    return model.state_dict_for_save_checkpoint()


def load_model_state_dict(model: Any, loaded: dict[str, Any]) -> None:
    """``model_state_dict``'s keys back into the model. They are ``MegatronFSDP``'s own (the adapter's
    ``state_dict`` is its inner module's), while the adapter's ``load_state_dict`` prefixes every key with
    ``module.`` once more (0.16.1 and 0.19.2: "Unexpected key(s) ... module.module.embedding..."): the inner
    module loads them."""
    model.module.load_state_dict(loaded, strict=True)


def optimizer_state_dict(optimizer: Any, *, is_loading: bool) -> tuple[dict[str, Any], int]:
    """The optimizer's per-parameter DTensor state (Megatron-Core's fsdp_dtensor sharding), every rank with the
    same keys (#4910), and how many empty shards were filled. Loading: Megatron first materialises the state with
    a zero-gradient step (DCP then overwrites it)."""
    if is_loading:
        for dist_opt in _inner_optimizers(optimizer):
            dist_opt._init_optimizer_states_with_dummy_values()
    filled = fill_empty_shard_state(optimizer)
    return optimizer.sharded_state_dict({}, is_loading=is_loading, metadata=dict(OPTIMIZER_SHARDING)), filled


def even_out(state_dict: dict[str, Any]) -> None:
    """Megatron-Core's own preparation of uneven DTensors (shards of different sizes) for torch DCP, in place."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    preprocess_state_dict_for_uneven_dtensor(state_dict)
