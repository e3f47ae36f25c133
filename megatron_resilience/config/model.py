"""GPT model shape. Plain data: the runtime turns it into a Megatron-Core ``GPTModel``."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.config._validate import check_choice, check_int, check_non_negative, fail

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(kw_only=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
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

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            check_int(f"model.{name}", getattr(self, name), minimum=1)
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
        check_non_negative("model.init_method_std", self.init_method_std)
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                fail(f"model.{name}", "must be a number in [0, 1)", value)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length
