"""torch FSDP2 through Megatron-Core's ``TorchFullyShardedDataParallel``: what each release needs on the compute
node. Imported by ``runtime/model.py`` and ``checkpointing/state_dict.py`` only when
``parallel.data_parallel_strategy='torch_fsdp2'``; torch and megatron load inside the functions.

Work-arounds, each for a fact measured on CPU with gloo (issue 33):

- The adapter builds its mesh with ``DeviceMesh.from_group(group, "cuda")`` (0.16.1 and 0.19.2): on a CPU run the
  mesh must be a CPU one, else FSDP2 puts its all-gather buffers on a device that is not there.
- megatron-core 0.16.0 .. 0.18.x: ``finalize_model_grads`` calls ``finish_grad_sync(force_all_reduce=...)`` but
  the FSDP2 adapter inherits a ``finish_grad_sync()`` without that argument (TypeError every step; Megatron-LM
  #4953, fixed in 0.19). FSDP2 reduces the gradients in its own backward hooks, so the call has nothing to do.
- torch 2.13: ``DTensor.to_local()`` on a Parameter returns a new view on every call, so Megatron's
  ``get_param_id_to_sharded_param_map`` (which keys parameters by ``id(param.to_local())``) finds none of the
  model's sharded tensors and every optimizer save fails (``Param id 0 does not match any model sharded param``).
  The map is rebuilt here keyed by the local shard's storage (``_local_tensor``), the tensor the model's sharded
  state dict holds; correct on every torch.
- Loading is in place: the torch_dist loader writes into the tensors the template holds (the parameters' and the
  Adam moments' local shards), as Megatron-LM and Megatron-Bridge do for FSDP2 (both skip ``load_state_dict``).
  torch Adam's per-parameter ``step`` is then not loaded (it is saved once, as ``common_step``): it is restored
  from there, one tensor per parameter (torch's Adam increments it in place).
"""

from __future__ import annotations

import contextlib
from typing import Any

from megatron_resilience.upstream.versions import package_version

# megatron-core whose FSDP2 adapter accepts finish_grad_sync(force_all_reduce=...) (Megatron-LM #4953).
FINISH_GRAD_SYNC_FIXED_IN = (0, 19)


@contextlib.contextmanager
def _mesh_on(device_type: str):
    """The adapter's ``DeviceMesh.from_group(group, "cuda")`` on ``device_type`` while it is built."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as adapter

    real = adapter.DeviceMesh

    class _Mesh:
        @staticmethod
        def from_group(group, _device_type, *args, **kwargs):
            return real.from_group(group, device_type, *args, **kwargs)

    adapter.DeviceMesh = _Mesh
    try:
        yield
    finally:
        adapter.DeviceMesh = real


def wrap(tconfig: Any, ddp_config: Any, module: Any, *, device_type: str):
    """``module`` sharded by FSDP2 (Megatron-Core's adapter), with the work-arounds this release needs."""
    from megatron.core.distributed import TorchFullyShardedDataParallel

    cls = TorchFullyShardedDataParallel
    version = package_version("megatron-core")
    if version is not None and version < FINISH_GRAD_SYNC_FIXED_IN:
        cls = _accepting_force_all_reduce(cls)
    with _mesh_on(device_type):
        return cls(config=tconfig, ddp_config=ddp_config, module=module)


def _accepting_force_all_reduce(base: type) -> type:
    class TorchFSDP2(base):  # Megatron-LM #4953: finalize_model_grads passes force_all_reduce
        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            return None  # FSDP2's backward hooks have reduce-scattered the gradients already

    return TorchFSDP2


def _param_id_map(model_sharded_state_dict, optim_params_iter):
    """``get_param_id_to_sharded_param_map`` keyed by each parameter's local shard (see the module doc)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    def local(param):
        return getattr(param, "_local_tensor", param)

    ids: dict[int, int] = {}
    for index, param in enumerate(optim_params_iter):
        ids.setdefault(id(local(param)), index)
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {ids[id(ten.data)]: ten for ten in nested_values(sharded) if id(ten.data) in ids}


def install_param_map_fix() -> None:
    """Megatron's optimizers look the map up in their module's namespace: point them at ``_param_id_map``."""
    from megatron.core.optimizer import optimizer

    optimizer.get_param_id_to_sharded_param_map = _param_id_map


def restore_adam_steps(optimizer: Any, loaded_optimizer_state: dict[str, Any]) -> None:
    """After an in-place load: each parameter's Adam ``step`` from the checkpoint's ``common_step``."""
    import torch

    step = (loaded_optimizer_state.get("state") or {}).get("common_step")
    if step is None:
        return
    for inner in (opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])):
        for group in inner.param_groups:
            for param in group["params"]:
                slot = inner.state[param]
                if slot:  # the moments the loader filled (Megatron's init_state_fn creates them without a step)
                    slot["step"] = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))
