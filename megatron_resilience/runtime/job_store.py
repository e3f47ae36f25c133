"""The process-group store on a port the job owns (``config/ports.py``), instead of the launcher's MASTER_PORT.

ft_launcher (0.4.1 and 0.7.0) hands its workers a ``MASTER_PORT`` it found free and closed again; rank 0
binds it seconds later, and on a crowded node another socket can take it first (``EADDRINUSE``: the
worker group restarts, a spurious failure). torchrun shares its agent's store with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``) and has no such window, so under torchrun the launcher's store is
used as before; under ft_launcher, and for in-process restart under any launcher, rank 0 hosts the store on
its job's process-group port (outside the ephemeral range, one block per job).

One store per process: in-process restart calls ``init_process_group`` again in the same process, each time
under a prefix of its own (the restart iteration), so no key of an earlier iteration is read by a later one.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
from typing import Callable, TypeVar

import torch

from megatron_resilience.config.ports import JOB_PORT_ENV, JobPorts, overlaps_ephemeral
from megatron_resilience.runtime import forked_children
from megatron_resilience.runtime.metrics import INPROCESS_RESTART_ENV

log = logging.getLogger(__name__)


T = TypeVar("T")
_stores: dict[tuple[int, int], torch.distributed.Store] = {}
_prefixes_used: set[str] = set()


def uses_job_store(env=None) -> bool:
    """True under ft_launcher (its MASTER_PORT is released before use) and for in-process restarts; False under
    torchrun (its agent's store is shared with the workers), srun without a launcher (MASTER_PORT derived from the
    job id) and a single process."""
    env = os.environ if env is None else env
    if INPROCESS_RESTART_ENV in env:
        return True
    return "TORCHELASTIC_RUN_ID" in env and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def job_key(env=None) -> str:
    """Prefix of every key this job writes to its stores: a client that reached another job's store by mistake
    (two jobs sharing a port block) waits for keys that never come and fails, instead of joining that job's
    groups. Not the launcher's restart count: agents count differently (a membership change restarts the
    workers without counting), and every worker-group cycle has a fresh store anyway (its rank 0 hosts it)."""
    env = os.environ if env is None else env
    return f"megatron_resilience/{env.get('SLURM_JOB_ID', '-')}/{env.get('TORCHELASTIC_RUN_ID', '-')}"


def port_holders(port: int) -> list[str]:
    """``"pid N (command line)"`` of every process of this node that this user can see listening on TCP ``port``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else ()):
        try:
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or another user's
            continue
        holders.append(f"pid {pid} ({cmd[:160]})")
    return holders


def bind_or_explain(create: Callable[[], T], port: int, what: str) -> T:
    """``create()`` a store that binds ``port``, once. The port is the job's own: a rank's forked helpers never
    keep it (``runtime/forked_children.py``), so a port in use is another job's or service's, and waiting would
    only hide that. The error names the processes that hold it and how to give the job another block."""
    forked_children.install()
    try:
        return create()
    except (RuntimeError, torch.distributed.DistNetworkError) as err:
        in_use = "EADDRINUSE" in str(err) or f"errno: {errno.EADDRINUSE}" in str(err)
        if not in_use:
            raise RuntimeError(f"{what}: cannot bind port {port} on this node: {err}") from None
        holders = port_holders(port)
        raise RuntimeError(
            f"{what}: cannot bind port {port} on this node: in use by "
            f"{'; '.join(holders) if holders else 'a process this user cannot see'}; the port belongs to this "
            f"job's port block, so another job or service uses it: give this job another block with "
            f"{JOB_PORT_ENV}=<base port>") from None


def connect_or_explain(create: Callable[[], T], host: str, port: int, what: str) -> T:
    """``create()`` a client of rank 0's store; a failure names the store it could not reach."""
    forked_children.install()
    try:
        return create()
    except (RuntimeError, torch.distributed.DistError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(f"{what}: cannot reach rank 0's store at {host}:{port} ({first}); rank 0 did not start "
                           f"it in time or died") from None


def host_or_connect(host: str, port: int, *, rank: int, world_size: int, timeout: datetime.timedelta,
                    what: str) -> torch.distributed.TCPStore:
    """Rank 0 binds ``port`` (see :func:`bind_or_explain`); the others connect."""
    if rank != 0:
        return connect_or_explain(lambda: torch.distributed.TCPStore(host, port, world_size, False, timeout=timeout),
                                  host, port, what)
    return bind_or_explain(lambda: torch.distributed.TCPStore(host, port, world_size, True, timeout=timeout,
                                                              wait_for_workers=False), port, what)


def process_group_store(ports: JobPorts, *, rank: int, world_size: int,
                        timeout: datetime.timedelta) -> torch.distributed.Store:
    """The store ``init_process_group`` uses, under a prefix unique to this call in this process."""
    key = (ports.process_group, rank)
    if key not in _stores:
        if rank == 0:
            ephemeral = _ephemeral_range()
            if ephemeral is not None and overlaps_ephemeral(ports, ephemeral):
                log.warning("job ports %s lie inside this node's ephemeral range %d-%d: other sockets may take "
                            "them; set %s to a base outside it", ports.describe(), *ephemeral, JOB_PORT_ENV)
            log.info("distributed: process-group store on this job's port %d (%s) instead of the launcher's "
                     "MASTER_PORT", ports.process_group, ports.describe())
        _stores[key] = host_or_connect(os.environ["MASTER_ADDR"], ports.process_group, rank=rank,
                                       world_size=world_size, timeout=timeout, what="process-group store")
    prefix = f"{job_key()}/pg/{os.environ.get(INPROCESS_RESTART_ENV, '0')}"
    while prefix in _prefixes_used:  # a second init in one iteration (tests): never reuse an earlier one's keys
        prefix += "+"
    _prefixes_used.add(prefix)
    return torch.distributed.PrefixStore(prefix, _stores[key])
