"""Goodput under a realistic failure stream: a chaos run per variant, each compared with Daly's E* for its own C, R, M.

    python benchmarks/chaos.py [--variants off] [--intervals young_daly,short,long] [--mtbf 60s] [--seed 27]
                               [--clock training|allocation]
                               [--max-count 10] [--steps 1600] [--ranks-per-node 1] [--out DIR] [--json PATH]
                               [--lemon NODE=WEIGHT] [--long-form]

Each run is the real trainer submitted through NeMo-Run's ``SlurmExecutor`` to the repo's multi-node Slurm
instance (``MR_SLURM_INSTANCE=multinode``: 2 nodes + 1 reserved node, started here when needed) with
``FaultTolerancePlugin``, ``PreemptionPlugin`` and ``RestartPolicyPlugin(policy="megatron_transient")``, the
watcher (``python -m megatron_resilience.watch``) and a chaos stream (``python -m megatron_resilience.chaos``)
at ``--mtbf`` from the ``--mix``, all with nobody watching. An uninterrupted reference of the same task runs on
the default single-node cluster at the same time; every run's losses are compared with it bitwise.

Variants are config overrides and plugin arguments (``VARIANTS``): ``off`` (process restarts by ft_launcher,
requeues by the job-level decision), ``fast_recovery`` (in-process restart and node-local checkpoints) and
``elastic_no_spare`` (elastic continuation on the nodes left, no spare node); a variant whose settings this
checkout does not have is reported as unavailable. Intervals: ``young_daly`` (the trainer picks Daly's
optimum), ``short`` / ``long`` (a fixed interval 10x shorter / longer than the optimum: ``--optimum-steps``, or
the one the young_daly run recommended). The table prints goodput / E* for each run; the JSON has every
report; each run directory keeps its report text and timeline PNG.

``--long-form`` is the acceptance of a weeks-long run (the command in docs/goodput.md): the plugins' shipped
restart counts, at least 40 faults on the allocation clock, 2 ranks per node, a lemon node (``--lemon``); the
report lists each fault as classified and the nodes excluded, and the table goodput / E*.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, describe, machine, table, write_json  # noqa: E402

INTERVALS = ("young_daly", "short", "long")
# Every variant: trainer overrides (``{run_dir}`` filled in), FaultTolerancePlugin arguments, and the Slurm layout.
# Restart counts raised by hand for the short runs (a dense stream in one allocation); --long-form keeps the
# plugins' shipped counts (RESTART_COUNTS dropped) and relies on the job-level decision's refilled budgets.
# --long-form's lemon: a 504-GPU B200 report (arXiv 2605.09370) had the top 3 of 63 nodes cause more than half of all
# exclusions, i.e. a lemon fails about 20 times as often as a healthy node (3w / (3w + 60) >= 1/2 at w = 20).
LEMON_WEIGHT = 20.0
RESTART_COUNTS = dict(num_in_job_restarts=30, num_job_retries_on_failure=0)
BASE_FT = dict(**RESTART_COUNTS, calc_ft_timeouts=False, setup_timeout=600.0,
               step_timeout=20.0, checkpointing_timeout=120.0, out_of_section_timeout=120.0,
               workload_check_interval=1.0)
VARIANTS = {
    "off": {"overrides": [], "ft": {}, "partition": "faults", "nodes": 1},
    # in-process timeouts below BASE_FT's step_timeout: ft_launcher must not end, as hung, a rank the wrapper
    # can still restart (the plugin refuses the job otherwise)
    "fast_recovery": {"overrides": ["inprocess.enabled=true", "inprocess.soft_timeout=10",
                                    "inprocess.hard_timeout=15", "checkpoint.local_dir={run_dir}/local_ckpt",
                                    "checkpoint.local_interval=10"], "ft": {"inprocess_restart": True},
                      "partition": "faults", "nodes": 1},
    "elastic_no_spare": {"overrides": [], "ft": {"min_nodes": 1}, "partition": "debug", "nodes": 2},
}
TASK = ["train.log_interval=1", "straggler.enabled=false", "train.eval_interval=null",
        "rerun.rerun_mode=validate_results", "rerun.accept_chaos_nan=true", "checkpoint.async_save=false",
        "checkpoint.keep_last_n=4"]


def start_cluster(instance: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MR_SLURM_")}
    if instance:
        env["MR_SLURM_INSTANCE"] = instance
    out = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "start.sh")], env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode:
        sys.exit(f"scripts/slurm/start.sh failed:\n{out.stdout}\n{out.stderr}")
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def build(root: str, name: str, *, steps: int, interval: str, optimum_steps: int | None, mtbf: float,
          variant: dict, shape: list[str], step_delay: float, ranks_per_node: int = 1, shipped_counts: bool = False,
          policy: str = "megatron_transient"):
    """The task and plugins of one run (a reference: ``VARIANTS["off"]``'s settings at a variant's shape, no chaos)."""
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin
    from megatron_resilience.recipes import apply_overrides, gpt_tiny

    task = gpt_tiny(dir=root, name=name, num_nodes=variant["nodes"], num_gpus_per_node=ranks_per_node)
    run_dir = task.run_dir
    overrides = [f"train.max_steps={steps}", f"optim.lr_decay_steps={steps}", *TASK, *shape]
    if step_delay:
        overrides += ["straggler.simulated_straggler_rank=0", f"straggler.simulated_straggler_delay={step_delay}"]
    if interval == "young_daly":
        overrides += ["checkpoint.interval_policy=young_daly", f"checkpoint.expected_mtbf_hours={mtbf / 3600}",
                      f"checkpoint.save_interval={max(1, (optimum_steps or 50))}"]
    else:
        every = {"short": max(1, round(optimum_steps / 10)), "long": optimum_steps * 10,
                 "fixed": optimum_steps}[interval]
        overrides += [f"checkpoint.save_interval={every}", f"checkpoint.expected_mtbf_hours={mtbf / 3600}"]
    overrides += [o.format(run_dir=run_dir) for o in variant["overrides"]]
    task = apply_overrides(task, overrides)
    ft = {k: v for k, v in BASE_FT.items() if not (shipped_counts and k in RESTART_COUNTS)}
    plugins = [FaultTolerancePlugin(**ft, **variant["ft"]), PreemptionPlugin(preempt_time=60),
               RestartPolicyPlugin(policy=policy)]
    return task, plugins, overrides


def submit(name: str, task, plugins, cluster: dict[str, str], *, partition: str, nodes: int, minutes: int,
           ranks_per_node: int = 1) -> str:
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    os.environ["SLURM_CONF"] = cluster["slurm_conf"]
    executor = run.SlurmExecutor(account="megatron_resilience_bench", partition=partition, nodes=nodes,
                                 ntasks_per_node=ranks_per_node, time=f"00:{minutes:02d}:00" if minutes < 60 else
                                 f"{minutes // 60:02d}:{minutes % 60:02d}:00", tunnel=run.LocalTunnel(job_dir=""),
                                 packager=run.Packager(), env_vars={"OMP_NUM_THREADS": "1"})
    with run.Experiment(name, executor=executor) as exp:
        exp.add(task, executor=executor, plugins=list(plugins), name=name)
        exp.run(detach=True)
    return exp.jobs[0].handle.rstrip("/").rsplit("/", 1)[-1]


def compressed_policy(args) -> str:
    """megatron_transient with its node-attribution window compressed as the stream compresses time
    (``chaos_lookback.py``); the window is printed."""
    from chaos_lookback import compressed_window_s, write_policy

    from megatron_resilience.chaos.cli import lemons
    from megatron_resilience.chaos.faults import fault
    from megatron_resilience.chaos.mix import load_mix

    shares = load_mix(args.mix).weights_by_fault()
    window = compressed_window_s(mtbf_s=args.mtbf, hardware_share=sum(v for k, v in shares.items()
                                                                       if fault(k).hardware),
                                 pool=len(args.pool), lemon_weight=max(lemons(args.lemon).values()))
    path = write_policy(args.out, "megatron_transient", window)
    print(f"long form: megatron_transient with exclude_nodes_within_days = {window:.0f} s ({path})", flush=True)
    return path


def partition_nodes(cluster: dict[str, str], partition: str) -> list[str]:
    env = {**os.environ, "SLURM_CONF": cluster["slurm_conf"]}
    out = subprocess.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return sorted(set(out))


def slurm_state(job: str, conf: str) -> str:
    env = {**os.environ, "SLURM_CONF": conf}
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], env=env, capture_output=True,
                         text=True).stdout.split()
    return out[-1] if out else "?"


def losses(run_dir: str) -> dict[int, float]:
    from megatron_resilience.jobs.evidence import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
            if r.get("kind") == "train"}


def classified_text(rows: list[dict]) -> str:
    """``12`` classified as injected, ``12 + 1 absorbed`` when a fault landed before the previous was noticed, and
    ``, 2 unexplained`` for faults classified as another kind, matched to no interruption or not carried out for
    another reason than striking a node outside the job (what the report's ``none_misread`` says is none)."""
    matched, absorbed = sum(1 for i in rows if i["match"]), sum(1 for i in rows if i.get("absorbed_by"))
    unexplained = sum(1 for i in rows if not (i["match"] or i.get("absorbed_by") or i.get("outside_job")))
    text = f"{matched} + {absorbed} absorbed" if absorbed else str(matched)
    return text + (f", {unexplained} unexplained" if unexplained else "")


# Losses after a resume at another data-parallel size agree with the run at the original size to float rounding
# (the same samples per step, summed in another order): docs/elastic.md states and justifies the bound.
RESHARD_TOLERANCE = 2e-5


def compare_losses(mine: dict[int, float], ref: dict[int, float], steps: int) -> str:
    """``bitwise``, ``within 2e-05`` (a run that changed its DP size), or what differs."""
    if sorted(ref) != list(range(1, steps + 1)):
        return f"reference incomplete ({len(ref)} of {steps} steps)"
    if sorted(mine) != sorted(ref):
        return f"steps differ ({len(mine)} of {steps})"
    if all(mine[s] == ref[s] for s in ref):
        return "bitwise"
    worst = max(abs(mine[s] - ref[s]) for s in ref)
    if worst <= RESHARD_TOLERANCE:
        return f"within {RESHARD_TOLERANCE:g} (max {worst:.1e})"
    return f"differ (max {worst:.1e})"


def watch_with_chaos(run_dir: str, job: str, env: dict, args, name: str, extra: list[str] = ()) -> float:
    """Once the job's first attempt has started (the batch script writes the job-level config the watcher reads):
    the chaos stream and the watcher beside it until the ledger records the run's end; their output in
    ``<out>/<name>.{chaos,watch}.log``. Returns the seconds from the first attempt's start to the end."""
    from megatron_resilience.records.ledger import Ledger

    ledger = Ledger(os.path.join(run_dir, "job_ledger.jsonl"))
    logs = {k: open(os.path.join(args.out, f"{name}.{k}.log"), "w") for k in ("watch", "chaos")}
    waited = time.monotonic()
    while not (os.path.isdir(run_dir) and ledger.records("attempt_start")) and time.monotonic() - waited < 600:
        time.sleep(1)
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_resilience.chaos", run_dir, "--job-id", job,
                               "--mtbf", str(args.mtbf), "--clock", args.clock, "--mix", args.mix,
                               "--seed", str(args.seed), "--max-count", str(args.max_count),
                               "--max-time", str(args.job_minutes * 60), "--repair", str(args.repair), *extra],
                              env=env, stdout=logs["chaos"], stderr=subprocess.STDOUT),
             subprocess.Popen([sys.executable, "-m", "megatron_resilience.watch", run_dir, "--job-id", job,
                               "--interval", "2"], env=env, stdout=logs["watch"], stderr=subprocess.STDOUT)]
    try:
        while ledger.final() is None and time.monotonic() - started < args.job_minutes * 60 + 600:
            time.sleep(5)
        for proc in procs:
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
        for f in logs.values():
            f.close()
    return time.monotonic() - started


