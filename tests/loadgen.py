"""A bounded CPU load generator: prove timing-sensitive behaviour on a saturated machine.

A green suite on a quiet machine hides timing bugs (a preempted job was lost once because other work
shared the 2 cores). Tests that prove signals, saves and restarts run some of their cases under
``saturated()``; the whole suite can be run that way too::

    .venv/bin/python tests/loadgen.py --seconds 3600 &    # one busy process per core, gone after an hour
    make test

Each busy process spins in pure Python, exits by itself after ``seconds`` and when its parent is gone,
so a killed test never leaves load behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

_SPIN = (
    "import os, sys, time\n"
    "end, parent = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])\n"
    "n = 0\n"
    "while time.monotonic() < end:\n"
    "    n += 1\n"
    "    if n % 200000 == 0 and os.getppid() != parent:\n"
    "        break\n"
)


def start(workers: int | None = None, seconds: float = 600.0) -> list[subprocess.Popen]:
    """Start ``workers`` busy processes (default: one per core) that end by themselves after ``seconds``."""
    count = workers or os.cpu_count() or 2
    return [subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds), str(os.getpid())],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(count)]


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


@contextlib.contextmanager
def saturated(workers: int | None = None, seconds: float = 600.0) -> Iterator[list[subprocess.Popen]]:
    """Keep every core busy inside the ``with`` block (at most ``seconds``)."""
    procs = start(workers, seconds)
    try:
        yield procs
    finally:
        stop(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long (default 3600)")
    parser.add_argument("--workers", type=int, default=None, help="busy processes (default: one per core)")
    args = parser.parse_args()
    procs = start(args.workers, args.seconds)
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
