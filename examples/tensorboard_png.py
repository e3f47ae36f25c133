"""A PNG of what TensorBoard shows for a run: the loss curve on one step axis with the resilience series beside it.

    python examples/tensorboard_png.py RUN_DIR [OUT.png]

Reads ``RUN_DIR/tensorboard`` with TensorBoard's own event file loader (what ``tensorboard --logdir`` reads);
docs/metrics.md's figure is this script's output for tests/test_dashboards_launched.py's run (an in-job
restart, then a requeue).
"""

import glob
import os
import sys

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader


def scalars(logdir: str) -> dict[str, list[tuple[int, float | str]]]:
    out: dict[str, list[tuple[int, float | str]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    item = value.tensor.string_val[0].decode()
                else:
                    item = value.simple_value if value.HasField("simple_value") else value.tensor.float_val[0]
                out.setdefault(value.tag, []).append((event.step, item))
    return out


def main(run_dir: str, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tb = scalars(os.path.join(run_dir, "tensorboard"))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    steps, loss = zip(*tb["lm loss"])
    top.plot(steps, loss, marker=".", label="lm loss")
    if "lm loss validation" in tb:
        vs, vl = zip(*tb["lm loss validation"])
        top.plot(vs, vl, "s", label="lm loss validation")
    events = dict(tb.get("resilience/events", []))
    for step, resumed in tb.get("resilience/restart-resumed-from", []):
        what = str(events.get(step, "restart")).split(" (")[0]  # "in-job restart", "requeue", ...
        top.axvline(step - 0.5, color="tab:red", linestyle="--", linewidth=1)
        top.annotate(f"{what}: resumed from {int(resumed)}", (step - 0.5, max(loss)), rotation=90, fontsize=8,
                     va="top", ha="right", color="tab:red")
    top.set_ylabel("loss")
    top.legend(loc="lower left")
    top.set_title("TensorBoard scalars of one run across an in-job restart and a requeue")
    for tag, width in (("resilience/in-job-restarts", 4), ("resilience/requeues", 2.5),
                       ("resilience/recomputed-steps", 1.2)):
        if tag in tb:
            s, v = zip(*tb[tag])
            bottom.step(s, v, where="post", label=tag, linewidth=width)
    bottom.set_xlabel("step")
    bottom.set_ylabel("running total")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tensorboard.png"))
