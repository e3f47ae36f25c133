"""Command line of the watcher: find the run's job-level config, then poll until the chain of attempts ends.

    python -m megatron_resilience.watch RUN_DIR [--job-id ID] [--interval 30] [--once]
    python -m megatron_resilience.watch --config JOB_DIR/NAME_job_level.json --job-id ID

The config is the one the batch script wrote (its path is in the ledger's ``attempt_start``
records). Started with ``--job-id`` while that job is still pending (no attempt has started, so no
config exists yet), the watcher waits for the first attempt, saying what the job waits for (Slurm's
pending reason), and gives up when the job ended without ever starting, or when Slurm does not know the job
id at all (``UNKNOWN_POLLS`` polls in a row).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace

from megatron_resilience.config.validate import ConfigError
from megatron_resilience.jobs import slurm
from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve, watcher_settings
from megatron_resilience.jobs.policies import load_policy
from megatron_resilience.records.ledger import LEDGER_FILE, Ledger
from megatron_resilience.watch.watcher import log, watch

# Polls in a row on which Slurm does not know the job before the watcher stops waiting for its first attempt.
UNKNOWN_POLLS = 10


def find_config(run_dir: str) -> str | None:
    starts = Ledger(os.path.join(run_dir, LEDGER_FILE)).records("attempt_start")
    paths = [s.get("config") for s in starts if s.get("config")]
    return paths[-1] if paths else None


def wait_for_first_attempt(run_dir: str, job_id: str, *, interval: float, once: bool,
                           unknown_polls: int = UNKNOWN_POLLS) -> tuple[str | None, int]:
    """Wait until the run's first attempt wrote its config (the job was pending); (config, 0) or (None, exit code).

    A job Slurm does not know (neither ``scontrol`` nor ``sacct``) for ``unknown_polls`` polls in a row is given
    up (exit 2): a mistyped id would otherwise be waited for forever. ``sbatch`` returns once slurmctld holds the
    job, so a real job is known at the first poll; the bound only leaves room for a slurmctld that is restarting.
    """
    said = None
    unknown = 0
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
        unknown = 0 if state.get("state") else unknown + 1
        if unknown >= unknown_polls:
            log(f"job {job_id} is not known to Slurm (scontrol, sacct) after {unknown} polls {interval:g} s apart: "
                "giving up (is the job id right, and is this the cluster it was submitted to?)")
            return None, 2
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
    """The run's config deciding with another policy/monitors, checked and translated as at submit time.

    ``--policy`` alone keeps the monitors the job was submitted with (inlined in its config: the user's own files
    as they were checked then), not the policy file's default set. ``--monitors`` replaces them; a foreign
    monitoring file's ``inactivity_threshold_seconds`` then becomes the watcher's inactivity threshold, as the
    translation says (the files given now replace what the job was submitted with)."""
    loaded = load_policy(policy) if policy else cfg.load_policy()
    for note in (loaded.notes + loaded.warnings) if policy and loaded else ():
        log(f"{loaded.source}: {note}")
    specs = resolve(None, monitors)[1] if monitors else cfg.monitors
    threshold = watcher_settings(None, monitors).get("inactivity_threshold") if monitors else None
    data = loaded.to_dict() if loaded else None
    own = " (the job's own)"
    log(f"deciding with policy {loaded.name if loaded else 'none (monitor-only)'}"
        f"{f' (--policy {policy})' if policy else own} and monitors "
        f"{' '.join(monitors) + ' (--monitors)' if monitors else _described(cfg.monitors) + own}")
    if threshold is not None:
        was = f"{cfg.inactivity_threshold:g} s" if cfg.inactivity_threshold is not None else "none"
        log(f"inactivity threshold {threshold:g} s (inactivity_threshold_seconds of --monitors), instead of {was}")
    return replace(cfg, policy=data, monitors=specs, monitor_only=cfg.monitor_only and not policy,
                   inactivity_threshold=threshold if threshold is not None else cfg.inactivity_threshold)


def _described(specs: list) -> str:
    """Monitor specs in one short phrase: preset names, and how many came inlined from the user's own files."""
    names = [m for m in specs if isinstance(m, str)]
    inline = len(specs) - len(names)
    return ", ".join(names + ([f"{inline} from the job's own files"] if inline else [])) or "none"
