"""Command line of the watcher: find the run's job-level config, then poll until the chain of attempts ends.

    python -m megatron_resilience.watch RUN_DIR [--job-id ID] [--interval 30] [--once]
    python -m megatron_resilience.watch --config JOB_DIR/NAME_job_level.json --job-id ID

The config is the one the batch script wrote (its path is in the ledger's ``attempt_start``
records). Started while the job is still pending (no attempt has started, so no config exists yet),
the watcher waits for the first attempt, saying what the job waits for (``--job-id``: Slurm's pending
reason), and gives up only when that job ended without ever starting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megatron_resilience.jobs import slurm
from megatron_resilience.jobs.jobconfig import JobLevelConfig
from megatron_resilience.jobs.ledger import LEDGER_FILE, Ledger
from megatron_resilience.jobs.watcher import log, watch


def find_config(run_dir: str) -> str | None:
    starts = Ledger(os.path.join(run_dir, LEDGER_FILE)).records("attempt_start")
    paths = [s.get("config") for s in starts if s.get("config")]
    return paths[-1] if paths else None


def wait_for_first_attempt(run_dir: str, job_id: str | None, *, interval: float,
                           once: bool) -> tuple[str | None, int]:
    """Wait until the run's first attempt wrote its config (the job was pending); (config, 0) or (None, exit code)."""
    said = None
    while True:
        config = find_config(run_dir)
        if config:
            log(f"the run's first attempt started: watching with {config}")
            return config, 0
        state = slurm.job_state(job_id) if job_id else {}
        if job_id and state.get("state") in slurm.TERMINAL:
            if find_config(run_dir):  # it started (and ended) since the look above
                continue
            log(f"job {job_id} ended ({state['state']}) before its first attempt started: nothing to watch")
            return None, 1
        what = (f"job {job_id} is {state.get('state') or 'not known to Slurm yet'}"
                + (f" ({state['reason']})" if state.get("reason") not in (None, "", "None") else "") if job_id
                else "no attempt of this run has started yet")
        if what != said:
            log(f"waiting for the run's first attempt: {what} (polling every {interval:g} s)")
            said = what
        if once:
            return None, 0
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resilience.watch", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", help="the run's directory (holds job_ledger.jsonl)")
    parser.add_argument("--config", help="the job-level config JSON (default: from the run's ledger)")
    parser.add_argument("--job-id", help="the Slurm job to start from (default: the ledger's newest)")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between polls (default 30)")
    parser.add_argument("--once", action="store_true", help="poll once and exit")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval: must be a number of seconds > 0")
    config = args.config or (find_config(args.run_dir) if args.run_dir else None)
    if not config and args.run_dir:
        config, code = wait_for_first_attempt(args.run_dir, args.job_id, interval=args.interval, once=args.once)
        if config is None:
            return code
    if not config or not os.path.exists(config):
        print(f"megatron_resilience watch: no job-level config found (ledger in {args.run_dir!r} has no attempt yet); "
              "pass RUN_DIR (the watcher waits for the first attempt) or --config JOB_DIR/<name>_job_level.json",
              file=sys.stderr)
        return 2
    return watch(JobLevelConfig.read(config), job_id=args.job_id, interval=args.interval, once=args.once)
