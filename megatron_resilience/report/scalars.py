"""The job-level report's goodput and badput as TensorBoard scalars of the run, beside its loss curve.

The folder is the one the trainer's newest ``start`` record names (``dashboards.tensorboard``), else
``<run_dir>/tensorboard`` when it exists. The figures describe the run so far, so they sit at its highest
logged step. The report may run many times (the watcher, by hand): each run replaces the event file the
previous one wrote (``*.goodput-report``), so no step appears twice.

Tags: ``goodput/goodput-percent``, ``goodput/productive-seconds``, ``goodput/allocated-seconds``,
``goodput/queue-wait-seconds`` (not allocated), and ``badput/<category>-seconds`` for every badput category.
"""

from __future__ import annotations

import glob
import os
from typing import Any

SUFFIX = ".goodput-report"


def tensorboard_dir(run_dir: str, records: list[dict[str, Any]]) -> str | None:
    starts = [r for r in records if r.get("kind") == "start"]
    named = ((starts[-1].get("dashboards") or {}).get("tensorboard")) if starts else None
    if named:
        return named
    default = os.path.join(run_dir, "tensorboard")
    return default if os.path.isdir(default) else None


def scalars(report: dict[str, Any]) -> dict[str, float]:
    """Tag -> value from ``RunReport.to_dict()``."""
    acc = report["accounting"]
    out = {"goodput/goodput-percent": 100.0 * float(acc["goodput"]),
           "goodput/productive-seconds": float(acc["productive"]),
           "goodput/allocated-seconds": float(acc["allocated"]),
           "goodput/queue-wait-seconds": float(acc.get("queue_wait") or 0.0)}
    out.update({f"badput/{name.replace('_', '-')}-seconds": float(v) for name, v in acc["badput"].items()})
    return out


def write(run_dir: str, report: dict[str, Any], records: list[dict[str, Any]]) -> str | None:
    """Write the scalars; the event file's path, or None when the run has no TensorBoard folder or no step yet."""
    folder = tensorboard_dir(run_dir, records)
    steps = [r["step"] for r in records if r.get("kind") == "train" and isinstance(r.get("step"), int)]
    if folder is None or not steps:
        return None
    from megatron_resilience.dashboards.series import Point
    from megatron_resilience.dashboards.tensorboard import EventWriter

    for old in glob.glob(os.path.join(folder, f"events.out.tfevents.*{SUFFIX}")):
        os.remove(old)
    writer = EventWriter(folder, filename_suffix=SUFFIX)
    try:
        writer.write([Point(tag, value, max(steps)) for tag, value in scalars(report).items()])
    finally:
        writer.close()
    return glob.glob(os.path.join(folder, f"events.out.tfevents.*{SUFFIX}"))[0]
