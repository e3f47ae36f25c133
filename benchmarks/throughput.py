"""Tokens/s, step time and MFU of our Megatron-Core trainer against a plain PyTorch GPT of the same shape.

    .venv/bin/python benchmarks/throughput.py [--device auto|cpu|cuda] [--shape gpt_126m] [--rounds 10 --steps 5]

One process, one device. Built side by side in the same run: our trainer's real setup (``trainer.py``:
Megatron-Core GPTModel + DDP + distributed optimizer class + mock data iterator + ``loop.train_step``) once per
attention backend (``sdpa``, ``unfused``, and ``te`` where Transformer Engine imports), and
benchmarks/plain_gpt.py eager and ``torch.compile``d. Same shape, micro-batch, sequence length and vocabulary
(one micro-batch per step everywhere); bf16 on GPU (ours: bf16 weights with fp32 main weights; plain: bf16
autocast over fp32 weights), fp32 on CPU. After ``--warmup`` steps each (compilation happens there), rounds run
every variant for ``--steps`` steps back to back, order rotated per round, so machine load hits all alike;
ratios are taken within a round. MFU = model FLOPs per token (see common.Shape.flops_per_token) x tokens/s /
peak (H100/H200/A100 bf16 known; elsewhere ``--peak-tflops``, else n/a).

Prints a markdown table and writes JSON. Figures are for the machine they were taken on.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def build_ours(shape: common.Shape, device: str, precision: str, backend: str, run_dir: str, max_steps: int):
    """Our trainer's setup in this process; returns a zero-argument step function."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    from megatron_resilience import trainer
    from megatron_resilience.config.overrides import config_from_overrides
    from megatron_resilience.runtime import loop
    from megatron_resilience.runtime.hooks import TrainingHooks

    config = config_from_overrides([
        f"run_dir={run_dir}", *shape.overrides(), f"model.precision={precision}", f"train.device={device}",
        f"model.attention_backend={backend}", f"train.max_steps={max_steps}"])
    destroy_rerun_state_machine()  # one per process; each setup makes its own
    ctx = trainer._setup(config, TrainingHooks(), time.monotonic())
    return lambda: loop.train_step(ctx)


def build_plain(shape: common.Shape, device: str, precision: str, compiled: bool):
    import torch
    from plain_gpt import PlainTrainer

    trainer = PlainTrainer(shape, torch.device(device), bf16=precision == "bf16", compiled=compiled)
    return trainer.step


def available_variants(device: str) -> list[str]:
    variants = ["ours:sdpa", "ours:unfused"]
    if device == "cuda":
        try:
            import transformer_engine  # noqa: F401

            variants.append("ours:te")
        except ImportError:
            pass
    return variants + ["plain:eager", "plain:compiled"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default=None, help="comma-separated subset of " + ", ".join(
        ["ours:sdpa", "ours:unfused", "ours:te", "plain:eager", "plain:compiled"]))
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()

    device = common.resolve_device(args.device)
    shape_name = common.default_shape(device, args.shape)
    shape = common.SHAPES[shape_name]
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    variants = args.variants.split(",") if args.variants else available_variants(device)
    unknown = set(variants) - {"ours:sdpa", "ours:unfused", "ours:te", "plain:eager", "plain:compiled"}
    if unknown:
        sys.exit(f"--variants: unknown {sorted(unknown)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    max_steps = args.warmup + args.rounds * args.steps + 10
    steps, errors = {}, {}
    with tempfile.TemporaryDirectory(prefix="throughput_") as tmp:
        for variant in variants:
            kind, flavour = variant.split(":")
            try:
                if kind == "ours":
                    steps[variant] = build_ours(shape, device, precision, flavour, f"{tmp}/{flavour}", max_steps)
                else:
                    steps[variant] = build_plain(shape, device, precision, compiled=flavour == "compiled")
                for _ in range(args.warmup):
                    steps[variant]()
                _sync(device)
            except Exception as err:  # e.g. no C++ compiler for torch.compile: reported, others still measured
                steps.pop(variant, None)
                errors[variant] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
        info = common.machine(device)
        times: dict[str, list[float]] = {v: [] for v in steps}
        names = list(steps)
        for r in range(args.rounds):
            for variant in names[r % len(names):] + names[:r % len(names)]:
                _sync(device)
                start = time.perf_counter()
                for _ in range(args.steps):
                    steps[variant]()
                _sync(device)
                times[variant].append((time.perf_counter() - start) / args.steps)
        info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]

    tokens = shape.micro_batch * shape.seq
    peak = common.peak_flops(info, args.peak_tflops)
    reference = "plain:eager" if "plain:eager" in times else None
    results = {}
    for variant, values in times.items():
        median, q1, q3 = common.median_iqr(values)
        ratios = [times[reference][i] / t for i, t in enumerate(values)] if reference else None
        results[variant] = {
            "step_time_s": values, "median_step_time_s": median, "iqr_step_time_s": [q1, q3],
            "tokens_per_s": tokens / median,
            "ratio_to_plain_eager": common.median_iqr(ratios)[0] if ratios else None,
            "mfu": shape.flops_per_token() * tokens / median / peak if peak else None,
        }
    print(f"\n{common.describe(info)}")
    print(f"shape {shape_name}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, "
          f"vocab {shape.vocab}, seq {shape.seq}, micro-batch {shape.micro_batch}, {precision}; "
          f"{args.rounds} rounds x {args.steps} steps per variant (interleaved), "
          f"{args.warmup} warm-up steps; tokens per step {tokens}\n")
    rows = [[v, f"{r['median_step_time_s'] * 1e3:.2f} [{r['iqr_step_time_s'][0] * 1e3:.2f}, "
                f"{r['iqr_step_time_s'][1] * 1e3:.2f}]", f"{r['tokens_per_s']:.0f}",
             None if r["ratio_to_plain_eager"] is None else f"{r['ratio_to_plain_eager']:.3f}",
             None if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"] for v, r in results.items()]
    rows += [[v, f"failed: {e}", None, None, None] for v, e in errors.items()]
    print(common.table(["variant", "step time ms (median [IQR])", "tokens/s", "tokens/s vs plain eager (per-round "
                        "median)", "MFU"], rows))
    path = common.write_json("throughput", device, {
        "machine": info, "shape_name": shape_name, "shape": shape, "precision": precision, "rounds": args.rounds,
        "steps_per_round": args.steps, "warmup": args.warmup, "tokens_per_step": tokens,
        "flops_per_token": shape.flops_per_token(), "peak_flops": peak, "variants": results, "errors": errors,
    }, args.json)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
