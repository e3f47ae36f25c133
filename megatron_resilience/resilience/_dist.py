"""The few collectives the resilience hooks need, on whatever backend the trainer initialised.

All ranks must agree before any of them stops (a rank that leaves alone hangs the
others in their next collective), so every decision goes through one small
all-reduce. gloo reduces CPU tensors, nccl CUDA tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device() -> torch.device:
    if dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise max over all ranks (identity without torch.distributed)."""
    if not is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s value on every rank."""
    if not is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.broadcast(tensor, src)
    return int(tensor.item())
