"""Training data: Megatron-Core's mock GPT dataset by default, indexed datasets when paths are given."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_resilience.config.validate import check_choice, check_int, check_types, fail

TOKENIZERS = ("null", "gpt2")


@dataclass(kw_only=True)
class DataConfig:
    # Megatron blend: ["path/prefix"] or ["0.7", "a_prefix", "0.3", "b_prefix"]; empty -> MockGPTDataset.
    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    tokenizer: str = "null"  # "null": token ids < model.vocab_size; "gpt2": vocab_file + merge_file
    vocab_file: str | None = None
    merge_file: str | None = None
    num_workers: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.data_path, str):
            self.data_path = [self.data_path]
        check_types(self, "data")
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check_int("data.num_workers", self.num_workers, minimum=0)
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts) \
                or sum(float(p) for p in parts) <= 0:
            fail("data.split", "must be three comma-separated non-negative weights like '969,30,1'", self.split)
        if self.tokenizer == "gpt2" and not (self.vocab_file and self.merge_file):
            fail("data.tokenizer", "'gpt2' needs data.vocab_file and data.merge_file", self.tokenizer)

    @property
    def is_mock(self) -> bool:
        return not self.data_path
