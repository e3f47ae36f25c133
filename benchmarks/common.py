"""What every benchmark shares: device choice, model shapes, the machine's description, tables and JSON.

Benchmarks print a markdown table and write the same figures as JSON (``--json PATH``; default
``benchmarks/results/<name>-<device>.json``). Timing targets live here and in docs/speed.md, never in tests.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A GPT shape and its micro-batch: the same numbers go to our trainer and to the plain PyTorch GPT."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int
    ffn: int | None = None

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    def overrides(self) -> list[str]:
        return [f"model.num_layers={self.layers}", f"model.hidden_size={self.hidden}",
                f"model.num_attention_heads={self.heads}", f"model.vocab_size={self.vocab}",
                f"model.seq_length={self.seq}", f"model.ffn_hidden_size={self.ffn_size}",
                f"train.micro_batch_size={self.micro_batch}"]

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), the PaLM / nanoGPT convention:
        6 x matmul parameters (the tied output layer included) + 12 x layers x hidden x seq for attention."""
        h, f = self.hidden, self.ffn_size
        matmul_params = self.layers * (4 * h * h + 2 * h * f) + h * self.vocab
        return 6.0 * matmul_params + 12.0 * self.layers * h * self.seq


SHAPES = {
    # recipes.gpt_tiny: the CPU demo / CI shape
    "gpt_tiny": Shape(layers=2, hidden=64, heads=4, vocab=1024, seq=64, micro_batch=4),
    # recipes.gpt_126m (GPT-3 Small): the shape of the H100 measurements
    "gpt_126m": Shape(layers=12, hidden=768, heads=12, vocab=50304, seq=2048, micro_batch=8),
    # between the two, for CPU runs that should not be dominated by per-call overhead
    "gpt_small_cpu": Shape(layers=4, hidden=256, heads=8, vocab=8192, seq=256, micro_batch=4),
}

# Dense bf16 tensor-core peaks (FLOP/s) by GPU model name, for MFU. Unknown devices: --peak-tflops.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}


def add_common_args(parser, *, default_shape: str | None = None) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda when a GPU is visible, else cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=default_shape,
                        help="default: gpt_126m on cuda, gpt_tiny on cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                        help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--json", type=Path, default=None, help="where to write the JSON (default benchmarks/results/)")


def resolve_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def default_shape(device: str, requested: str | None) -> str:
    return requested or ("gpt_126m" if device == "cuda" else "gpt_tiny")


def machine(device: str) -> dict:
    """Where the figures come from: CPU count and load (others share this machine), GPU model, versions."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    info = {"host_cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "torch": ver("torch"), "megatron_core": ver("megatron-core"),
            "nvidia_resiliency_ext": ver("nvidia-resiliency-ext"), "device": device}
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    return info


def describe(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (f"machine: {info['host_cpus']} CPUs (load average {info['load_average'][0]}){gpu}; torch {info['torch']}, "
            f"megatron-core {info['megatron_core']}, nvidia-resiliency-ext {info['nvidia_resiliency_ext']}")


def peak_flops(info: dict, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    gpu = info.get("gpu") or ""
    return next((peak for name, peak in PEAK_BF16.items() if name in gpu), None)


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join("n/a" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def median_iqr(values: list[float]) -> tuple[float, float, float]:
    v = sorted(values)
    return statistics.median(v), v[len(v) // 4], v[(3 * len(v)) // 4]


def write_json(name: str, device: str, payload: dict, path: Path | None) -> Path:
    path = path or RESULTS / f"{name}-{device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "written": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__")
                               else str(o)) + "\n")
    return path
