"""Megatron-LM's ``throughput`` scalar: model TFLOP/s per GPU, from the model's shape and the trainer's tokens/s.

Megatron-LM writes ``throughput`` = ``num_floating_point_operations(args, batch_size)`` / (seconds per iteration
x 10^12 x world size) (``megatron/training/training.py``), a figure users compare across runs and clusters, so
the same count is used here. For the models this trainer builds (dense GPT: multi-head or grouped-query
attention with ``kv_channels = hidden / heads``, a GELU MLP; no SwiGLU, MoE, MTP or MLA; causal attention over
full-length sequences) that function reduces to, per token (l layers, h hidden, f FFN, s sequence, g query
groups of n heads, v vocabulary)::

    l * (12 h f  +  12 h (h + h g / n)  +  6 h s)  +  6 h v
         MLP        QKV and output        core attention (causal: half the s x s scores)   logits

(the 12 and 6 are 3 GEMMs per matmul, forward and two backward, x 2 FLOPs per multiply-add; checked against
the function megatron-core 0.19.2 ships, for MHA and GQA shapes). Per token, because the trainer records the
global tokens/s (global batch x sequence / step time): FLOPs per iteration / seconds per iteration = FLOPs per
token x tokens/s. Megatron-LM counts its padded vocabulary, the width of its output layer; this trainer's output
layer is ``model.vocab_size`` wide (no padding), and that is what is counted. Megatron-LM releases before the
causal halving count the core attention in full (12 h s per layer), a slightly higher figure for the same run.
"""

from __future__ import annotations

from typing import Any


def flops_per_token(model: Any) -> float:
    """Training FLOPs per token of a :class:`~megatron_resilience.config.ModelConfig` (Megatron-LM's count)."""
    h, layers = model.hidden_size, model.num_layers
    kv = h // model.num_attention_heads * model.query_groups  # key (and value) projection width
    per_layer = 12 * h * model.ffn_size + 12 * h * (h + kv) + 6 * h * model.seq_length
    return float(layers * per_layer + 6 * h * model.vocab_size)


def tflops_per_gpu(per_token: float, tokens_per_s: float, world_size: int) -> float:
    """Megatron-LM's ``throughput``: model TFLOP/s per GPU (per rank: one GPU each)."""
    return per_token * tokens_per_s / (1e12 * world_size)
