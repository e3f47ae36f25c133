"""What resilience costs: per-step overhead, and time from a fault to the first step after the restart.

    .venv/bin/python benchmarks/resilience_overhead.py [--blocks 12 --block-steps 10]

1. Per-step overhead, measured in ONE run (2 CPU ranks of the real trainer under the real ft_launcher):
   the same model, optimizer and data iterator run blocks of ``--block-steps`` steps in each mode, the
   modes interleaved block by block (order rotated) so machine load hits them alike:
   ``off`` (no hooks, rerun disabled, no NaN check) | ``ft`` (FT step sections, 2 IPC round trips) |
   ``straggler`` (Detector section around the step + its per-step report check) | ``rerun`` (Megatron-Core
   rerun state machine in validate_results: state save + NaN check + an all-reduce per step) | ``all``
   (the real ResilienceHooks path: FT + straggler + exit-signal agreement all-reduce, and rerun on).
   Reported: median step time per mode, ratio to ``off``, added microseconds per step.
   CPU only: the Detector's CUPTI extension cannot load without CUDA, so the straggler modes use the test
   stand-in (tests/resilience_support/fake_cupti, process CPU time); on a GPU the CUPTI cost differs.
2. Fault -> first completed step after the restart: the trainer with a simulated ``rank_killed`` and a
   ``rank_hung`` (step timeout 5 s, check interval 1 s) at step 8 (last checkpoint at 5), timed from the
   fault's banner to the first ``train`` record the restarted ranks write; split into detection (the
   launcher's failure / the monitor's timeout line), restart + setup (up to ``setup: resumed``), and re-running
   the steps since the checkpoint.

Prints a markdown table. Numbers are for this machine; timing targets live here, not in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

MODES = ("off", "ft", "straggler", "rerun", "all")


# --- worker: runs inside each rank under ft_launcher -----------------------------------------------------------


def worker(run_dir: str, blocks: int, block_steps: int) -> None:
    import torch
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    from megatron_resilience.config.overrides import config_from_overrides
    from megatron_resilience.resilience import _dist, build_hooks
    from megatron_resilience.runtime import loop, pretrain

    config = config_from_overrides([
        f"run_dir={run_dir}", "train.max_steps=100000", "ft.enabled=true", "straggler.enabled=true",
        "straggler.report_time_interval=3600", "train.exit_signal_handler=true", "rerun.rerun_mode=validate_results"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pretrain._setup_logging(rank)
    hooks = build_hooks(config, rank=rank, world_size=world)
    with hooks.setup_section():
        ctx = pretrain._setup(config, hooks, time.monotonic())
    hooks.after_setup(ctx.state)
    rerun = get_rerun_state_machine()
    raw = lambda: loop.train_step(ctx)  # noqa: E731
    wrapped_all = hooks.wrap_train_step(raw)
    wrapped_straggler = hooks.straggler.wrap(raw)
    state = ctx.state

    def run_step(mode: str) -> None:
        step = state.step + 1
        if mode == "all":
            with hooks.step_section(step):
                wrapped_all()
            state.step = step
            assert hooks.after_step(state) is None
        elif mode == "ft":
            with hooks.ft.step():
                raw()
            state.step = step
        elif mode == "straggler":
            wrapped_straggler()
            state.step = step
            hooks.straggler.after_step(step)
        else:  # off, rerun
            raw()
            state.step = step

    def set_mode(mode: str) -> None:
        on = mode in ("rerun", "all")
        rerun.set_mode(RerunMode.VALIDATE_RESULTS if on else RerunMode.DISABLED)
        config.rerun.check_for_nan_in_loss = on

    isolated = _isolated_costs(hooks, _dist)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:  # warm-up
        set_mode(mode)
        for _ in range(3):
            run_step(mode)
    for block in range(blocks):
        order = MODES[block % len(MODES):] + MODES[:block % len(MODES)]
        for mode in order:
            set_mode(mode)
            torch.distributed.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(block_steps):
                run_step(mode)
            elapsed, cpu_used = _dist.all_reduce_max([time.perf_counter() - start, time.process_time() - cpu_start])
            times[mode].append(elapsed / block_steps)
            cpu[mode].append(cpu_used / block_steps)
    set_mode("off")
    hooks.on_exit(state, "signal")  # not "finished": nothing to mark, the benchmark just stops
    if rank == 0:
        (Path(run_dir) / "overhead.json").write_text(json.dumps({"wall": times, "cpu": cpu, "isolated": isolated}))


def _isolated_costs(hooks, dist_utils, chunks: int = 15, per_chunk: int = 40) -> dict[str, float]:
    """Each hook operation around a no-op step, without the model: microseconds per step (median of chunks)."""
    import torch

    noop = lambda: None  # noqa: E731
    straggler_step = hooks.straggler.wrap(noop)
    all_step = hooks.wrap_train_step(noop)
    state = type("S", (), {"step": 0})()
    counter = iter(range(10**9))

    def ft():
        with hooks.ft.step():
            noop()

    def straggler():
        straggler_step()
        hooks.straggler.after_step(next(counter))

    def agree():
        dist_utils.all_reduce_max([0.0, 0.0])

    def everything():
        state.step += 1
        with hooks.step_section(state.step):
            all_step()
        hooks.after_step(state)

    out = {}
    for name, fn in (("ft sections (2 IPC round trips)", ft), ("straggler section + report check", straggler),
                     ("stop agreement all-reduce (signal, straggler)", agree), ("all hooks", everything)):
        samples = []
        for _ in range(chunks):
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(per_chunk):
                fn()
            samples.append(dist_utils.all_reduce_max([(time.perf_counter() - start) / per_chunk])[0])
        out[name] = statistics.median(samples) * 1e6
    return out


# --- driver ----------------------------------------------------------------------------------------------------


def measure_overhead(root: Path, blocks: int, block_steps: int) -> dict[str, list[float]]:
    from resilience_support.launch import FAKE_CUPTI, VENV_BIN, write_ft_yaml
    import subprocess

    run_dir = root / "overhead"
    run_dir.mkdir(parents=True)
    write_ft_yaml(run_dir / "ft.yaml", {})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_CUPTI), str(REPO)]), OMP_NUM_THREADS="1")
    cmd = [str(VENV_BIN / "ft_launcher"), "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           f"--ft-cfg-path={run_dir / 'ft.yaml'}", str(Path(__file__).resolve()), "worker", str(run_dir),
           str(blocks), str(block_steps)]
    with open(run_dir / "launcher.log", "wb") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"overhead run failed (rc={rc}); see {run_dir / 'launcher.log'}")
    return json.loads((run_dir / "overhead.json").read_text())


def measure_recovery(root: Path, kind: str) -> dict[str, float]:
    from resilience_support.launch import launch, log_time

    run = launch(root / kind, [
        "train.max_steps=12", "checkpoint.save_interval=5", "ft.simulate_fault=true",
        f"ft.simulated_fault_type={kind}", "ft.simulated_fault_rank=1", "ft.simulated_fault_step=8"],
        max_restarts=1, timeouts={"step": 5.0})
    rc = run.wait(600)
    lines = run.log().splitlines()
    if rc != 0:
        sys.exit(f"{kind} run failed (rc={rc}); see {run.log_path}")
    fault_i = next(i for i, line in enumerate(lines) if "SIMULATED FAULT at" in line)
    fault = log_time(lines[fault_i])
    detect_marker = "has been open for" if kind == "rank_hung" else "failed (exitcode:"
    detected = log_time(next(line for line in lines[fault_i:] if detect_marker in line))
    resumed = log_time(next(line for line in lines[fault_i:] if "setup: resumed at step" in line))
    records = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    restarts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    first_step = next(r for r in records[restarts[-1]:] if r.get("kind") == "train")
    return {"detect": detected - fault, "restart_setup": resumed - detected,
            "first_step": first_step["time"] - fault, "resumed_from": records[restarts[-1]]["step"],
            "first_step_no": first_step["step"]}


def _med_iqr(values: list[float], fmt: str) -> str:
    v = sorted(values)
    return f"{format(statistics.median(v), fmt)} [{format(v[len(v) // 4], fmt)}, {format(v[(3 * len(v)) // 4], fmt)}]"


def main() -> None:
    if sys.argv[1:2] == ["worker"]:  # a rank under ft_launcher (positional: launcher options would shadow flags)
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--skip-recovery", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="resilience_bench_"))
    load_before = os.getloadavg()[0]
    measured = measure_overhead(root, args.blocks, args.block_steps)
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after "
          "the overhead run (other processes compete for the same cores)")
    wall, cpu = measured["wall"], measured["cpu"]
    print(f"\nPer-step overhead, one run, 2 CPU ranks, tiny GPT; {args.blocks} rounds, each running every mode for "
          f"{args.block_steps} steps back to back. Per round: ratio and difference to that round's `off` block; "
          "the table gives the median over rounds [interquartile range]. CPU = process CPU time (max over ranks), "
          "less sensitive to other load on the machine than wall time.\n")
    print("| mode | step wall time (ms) | ratio to off (wall) | added wall per step (µs) | added CPU per step (µs) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        ratios = [w / o for w, o in zip(wall[mode], wall["off"])]
        added = [(w - o) * 1e6 for w, o in zip(wall[mode], wall["off"])]
        added_cpu = [(c - o) * 1e6 for c, o in zip(cpu[mode], cpu["off"])]
        print(f"| {mode} | {statistics.median(wall[mode]) * 1e3:.2f} | {_med_iqr(ratios, '.3f')} | "
              f"{_med_iqr(added, '+.0f')} | {_med_iqr(added_cpu, '+.0f')} |")
    print("\nThe same hook operations around a no-op step (no model), microseconds per step, median over chunks "
          "(max over ranks); the rerun state machine needs a real step and is only measured above:\n")
    print("| hook operation | µs per step |")
    print("|---|---|")
    for name, value in measured["isolated"].items():
        print(f"| {name} | {value:.0f} |")
    if not args.skip_recovery:
        print("\nFault -> first completed step after the in-job restart (ft_launcher, step timeout 5 s, "
              "check interval 1 s; checkpoint at step 5, fault at step 8)\n")
        print("| fault | detection (s) | restart + setup + load (s) | fault -> first step (s) | resumed from |")
        print("|---|---|---|---|---|")
        for kind in ("rank_killed", "rank_hung"):
            r = measure_recovery(root, kind)
            print(f"| {kind} | {r['detect']:.1f} | {r['restart_setup']:.1f} | {r['first_step']:.1f} | "
                  f"step {r['resumed_from']} (first step {r['first_step_no']}) |")
    print(f"\nlogs: {root}")


if __name__ == "__main__":
    main()
