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
  ``TrainState.extra``, the world size the RNG states belong to, and the ``layout`` (world size, TP, PP,
  DP, global and micro batch) that a resume at another DP size is checked against (:mod:`reshard`);
- ``rerun_state_machine``, only while Megatron-Core's rerun state machine is
  mid-diagnosis (the exit-16/17 checkpoints): its common part (mode, state,
  iteration) plus one ``ShardedObject`` per rank with that rank's suspicious
  result, so the resumed job re-runs the step from the checkpoint.

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

from megatron_resilience.checkpointing import reshard
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
    sharded[reshard.LAYOUT_KEY] = current_layout(state)
    if not is_loading:
        rerun = rerun_state_to_save()
        if rerun is not None:
            sharded[RERUN_KEY] = rerun
            sharded[RERUN_LAYOUT_KEY] = _parallel_layout()
    return sharded


# --- rerun state machine ---------------------------------------------------------------------------------------
# Saved as Megatron-LM does (``state_dict(..., ckpt_format="torch_dist")``, None unless a step is being
# diagnosed), except for the data iterator, passed as None on purpose: our sampler restarts at the suspicious
# step's first sample from ``consumed_samples`` (the step was not counted), so the re-run reads that step's
# data anyway. Megatron-Core applies a saved iterator state only after the re-run (and its ``advance()``
# drops it there), so saving it would only copy the step's micro-batches into the checkpoint.

RERUN_KEY = "rerun_state_machine"
RERUN_LAYOUT_KEY = "rerun_state_machine_layout"  # (world, tp, pp, dp) the per-rank rerun states belong to


def current_layout(state: TrainState) -> dict[str, int | None]:
    """This job's layout as :mod:`reshard` records and checks it."""
    from megatron.core import parallel_state

    return reshard.layout(world_size=torch.distributed.get_world_size(),
                          tp=parallel_state.get_tensor_model_parallel_world_size(),
                          pp=parallel_state.get_pipeline_model_parallel_world_size(),
                          dp=parallel_state.get_data_parallel_world_size(),
                          global_batch_size=state.global_batch_size, micro_batch_size=state.micro_batch_size)


def _parallel_layout() -> list[int]:
    from megatron.core import parallel_state

    return [torch.distributed.get_world_size(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_data_parallel_world_size()]


def _rerun_machine():
    """The job's rerun state machine, or None when none was initialised (e.g. a bare checkpoint round trip):
    ``get_rerun_state_machine()`` would create one implicitly, which a later ``initialize`` then refuses."""
    from megatron.core import rerun_state_machine

    if rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None:
        return None
    return rerun_state_machine.get_rerun_state_machine()


def rerun_state_to_save() -> dict[str, Any] | None:
    """The rerun state machine's state while a step is being diagnosed, else None.

    megatron-core up to 0.16 returns None between steps itself; from 0.17 it saves an all-default sentinel in
    every checkpoint (a constant checkpoint structure for Megatron-LM's cached save plans, which we do not use).
    Interval and signal checkpoints carry no rerun state here on every version.
    """
    from megatron.core.rerun_state_machine import RerunState

    machine = _rerun_machine()
    if machine is None or machine.state == RerunState.NOT_RUNNING_YET:
        return None
    return machine.state_dict(data_iterator=None, ckpt_format="torch_dist")


def _rerun_template(common: dict[str, Any]) -> dict[str, Any] | None:
    """The per-rank part to load when the checkpoint holds a rerun state this job can resume, else None."""
    from megatron.core.rerun_state_machine import RerunState

    saved = common.get(RERUN_KEY)
    machine = _rerun_machine()
    if saved is None or machine is None or not machine.validate_state_dict(saved):
        return None
    first_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if saved["state"] != RerunState.WILL_RERUN_FROM_CHECKPOINT:
        # The exit-17 checkpoint holds RERUNNING_IN_PLACE (kept for examination). Megatron-Core cannot resume
        # that state (its in-memory pre-step RNG snapshot is not saved): the step is simply trained again.
        if first_rank:
            log.warning("checkpoint: rerun state machine state %s saved for examination only; not resumed, "
                        "the step is trained again", saved["state"].name)
        return None
    if common.get(RERUN_LAYOUT_KEY) != _parallel_layout():
        if first_rank:
            log.warning("checkpoint: the rerun state machine state was saved with (world, tp, pp, dp)=%s, "
                        "this job is %s: it is ignored and the suspicious step is not re-run",
                        common.get(RERUN_LAYOUT_KEY), _parallel_layout())
        return None
    return {"sharded": machine.state_dict(data_iterator=None, ckpt_format="torch_dist", force=True)["sharded"]}


def restore_rerun_state(saved: dict[str, Any] | None) -> None:
    """Hand a loaded rerun state to the machine (after every rank has loaded the same checkpoint)."""
    machine = _rerun_machine()
    if saved is None or "sharded" not in saved or machine is None:
        return
    machine.load_state_dict(saved)
    if torch.distributed.get_rank() == 0:
        log.info("checkpoint: rerun state machine restored (state %s, iteration %d, mode %s)",
                 machine.state.name, machine.current_iteration, machine.mode.name)


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
                     saved_world_size: int, common: dict[str, Any] | None = None) -> dict[str, Any]:
    """What to ask dist_checkpointing for: everything, minus the RNG shards when the world size changed,
    plus the per-rank rerun states when ``common`` (the checkpoint's common dict) holds a resumable one."""
    _ensure_adam_step_state(state.optimizer)
    metadata = {k: v for k, v in (saved_metadata or {}).items() if k in SHARDING_METADATA} or None
    template = build_sharded_state_dict(state, is_loading=True, metadata=metadata)
    for key in ("step", "consumed_samples", "scheduler", "extra", "world_size", reshard.LAYOUT_KEY):
        del template[key]  # common values come back from the checkpoint's common.pt
    if saved_world_size != torch.distributed.get_world_size():
        del template["rng_state"]
    rerun = _rerun_template(common or {})
    if rerun is not None:
        template[RERUN_KEY] = rerun
    return template


