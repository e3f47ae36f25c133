"""Numerics of the SDPA core attention against Megatron-Core's unfused ``DotProductAttention``, on CPU.

Run in a fresh interpreter by tests/test_attention.py (``cpu_compat`` patches torch process-wide and
Megatron's parallel state is global). Prints one JSON object: max absolute differences of outputs and
gradients per case, and the outcome of each behavioural check. Nothing is mocked except the GPU: the
``pg_collection`` stand-in below only reports a tensor-parallel size of 2 to the constructors.
"""

from __future__ import annotations

import json
import os
import types

import torch


def setup() -> None:
    from megatron.core import parallel_state, tensor_parallel

    from megatron_resilience.runtime import cpu_compat

    cpu_compat.install()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def tconfig(*, heads=8, groups=8, dtype=torch.float32, dropout=0.0, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=16 * heads, num_attention_heads=heads, num_query_groups=groups,
                             attention_dropout=dropout, hidden_dropout=0.0, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, use_cpu_initialization=True, **extra)


def modules(config, mask_type, tp_size=1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_resilience.runtime.attention import SDPAttention

    kwargs = dict(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")
    if tp_size != 1:
        kwargs["pg_collection"] = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: tp_size))
    return DotProductAttention(**kwargs), SDPAttention(**kwargs)