def one_run(args, name: str, variant_name: str, interval: str, optimum_steps: int | None, clusters: dict) -> dict:
    from megatron_resilience.report.run_report import build as build_report
    from megatron_resilience.report.run_report import format_report
    from megatron_resilience.report.timeline import write_timeline

    variant = VARIANTS[variant_name]
    try:
        task, plugins, overrides = build(args.out, name, steps=args.steps, interval=interval,
                                         optimum_steps=optimum_steps, mtbf=args.mtbf, variant=variant,
                                         shape=args.shape, step_delay=args.step_delay,
                                         ranks_per_node=args.ranks_per_node, shipped_counts=args.long_form,
                                         policy=args.policy)
    except (TypeError, ValueError) as err:  # a setting of a feature this checkout does not have
        return {"name": name, "variant": variant_name, "interval": interval, "unavailable": str(err)}
    run_dir = task.run_dir
    cluster = clusters["multinode"]
    env = {**os.environ, "SLURM_CONF": cluster["slurm_conf"]}
    job = submit(name, task, plugins, cluster, partition=variant["partition"], nodes=variant["nodes"],
                 minutes=args.job_minutes, ranks_per_node=args.ranks_per_node)
    print(f"[{name}] job {job}: {' '.join(overrides)}", flush=True)
    os.makedirs(run_dir, exist_ok=True)
    extra = [f"--lemon={x}" for x in args.lemon] + ([f"--pool={','.join(args.pool)}"] if args.pool else [])
    wall = watch_with_chaos(run_dir, job, env, args, name, extra=extra)
    os.environ["SLURM_CONF"] = cluster["slurm_conf"]
    report = build_report(run_dir)
    text = format_report(report, evidence=False)
    Path(run_dir, "report.txt").write_text(text + "\n")
    png = write_timeline(report, os.path.join(run_dir, "timeline.png"))
    print(text, flush=True)
    acc, opt = report.accounting, report.optimum
    return {"name": name, "variant": variant_name, "interval": interval, "job": job, "run_dir": run_dir,
            "wall_s": wall, "overrides": overrides, "final": report.final, "timeline": png,
            "steps": len(losses(run_dir)), "report": report.to_dict(),
            "sum_error_s": abs(acc.productive + sum(acc.badput.values()) - acc.allocated),
            "goodput": acc.goodput, "e_star": opt.e_star, "ratio": opt.ratio, "recommended_steps":
            opt.recommended_steps, "interval_steps": opt.interval_steps}


