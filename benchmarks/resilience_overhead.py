"""What resilience costs per training step: FT sections, straggler detection, rerun validation, all on.

    .venv/bin/python benchmarks/resilience_overhead.py [--device auto|cpu|cuda] [--shape ...] [--nproc N]
                                                         [--blocks 30 --block-steps 5]

Measured in ONE run of the real trainer under the real ft_launcher (``--nproc`` ranks: 2 on CPU, 1 on a
single GPU, where two nccl ranks cannot share the device): the same model, optimizer and data iterator run
blocks of ``--block-steps`` steps in each mode, the modes interleaved block by block (order rotated) so
machine load hits them alike:
``off`` (no hooks, rerun disabled, no NaN check) | ``ft`` (FT step sections, 2 IPC round trips) |
``straggler`` (Detector section around the step + its per-step report check) | ``rerun`` (Megatron-Core
rerun state machine in validate_results: state save + NaN check + an all-reduce per step) | ``all``
(the real ResilienceHooks path: FT + straggler + exit-signal agreement all-reduce, and rerun on).
Reported: median step time per mode, ratio to ``off``, added microseconds per step, and each hook
operation around a no-op step. On CPU the Detector's CUPTI extension cannot load (no CUDA), so the straggler
modes use the test stand-in (tests/resilience_support/fake_cupti, process CPU time); on a GPU the real
CUPTI extension runs (put libcupti on LD_LIBRARY_PATH).

Prints markdown tables and writes JSON. Fault -> restart timings are benchmarks/recovery.py's.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

MODES = ("off", "ft", "straggler", "rerun", "all")


# --- worker: runs inside each rank under ft_launcher -----------------------------------------------------------


def worker(run_dir: str, blocks: int, block_steps: int, device: str, shape: str, precision: str,
           isolated_chunks: int, isolated_steps: int) -> None:
    import torch
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    from megatron_resilience import trainer
    from megatron_resilience.config.overrides import config_from_overrides
    from megatron_resilience.resilience import build_hooks
    from megatron_resilience.runtime import collectives as _dist
    from megatron_resilience.runtime import loop

    config = config_from_overrides([
        f"run_dir={run_dir}", *common.SHAPES[shape].overrides(), f"train.device={device}",
        f"model.precision={precision}", f"train.max_steps={(blocks + 5) * block_steps * len(MODES)}",
        "ft.enabled=true", "straggler.enabled=true",
        "straggler.report_time_interval=3600", "train.exit_signal_handler=true", "rerun.rerun_mode=validate_results"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer._setup_logging(rank)
    hooks = build_hooks(config, rank=rank, world_size=world)
    with hooks.setup_section():
        ctx = trainer._setup(config, hooks, time.monotonic())
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

    isolated = _isolated_costs(hooks, _dist, isolated_chunks, isolated_steps)
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


def ft_launcher() -> list[str]:
    """The ft_launcher next to this interpreter (a venv), else the one on PATH (a --target install's bin/)."""
    import shutil

    beside = Path(sys.executable).parent / "ft_launcher"
    found = str(beside) if beside.exists() else shutil.which("ft_launcher")
    if not found:
        sys.exit("ft_launcher not found next to the interpreter nor on PATH")
    return [found]


def measure_overhead(root: Path, args, device: str, shape: str, precision: str) -> dict[str, list[float]]:
    import subprocess

    from resilience_support.launch import FAKE_CUPTI, write_ft_yaml

    run_dir = root / "overhead"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_ft_yaml(run_dir / "ft.yaml", {})
    paths = ([str(FAKE_CUPTI)] if device == "cpu" else []) + [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1")
    cmd = [*ft_launcher(), "--standalone", f"--nproc-per-node={args.nproc}", "--max-restarts=0",
           f"--ft-cfg-path={run_dir / 'ft.yaml'}", str(Path(__file__).resolve()), "worker", str(run_dir),
           str(args.blocks), str(args.block_steps), device, shape, precision, str(args.isolated_chunks),
           str(args.isolated_steps)]
    with open(run_dir / "launcher.log", "wb") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"overhead run failed (rc={rc}); see {run_dir / 'launcher.log'}")
    return json.loads((run_dir / "overhead.json").read_text())


def _fmt(values: list[float], fmt: str) -> str:
    median, q1, q3 = common.median_iqr(values)
    return f"{format(median, fmt)} [{format(q1, fmt)}, {format(q3, fmt)}]"


def main() -> None:
    if sys.argv[1:2] == ["worker"]:  # a rank under ft_launcher (positional: launcher options would shadow flags)
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:8], int(sys.argv[8]), int(sys.argv[9]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--isolated-chunks", type=int, default=15, help="no-op step timings: chunks (median over)")
    parser.add_argument("--isolated-steps", type=int, default=40, help="no-op step timings: steps per chunk")
    parser.add_argument("--work-dir", type=Path, default=None, help="run folder (default: a new temporary one)")
    args = parser.parse_args()
    device = common.resolve_device(args.device)
    shape = common.default_shape(device, args.shape)
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    args.nproc = args.nproc or (1 if device == "cuda" else 2)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="resilience_bench_"))
    info = common.machine(device)
    measured = measure_overhead(root, args, device, shape, precision)
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    wall, cpu = measured["wall"], measured["cpu"]
    print(f"\n{common.describe(info)}; load average after the run {info['load_average_after'][0]}")
    print(f"\nPer-step overhead, one run, {args.nproc} {device} rank(s), shape {shape}, {precision}; "
          f"{args.blocks} rounds, each running every mode for {args.block_steps} steps back to back. "
          "Per round: ratio and difference to that round's `off` block; the table gives the median over "
          "rounds [interquartile range]. CPU = process CPU time (max over ranks), less sensitive to other "
          "load on the machine than wall time.\n")
    modes = {}
    rows = []
    for mode in MODES:
        ratios = [w / o for w, o in zip(wall[mode], wall["off"])]
        added = [(w - o) * 1e6 for w, o in zip(wall[mode], wall["off"])]
        added_cpu = [(c - o) * 1e6 for c, o in zip(cpu[mode], cpu["off"])]
        modes[mode] = {"step_wall_s": wall[mode], "step_cpu_s": cpu[mode],
                       "median_step_wall_s": common.median_iqr(wall[mode])[0],
                       "ratio_to_off": common.median_iqr(ratios), "added_wall_us": common.median_iqr(added),
                       "added_cpu_us": common.median_iqr(added_cpu)}
        rows.append([mode, f"{modes[mode]['median_step_wall_s'] * 1e3:.2f}", _fmt(ratios, ".3f"), _fmt(added, "+.0f"),
                     _fmt(added_cpu, "+.0f")])
    print(common.table(["mode", "step wall time (ms)", "ratio to off (wall)", "added wall per step (µs)",
                        "added CPU per step (µs)"], rows))
    print("\nThe same hook operations around a no-op step (no model), microseconds per step, median over chunks "
          "(max over ranks); the rerun state machine needs a real step and is only measured above:\n")
    print(common.table(["hook operation", "µs per step"],
                       [[name, f"{value:.0f}"] for name, value in measured["isolated"].items()]))
    path = common.write_json("resilience_overhead", device, {
        "machine": info, "shape_name": shape, "shape": common.SHAPES[shape], "precision": precision,
        "nproc": args.nproc, "blocks": args.blocks, "block_steps": args.block_steps,
        "straggler_cupti": "stand-in (no CUDA)" if device == "cpu" else "real",
        "modes": modes, "isolated_us": measured["isolated"]}, args.json)
    print(f"\nJSON: {path}\nlogs: {root}")


if __name__ == "__main__":
    main()
