"""GPT model shape. Plain data: the runtime turns it into a Megatron-Core ``GPTModel``."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.config.validate import (
    check_below_one,
    check_choice,
    check_int,
    check_non_negative,
    check_types,
    fail,
)

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
PRECISIONS = ("fp32", "bf16", "fp16")
# Core attention: "te" Transformer Engine's layer spec; "sdpa" Megatron-Core's local spec with
# torch.nn.functional.scaled_dot_product_attention; "unfused" the local spec as upstream ships it
# (score matrix, masked softmax); "auto" te when Transformer Engine imports on a GPU, else sdpa.
ATTENTION_BACKENDS = ("auto", "sdpa", "unfused", "te")


@dataclass(kw_only=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # key/value heads (grouped-query attention); None -> num_attention_heads
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size
    vocab_size: int = 1024
    seq_length: int = 64
    max_position_embeddings: int | None = None  # None -> seq_length
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    share_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    precision: str = "fp32"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        check_types(self, "model")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            check_int(f"model.{name}", getattr(self, name), minimum=1)
        check_int("model.num_query_groups", self.num_query_groups, minimum=1, allow_none=True)
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            fail("model.num_query_groups", f"must divide model.num_attention_heads={self.num_attention_heads}",
                 self.num_query_groups)
        check_int("model.ffn_hidden_size", self.ffn_hidden_size, minimum=1, allow_none=True)
        check_int("model.max_position_embeddings", self.max_position_embeddings, minimum=1, allow_none=True)
        if self.hidden_size % self.num_attention_heads:
            fail(
                "model.hidden_size",
                f"must be divisible by model.num_attention_heads={self.num_attention_heads}",
                self.hidden_size,
            )
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            fail("model.max_position_embeddings", f"must be >= model.seq_length={self.seq_length}",
                 self.max_position_embeddings)
        check_choice("model.normalization", self.normalization, NORMALIZATIONS)
        check_choice("model.position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        check_choice("model.precision", self.precision, PRECISIONS)
        check_choice("model.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_non_negative("model.init_method_std", self.init_method_std)
        for name in ("hidden_dropout", "attention_dropout"):
            check_below_one(f"model.{name}", getattr(self, name))

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length
