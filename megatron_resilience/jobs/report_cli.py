"""The report's command line: the table (or JSON), every attempt's log tails, the PNG timeline.

Apart from :mod:`.report` (which builds and formats) and :mod:`.timeline` (which draws from a built report),
so that neither imports the other's caller.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_resilience.jobs import attempt_throughput, report
from megatron_resilience.jobs.timeline import write_timeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resilience.report",
                                     description=report.__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--png", default=None, help="timeline PNG path (default RUN_DIR/attempts_timeline.png; "
                                                    "'none' to skip)")
    parser.add_argument("--logs", action="store_true", help="print the tail of every attempt's log files")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        print(f"megatron_resilience report: no such run directory {args.run_dir!r}", file=sys.stderr)
        return 2
    run_report = report.build(args.run_dir)
    print(json.dumps(run_report.to_dict(), indent=1, default=str) if args.json else report.format_report(run_report))
    throughput = "" if args.json else attempt_throughput.section(args.run_dir)
    if throughput:
        print(f"\n{throughput}")
    if args.logs:
        print(report.attempt_logs(run_report))
    if args.png != "none":
        png = write_timeline(run_report, args.png or os.path.join(args.run_dir, "attempts_timeline.png"))
        if not args.json:
            print(f"timeline: {png}")
    return 0
