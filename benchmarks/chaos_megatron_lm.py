"""The chaos benchmark against Megatron-LM's own trainer: its ``pretrain`` under the plugins, the watcher and a chaos
stream on the multi-node Slurm instance, compared with an uninterrupted run and with Daly's E*.

    python benchmarks/chaos_megatron_lm.py [--mtbf 30s] [--mix llama3_local_cluster] [--seed 27] [--max-count 10]
                                           [--steps 600] [--save-interval 50] [--step-delay 0.1] [--clock training]
                                           [--repair 120s] [--job-minutes 40] [--out DIR] [--json PATH]

The trainer is Megatron-LM's training loop as megatron-core 0.19.2's wheel ships it (``.venv-newest``:
``scripts/newest/install.sh .venv-newest``; ``make test-megatron-lm`` installs it), started by
``tests/megatron_lm/pretrain_gpt.py`` on CPU (its CPU layer; ``STEP_DELAY_S`` makes each step compute-sized), 2 ranks
under ft_launcher 0.7.0, through ``run.Script`` on a ``SlurmExecutor`` with FaultTolerancePlugin, PreemptionPlugin
and RestartPolicyPlugin(``megatron_transient``), ``--save`` only (the plugins add ``--load``) and ``--ckpt-format
torch`` (megatron-core 0.19.2's ``torch_dist`` save breaks at a signal ft_launcher forwards: docs/migration.md).
Megatron-LM writes no ``metrics.jsonl``: the chaos stream, the watcher and the report read the job folder (its
ledger, its logs). Faults that act on any trainer only (``nan`` needs this package's trainer: leave it out of the
mix). The table prints what was injected and classified, goodput, E*, and whether every step's loss, as Megatron-LM
prints it, equals the uninterrupted run's (but the second line of each resumed process, the mean of its first two
steps: compared as that mean).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import classified_text, slurm_state, start_cluster, watch_with_chaos  # noqa: E402
from common import REPO, describe, machine, table, write_json  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "megatron_lm"))
from megatron_lm_run import ENV, NEWEST, SCRIPT, iteration_losses, tiny_gpt_args  # noqa: E402

LOADED = re.compile(r"successfully loaded checkpoint from \S+ .* at iteration (\d+)")
FT = dict(nvrx_version="0.7", num_in_job_restarts=30, num_job_retries_on_failure=0, calc_ft_timeouts=False,
          setup_timeout=600.0, step_timeout=30.0, checkpointing_timeout=120.0, out_of_section_timeout=120.0,
          workload_check_interval=1.0)


def submit(name: str, cluster: dict[str, str], *, steps: int, save_interval: int, step_delay: float, root: str,
           partition: str, minutes: int) -> tuple[str, str]:
    """(Slurm job id, nemo_run's job folder) of one run of the tiny GPT through ``run.Script`` and the plugins."""
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    os.environ["SLURM_CONF"] = cluster["slurm_conf"]
    task = run.Script(path=SCRIPT, entrypoint="python", args=tiny_gpt_args(
        train_iters=steps, save=os.path.join(root, name, "ckpt"), save_interval=save_interval,
        extra=("--ckpt-format", "torch")))
    plugins = [FaultTolerancePlugin(**FT), PreemptionPlugin(preempt_time=60),
               RestartPolicyPlugin(policy="megatron_transient")]
    executor = run.SlurmExecutor(account="megatron_resilience_bench", partition=partition, nodes=1,
                                 ntasks_per_node=2, time=f"00:{minutes:02d}:00", tunnel=run.LocalTunnel(job_dir=""),
                                 packager=run.Packager(), env_vars={**ENV, "STEP_DELAY_S": str(step_delay)})
    with run.Experiment(name, executor=executor) as exp:
        exp.add(task, executor=executor, plugins=plugins, name=name)
        exp.run(detach=True)
    job = exp.jobs[0]
    return job.handle.rstrip("/").rsplit("/", 1)[-1], job.executor.job_dir


def step_logs(job_dir: str) -> str:
    """Every attempt's step log, in attempt order (``log-..._<restart>.out``)."""
    def restart(name: str) -> int:
        return int(name.rsplit("_", 1)[-1].split(".")[0])

    names = sorted((n for n in os.listdir(job_dir) if n.startswith("log-") and n.endswith(".out")), key=restart)
    return "".join(open(os.path.join(job_dir, n), errors="replace").read() for n in names)


def compare_losses(text: str, reference: dict[int, str], steps: int) -> str:
    """``bitwise``: every step's loss as printed equals the reference's; the second line of a resumed process
    (Megatron-LM's mean of that process's first two steps) equals the mean of the reference's two."""
    mine = iteration_losses(text)
    if sorted(reference) != list(range(1, steps + 1)):
        return f"reference incomplete ({len(reference)} of {steps} steps)"
    if set(mine) - set(reference):
        return f"steps beyond the reference: {sorted(set(mine) - set(reference))[:10]}"
    # a node that fails takes the last lines of its job step's output with it (slurmstepd's log is not flushed), while
    # the ranks' save at Slurm's SIGTERM still reached the shared checkpoint: such steps are in no log; said so
    unlogged = sorted(set(reference) - set(mine))
    means = {int(m.group(1)) + 2 for m in LOADED.finditer(text)} & set(mine)
    # a step trained again after a restart keeps its last line: the mean is of the last resumed process only
    differ = [s for s in mine if s not in means and mine[s] != reference[s]]
    off = [s for s in means if abs(float(mine[s]) - (float(reference[s - 1]) + float(reference[s])) / 2) > 1e-6
           and mine[s] != reference[s]]
    if differ or off:
        return f"differ at steps {sorted(differ + off)[:10]}"
    return f"bitwise (not in any log: {unlogged})" if unlogged else "bitwise"


def main(argv: list[str] | None = None) -> int:
    from megatron_resilience.chaos.cli import duration
    from megatron_resilience.report.run_report import build as build_report
    from megatron_resilience.report.run_report import format_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mtbf", type=duration, default=30.0)
    p.add_argument("--mix", default="llama3_local_cluster")
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--max-count", type=int, default=10)
    p.add_argument("--clock", default="training", choices=("training", "allocation"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--save-interval", type=int, default=50)
    p.add_argument("--step-delay", type=float, default=0.1, help="seconds of 'compute' per step on every rank")
    p.add_argument("--repair", type=duration, default=120.0)
    p.add_argument("--job-minutes", type=int, default=40)
    p.add_argument("--out", default=None, help="runs go here (default /tmp/mr-chaos-mlm-<time>)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(NEWEST, "megatron", "training")):
        sys.exit(f"{NEWEST} has no megatron.training: run scripts/newest/install.sh .venv-newest")
    args.out = os.path.abspath(args.out or f"/tmp/mr-chaos-mlm-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("NEMORUN_HOME", os.path.join(args.out, "nemorun_home"))
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    clusters = {"multinode": start_cluster("multinode"), "default": start_cluster(None)}
    shape = dict(steps=args.steps, save_interval=args.save_interval, step_delay=args.step_delay, root=args.out,
                 minutes=args.job_minutes)
    ref_job, ref_dir = submit("mlm-reference", clusters["default"], partition=clusters["default"]["partition"],
                              **shape)
    print(f"[mlm-reference] job {ref_job} on the default cluster", flush=True)
    job, job_dir = submit("mlm-chaos", clusters["multinode"], partition="faults", **shape)
    print(f"[mlm-chaos] job {job}: {job_dir}", flush=True)
    env = {**os.environ, "SLURM_CONF": clusters["multinode"]["slurm_conf"]}
    wall = watch_with_chaos(job_dir, job, env, args, "mlm-chaos")
    os.environ["SLURM_CONF"] = clusters["multinode"]["slurm_conf"]
    report = build_report(job_dir)
    text = format_report(report, evidence=False)
    Path(args.out, "mlm-chaos.report.txt").write_text(text + "\n")
    print(text, flush=True)
    deadline = time.monotonic() + args.job_minutes * 60
    while slurm_state(ref_job, clusters["default"]["slurm_conf"]) not in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and time.monotonic() < deadline:
        time.sleep(5)
    reference = iteration_losses(step_logs(ref_dir))
    acc, opt = report.accounting, report.optimum
    result = {"name": "mlm-chaos", "job": job, "job_dir": job_dir, "run_dir": job_dir, "wall_s": wall,
              "final": report.final, "report": report.to_dict(),
              "sum_error_s": abs(acc.productive + sum(acc.badput.values()) - acc.allocated),
              "goodput": acc.goodput, "e_star": opt.e_star, "ratio": opt.ratio,
              "recommended_steps": opt.recommended_steps,
              "losses_vs_reference": compare_losses(step_logs(job_dir), reference, args.steps),
              "reference": {"job": ref_job, "job_dir": ref_dir, "steps": len(reference)}}
    inj = result["report"]["injected"]
    headers = ["trainer", "steps/save", "injected", "classified", "goodput", "E*", "goodput/E*", "losses vs reference",
               "|sum - allocated| s", "final"]
    row = ["megatron_lm", args.save_interval, len(inj["injections"]), classified_text(inj["injections"]),
           f"{100 * acc.goodput:.1f}%", f"{100 * opt.e_star:.1f}%" if opt.e_star else None,
           f"{opt.ratio:.3f}" if opt.ratio else None, result["losses_vs_reference"], f"{result['sum_error_s']:.2e}",
           (report.final or "")[:60]]
    info = machine("cpu")
    print(describe(info))
    print(table(headers, [row]))
    path = write_json("chaos_megatron_lm", "cpu", {"machine": info, "args": {k: v for k, v in vars(args).items()
                                                                             if k != "json"}, "runs": [result]},
                      args.json)
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
