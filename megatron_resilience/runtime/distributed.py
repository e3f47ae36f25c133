"""torch.distributed and Megatron-Core parallel state from the launcher's environment.

Who a rank is comes from :mod:`launch_env` (torchrun/ft_launcher variables, Slurm's under a bare
``srun``, or a world of one). The backend follows the device: gloo on CPU (with :mod:`cpu_compat`
installed), nccl on GPU.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch

from megatron_resilience.config import PretrainConfig
from megatron_resilience.config.ports import job_ports
from megatron_resilience.config.validate import ConfigError
from megatron_resilience.runtime import forked_children
from megatron_resilience.runtime.job_store import process_group_store, uses_job_store
from megatron_resilience.runtime.launch_env import adopted_from_slurm, launch_env

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp: int
    pp: int
    dp: int

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"


def resolve_device(requested: str) -> torch.device:
    """``train.device``: "auto" picks cuda when a GPU is visible, else cpu; "cuda" without a GPU fails clearly."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' requested but torch.cuda.is_available() is False")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_timeout(config: PretrainConfig, backend: str) -> datetime.timedelta:
    """Every process group's timeout: 10 minutes, or what in-process restart needs (config/inprocess.py)."""
    if config.inprocess.enabled:
        return datetime.timedelta(seconds=config.inprocess.group_timeout_seconds(backend))
    return datetime.timedelta(minutes=10)


def init_distributed(config: PretrainConfig) -> DistInfo:
    """Initialise the process group and Megatron-Core's TP/PP/DP groups; fail clearly on a bad world size."""
    launch = launch_env()
    rank, world_size, local_rank = launch.rank, launch.world_size, launch.local_rank
    forked_children.install()  # before any helper is forked and before the store binds: see that module
    dp = config.validate_world_size(world_size)  # raises ConfigError naming the keys that do not fit
    device = resolve_device(config.train.device)
    if device.type == "cpu":
        from megatron_resilience.runtime import cpu_compat

        cpu_compat.install()
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    backend = "gloo" if device.type == "cpu" else "nccl"
    timeout = group_timeout(config, backend)
    if not torch.distributed.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # single process without a launcher
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
        ports = job_ports(os.environ) if uses_job_store() else None
        store = None if ports is None else process_group_store(ports, rank=rank, world_size=world_size,
                                                               timeout=timeout)
        torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                                             store=store)
    from megatron.core import parallel_state

    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    if not parallel_state.model_parallel_is_initialized():
        # In-process restart: every subgroup gets the world's timeout (Megatron-Core's unit is minutes; fractions
        # are kept). Otherwise Megatron-Core's default (30 minutes).
        extra = {"distributed_timeout_minutes": timeout.total_seconds() / 60} if config.inprocess.enabled else {}
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 **extra)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, tp=tp, pp=pp, dp=dp)
    if rank == 0:
        log.info("distributed: world_size=%d tp=%d pp=%d dp=%d device=%s backend=%s",
                 world_size, tp, pp, dp, device, torch.distributed.get_backend())
        slurm = adopted_from_slurm()
        if slurm is not None:
            log.info("distributed: started by srun without a launcher: rank = SLURM_PROCID, world size = "
                     "SLURM_STEP_NUM_TASKS = %d, local rank = SLURM_LOCALID; rendezvous %s:%d", slurm.world_size,
                     slurm.master_addr, slurm.master_port)
    return info


def seed_everything(seed: int) -> None:
    """The same seed on every rank before the model is built; then Megatron's TP RNG tracker.

    Identical seeds make every data-parallel replica start from the same weights;
    ``model_parallel_cuda_manual_seed`` gives tensor-parallel ranks their own
    dropout stream (seed + 2718 + tp_rank) and keeps the default one shared.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Megatron-Core's groups, then the default group; the next init (an in-process restart, a test) starts clean
    even where an earlier teardown was cut short (``upstream.pytorch.reset_group_names``)."""
    from megatron.core import parallel_state

    from megatron_resilience.upstream.pytorch import reset_group_names

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    reset_group_names()
