"""``make demo``: a resilient pretraining run on this machine, the way a user would launch one with NeMo-Run.

The tiny GPT recipe trains on 2 CPU ranks under nvidia-resiliency-ext's ft_launcher
(``local_ft`` executor, ``FaultTolerancePlugin`` and ``PreemptionPlugin``). A
simulated fault SIGKILLs rank 1 at the start of step ``--fault-step``; ft_launcher
sees the dead rank, restarts the worker group, and the trainer resumes from the
last checkpoint and finishes. Everything the summary prints is read back from the
run's ``metrics.jsonl`` and checkpoint directory, not assumed:

- steps: the distinct steps completed, and whether the last one is ``max_steps``;
- restarts: (re)starts of the trainer after the first, and the step each resumed from;
- checkpoints: the complete checkpoints on disk;
- lost steps: steps in 1..max_steps that never completed (must be 0);
- recomputed steps: steps run twice because they came after the last checkpoint before the
  fault, and whether the re-run produced bit-identical losses (exact resume).

It also writes a PNG: loss over steps per attempt, the fault, the restart and the checkpoints; and it
ends with the job-level report of its own run (``python -m megatron_resilience.report RUN_DIR``): one
row per trainer (re)start, goodput and badput by cause, and a timeline PNG.

    python examples/demo.py [--dir DIR] [--max-steps 40] [--fault-step 25] [--plot demo.png]
"""

import argparse
import json
import os
import sys
import time

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()
import fiddle as fdl  # noqa: E402

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402
from megatron_resilience.recipes import apply_overrides, gpt_tiny, to_config  # noqa: E402
from megatron_resilience.recipes.cli import local_ft  # noqa: E402

EXPERIMENT = "megatron_resilience_demo"


def build(root: str, *, max_steps: int, fault_step: int, save_interval: int):
    """The task, executor and plugins of the demo: the gpt_tiny recipe with a rank killed mid-run."""
    task = apply_overrides(gpt_tiny(dir=root, name="gpt_tiny", num_gpus_per_node=2), [
        f"train.max_steps={max_steps}",
        f"checkpoint.save_interval={save_interval}",
        "ft.simulate_fault=true",
        "ft.simulated_fault_type=rank_killed",
        "ft.simulated_fault_rank=1",
        f"ft.simulated_fault_step={fault_step}",
    ])
    executor = fdl.build(local_ft(ntasks_per_node=2))
    plugins = [
        # Detect the dead rank quickly; one in-job restart is all the demo needs (two allowed). Timeouts are
        # the plugin's fixed section timeouts, not learned ones, so what the demo prints does not depend on how
        # fast an earlier run was (production recipes keep ft.calc_ft_timeouts on; learned timeouts never go
        # below ft.min_learned_timeout, 60 s by default).
        FaultTolerancePlugin(num_in_job_restarts=2, num_job_retries_on_failure=0, workload_check_interval=1.0,
                             calc_ft_timeouts=False),
        PreemptionPlugin(),
    ]
    return task, executor, plugins


def launch(task, executor, plugins) -> tuple[str, str]:
    """Run the job through ``run.Experiment`` and wait; returns (final state, job directory with the logs)."""
    with run.Experiment(EXPERIMENT, executor=executor, log_level="WARN") as exp:
        exp.add(task, executor=executor, plugins=plugins, name="gpt_tiny")
        exp.run(sequential=True, detach=False, tail_logs=False)
    # Leaving the `with` block waits for the job; only then is its state final.
    job = exp.jobs[0]
    return job.state.name if hasattr(job.state, "name") else str(job.state), job.executor.job_dir


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(run_dir: str, checkpoint_dir: str, max_steps: int) -> dict:
    """Steps, restarts, checkpoints, lost and recomputed steps, from ``metrics.jsonl`` and the checkpoint dir."""
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    attempts: list[dict] = []  # one per trainer (re)start: where it resumed and what it logged
    for rec in records:
        if rec["kind"] == "start":
            attempts.append({"resumed_from": rec["step"], "steps": {}})
        elif rec["kind"] == "train" and attempts:
            attempts[-1]["steps"][rec["step"]] = rec["loss"]
    done = set().union(*(a["steps"] for a in attempts)) if attempts else set()
    lost = sorted(set(range(1, max_steps + 1)) - done)
    recomputed, identical = [], True
    for before, after in zip(attempts, attempts[1:]):
        again = sorted(set(before["steps"]) & set(after["steps"]))
        recomputed += again
        identical = identical and all(before["steps"][s] == after["steps"][s] for s in again)
    checkpoints = sorted(int(name[len("iter_"):]) for name in os.listdir(checkpoint_dir)
                         if name.startswith("iter_") and not name.endswith(".tmp")) \
        if os.path.isdir(checkpoint_dir) else []
    return {
        "max_steps": max_steps,
        "steps_completed": len(done),
        "last_step": max(done, default=0),
        "finished": max(done, default=0) == max_steps,
        "restarts": len(attempts) - 1,
        "resumed_from": [a["resumed_from"] for a in attempts[1:]],
        "fault_after_step": [max(a["steps"], default=a["resumed_from"]) for a in attempts[:-1]],
        "checkpoints": checkpoints,
        "lost_steps": len(lost),
        "lost": lost,
        "recomputed_steps": len(recomputed),
        "recomputed_losses_identical": identical,
        "attempts": [{"resumed_from": a["resumed_from"], "steps": sorted(a["steps"].items())} for a in attempts],
    }


