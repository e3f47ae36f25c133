"""What sharding buys: peak memory per rank and step time for each data-parallel strategy, at one shape.

    python benchmarks/fsdp_memory.py [--ranks 2] [--steps 10]
        [--strategies ddp,ddp_distopt,torch_fsdp2,megatron_fsdp,megatron_fsdp_optim_grads] [--device cpu|cuda]
        [--json PATH]

Each strategy is the real trainer under torchrun on ``--ranks`` ranks (CPU and gloo here; on a lent GPU the same
command measures CUDA memory), the same GPT (4 layers, hidden 512, vocab 32768, untied embeddings, fp32: 46 M
parameters, so the weights, gradients and Adam state, 16 bytes a parameter, are 0.7 GiB unsharded) and the same
batch. Per rank it reports the bytes of the tensors alive after the third optimizer step (weights, gradients,
optimizer state, communication buffers: what a strategy shards; the activations are freed by then), the process's
peak (CPU: resident memory, ``ru_maxrss``, which also counts Python, torch, the allocator's cache and the whole
model as built before FSDP shards it; GPU: the device's peak allocation), the submit-time estimate of the state
(``config/memory.py``) and the median step time. ``megatron_fsdp`` is Megatron-FSDP with its default sharding
strategy (``optim_grads_params``), ``megatron_fsdp_optim_grads`` the one that keeps the weights whole; the trainer
runs Megatron-FSDP in fp32 with synchronous saves only so far, and its rows say so (this shape is fp32 and saves
nothing). The state estimate leaves out what FSDP gathers whole while it computes (``MemoryEstimate.gathered``).
A strategy the trainer or the installed megatron-core refuses gets the refusal as its note.

Each rank runs this file (``--as-rank OUT``): it trains through ``python -m megatron_resilience``'s ``main`` and
then writes its peak to ``OUT.<rank>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, describe, machine, table, write_json  # noqa: E402

SHAPE = ["model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8", "model.vocab_size=32768",
         "model.seq_length=128", "model.max_position_embeddings=128", "train.micro_batch_size=2",
         "model.share_embeddings_and_output_weights=false", "train.log_interval=1"]
STRATEGIES = {
    "ddp": ["parallel.data_parallel_strategy=ddp"],
    "ddp_distopt": ["parallel.data_parallel_strategy=ddp", "parallel.use_distributed_optimizer=true"],
    "torch_fsdp2": ["parallel.data_parallel_strategy=torch_fsdp2"],
    # what the trainer's Megatron-FSDP path runs so far: fp32, synchronous saves
    "megatron_fsdp": ["parallel.data_parallel_strategy=megatron_fsdp", "model.precision=fp32",
                      "checkpoint.async_save=false"],
    "megatron_fsdp_optim_grads": ["parallel.data_parallel_strategy=megatron_fsdp", "model.precision=fp32",
                                  "checkpoint.async_save=false",
                                  "parallel.data_parallel_sharding_strategy=optim_grads"],
}


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each storage once (DTensors by their local shard)."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            tensor = getattr(obj, "_local_tensor", obj)
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # meta tensors, tensor subclasses without storage
            continue
    return sum(seen.values())


def _as_rank(out: str, overrides: list[str]) -> None:
    """Train; after the third optimizer step count the live tensors (weights, gradients, optimizer state: the
    activations are freed by then); write both peaks."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from megatron_resilience.__main__ import main

    seen = {"steps": 0, "live": 0}

    def after_step(optimizer, args, kwargs):
        seen["steps"] += 1
        if seen["steps"] == 3:
            seen["live"] = _live_tensor_bytes()

    register_optimizer_step_post_hook(after_step)
    main(overrides)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    Path(f"{out}.{os.environ['RANK']}").write_text(json.dumps({"peak": peak, "live": seen["live"]}))


def _estimate(overrides: list[str], ranks: int) -> float | None:
    from megatron_resilience.config import ConfigError
    from megatron_resilience.config.memory import estimate
    from megatron_resilience.config.overrides import config_from_overrides

    try:
        est = estimate(config_from_overrides(["run_dir=/tmp/estimate", *overrides]), ranks)
    except ConfigError:
        return None
    return est.params * est.bytes_per_param


def _measure(name: str, ranks: int, steps: int, root: Path, device: str = "cpu") -> dict:
    overrides = [*SHAPE, *STRATEGIES[name], f"train.max_steps={steps}", f"train.device={device}"]
    run_dir, out = root / name, root / f"{name}.peak"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={ranks}", __file__, "--as-rank",
                           str(out), f"run_dir={run_dir}", *overrides], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    row = {"strategy": name, "state_estimate_gib": None, "live_tensors_gib": None, "peak_gib": None,
           "step_time_ms": None, "note": ""}
    estimate_bytes = _estimate(overrides, ranks)
    row["state_estimate_gib"] = None if estimate_bytes is None else round(estimate_bytes / 2**30, 3)
    if proc.returncode != 0:
        refused = [line for line in proc.stderr.splitlines() if line.startswith("megatron_resilience: ")]
        row["note"] = refused[-1][:160] if refused else f"exit {proc.returncode}"
        return row
    peaks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
    row["peak_gib"] = [round(p["peak"] / 2**30, 3) for p in peaks]
    row["live_tensors_gib"] = [round(p["live"] / 2**30, 3) for p in peaks]
    row["live_tensors_bytes"], row["state_estimate_bytes"] = [p["live"] for p in peaks], estimate_bytes
    times = [json.loads(line)["step_time_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line][1:]  # the first step builds caches
    row["step_time_ms"] = round(1000 * statistics.median(times), 1) if times else None
    return row


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--as-rank":
        _as_rank(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per rank (benchmarks/gpu.sh fsdp); peak = the device's peak allocation")
    args = parser.parse_args()
    info = machine(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [_measure(name, args.ranks, args.steps, Path(tmp), args.device) for name in args.strategies.split(",")]
    print(describe(info))
    print(f"shape: {' '.join(SHAPE)}; {args.ranks} ranks, {args.steps} steps")
    print(table(["strategy", "state per rank, estimate (GiB)", "live tensors per rank after a step (GiB)",
                 "peak memory per rank (GiB)", "median step (ms)", "note"],
                [[r["strategy"], r["state_estimate_gib"], r["live_tensors_gib"], r["peak_gib"], r["step_time_ms"],
                  r["note"]] for r in rows]))
    print(f"JSON: {write_json('fsdp_memory', args.device, {'machine': info, 'rows': rows}, args.json)}")


if __name__ == "__main__":
    main()