def main(argv: list[str] | None = None) -> int:
    from megatron_resilience.chaos.cli import duration

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="off", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--intervals", default="young_daly,short,long", help=f"comma-separated, of {INTERVALS}")
    # seed 27: the first whose first 10 faults of the default mix cover its 5 kinds with at most 2 node failures
    # (megatron_transient allows 3 crash requeues; Xid, ECC and hangs are restarted by ft_launcher inside the job)
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--max-count", type=int, default=10)
    p.add_argument("--mix", default="llama3_local_cluster")
    p.add_argument("--mtbf", type=duration, default=60.0, help="mean time between faults, on --clock")
    p.add_argument("--clock", default="training", choices=("training", "allocation"),
                   help="the chaos stream's clock: training time, or allocated time (Daly's assumption)")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--step-delay", type=float, default=0.1, help="extra compute per step on rank 0 (s): per-step "
                   "overhead (logging, FT sections) small beside the step, as on a GPU")
    p.add_argument("--shape", nargs="*", default=[], help="model overrides (default gpt_tiny's)")
    p.add_argument("--optimum-steps", type=int, default=None, help="the optimum interval for short/long (default: "
                   "what the young_daly run recommends)")
    p.add_argument("--repair", type=duration, default=120.0)
    p.add_argument("--job-minutes", type=int, default=40)
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks (GPUs) per node: with 2 or more, a rank "
                   "fault hits rank 0, which hosts the job's store, or another rank")
    p.add_argument("--out", default=None, help="runs go here (default /tmp/mr-chaos-<time>)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--lemon", action="append", default=[], metavar="NODE=WEIGHT",
                   help="a node faults pick WEIGHT times as often (chaos --lemon); --long-form: the fault partition's "
                        "first node, weight 20, unless given, hardware faults striking any node of the partition "
                        "(chaos --pool)")
    p.add_argument("--long-form", action="store_true", help=(
        "the acceptance of weeks-long runs (issue 34): the plugins' shipped restart counts (no hand-raised "
        "num_in_job_restarts), RestartPolicyPlugin(policy='megatron_transient'), at least 40 faults on the "
        "allocation clock, 2 ranks per node, variant off at Daly's interval, a lemon node"))
    args = p.parse_args(argv)
    if args.long_form:
        args.max_count, args.clock, args.ranks_per_node = max(args.max_count, 40), "allocation", 2
        args.variants, args.intervals = "off", "young_daly"
    args.out = os.path.abspath(args.out or f"/tmp/mr-chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("NEMORUN_HOME", os.path.join(args.out, "nemorun_home"))
    # sbatch exports this environment to the jobs: their python, ft_launcher and torchrun are this checkout's
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    clusters = {"multinode": start_cluster("multinode"), "default": start_cluster(None)}
    args.pool, args.policy = [], "megatron_transient"
    if args.long_form:  # every node of the fault partition fails on its own; the lemon is where a job starts
        args.pool = partition_nodes(clusters["multinode"], VARIANTS["off"]["partition"])
        args.lemon = args.lemon or [f"{clusters['multinode']['fault_nodes'].split(',')[0]}={LEMON_WEIGHT:g}"]
        args.policy = compressed_policy(args)

    # the uninterrupted references, on the default cluster, beside the chaos runs: one per data-parallel size the
    # variants start at (a variant on 2 nodes trains at DP 2, whose gradients are summed in another order than at
    # DP 1), each on one node with a rank per variant rank
    references = {}
    for size in sorted({VARIANTS[v]["nodes"] * args.ranks_per_node for v in args.variants.split(",")
                        if v in VARIANTS}):
        name = "reference" if size == 1 else f"reference-dp{size}"
        task, plugins, _ = build(args.out, name, steps=args.steps, interval="fixed",
                                 optimum_steps=max(1, args.steps // 4), mtbf=args.mtbf,
                                 variant={**VARIANTS["off"], "nodes": 1}, shape=args.shape,
                                 step_delay=args.step_delay, ranks_per_node=size)
        job = submit(name, task, plugins, clusters["default"], partition=clusters["default"]["partition"], nodes=1,
                     minutes=args.job_minutes, ranks_per_node=size)
        references[size] = {"job": job, "run_dir": task.run_dir, "name": name}
        print(f"[{name}] job {job} on the default cluster (DP {size})", flush=True)

    results, optimum = [], args.optimum_steps
    for variant in args.variants.split(","):
        for interval in args.intervals.split(","):
            if interval != "young_daly" and optimum is None:
                results.append({"name": f"{variant}-{interval}", "variant": variant, "interval": interval,
                                "unavailable": "no optimum interval known (run young_daly first or --optimum-steps)"})
                continue
            result = one_run(args, f"{variant}-{interval}", variant, interval, optimum, clusters)
            if interval == "young_daly" and result.get("recommended_steps"):
                optimum = optimum or result["recommended_steps"]
            results.append(result)
    deadline = time.monotonic() + args.job_minutes * 60
    for ref in references.values():
        while slurm_state(ref["job"], clusters["default"]["slurm_conf"]) not in (
                "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and time.monotonic() < deadline:
            time.sleep(5)
        ref["losses"] = losses(ref["run_dir"])
    for r in results:
        if "run_dir" in r:
            ref = references[VARIANTS[r["variant"]]["nodes"] * args.ranks_per_node]
            r["reference"] = ref["name"]
            r["losses_vs_reference"] = compare_losses(losses(r["run_dir"]), ref["losses"], args.steps)

    rows = []
    for r in results:
        if "unavailable" in r:
            rows.append([r["variant"], r["interval"], f"unavailable: {r['unavailable'][:80]}"] + [None] * 8)
            continue
        inj = r["report"]["injected"]
        rows.append([r["variant"], r["interval"], r["interval_steps"], len(inj["injections"]),
                     classified_text(inj["injections"]), f"{100 * r['goodput']:.1f}%",
                     f"{100 * r['e_star']:.1f}%" if r["e_star"] else None,
                     f"{r['ratio']:.3f}" if r["ratio"] else None, r["losses_vs_reference"],
                     f"{r['sum_error_s']:.2e}", r["final"][:60]])
    headers = ["variant", "interval", "steps/save", "injected", "classified", "goodput", "E*", "goodput/E*",
               "losses vs reference", "|sum - allocated| s", "final"]
    info = machine("cpu")
    print(describe(info))
    print(table(headers, rows))
    path = write_json("chaos", "cpu", {"machine": info, "args": {k: v for k, v in vars(args).items()
                                                                  if k != "json"}, "optimum_steps": optimum,
                                        "references": {size: {"job": ref["job"], "run_dir": ref["run_dir"],
                                                              "steps": len(ref["losses"])}
                                                       for size, ref in references.items()},
                                        "runs": results}, args.json)
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
