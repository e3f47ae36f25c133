"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for Megatron-Core's local layer spec.

Megatron-Core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]``
score matrix (``baddbmm``, masked softmax, dropout, ``bmm``): on one H100 the
125M GPT shape ran 4x slower with it than a plain PyTorch GPT. Without
Transformer Engine (pip installs, laptops, many academic clusters) that was the
only choice. :class:`SDPAttention` is a drop-in ``core_attention`` submodule: same
constructor keywords and ``forward`` contract as ``DotProductAttention``
(``[s, b, heads, dim]`` in, ``[s, b, heads * dim]`` out), no parameters (so
checkpoints are interchangeable with the unfused path), and torch picks the
fused kernel (flash / memory-efficient on GPU, the flash CPU kernel on CPU).

What it keeps from ``DotProductAttention``:

- causal masking. As Transformer Engine and Megatron's fused softmax do, a
  causal layer ignores the mask tensor (``is_causal`` instead); other mask
  types apply Megatron's boolean mask (``True`` = masked out);
- grouped-query attention: ``num_query_groups`` key/value heads serve the query
  heads in ``repeat_interleave`` order, Megatron's grouping;
- tensor parallelism: heads and groups per partition from the TP group size,
  checked against the tensors it is given;
- dropout on the attention probabilities inside Megatron's CUDA RNG tracker
  fork (``model-parallel-rng``), so TP ranks draw different masks and
  checkpoints restore the stream; outside it with sequence parallelism, as upstream;
- ``softmax_scale`` (default ``1/sqrt(head dim)``). ``apply_query_key_layer_scaling``
  divides and re-multiplies by the layer number upstream (an fp16 overflow guard);
  the fused kernels accumulate in fp32, so the plain scale is used.

Refused with a clear error: context parallelism, packed sequences, attention
bias, sliding windows and non-vanilla softmax (Transformer Engine's territory).
"""

from __future__ import annotations

import math

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_resilience.upstream import mcore, pytorch


class SDPAttention(MegatronModule):
    """``core_attention`` for ``SelfAttention`` on ``scaled_dot_product_attention`` (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, **process_groups) -> None:
        super().__init__(config=config)
        unsupported = mcore.unsupported_for_sdpa(config, layer_number)
        if unsupported:
            raise ValueError(f"model.attention_backend: 'sdpa' does not support {unsupported}; "
                             "use 'te' (Transformer Engine) or 'unfused'")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = mcore.tensor_parallel_size(process_groups)
        self.num_heads_per_partition = config.num_attention_heads // tp
        # Attention hands a config with num_query_groups raised to the TP size when there are fewer groups.
        self.num_groups_per_partition = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused) -> torch.Tensor:
        """``[sq, b, np, hn]`` queries, ``[sk, b, ng, hn]`` keys/values -> ``[sq, b, np * hn]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("model.attention_backend: 'sdpa' supports neither packed sequences nor attention "
                             "bias; use 'te'")
        sq, batch, heads, dim = query.shape
        groups = key.size(2)
        if heads != self.num_heads_per_partition or groups != self.num_groups_per_partition:
            raise ValueError(f"SDPAttention: got {heads} query / {groups} key-value heads on this tensor-parallel "
                             f"rank, expected {self.num_heads_per_partition} / {self.num_groups_per_partition}")
        # [s, b, h, d] -> [b, h, s, d]: views; the kernels take strided inputs with a contiguous last dimension.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if groups != heads and not pytorch.sdpa_has_gqa():
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        mask, causal = self._mask(attention_mask, attn_mask_type or self.attn_mask_type, sq, k.size(2), q.device)
        dropout = self.dropout_p if self.training else 0.0
        kwargs = {"enable_gqa": True} if k.size(1) != heads else {}

        def attend() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale, **kwargs)

        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, h, sq, d] -> [sq, b, h * d]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * dim)

    @staticmethod
    def _mask(attention_mask, mask_type, sq: int, sk: int, device) -> tuple[torch.Tensor | None, bool]:
        """(SDPA's boolean ``attn_mask`` where True = attend, ``is_causal``) for Megatron's mask conventions."""
        if mask_type == AttnMaskType.causal:
            if sq == sk:
                return None, True
            # Fewer queries than keys (decoding with a cache): the queries are the last sq positions.
            return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq), False
        if attention_mask is None:
            return None, False
        return ~attention_mask, False
