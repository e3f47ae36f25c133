"""nvidia-resiliency-ext's node-local checkpoints (``checkpointing.local``), adapted where it assumes a GPU.

The module is the same in 0.4.1 and 0.7.0 (only the async request's signature differs, which we do not use:
async local saves are CUDA-only). What we adapt, without copying its code:

- **the replica fetch** (``GroupWrapper.isend_state_dict`` / ``irecv_state_dict``, used when a rank's own part
  is gone and a replica on another rank sends it) moves every tensor to CUDA unconditionally before
  ``send``/``recv``: on gloo (CPU) it fails with "Torch not compiled with CUDA enabled". Our group wrapper sends
  on a device the group's backend supports (the CPU for gloo, the GPU for NCCL); the object and the order of
  tensors are upstream's protocol, reused through its own ``send_object``/``recv_object``;
- **replication groups** are created by upstream with ``torch.distributed.new_group`` and no timeout (gloo's
  default is 30 minutes: a rank blocked there during an in-process restart is freed only by the hard timeout,
  which kills it): we create the same cliques (upstream's ``parse_group_sequence``) with the run's timeout;
- **retention**: upstream keeps only the newest local checkpoint; ``checkpoint.local_keep_last_n`` keeps N,
  and a checkpoint superseded by a persistent one of the same or a later step can be discarded;
- **a save cut off mid-write** (a rank killed, or aborted by an in-process restart, inside ``torch.save``) leaves
  its ``.dirty`` file behind, and upstream opens that name in exclusive-create mode: every later save of that
  step raises ``SameMachineReplicationException`` (in-process restart, process restart, requeue onto the same
  disk alike). Upstream removes it only when the failed save itself reaches its finalize step, which a cut-off
  save never does. ``forget_after`` removes it (and parts newer than the step resumed) on every (re)start.

Imports torch and nvidia_resiliency_ext lazily (this package must import without them).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

_FILE = re.compile(r"^iter_(\d{7,})_(\d+)_local(\.dirty)?\.pt$")


def _classes():
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

    return LocalCheckpointManager, GroupWrapper


def _backend_device(group) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend(group) == "nccl" \
        else torch.device("cpu")


def _group_wrapper_class():
    _, GroupWrapper = _classes()

    class BackendDeviceGroupWrapper(GroupWrapper):
        """Point-to-point state-dict exchange on the device the group's backend supports."""

        def isend_state_dict(self, state_dict, dst: int):
            import torch.distributed as dist

            device = _backend_device(self.group)
            tensors = state_dict.pop_tensors()
            self.send_object(state_dict, dst)
            for tensor in tensors:
                dist.send(tensor.to(device), dst, group=self.group)
            state_dict.insert_tensors(tensors)
            return {"data_sent": sum(t.nbytes for t in tensors)}

        def irecv_state_dict(self, src: int):
            import torch
            import torch.distributed as dist

            device = _backend_device(self.group)
            hollow = self.recv_object(src)
            hollow.init_tensors()
            for tensor in hollow.tensors:
                buffer = tensor if tensor.device == device else torch.empty_like(tensor, device=device)
                dist.recv(buffer, src, group=self.group)
                if buffer is not tensor:
                    tensor.copy_(buffer)
            return hollow, {"data_recv": sum(t.nbytes for t in hollow.tensors)}

    return BackendDeviceGroupWrapper


def replication_strategy(*, factor: int, jump: int, timeout: datetime.timedelta):
    """Upstream's clique replication (each rank's part on ``factor`` ranks ``jump`` apart), groups with ``timeout``."""
    import torch
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import parse_group_sequence
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    cliques = parse_group_sequence(replication_jump=jump, replication_factor=factor,
                                   world_size=torch.distributed.get_world_size())
    groups = [torch.distributed.new_group(ranks, timeout=timeout) for ranks in cliques]  # collective: every rank
    me = torch.distributed.get_rank()
    mine = next(g for g, ranks in zip(groups, cliques) if me in ranks)
    return CliqueReplicationStrategy(_group_wrapper_class()(mine), target_device="cpu"), cliques


def local_checkpoint_manager(root: str, session_id: str, *, keep_last_n: int, strategy=None):
    """A ``LocalCheckpointManager`` writing under ``<root>/<session_id>/<rank>/`` that keeps ``keep_last_n``."""
    LocalCheckpointManager, _ = _classes()

    class KeepLastN(LocalCheckpointManager):
        def _cleanup(self, iteration):  # upstream: after a complete save of `iteration`, delete every older one
            complete = sorted({step for step, path in self.files() if step <= iteration and ".dirty" not in path.name})
            keep = set(complete[-keep_last_n:]) | {iteration}
            for step, path in self.files():
                if step < iteration and (step not in keep or ".dirty" in path.name):
                    path.unlink(missing_ok=True)

        def files(self) -> list[tuple[int, Path]]:
            """(step, path) of every checkpoint file in this rank's folder (own parts, replicas, unfinished)."""
            folder = Path(self.local_ckpt_dir)
            if not folder.is_dir():
                return []
            return [(int(m.group(1)), folder / name) for name in sorted(p.name for p in folder.iterdir())
                    if (m := _FILE.match(name))]

        def ranks_without_own_part(self, step: int) -> list[int]:
            """After ``find_latest()``: the ranks whose own part of ``step`` is not on their node (each is fetched
            from a replica by ``load()``)."""
            available = getattr(self, "globally_available_ids", None) or []
            return [rank for rank, ids in enumerate(available)
                    if not any(i[0] == step and i[1] == rank for i in ids)]

        def discard_from(self, step: int) -> list[str]:
            """Delete this rank's files of ``step`` and later (superseded by a persistent checkpoint)."""
            removed = []
            for saved, path in self.files():
                if saved >= step:
                    path.unlink(missing_ok=True)
                    removed.append(str(path))
            self.latest_iteration = -1
            return removed

        def forget_after(self, step: int) -> list[str]:
            """Delete this rank's unfinished (``.dirty``) files of any step and its files of steps after ``step``
            (the step resumed): a save cut off mid-write blocks every later save of its step, and a part newer
            than the resumed step belongs to a future this run abandoned (it could complete a later save's
            partial set with the wrong timeline's data, and upstream asserts every save is newer than it)."""
            removed = []
            for saved, path in self.files():
                if saved > step or ".dirty" in path.name:
                    path.unlink(missing_ok=True)
                    removed.append(str(path))
            self.latest_iteration = -1
            return removed

    return KeepLastN(root, session_id=session_id, repl_strategy=strategy)


def tensor_aware_state_dict(sharded_state_dict: dict):
    """Megatron-Core's adapter between a sharded state dict and the local manager (each rank saves every shard it
    holds: ``atomic``, no exchange; a local checkpoint is read back with the same parallel layout only)."""
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sharded_state_dict, algo="atomic")
    return tasd


def to_state_dict(tasd, template: dict) -> dict:
    """The loaded state dict for ``template`` (a loading sharded state dict) from a tensor-aware one."""
    return tasd.to_state_dict(template, algo="atomic")
