"""A port block of its own for every launch the tests start (``MEGATRON_RESILIENCE_JOB_PORT``).

The trainer binds its stores on its job's block (``megatron_resilience/config/ports.py``). A real job's block
comes from its Slurm job id; launches started by hand (ft_launcher --standalone) would hash the launcher's
rendezvous id into the block range, and a dozen concurrent launches (this suite, other suites on the machine)
could share one. So each launch here takes a block from a range no derived block uses (10000-14999: below
srun's MASTER_PORT scheme, 15000 + job id % 10000, and far below the ephemeral range), reserved machine-wide
with an ``flock`` on a file per block for as long as the launch lives: two test processes never get the same
block, and a block whose owner died is free again (the kernel drops the lock).
"""

from __future__ import annotations

import fcntl
import os
import random

REGISTRY = "/tmp/megatron_resilience_test_ports"
FIRST, LAST = 10000, 14996  # block bases; a block is 4 ports


class PortBlock:
    """A reserved block; ``release()`` (or the process ending) frees it."""

    def __init__(self, base: int, fd: int) -> None:
        self.base, self._fd = base, fd

    def env(self) -> dict[str, str]:
        return {"MEGATRON_RESILIENCE_JOB_PORT": str(self.base)}

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def reserve() -> PortBlock:
    """A block no other process on this machine holds now."""
    os.makedirs(REGISTRY, exist_ok=True)
    bases = list(range(FIRST, LAST + 1, 4))
    start = random.randrange(len(bases))
    for base in bases[start:] + bases[:start]:
        fd = os.open(os.path.join(REGISTRY, str(base)), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return PortBlock(base, fd)
    raise RuntimeError(f"no free test port block in {FIRST}-{LAST + 3}")
