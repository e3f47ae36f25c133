"""The few collectives the trainer and the resilience hooks need, on whatever backend the trainer initialised.

All ranks must agree before any of them acts on a decision (a rank that leaves alone hangs the others in their
next collective; a rank that loads another checkpoint trains another model), so every such decision goes through
one of these: rank 0 decides and broadcasts, or every rank votes in one small all-reduce. gloo reduces CPU
tensors, NCCL CUDA tensors. Without torch.distributed (one process) each is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if is_initialized() else 0


def _device() -> torch.device:
    if dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise max over all ranks."""
    if not is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


def all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    if not is_initialized():
        return bool(ok)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def all_min_max(value: int) -> tuple[int, int]:
    """(smallest, largest) ``value`` over all ranks, in one all-reduce."""
    if not is_initialized():
        return value, value
    both = torch.tensor([-value, value], dtype=torch.int64, device=_device())
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(-both[0].item()), int(both[1].item())


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s value on every rank."""
    if not is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.broadcast(tensor, src)
    return int(tensor.item())


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (any picklable value) on every rank."""
    if not is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
