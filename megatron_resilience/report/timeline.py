"""The PNG timeline of a run: one lane per attempt, every second in its bucket, the injected faults marked.

Drawn from the report's accounting spans (:mod:`.accounting`), so the picture and the numbers are the
same thing: green is productive training, orange the steps run again after a restart (where they were
re-run: they belong to the interruption), reds the failure detection and restart downtime, greys the
startup phases, black the checkpoint save stalls; queue wait is the hatched lane below. Red triangles
are the faults a chaos run injected (``chaos_ledger.jsonl``), labelled with their kind. matplotlib is
imported here only (lazily), so the report's text and the batch script's decision never need it.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_resilience.goodput.accounting import PRODUCTIVE, QUEUE
from megatron_resilience.report.run_report import RunReport

COLORS = {PRODUCTIVE: "#4caf50", "startup": "#9e9e9e", "data_loading": "#bdbdbd", "checkpoint_restore": "#7e57c2",
          "checkpoint_save": "#212121", "wasted_progress": "#ff9800", "failure_detection": "#ad1457",
          "restart_inprocess": "#ef9a9a", "restart_process": "#e53935", "restart_job": "#b71c1c", "eval": "#29b6f6",
          "other": "#e0e0e0", QUEUE: "#90caf9"}


def write_timeline(report: RunReport, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = report.accounting.spans
    lanes = sorted({s.attempt for s in spans if s.attempt is not None})
    t0 = min((s.start for s in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(11, 2.4 + 0.6 * max(1, len(lanes))), dpi=110)
    y_of = {a: len(lanes) - 1 - k for k, a in enumerate(lanes)}
    for s in spans:
        if s.bucket == QUEUE:
            ax.barh(-1, s.seconds, left=s.start - t0, height=0.4, color=COLORS[QUEUE], hatch="//",
                    edgecolor="#1e88e5", linewidth=0)
        elif s.attempt is not None:
            ax.barh(y_of[s.attempt], s.seconds, left=s.start - t0, height=0.5, color=COLORS.get(s.bucket, "#000"),
                    linewidth=0)
    for w in report.windows:
        if w.index in y_of:
            ax.text(w.end - t0, y_of[w.index], f"  {w.ending}", va="center", fontsize=7)
    _mark_injections(ax, report.injected.get("injections") or [], t0, len(lanes))
    labels = [f"attempt {a}" for a in lanes]
    ax.set_yticks([y_of[a] for a in lanes], labels)
    ax.set_ylim(-1.4 if any(s.bucket == QUEUE for s in spans) else -0.6, len(lanes) - 0.2)
    ax.set_xlabel("seconds since the first attempt started")
    acc = report.accounting
    title = f"{os.path.basename(report.run_dir.rstrip('/'))}: goodput {100 * acc.goodput:.1f}% of " \
            f"{acc.allocated:.0f} s allocated"
    if report.optimum.ratio is not None:
        title += f" = {report.optimum.ratio:.2f} x E* ({100 * report.optimum.e_star:.1f}%)"
    ax.set_title(title, fontsize=10, pad=30)
    used = [b for b in COLORS if any(s.bucket == b for s in spans)]
    handles = [Patch(color=COLORS[b], label=b.replace("_", " ")) for b in used]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=min(7, len(handles)), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _mark_injections(ax: Any, rows: list[dict[str, Any]], t0: float, lanes: int) -> None:
    for row in rows:
        x = float(row.get("time") or 0) - t0
        ax.plot([x], [lanes - 0.35], marker="v", color="#d50000", markersize=6)
        ax.text(x, lanes - 0.25, str(row.get("fault")), fontsize=6, rotation=45, ha="left", va="bottom")
