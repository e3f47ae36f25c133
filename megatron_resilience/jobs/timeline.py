"""The PNG timeline of a run's attempts: one lane per Slurm attempt, what each second was spent on.

Grey: setup (launch, imports, checkpoint load); green: training; orange: steps that were run again
after a restart; red: restart downtime (a failed cycle's last sign of life to the next start, or to
the end of a failed attempt); blue hatch: waiting in the queue; black ticks: checkpoints. Each
lane is labelled with why the attempt ended. matplotlib is imported here only (lazily), so the
report's text and the batch script's decision never need it.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_resilience.jobs.evidence import read_metrics
from megatron_resilience.jobs.report import RunReport, _train_windows

COLORS = {"setup": "#9e9e9e", "train": "#4caf50", "recomputed": "#ff9800", "downtime": "#e53935", "queue": "#90caf9"}


def write_timeline(report: RunReport, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    records = read_metrics(os.path.join(report.run_dir, "metrics.jsonl"))
    windows = _train_windows(records)
    kept_last = {}
    for w in windows:
        kept_last[w["step"]] = id(w)
    lanes = [s for s in report.segments if s["kind"] == "attempt"]
    t0 = min([s["start"] for s in report.segments] + [float(r["time"]) for r in records if r.get("time")],
             default=0.0)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * max(1, len(lanes))), dpi=110)
    for lane, seg in enumerate(lanes):
        y = len(lanes) - 1 - lane
        start, end = seg["start"] - t0, seg["end"] - t0
        starts = [c - t0 for c in seg.get("cycle_starts") or []]
        bar(ax, y, start, (starts[0] if starts else end) - start, "setup")
        bounds = starts + [end]
        for k, begin in enumerate(starts):
            mine = [w for w in windows if begin <= float(w["time"]) - t0 <= bounds[k + 1]]
            alive = max((float(w["time"]) - t0 for w in mine), default=begin)
            bar(ax, y, begin, alive - begin, "train")
            for w in mine:
                if kept_last.get(w["step"]) != id(w):
                    bar(ax, y, float(w["time"]) - t0 - w["_seconds"], w["_seconds"], "recomputed")
            if k + 1 < len(starts) or seg.get("label") not in ("finished", "preempted", "running", ""):
                bar(ax, y, alive, bounds[k + 1] - alive, "downtime")
        for rec in records:
            if rec.get("kind") == "checkpoint" and seg["start"] <= float(rec.get("time", 0)) <= seg["end"]:
                ax.plot([float(rec["time"]) - t0] * 2, [y - 0.3, y + 0.3], color="black", linewidth=1)
        ax.text(end, y, f"  {seg.get('label') or ''}", va="center", fontsize=8)
    for seg in report.segments:
        if seg["kind"] == "queue":
            ax.barh(-0.9, seg["end"] - seg["start"], left=seg["start"] - t0, height=0.4, color=COLORS["queue"],
                    hatch="//", edgecolor="#1e88e5")
    ax.set_yticks(range(len(lanes)), [f"attempt {len(lanes) - 1 - i}" for i in range(len(lanes))])
    ax.set_ylim(-1.3 if any(s["kind"] == "queue" for s in report.segments) else -0.6, len(lanes) - 0.4)
    ax.set_xlabel("seconds since the first attempt started")
    acc = report.accounting
    ax.set_title(f"{os.path.basename(report.run_dir.rstrip('/'))}: goodput {100 * acc.goodput:.1f}% of "
                 f"{acc.allocated:.0f} s allocated", fontsize=10, pad=22)
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    ax.legend(handles=handles, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def bar(ax: Any, y: float, left: float, width: float, kind: str) -> None:
    if width > 0:
        ax.barh(y, width, left=left, height=0.5, color=COLORS[kind])