def format_summary(s: dict) -> str:
    restarts = ", ".join(f"after step {f} -> resumed from checkpoint at step {r}"
                         for f, r in zip(s["fault_after_step"], s["resumed_from"])) or "none"
    return "\n".join([
        "== megatron_resilience demo: summary ==",
        f"steps:        {s['steps_completed']}/{s['max_steps']} completed, last step {s['last_step']}"
        f" ({'finished' if s['finished'] else 'NOT finished'})",
        f"restarts:     {s['restarts']} ({restarts})",
        f"checkpoints:  {len(s['checkpoints'])} at steps {s['checkpoints']}",
        f"lost steps:   {s['lost_steps']}" + (f" {s['lost']}" if s["lost"] else ""),
        f"recomputed:   {s['recomputed_steps']} steps after the last checkpoint before the fault; losses "
        f"{'bit-identical' if s['recomputed_losses_identical'] else 'DIFFERENT'} on re-run",
    ])


def plot(s: dict, path: str) -> str:
    """Loss over steps, one colour per attempt; the fault, the restart and the checkpoints marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, attempt in enumerate(s["attempts"]):
        if not attempt["steps"]:
            continue
        steps, losses = zip(*attempt["steps"])
        label = "first attempt" if i == 0 else f"after restart {i} (resumed from step {attempt['resumed_from']})"
        ax.plot(steps, losses, marker="o", markersize=3, linewidth=1.5 if i == 0 else 2.5, alpha=0.9,
                label=label, zorder=3 - i * 0.1)
    for k, (resumed, fault) in enumerate(zip(s["resumed_from"], s["fault_after_step"])):
        if fault > resumed:
            ax.axvspan(resumed + 0.5, fault + 0.5, color="orange", alpha=0.12,
                       label=("steps recomputed after the restart (losses bit-identical)"
                              if s["recomputed_losses_identical"] else "steps recomputed after the restart")
                       if k == 0 else None)
    for k, step in enumerate(s["fault_after_step"]):
        ax.axvline(step + 0.5, color="red", linestyle="--", linewidth=1.2,
                   label="rank 1 killed (ft_launcher restarts the workers)" if k == 0 else None)
    for k, step in enumerate(s["resumed_from"]):
        ax.axvline(step, color="purple", linestyle=":", linewidth=1.2,
                   label="resume point (checkpoint loaded)" if k == 0 else None)
    all_losses = {st: lo for a in s["attempts"] for st, lo in a["steps"]}
    ckpts = [c for c in s["checkpoints"] if c in all_losses]
    ax.scatter(ckpts, [all_losses[c] for c in ckpts], marker="s", s=60, facecolors="none", edgecolors="black",
               linewidths=1.5, zorder=5, label="checkpoint saved")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"gpt_tiny on 2 CPU ranks under ft_launcher: {s['restarts']} restart(s), "
                 f"{s['lost_steps']} lost steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=os.path.abspath("demo_runs"), help="runs go to DIR/<timestamp>/gpt_tiny")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=25)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--plot", default=None, help="PNG path (default: <run dir>/demo.png)")
    args = parser.parse_args(argv)

    root = os.path.join(args.dir, time.strftime("%Y%m%d-%H%M%S"))
    task, executor, plugins = build(root, max_steps=args.max_steps, fault_step=args.fault_step,
                                    save_interval=args.save_interval)
    config = to_config(task)
    print(f"demo: gpt_tiny, 2 CPU ranks under ft_launcher, {args.max_steps} steps, checkpoint every "
          f"{args.save_interval}, rank 1 killed at step {args.fault_step}; run dir {config.run_dir}", flush=True)
    start = time.monotonic()
    state, job_dir = launch(task, executor, plugins)
    print(f"demo: job {state} in {time.monotonic() - start:.0f} s; launcher logs in {job_dir}", flush=True)

    summary = summarize(config.run_dir, config.checkpoint.save, args.max_steps)
    with open(os.path.join(config.run_dir, "demo_summary.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in summary.items() if k != "attempts"}, f, indent=1)
    png = plot(summary, args.plot or os.path.join(config.run_dir, "demo.png"))
    print(format_summary(summary))
    print(f"plot:         {png}")
    from megatron_resilience.report.run_report import build as build_report
    from megatron_resilience.report.run_report import format_report
    from megatron_resilience.report.timeline import write_timeline

    report = build_report(config.run_dir)
    print(format_report(report))
    print(f"timeline:     {write_timeline(report, os.path.join(config.run_dir, 'attempts_timeline.png'))}")
    ok = state == "SUCCEEDED" and summary["finished"] and summary["lost_steps"] == 0 and summary["restarts"] >= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
