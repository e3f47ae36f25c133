"""Login-node cost of the CLI: dry run and help against ``import nemo_run`` itself, each in a fresh interpreter.

    .venv/bin/python benchmarks/login_node_cli.py [--repeat 5]

Prints, per command, the median wall time and CPU time (user + sys of the child) and whether torch was
imported, and the dry run's ratio to ``import nemo_run``. ``nemo`` is nemo_run's own console script: it
imports nemo_run (and with it torch, when torch is installed) before any of our code runs;
``python -m megatron_resilience.recipes.cli`` is the same command without that import.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BIN = os.path.dirname(sys.executable)
PY = sys.executable
DRYRUN = ["pretrain", "--factory", "gpt_126m(dir=/lustre/runs,num_nodes=2)", "--dryrun", "run.executor=slurm",
          "run.executor.account=acct", "run.executor.partition=batch", "run.executor.nodes=2", "run.plugins=resilience"]
TORCH_PROBE = "import atexit, sys; atexit.register(lambda: sys.stderr.write(f'\\nTORCH={\"torch\" in sys.modules}\\n'))"

# What the `nemo` console script runs (nemo_run.__main__), with the torch probe in front.
NEMO = [PY, "-c", f"{TORCH_PROBE}; sys.argv = ['nemo', *sys.argv[1:]]; from nemo_run.__main__ import app; app()"]

COMMANDS = {
    "import nemo_run": [PY, "-c", f"{TORCH_PROBE}; import nemo_run"],
    "import nemo_run (torch blocked, as our code does)":
        [PY, "-c", f"{TORCH_PROBE}; from megatron_resilience.upstream import import_nemo_run; import_nemo_run()"],
    "python -m megatron_resilience.recipes.cli pretrain ... --dryrun (Slurm)":
        [PY, "-c", f"{TORCH_PROBE}; import runpy, sys; sys.argv = ['cli', *sys.argv[1:]]; "
                   "runpy.run_module('megatron_resilience.recipes.cli', run_name='__main__')", *DRYRUN],
    "nemo megatron_resilience pretrain ... --dryrun (Slurm)": [*NEMO, "megatron_resilience", *DRYRUN],
    "nemo megatron_resilience pretrain --help": [*NEMO, "megatron_resilience", "pretrain", "--help"],
    "python -m megatron_resilience --help": [PY, "-c", f"{TORCH_PROBE}; import runpy, sys; sys.argv = ['x', '--help']; "
                                                        "runpy.run_module('megatron_resilience', run_name='__main__')"],
}


def measure(cmd: list[str], cwd: str) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env={**os.environ, "NEMORUN_HOME": cwd})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    torch = "yes" if "TORCH=True" in proc.stderr else "no" if "TORCH=False" in proc.stderr else "?"
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.repeat):  # interleaved, so load changes hit every command alike
            for name, cmd in COMMANDS.items():
                results.setdefault(name, []).append(measure(cmd, cwd))
    print(f"| command | wall (s), median of {args.repeat} | CPU (s) | torch imported |")
    print("|---|---|---|---|")
    medians = {}
    for name, runs in results.items():
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        medians[name] = wall
        print(f"| `{name}` | {wall:.2f} | {cpu:.2f} | {runs[-1][2]} |")
    base = medians["import nemo_run"]
    for name in ("python -m megatron_resilience.recipes.cli pretrain ... --dryrun (Slurm)",
                 "nemo megatron_resilience pretrain ... --dryrun (Slurm)"):
        print(f"{name}: {medians[name] / base:.2f}x `import nemo_run`")


if __name__ == "__main__":
    main()