def qkv(config, *, seq=32, batch=2, tp_size=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, groups = config.num_attention_heads // tp_size, max(1, config.num_query_groups // tp_size)
    dim = config.kv_channels
    make = lambda n: torch.randn(seq, batch, n, dim, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return make(heads), make(groups), make(groups)


def causal_mask(seq):
    """The dataset's mask convention: [1, 1, s, s], True = masked out (future positions)."""
    return torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)[None, None]


def run(module, q, k, v, mask, mask_type=None):
    from megatron.core.transformer.enums import AttnMaskType

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask, attn_mask_type=mask_type or AttnMaskType.causal)
    out.float().pow(2).sum().backward()
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def max_diff(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    return {"out": (out_a - out_b).abs().max().item(),
            "grad": max((x - y).abs().max().item() for x, y in zip(grads_a, grads_b)),
            "scale": out_a.abs().max().item(), "grad_scale": max(g.abs().max().item() for g in grads_a)}


def numerics() -> dict:
    from megatron.core.transformer.enums import AttnMaskType

    causal, padding = AttnMaskType.causal, AttnMaskType.padding
    results = {}
    for name, cfg_kwargs, dtype, tp in (
            ("mha_fp32", dict(heads=8, groups=8), torch.float32, 1),
            ("gqa_fp32", dict(heads=8, groups=2), torch.float32, 1),
            ("mha_bf16", dict(heads=8, groups=8, dtype=torch.bfloat16), torch.bfloat16, 1),
            ("gqa_bf16", dict(heads=8, groups=2, dtype=torch.bfloat16), torch.bfloat16, 1),
            ("gqa_fp32_tp2_shard", dict(heads=8, groups=4), torch.float32, 2)):
        config = tconfig(**cfg_kwargs)
        unfused, sdpa = modules(config, causal, tp_size=tp)
        q, k, v = qkv(config, tp_size=tp, dtype=dtype)
        seq = q.size(0)
        # Unfused with the dataset's explicit mask (as before), SDPA without one (causal kernel).
        results[name] = max_diff(run(unfused, q, k, v, causal_mask(seq)), run(sdpa, q, k, v, None))
        results[name]["heads_per_partition"] = [sdpa.num_heads_per_partition, sdpa.num_groups_per_partition]
    # A non-causal layer with a padding mask (last 5 keys masked) goes through SDPA's boolean mask.
    config = tconfig(heads=4, groups=4)
    unfused, sdpa = modules(config, padding)
    q, k, v = qkv(config)
    pad = torch.zeros(2, 1, q.size(0), q.size(0), dtype=torch.bool)
    pad[..., -5:] = True
    results["padding_fp32"] = max_diff(run(unfused, q, k, v, pad, padding), run(sdpa, q, k, v, pad, padding))
    return results


def dropout_checks() -> dict:
    from megatron.core import tensor_parallel

    from megatron_resilience.runtime import cpu_compat

    _, plain = modules(tconfig(heads=4, groups=4), __import__("megatron.core.transformer.enums",
                                                              fromlist=["AttnMaskType"]).AttnMaskType.causal)
    config = tconfig(heads=4, groups=4, dropout=0.5)
    _, sdpa = modules(config, plain.attn_mask_type)
    q, k, v = qkv(config)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    reference = plain(q, k, v, None)
    saved, default_before = cpu_compat.get_rng_tracker_states(), torch.get_rng_state()
    first = sdpa(q, k, v, None)
    default_untouched = torch.equal(torch.get_rng_state(), default_before)
    tracker_advanced = not all(torch.equal(a, b) for a, b in zip(saved.values(), tracker.get_states().values()))
    second = sdpa(q, k, v, None)
    cpu_compat.set_rng_tracker_states(saved)
    replay = sdpa(q, k, v, None)
    sdpa.eval()
    evaluated = sdpa(q, k, v, None)
    return {
        "dropout_changes_output": not torch.allclose(first, reference),
        "default_rng_untouched": default_untouched,  # the draw happened inside the tracker's fork
        "tracker_advanced": tracker_advanced,
        "next_call_differs": not torch.equal(first, second),
        "replay_after_restore_equal": torch.equal(first, replay),
        "eval_has_no_dropout": (evaluated - reference).abs().max().item() < 1e-5,
    }


def refusals() -> dict:
    from megatron.core.transformer.enums import AttnMaskType

    out = {}
    for name, extra in (("window", dict(window_size=(8, 0))), ("softmax", dict(softmax_type="off-by-one"))):
        try:
            modules(tconfig(heads=4, groups=4, **extra), AttnMaskType.causal)
            out[name] = "built"
        except ValueError as err:
            out[name] = str(err)
    _, sdpa = modules(tconfig(heads=8, groups=8), AttnMaskType.causal, tp_size=2)
    q, k, v = qkv(tconfig(heads=8, groups=8))  # full heads on a TP=2 shard: a wiring error
    try:
        sdpa(q, k, v, None)
        out["wrong_heads"] = "ran"
    except ValueError as err:
        out["wrong_heads"] = str(err)
    return out


def gpt_losses() -> dict:
    """Whole GPTModel (local spec) with either core attention, identical weights: per-token losses."""
    from megatron.core.models.gpt import GPTModel

    from megatron_resilience.runtime.attention import SDPAttention
    from megatron_resilience.upstream import mcore

    config = tconfig(heads=4, groups=4)
    config.hidden_size = 64
    config.kv_channels = 16
    config.ffn_hidden_size = 256
    tokens = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(32)[None].expand(2, -1)
    losses = {}
    for name, core in (("unfused", None), ("sdpa", SDPAttention)):
        torch.manual_seed(5)
        model = GPTModel(config=config, transformer_layer_spec=mcore.local_layer_spec(
            normalization="LayerNorm", core_attention=core), vocab_size=1024, max_sequence_length=32)
        kinds = {type(m).__name__ for m in model.modules()}
        mask = causal_mask(32) if name == "unfused" else None
        losses[name] = (model(tokens, positions, mask, labels=tokens), "SDPAttention" in kinds,
                        "DotProductAttention" in kinds)
    # The unfused path without the dataset's mask (Megatron builds the causal mask itself): what runs now.
    torch.manual_seed(5)
    model = GPTModel(config=config, transformer_layer_spec=mcore.local_layer_spec(normalization="LayerNorm"),
                     vocab_size=1024, max_sequence_length=32)
    no_mask = model(tokens, positions, None, labels=tokens)
    return {
        "sdpa_vs_unfused": (losses["sdpa"][0] - losses["unfused"][0]).abs().max().item(),
        "unfused_mask_vs_none_equal": torch.equal(no_mask, losses["unfused"][0]),
        "modules": {"unfused": [losses["unfused"][1], losses["unfused"][2]],
                    "sdpa": [losses["sdpa"][1], losses["sdpa"][2]]},
        "mean_loss": losses["sdpa"][0].mean().item(),
    }


if __name__ == "__main__":
    setup()
    print(json.dumps({"numerics": numerics(), "dropout": dropout_checks(), "refusals": refusals(),
                      "gpt": gpt_losses()}))
