"""Command line of the watcher: find the run's job-level config, then poll until the chain of attempts ends.

    python -m megatron_resilience.watch RUN_DIR [--job-id ID] [--interval 30] [--once]
    python -m megatron_resilience.watch --config JOB_DIR/NAME_job_level.json --job-id ID

The config is the one the batch script wrote (its path is in the ledger's ``attempt_start``
records); before the first attempt started, give ``--config`` and ``--job-id``.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_resilience.jobs.jobconfig import JobLevelConfig
from megatron_resilience.jobs.ledger import LEDGER_FILE, Ledger
from megatron_resilience.jobs.watcher import watch


def find_config(run_dir: str) -> str | None:
    starts = Ledger(os.path.join(run_dir, LEDGER_FILE)).records("attempt_start")
    paths = [s.get("config") for s in starts if s.get("config")]
    return paths[-1] if paths else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resilience.watch", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", help="the run's directory (holds job_ledger.jsonl)")
    parser.add_argument("--config", help="the job-level config JSON (default: from the run's ledger)")
    parser.add_argument("--job-id", help="the Slurm job to start from (default: the ledger's newest)")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between polls (default 30)")
    parser.add_argument("--once", action="store_true", help="poll once and exit")
    args = parser.parse_args(argv)
    config = args.config or (find_config(args.run_dir) if args.run_dir else None)
    if not config or not os.path.exists(config):
        print(f"megatron_resilience watch: no job-level config found (ledger in {args.run_dir!r} has no attempt yet); "
              "pass --config JOB_DIR/<name>_job_level.json and --job-id", file=sys.stderr)
        return 2
    if args.interval <= 0:
        parser.error("--interval: must be a number of seconds > 0")
    return watch(JobLevelConfig.read(config), job_id=args.job_id, interval=args.interval, once=args.once)
