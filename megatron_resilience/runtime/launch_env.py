"""Who this rank is and where the rendezvous is, from the launcher's or Slurm's variables. Never imports torch.

Three ways a rank learns who it is (:func:`launch_env`):

- torchrun and ft_launcher export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- ``srun`` with no launcher (one task per rank, e.g. ``ntasks_per_node=8`` and a ``run.Script``
  whose trainer line is ``exec python -m megatron_resilience ...``) exports only Slurm's variables:
  rank = ``SLURM_PROCID``, world size = ``SLURM_STEP_NUM_TASKS``, local rank = ``SLURM_LOCALID``, and
  the rendezvous is the first node of the step (127.0.0.1 when the step has one node) on a port
  derived from the job id, as Megatron-LM and NeMo users on Slurm expect. Only inside a job step
  (``SLURM_STEP_ID`` set): the batch shell also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the
  whole job, and a trainer started there is one process;
- neither: a plain ``python -m megatron_resilience``, a world of one.

:func:`adopt_launch_env` exports the Slurm-derived values as the torchrun variables, so every part of
the trainer (logs, hooks, ``init_process_group``) reads one picture. It runs before torch is imported,
so the submit-time checks the trainer repeats (world size, paths) know the world size in seconds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping


@dataclass(kw_only=True, frozen=True)
class LaunchEnv:
    """Who this process is, and where the rendezvous is (None: the launcher's variables already say it)."""

    rank: int
    world_size: int
    local_rank: int
    source: str  # "launcher" (torchrun/ft_launcher), "slurm" (srun, no launcher) or "single"
    master_addr: str | None = None
    master_port: int | None = None


SLURM_PORT_BASE = 15000  # rendezvous port for srun-launched ranks: SLURM_PORT_BASE + job id % SLURM_PORT_SPAN
SLURM_PORT_SPAN = 10000


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``node[007-010,12],gpu3`` -> ``node007`` (what ``scontrol show
    hostnames`` prints first; zero padding kept; no subprocess, so it works wherever the trainer runs)."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level item: commas inside brackets do not split
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], item)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    return host


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank, world size, local rank and rendezvous from the launcher's or Slurm's variables (see module doc)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return LaunchEnv(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
                         local_rank=int(env.get("LOCAL_RANK", "0")), source="launcher")
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        world_size = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES")) == "1":
            addr = "127.0.0.1"  # every rank on this node: no name to resolve (a node's name may not be its host's)
        elif nodelist:
            addr = first_host(nodelist)
        else:
            addr = "127.0.0.1"
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else \
            SLURM_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % SLURM_PORT_SPAN
        return LaunchEnv(rank=int(env["SLURM_PROCID"]), world_size=world_size,
                         local_rank=int(env.get("SLURM_LOCALID", "0")), source="slurm",
                         master_addr=addr, master_port=port)
    return LaunchEnv(rank=0, world_size=1, local_rank=0, source="single")


_adopted_from_slurm: LaunchEnv | None = None  # what adopt_launch_env derived, for init_distributed's log line


def adopt_launch_env() -> LaunchEnv:
    """:func:`launch_env`; Slurm-derived values are exported as RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
    MASTER_PORT, so logs, hooks and ``init_process_group`` read one picture (logged by :func:`init_distributed`)."""
    global _adopted_from_slurm
    env = launch_env()
    if env.source == "slurm":
        os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                          MASTER_ADDR=str(env.master_addr), MASTER_PORT=str(env.master_port))
        _adopted_from_slurm = env
    return env


def adopted_from_slurm() -> LaunchEnv | None:
    """What :func:`adopt_launch_env` derived from Slurm's variables in this process (None: nothing)."""
    return _adopted_from_slurm
