"""Run a snippet on two real gloo ranks (separate interpreters, a store on a port block of their own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from resilience_support.ports import reserve

REPO = Path(__file__).resolve().parents[2]


def two_ranks(tmp_path, body: str, timeout: float = 900) -> list[str]:
    """Run ``body`` on ranks 0 and 1 (gloo, a store on a reserved port); returns each rank's stdout."""
    block = reserve()
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent("""
        import datetime, os, sys, time, threading, torch, torch.distributed as dist
        rank = int(sys.argv[1]); port = int(sys.argv[2]); root = sys.argv[3]
        # generous: a rank's imports took minutes beside the other suites (CI), and nothing here is a timing
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=600))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    """) + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    try:
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(block.base), str(tmp_path)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for r in (0, 1)]
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        block.release()
    return outs
