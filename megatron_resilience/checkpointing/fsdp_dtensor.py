"""Megatron-FSDP checkpoints (``checkpoint.ckpt_format='fsdp_dtensor'``): torch distributed checkpoint (DCP) of
the model's and the optimizer's DTensors, the format Megatron-LM writes for ``--use-megatron-fsdp``.

What the folder holds (it is written into ``iter_N.tmp`` and published by :class:`CheckpointManager` exactly like a
``torch_dist`` one: barrier, rename, tracker file, keep-last-N):

- DCP's shards and its ``.metadata`` index: ``model`` (the adapter's ``state_dict_for_save_checkpoint()``, one
  DTensor per parameter), ``optimizer`` (Megatron-Core's fsdp_dtensor optimizer state: Adam moments as DTensors,
  keyed by parameter name, plus the param groups) and ``rng_state.rank_<r>`` (each rank's own RNG states: dropout
  draws differ per rank). Megatron-LM's ``save_checkpoint``/``_load_base_checkpoint`` (megatron-core 0.19.2,
  ``megatron/training/checkpointing.py``) save and load the same three with DCP; its RNG states are per (PP, TP)
  rank, ours per global rank as in our torch_dist checkpoints.
- ``common.pt`` and ``metadata.json`` (``sharded_backend: fsdp_dtensor``), written by rank 0 after DCP's index (an
  async save's in its finalize, from the counters taken when it was scheduled):
  the step, consumed samples, scheduler, extra, world size and layout, read back with dist_checkpointing's own
  ``load_common_state_dict`` on every release, so the resume scan (``readable.py``) and the layout check treat both
  formats alike.

Loading is in place, as Megatron-LM's: the template holds the live DTensors (after Megatron's dummy optimizer step
materialises the Adam state), DCP fills them, and the model's and optimizer's ``load_state_dict`` take them.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch

from megatron_resilience.checkpointing import reshard
from megatron_resilience.checkpointing import state_dict as checkpoint_state
from megatron_resilience.runtime.state import TrainState
from megatron_resilience.upstream import dist_checkpointing, megatron_fsdp

log = logging.getLogger(__name__)

SHARDED_BACKEND = "fsdp_dtensor"


def is_fsdp_dtensor(state: TrainState) -> bool:
    """The run's model is Megatron-FSDP (its only checkpoint format is fsdp_dtensor)."""
    return megatron_fsdp.is_megatron_fsdp(state.model[0])


def _rng_key(rank: int) -> str:
    return f"rank_{rank}"


def _sharded(state: TrainState, *, is_loading: bool, with_rng: bool = True) -> dict[str, Any]:
    if len(state.model) != 1:
        raise ValueError("checkpoint: fsdp_dtensor holds one model chunk (no virtual pipeline)")
    # The model first: its state_dict hook puts the sharded DTensors back into the module (after a step it holds
    # the gathered parameters), which the optimizer's names for its parameters are looked up in.
    model = megatron_fsdp.model_state_dict(state.model[0])
    optimizer, filled = megatron_fsdp.optimizer_state_dict(state.optimizer, is_loading=is_loading)
    sharded: dict[str, Any] = {"model": model, "optimizer": optimizer}
    _report_filled(filled)
    if with_rng:
        sharded["rng_state"] = {_rng_key(torch.distributed.get_rank()): checkpoint_state.capture_rng()}
    megatron_fsdp.even_out(sharded)
    return sharded


_FILLED_REPORTED: list[bool] = []


def _report_filled(filled: int) -> None:
    """Collective (once per process): rank 0 says how many Adam states were filled for empty shards (#4910)."""
    if _FILLED_REPORTED:
        return
    _FILLED_REPORTED.append(True)
    count = torch.tensor([filled], dtype=torch.int64)
    torch.distributed.all_reduce(count)
    if count.item() and torch.distributed.get_rank() == 0:
        log.info("checkpoint: %d parameter shards are empty on their rank: zero Adam state filled in so every rank "
                 "saves the same keys (Megatron-LM #4910)", count.item())


def _common(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "consumed_samples": state.consumed_samples,
            "scheduler": state.scheduler.state_dict(), "extra": dict(state.extra),
            "world_size": torch.distributed.get_world_size(),
            reshard.LAYOUT_KEY: checkpoint_state.current_layout(state),
            "content_metadata": {**checkpoint_state.content_metadata(), **megatron_fsdp.OPTIMIZER_SHARDING}}


def _warn_rerun_state() -> None:
    if checkpoint_state.rerun_state_to_save() is not None and torch.distributed.get_rank() == 0:
        log.warning("checkpoint: the rerun state machine is mid-diagnosis; fsdp_dtensor checkpoints do not hold its "
                    "state yet, so a resume trains the step again without re-running it")


def _write_common(path: str, common: dict[str, Any]) -> None:
    """Rank 0, after DCP's ``.metadata``: the common state, then ``metadata.json`` (what marks the folder complete for
    ``readable.py``)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    torch.save(common, os.path.join(path, "common.pt"))
    save_config(CheckpointingConfig(sharded_backend=SHARDED_BACKEND), path)


def save(state: TrainState, path: str) -> None:
    """Collective: every rank's shards into ``path`` (an existing, empty ``iter_N.tmp``), then rank 0 the common
    state and ``metadata.json``."""
    import torch.distributed.checkpoint as dcp

    _warn_rerun_state()
    dcp.save(_sharded(state, is_loading=False), checkpoint_id=path)
    if torch.distributed.get_rank() == 0:
        _write_common(path, _common(state))
    torch.distributed.barrier()


def save_async(state: TrainState, path: str) -> Any:
    """Collective: plan the save of ``state`` into ``path`` and return megatron-core's ``AsyncRequest`` for the
    manager's queue (``checkpoint.async_save``, as Megatron-LM's ``--async-save`` with ``fsdp_dtensor``). The forked
    writer holds the shards as they are now; the common state is taken now too and written by rank 0 in the
    request's finalize, after DCP's index, before the manager's commit."""
    _warn_rerun_state()
    sharded = _sharded(state, is_loading=False)
    then = []
    if torch.distributed.get_rank() == 0:
        common = copy.deepcopy(_common(state))  # this step's counters, not the ones when the write finishes
        then.append(lambda: _write_common(path, common))
    return dist_checkpointing.dcp_async_save_request(sharded, path, then)


def load(state: TrainState, path: str, common: dict[str, Any]) -> None:
    """Collective: ``path`` into ``state``, in place. The RNG states come back only at the world size they were
    saved with (as for torch_dist checkpoints)."""
    import torch.distributed.checkpoint as dcp

    same_world = int(common.get("world_size", -1)) == torch.distributed.get_world_size()
    template = _sharded(state, is_loading=True, with_rng=same_world)
    dcp.load(template, checkpoint_id=path)
    megatron_fsdp.load_model_state_dict(state.model[0], template["model"])
    state.optimizer.load_state_dict(template["optimizer"])
    loaded = {**common}
    if same_world:
        loaded["rng_state"] = template["rng_state"][_rng_key(torch.distributed.get_rank())]
    checkpoint_state.apply_counters(state, loaded)
