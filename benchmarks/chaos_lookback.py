"""The node-attribution lookback of ``chaos.py --long-form``, compressed as its failure stream is.

A policy counts a node's hardware attributions over ``exclude_nodes_within_days`` (14 days in the presets, as
nvidia-resiliency-ext's node attribution). That window is sized for real clusters, where a healthy node fails
rarely: Llama 3's 54-day run met 419 unexpected interruptions on 2,048 nodes, 78 % of them attributed to hardware
(A. Dubey et al., arXiv:2407.21783, section 3.3.4), about one hardware failure per healthy node every 338 days, so
14 days is 0.041 of a node's mean time between hardware failures. The chaos run compresses time: a fault a
minute on a three-node partition makes a healthy node that hosts the job fail every few hundred seconds, and a
14-day window would count a whole run's failures as repeats and exclude healthy nodes along with the lemon. The
long form therefore runs the shipped policy with the window scaled by the same factor as a healthy node's failure
rate: 0.041 of the chaos stream's mean time between hardware failures of a healthy node. Everything else in the
policy is the preset's; the report names the policy file and the window.
"""

from __future__ import annotations

import os
from pathlib import Path

# Llama 3 405B (arXiv:2407.21783, section 3.3.4 and Table 5): 419 unexpected interruptions in 54 days on 16,384 GPUs
# (2,048 nodes of 8), 78 % attributed to confirmed or suspected hardware issues.
LLAMA3_DAYS, LLAMA3_UNEXPECTED, LLAMA3_NODES, LLAMA3_HARDWARE_SHARE = 54, 419, 2048, 0.78
SHIPPED_WINDOW_DAYS = 14.0


def healthy_node_mtbf_days() -> float:
    """A healthy node's mean time between hardware failures in the Llama 3 run (days): about 338."""
    return LLAMA3_DAYS * LLAMA3_NODES / (LLAMA3_UNEXPECTED * LLAMA3_HARDWARE_SHARE)


def compressed_window_s(*, mtbf_s: float, hardware_share: float, pool: int, lemon_weight: float) -> float:
    """The lookback (seconds) that is to a healthy node of the chaos pool what 14 days is to a Llama 3 node.

    Hardware faults come every ``mtbf_s / hardware_share`` seconds and strike the pool's ``pool`` nodes, the lemon
    ``lemon_weight`` times as often as each other node."""
    healthy_mtbf_s = mtbf_s / hardware_share * (lemon_weight + pool - 1)
    return SHIPPED_WINDOW_DAYS / healthy_node_mtbf_days() * healthy_mtbf_s


def write_policy(out_dir: str, preset: str, window_s: float) -> str:
    """``preset`` with ``exclude_nodes_within_days`` set to ``window_s``; returns the file's path."""
    import yaml

    from megatron_resilience.jobs.policies import PRESET_DIR

    with open(os.path.join(PRESET_DIR, f"{preset}.yaml")) as f:
        data = yaml.safe_load(f)
    data["name"] = f"{preset}_compressed"
    data["description"] = (f"{preset} with its node-attribution window compressed as the chaos stream compresses "
                           f"time: {window_s:.0f} s (benchmarks/chaos_lookback.py). "
                           + str(data.get("description", "")))
    data["exclude_nodes_within_days"] = window_s / 86400.0
    path = Path(out_dir, f"{preset}_compressed.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)
