"""The ports a job binds on its nodes: a block of its own, outside the kernel's ephemeral range.

Why: a port picked by binding port 0 and closing the socket (ft_launcher 0.4.1 and 0.7.0 pick the workers'
``MASTER_PORT`` that way; Megatron-LM adds 1 and 2 to it for in-process restart) is free for anyone until
rank 0 binds it again seconds later, and on a crowded node any outgoing connection can get it as its
ephemeral local port: the store fails with ``EADDRINUSE`` and the worker group restarts for nothing.
nemo_run's fixed rendezvous port (29500) is shared by every job on a node. Instead every job owns

    base = PORT_RANGE_START + (job key % BLOCKS) * PORTS_PER_JOB
    base + 0  ft_launcher's rendezvous (the c10d store its agents meet at; Slurm jobs rendered by the plugin)
    base + 1  the trainer's process-group store (rank 0 hosts it; replaces the launcher's MASTER_PORT)
    base + 2  the in-process restart wrapper's store
    base + 3  spare

The block lies below the ephemeral range (Linux default 32768-60999), so no socket the kernel numbers
itself can take it; two jobs on one node share a block only if their keys are equal modulo BLOCKS. The key is
``MEGATRON_RESILIENCE_JOB_PORT`` (an explicit base: tests, or an admin's own scheme), else ``SLURM_JOB_ID``,
else a hash of ``TORCHELASTIC_RUN_ID`` (the launcher's rendezvous id, the same on every rank). Stdlib only:
the plugins render the Slurm side, the trainer binds.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Mapping

JOB_PORT_ENV = "MEGATRON_RESILIENCE_JOB_PORT"
PORT_RANGE_START = 25000
PORT_RANGE_END = 32768  # exclusive: the Linux default start of the ephemeral range
PORTS_PER_JOB = 4
BLOCKS = (PORT_RANGE_END - PORT_RANGE_START) // PORTS_PER_JOB
RENDEZVOUS, PROCESS_GROUP, INPROCESS = 0, 1, 2


@dataclass(frozen=True)
class JobPorts:
    base: int
    source: str  # where the base came from (an env var name)

    @property
    def rendezvous(self) -> int:
        return self.base + RENDEZVOUS

    @property
    def process_group(self) -> int:
        return self.base + PROCESS_GROUP

    @property
    def inprocess(self) -> int:
        return self.base + INPROCESS

    def describe(self) -> str:
        return (f"ports {self.base}-{self.base + PORTS_PER_JOB - 1} (from {self.source}): process-group store "
                f"{self.process_group}, in-process store {self.inprocess}")


def block_base(key: int) -> int:
    return PORT_RANGE_START + (key % BLOCKS) * PORTS_PER_JOB


def job_ports(env: Mapping[str, str]) -> JobPorts | None:
    """This job's port block from its environment; None when nothing identifies the job (a bare process)."""
    explicit = env.get(JOB_PORT_ENV)
    if explicit:
        if not explicit.isdigit() or not 1024 <= int(explicit) <= 65535 - PORTS_PER_JOB:
            raise ValueError(f"{JOB_PORT_ENV}: must be a port number 1024..{65535 - PORTS_PER_JOB}, got {explicit!r}")
        return JobPorts(int(explicit), JOB_PORT_ENV)
    job_id = env.get("SLURM_JOB_ID", "")
    if job_id.isdigit():
        return JobPorts(block_base(int(job_id)), "SLURM_JOB_ID")
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return JobPorts(block_base(zlib.crc32(run_id.encode())), "TORCHELASTIC_RUN_ID")
    return None


def overlaps_ephemeral(ports: JobPorts, ephemeral: tuple[int, int]) -> bool:
    """Whether the block lies inside the node's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``)."""
    low, high = ephemeral
    return ports.base <= high and ports.base + PORTS_PER_JOB - 1 >= low


def slurm_block_base_shell() -> str:
    """The bash expression the batch script exports as JOB_PORT_ENV (the same arithmetic as ``block_base``)."""
    return f"$(({PORT_RANGE_START}+SLURM_JOB_ID%{BLOCKS}*{PORTS_PER_JOB}))"
