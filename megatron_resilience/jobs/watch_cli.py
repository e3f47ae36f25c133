"""Command line of the watcher: find the run's job-level config, then poll until the chain of attempts ends.

    python -m megatron_resilience.watch RUN_DIR [--job-id ID] [--interval 30] [--once]
    python -m megatron_resilience.watch --config JOB_DIR/NAME_job_level.json --job-id ID

The config is the one the batch script wrote (its path is in the ledger's ``attempt_start``
records). Started with ``--job-id`` while that job is still pending (no attempt has started, so no
config exists yet), the watcher waits for the first attempt, saying what the job waits for (Slurm's
pending reason), and gives up only when the job ended without ever starting.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace

from megatron_resilience.config._validate import ConfigError
from megatron_resilience.jobs import slurm
from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve
from megatron_resilience.jobs.ledger import LEDGER_FILE, Ledger
from megatron_resilience.jobs.policies import load_policy
from megatron_resilience.jobs.watcher import log, watch


def find_config(run_dir: str) -> str | None:
    starts = Ledger(os.path.join(run_dir, LEDGER_FILE)).records("attempt_start")
    paths = [s.get("config") for s in starts if s.get("config")]
    return paths[-1] if paths else None


def wait_for_first_attempt(run_dir: str, job_id: str, *, interval: float, once: bool) -> tuple[str | None, int]:
    """Wait until the run's first attempt wrote its config (the job was pending); (config, 0) or (None, exit code)."""
    said = None
    while True:
        config = find_config(run_dir)
        if config:
            log(f"the run's first attempt started: watching with {config}")
            return config, 0
        state = slurm.job_state(job_id)
        if state.get("state") in slurm.TERMINAL:
            if find_config(run_dir):  # it started (and ended) since the look above
                continue
            log(f"job {job_id} ended ({state['state']}) before its first attempt started: nothing to watch")
            return None, 1
        what = (f"job {job_id} is {state.get('state') or 'not known to Slurm yet'}"
                + (f" ({state['reason']})" if state.get("reason") not in (None, "", "None") else ""))
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
    parser.add_argument("--policy", help="decide with this policy (a preset or a YAML file, this package's schema "
                                         "or the log-monitoring tool's) instead of the one the job was submitted with")
    parser.add_argument("--monitors", nargs="+", help="recognise with these monitor presets/files instead")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="megatron_resilience watch: %(message)s", stream=sys.stdout)
    if args.interval <= 0:
        parser.error("--interval: must be a number of seconds > 0")
    config = args.config or (find_config(args.run_dir) if args.run_dir else None)
    if not config and args.run_dir and args.job_id:
        config, code = wait_for_first_attempt(args.run_dir, args.job_id, interval=args.interval, once=args.once)
        if config is None:
            return code
    if not config or not os.path.exists(config):
        print(f"megatron_resilience watch: no job-level config found (ledger in {args.run_dir!r} has no attempt yet); "
              "pass --job-id ID to wait for the pending job's first attempt, or --config "
              "JOB_DIR/<name>_job_level.json", file=sys.stderr)
        return 2
    cfg = JobLevelConfig.read(config)
    if args.policy or args.monitors:
        try:
            cfg = with_policy(cfg, args.policy, args.monitors)
        except ConfigError as err:
            log(str(err))
            return 2
    return watch(cfg, job_id=args.job_id, interval=args.interval, once=args.once)


def with_policy(cfg: JobLevelConfig, policy: str | None, monitors: list[str] | None) -> JobLevelConfig:
    """The run's config deciding with another policy/monitors, checked and translated as at submit time."""
    loaded = load_policy(policy) if policy else cfg.load_policy()
    for note in (loaded.notes + loaded.warnings) if policy and loaded else ():
        log(f"{loaded.source}: {note}")
    specs = resolve(policy, monitors)[1] if policy else (resolve(None, monitors)[1] if monitors else cfg.monitors)
    data = loaded.to_dict() if loaded else None
    log(f"deciding with policy {loaded.name if loaded else 'none (monitor-only)'}"
        f"{' (--policy ' + policy + ')' if policy else ''} and monitors {monitors or cfg.monitors}, instead of what "
        "the job was submitted with")
    return replace(cfg, policy=data, monitors=specs, monitor_only=cfg.monitor_only and not policy)
