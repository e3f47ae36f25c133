"""Run a chaos benchmark script (``benchmarks/chaos.py``, ``benchmarks/chaos_megatron_lm.py``) as a user runs it,
on the multi-node instance, and read back what it wrote: its JSON and the chaos stream's own log.

One place for the environment it needs (the multi-node instance's Slurm settings, none of the suite's own ``MR_SLURM_*``
or ``NEMORUN_HOME``: the benchmark keeps its experiments under ``--out``) and for the failure message (the tail of
its output), shared by the suite's chaos, SDC and Megatron-LM chaos tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_benchmark(script: str, cluster, out: str, args: list[str], *, log_name: str | None = None) -> dict:
    """``python benchmarks/<script> <args> --out OUT --json OUT/chaos.json``; asserts it exited 0.

    Returns ``data`` (the JSON), ``run`` (its single run), ``stdout`` and ``chaos_log`` (``OUT/<log_name>``, by
    default the run's ``<name>.chaos.log``)."""
    path = os.path.join(out, "chaos.json")
    env = {k: v for k, v in cluster.env.items() if not k.startswith("MR_SLURM_")}
    env.pop("NEMORUN_HOME", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *args, "--out", out,
                           "--json", path], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    with open(path) as f:
        data = json.load(f)
    [run] = data["runs"]
    with open(os.path.join(out, log_name or f"{run['name']}.chaos.log")) as f:  # what chaos did, and why
        chaos_log = f.read()
    return {"data": data, "run": run, "stdout": proc.stdout, "chaos_log": chaos_log}
