"""The report's command line: the table (or JSON), every attempt's own log tails, the PNG timeline, and the
goodput/badput as TensorBoard scalars of the run.

Apart from :mod:`.report` (which builds and formats) and :mod:`.timeline` (which draws from a built report),
so that neither imports the other's caller. matplotlib (the PNG) and tensorboard (the scalars) are not required
dependencies, and a login node often lacks them: without one, that part is skipped with one line saying what to
install, and the report itself still prints and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_resilience.config.paths import check_writable_dir
from megatron_resilience.config.validate import ConfigError
from megatron_resilience.jobs.attempt_logs import attempt_logs
from megatron_resilience.jobs.evidence import read_metrics
from megatron_resilience.records import megatron_log
from megatron_resilience.records.ledger import LEDGER_FILE
from megatron_resilience.records.names import METRICS_FILE
from megatron_resilience.report import run_report as report
from megatron_resilience.report import scalars as report_scalars
from megatron_resilience.report import throughput as attempt_throughput
from megatron_resilience.report.timeline import write_timeline

PROG = "python -m megatron_resilience.report"
# what each optional part needs: (package, install hint, the option that leaves it out); extras are pyproject's
OPTIONAL = {"timeline": ("matplotlib", "pip install matplotlib", "--png none leaves it out"),
            "goodput/badput TensorBoard scalars": ("tensorboard", "pip install 'megatron-resilience[tensorboard]'",
                                                   "--no-tensorboard leaves them out")}
RUN_FILES = (METRICS_FILE, LEDGER_FILE)  # what makes a folder a run: the trainer's or the batch script's record


def is_run_dir(path: str) -> bool:
    """A folder with the trainer's or the batch script's record, or with a foreign trainer's log (Megatron-LM,
    Megatron-Bridge: read from its own lines); a file that is such a log."""
    if os.path.isfile(path):
        return bool(megatron_log.log_files(path))
    return any(os.path.exists(os.path.join(path, name)) for name in RUN_FILES) or bool(megatron_log.log_files(path))


def run_dirs_under(path: str, *, depth: int = 3, limit: int = 20) -> list[str]:
    """Run folders at most ``depth`` levels below ``path`` (sorted; at most ``limit``)."""
    found, base = [], os.path.abspath(path).rstrip(os.sep)
    for here, dirs, _ in os.walk(base):
        level = here[len(base):].count(os.sep)
        if here != base and is_run_dir(here):
            found.append(here)
            dirs[:] = []  # a run's own sub-folders (checkpoints, tensorboard) are not runs
        elif level >= depth:
            dirs[:] = []
        dirs.sort()
    return sorted(found)[:limit]


def not_a_run(path: str) -> str:
    runs = run_dirs_under(path)
    listing = ("; run folders under it: " + ", ".join(runs)) if runs else "; no run folder under it either"
    return (f"megatron_resilience report: {path!r} is not a run folder (it has no {' or '.join(RUN_FILES)})"
            f"{listing}")


def skipped(part: str, err: ImportError) -> str:
    """The one line for an optional part whose package did not import (missing, or broken: then its error)."""
    package, hint, option = OPTIONAL[part]
    why = (f"{package} is not installed ({hint}" if (err.name or "").split(".")[0] == package else
           f"{package} did not import ({type(err).__name__}: {err}")
    return f"megatron_resilience report: {part} skipped: {why}; {option})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=report.__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the run folder; or a Megatron-LM/Megatron-Bridge log file (read from its "
                                        "own lines when the run has no metrics.jsonl)")
    parser.add_argument("--png", default=None, help="timeline PNG path (default RUN_DIR/attempts_timeline.png; "
                                                    "'none' to skip)")
    parser.add_argument("--logs", action="store_true", help="print the tail of each attempt's own log lines")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-tensorboard", action="store_true",
                        help="do not write goodput/badput scalars into the run's TensorBoard folder")
    args = parser.parse_args(argv)
    if not os.path.exists(args.run_dir):
        print(f"megatron_resilience report: no such run directory {args.run_dir!r}", file=sys.stderr)
        return 2
    if not is_run_dir(args.run_dir):
        print(not_a_run(args.run_dir), file=sys.stderr)
        return 2
    if args.png not in (None, "none"):  # before the report is printed, not after
        try:
            check_writable_dir("--png", os.path.dirname(os.path.abspath(args.png)))
        except ConfigError as err:
            print(f"megatron_resilience report: {err} (the timeline PNG's folder; --png none leaves it out)",
                  file=sys.stderr)
            return 2
    run_report = report.build(args.run_dir)
    as_dict = run_report.to_dict()
    print(json.dumps(as_dict, indent=1, default=str) if args.json else report.format_report(run_report))
    throughput = "" if args.json else attempt_throughput.section(args.run_dir)
    if throughput:
        print(f"\n{throughput}")
    if args.logs:
        print(attempt_logs(args.run_dir, run_report.rows))
    if args.png != "none":
        try:
            folder = args.run_dir if os.path.isdir(args.run_dir) else os.path.dirname(os.path.abspath(args.run_dir))
            png = write_timeline(run_report, args.png or os.path.join(folder, "attempts_timeline.png"))
        except ImportError as err:
            print(skipped("timeline", err), file=sys.stderr)
        else:
            if not args.json:
                print(f"timeline: {png}")
    if not args.no_tensorboard and os.path.isdir(args.run_dir):
        try:
            events = report_scalars.write(args.run_dir, as_dict, read_metrics(os.path.join(args.run_dir,
                                                                                            METRICS_FILE)))
        except ImportError as err:
            print(skipped("goodput/badput TensorBoard scalars", err), file=sys.stderr)
        else:
            if events and not args.json:
                print(f"tensorboard: goodput/badput scalars in {events}")
    return 0
