"""``python -m megatron_resilience.chaos RUN_DIR --mtbf 120s [--mix llama3] [--seed 7] ...``: the command line."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict

from megatron_resilience.chaos.faults import FAULTS
from megatron_resilience.chaos.mix import load_mix, preset_names
from megatron_resilience.chaos.runner import CLOCKS, Chaos, ChaosConfig, plan
from megatron_resilience.config.validate import ConfigError
from megatron_resilience.records.ledger import LEDGER_FILE, Ledger

UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def duration(text: str) -> float:
    """``120``, ``120s``, ``2m``, ``1.5h`` -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"must be a duration like 120s, 2m or 1h, got {text!r}")
    return float(match.group(1)) * UNITS[match.group(2) or ""]


def lemons(items: list[str]) -> dict[str, float]:
    """``["mn2=5"]`` -> ``{"mn2": 5.0}``; a malformed item is a ValueError naming the option."""
    out: dict[str, float] = {}
    for item in items:
        node, sep, weight = item.partition("=")
        try:
            out[node.strip()] = float(weight) if sep else float("nan")
        except ValueError:
            out[node.strip()] = float("nan")
        if not sep or not node.strip() or out[node.strip()] != out[node.strip()]:
            raise ValueError(f"chaos --lemon: must be NODE=WEIGHT (e.g. mn2=5), got {item!r}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_resilience.chaos", description=(
        "Inject a seeded stream of realistic failures into the running Slurm job of RUN_DIR (and only that job): "
        "exponential inter-arrival times at MTBF (on --clock), causes drawn from a published mix. Every "
        "injection goes to RUN_DIR/chaos_ledger.jsonl; the report prints injected vs classified."))
    p.add_argument("run_dir", help="the run directory (holds job_ledger.jsonl)")
    p.add_argument("--mtbf", type=duration, required=True, help="mean time between faults, e.g. 120s, 5m")
    p.add_argument("--clock", default="training", choices=CLOCKS,
                   help="what the MTBF is measured in: training time (default; a recovery is never interrupted) or "
                        "the job's allocated time (faults also land during restarts, as Daly's optimum assumes)")
    p.add_argument("--mix", default="llama3", help=f"a preset ({', '.join(preset_names())}) or a YAML file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-count", type=int, default=10, help="at most this many faults (default 10)")
    p.add_argument("--max-time", type=duration, default=3600.0, help="stop after this long (default 1h)")
    p.add_argument("--repair", type=duration, default=60.0, help="a node taken down is resumed after (default 60s)")
    p.add_argument("--job-id", default=None, help="the job, when RUN_DIR's ledger has no attempt yet")
    p.add_argument("--rank", type=int, default=None, help="always this rank (default: drawn per fault)")
    p.add_argument("--lemon", action="append", default=[], metavar="NODE=WEIGHT",
                   help="a node that fails more often: a fault that picks a node picks NODE WEIGHT times as often as "
                        "any other (repeatable; e.g. --lemon mn2=5)")
    p.add_argument("--pool", type=lambda text: [n for n in text.split(",") if n], default=[], metavar="NODE,NODE",
                   help="the partition's nodes, each failing on its own: a hardware fault strikes one of them (a "
                        "--lemon more often), and costs the job nothing when the job does not run there (default: "
                        "one of the job's nodes)")
    p.add_argument("--plan", action="store_true", help="print the stream the seed gives and exit (touches nothing)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        mix = load_mix(args.mix)
        cfg = ChaosConfig(run_dir=args.run_dir, mtbf=args.mtbf, clock=args.clock, mix=args.mix, seed=args.seed,
                          max_count=args.max_count, max_time=args.max_time, repair=args.repair, job_id=args.job_id,
                          rank=args.rank, lemons=lemons(args.lemon), pool=args.pool)
    except (ConfigError, ValueError) as err:
        print(f"megatron_resilience chaos: {err}", file=sys.stderr)
        return 2
    if not args.plan and args.job_id is None and Ledger.in_run_dir(cfg.run_dir).current_job() is None:
        print(f"megatron_resilience chaos: run_dir: must be the run directory of a Slurm job, got {args.run_dir!r} "
              f"({os.path.join(args.run_dir, LEDGER_FILE)} names no job: the job has not started, or the run is not "
              "a Slurm job); chaos injects into a job's allocation: give --job-id JOB for a job that is still "
              "pending, or --plan to see the stream the seed gives", file=sys.stderr)
        return 2
    if args.plan:
        for item in plan(mix, seed=cfg.seed, mtbf=cfg.mtbf, count=cfg.max_count):
            print(json.dumps({**asdict(item), "expected": list(FAULTS[item.fault].expected)}))
        return 0
    summary = Chaos(cfg, log=lambda m: print(m, flush=True)).run()
    return 0 if summary["failed_injections"] == 0 else 1