def _is_torch_fsdp2(state: TrainState) -> bool:
    try:
        from megatron.core.distributed import TorchFullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(state.model[0], TorchFullyShardedDataParallel)


def live_tensors(template: Any, path: tuple = ()) -> dict[tuple, torch.Tensor]:
    """The tensors a loading template's ShardedTensors hold, by their path: for FSDP2 these are the live local
    shards of the parameters and Adam moments, which a load must write into."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    found: dict[tuple, torch.Tensor] = {}
    if isinstance(template, ShardedTensor):
        found[path] = template.data
    elif isinstance(template, dict):
        for key, value in template.items():
            found.update(live_tensors(value, (*path, key)))
    elif isinstance(template, (list, tuple)):
        for index, value in enumerate(template):
            found.update(live_tensors(value, (*path, index)))
    return found


def _copy_into_live(live: dict[tuple, torch.Tensor], loaded: dict[str, Any]) -> None:
    with torch.no_grad():
        for path, tensor in live.items():
            value: Any = loaded
            for part in path:
                value = value[part]
            if value is not tensor:
                tensor.copy_(value)


def apply_loaded(state: TrainState, loaded: dict[str, Any], *, live: dict[tuple, torch.Tensor] | None = None) -> None:
    """Copy a loaded state dict into the live model, optimizer, scheduler, RNG and counters.

    torch FSDP2: the persistent loader has written the parameters' and Adam moments' local shards in place (the
    template held them); a loader that returns new tensors (the node-local tier) passes ``live``
    (``live_tensors(template)``, taken before the load) and they are copied in. Then the Adam steps are restored
    (``upstream/torch_fsdp2.py``)."""
    if _is_torch_fsdp2(state):
        from megatron_resilience.upstream import torch_fsdp2

        if live is not None:
            _copy_into_live(live, loaded)
        torch_fsdp2.restore_adam_steps(state.optimizer, loaded["optimizer"])
    else:
        for key, chunk in zip(_model_keys(state), state.model):
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
        with torch.no_grad():  # DistributedOptimizer copies into views of fp32 params that require grad
            state.optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(state.optimizer)
    apply_counters(state, loaded)


def apply_counters(state: TrainState, loaded: dict[str, Any]) -> None:
    """The scheduler, step, consumed samples, extra and (when saved at this world size) RNG states of a loaded
    checkpoint; every format's last part of a load."""
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
