"""``model.attention_backend``: the SDPA core attention equals Megatron-Core's unfused one, and who picks what.

The numerics run in a fresh interpreter (tests/attention_probe.py: ``cpu_compat`` and Megatron's
parallel state are process-wide) on CPU, fp32 and bf16, MHA and GQA, a TP=2 shard, a padding
mask, dropout, and a whole GPT. Training-level proof (TP=2 / PP=2 / unfused vs sdpa curves, exact
resume) is in tests/test_runtime_parallel.py and tests/test_checkpoint_resume.py, which run with the
default backend (sdpa on CPU). Transformer Engine cannot exist here: only its *selection* is tested,
with its importability stubbed (said where it is).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_resilience.config import ConfigError, ModelConfig

PROBE = Path(__file__).with_name("attention_probe.py")
BF16_EPS = 2.0**-7  # bf16 has 8 significant bits


@pytest.fixture(scope="module")
def probe():
    proc = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["mha_fp32", "gqa_fp32", "gqa_fp32_tp2_shard", "padding_fp32"])
def test_sdpa_equals_unfused_in_fp32(probe, case):
    result = probe["numerics"][case]
    # Measured here: outputs <= 7.2e-7 apart (values up to ~3), gradients <= 4e-6.
    assert result["out"] < 1e-5 * max(1.0, result["scale"]), result
    assert result["grad"] < 1e-4, result


@pytest.mark.parametrize("case", ["mha_bf16", "gqa_bf16"])
def test_sdpa_equals_unfused_in_bf16(probe, case):
    result = probe["numerics"][case]
    # Both round to bf16 at different points: at most two units in the last place of the largest value.
    assert result["out"] <= 2 * BF16_EPS * result["scale"], result
    assert result["grad"] <= 2 * BF16_EPS * result["grad_scale"], result


def test_heads_per_partition_follow_the_tensor_parallel_size(probe):
    assert probe["numerics"]["mha_fp32"]["heads_per_partition"] == [8, 8]
    assert probe["numerics"]["gqa_fp32"]["heads_per_partition"] == [8, 2]
    assert probe["numerics"]["gqa_fp32_tp2_shard"]["heads_per_partition"] == [4, 2]  # 8 heads, 4 groups, TP=2
    assert probe["refusals"]["wrong_heads"] == ("SDPAttention: got 8 query / 8 key-value heads on this "
                                                "tensor-parallel rank, expected 4 / 4")


def test_dropout_draws_from_megatrons_tracker(probe):
    assert probe["dropout"] == {
        "dropout_changes_output": True,
        "default_rng_untouched": True,  # drawn inside get_cuda_rng_tracker().fork()
        "tracker_advanced": True,
        "next_call_differs": True,
        "replay_after_restore_equal": True,  # a checkpointed tracker state replays the same masks
        "eval_has_no_dropout": True,
    }


def test_unsupported_features_are_refused_by_name(probe):
    assert probe["refusals"]["window"] == ("model.attention_backend: 'sdpa' does not support window_size=(8, 0); "
                                           "use 'te' (Transformer Engine) or 'unfused'")
    assert probe["refusals"]["softmax"].startswith("model.attention_backend: 'sdpa' does not support "
                                                   "softmax_type='off-by-one'")


def test_whole_gpt_matches_and_the_spec_holds_the_chosen_module(probe):
    gpt = probe["gpt"]
    assert gpt["modules"] == {"unfused": [False, True], "sdpa": [True, False]}  # [has SDPAttention, has DPA]
    assert gpt["sdpa_vs_unfused"] < 1e-5, gpt
    assert 6.5 < gpt["mean_loss"] < 7.5  # untrained: about ln(1024)
    # The batches no longer carry a mask: the unfused path builds the same causal mask itself.
    assert gpt["unfused_mask_vs_none_equal"] is True


# --- which backend runs -----------------------------------------------------------------------------------------


def _dist(device: str):
    import torch

    from megatron_resilience.runtime.distributed import DistInfo

    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device(device), tp=1, pp=1, dp=1)


def _config(backend: str):
    from megatron_resilience.config import PretrainConfig

    return PretrainConfig(run_dir="/tmp/unused", model=ModelConfig(attention_backend=backend))


def test_auto_is_sdpa_on_cpu_and_te_only_when_requested_where_it_exists(monkeypatch):
    from megatron_resilience.runtime import model

    assert model.resolve_attention_backend(_config("auto"), _dist("cpu")) == "sdpa"
    assert model.resolve_attention_backend(_config("unfused"), _dist("cpu")) == "unfused"
    assert model.resolve_attention_backend(_config("sdpa"), _dist("cpu")) == "sdpa"
    with pytest.raises(ConfigError) as err:
        model.resolve_attention_backend(_config("te"), _dist("cpu"))
    assert str(err.value) == ("model.attention_backend: 'te' needs Transformer Engine on a GPU (device=cpu, "
                              "transformer_engine importable: False); use 'auto' or 'sdpa', got 'te'")
    # No GPU and no Transformer Engine here: a cuda DistInfo is only a value, and TE's importability is stubbed.
    monkeypatch.setattr(model, "_importable", lambda name: name == "transformer_engine")
    assert model.resolve_attention_backend(_config("auto"), _dist("cuda")) == "te"
    monkeypatch.setattr(model, "_importable", lambda name: False)
    assert model.resolve_attention_backend(_config("auto"), _dist("cuda")) == "sdpa"
    with pytest.raises(ConfigError, match=r"transformer_engine importable: False\); use 'auto' or 'sdpa'"):
        model.resolve_attention_backend(_config("te"), _dist("cuda"))


def test_config_names_the_allowed_backends_and_query_groups():
    from megatron_resilience.config import ParallelConfig, PretrainConfig

    with pytest.raises(ConfigError) as err:
        ModelConfig(attention_backend="flash")
    assert str(err.value) == "model.attention_backend: must be one of ['auto', 'sdpa', 'unfused', 'te'], got 'flash'"
    with pytest.raises(ConfigError) as err:
        ModelConfig(num_attention_heads=4, num_query_groups=3)
    assert str(err.value) == "model.num_query_groups: must divide model.num_attention_heads=4, got 3"
    with pytest.raises(ConfigError) as err:
        PretrainConfig(run_dir="/r", model=ModelConfig(hidden_size=96, num_attention_heads=12, num_query_groups=6),
                       parallel=ParallelConfig(tensor_model_parallel_size=4))
    assert str(err.value) == ("parallel.tensor_model_parallel_size: must divide model.num_query_groups=6 "
                              "or be a multiple of it, got 4")
    assert ModelConfig(num_attention_heads=8, num_query_groups=2).query_groups == 2
    assert ModelConfig(num_attention_heads=8).query_groups == 8
