"""The model's shape, written into every checkpoint and compared before torch loads on a resume.

A resume with another shape (``model.hidden_size=128`` over checkpoints saved at 64) used to fail late: after
the model and the optimizer were built, with three tracebacks from the tensor loader, calling valid checkpoints
unreadable and suggesting to remove them. Each checkpoint now carries ``model_shape.json`` (the settings that
decide the shapes of its tensors, with their defaults resolved), written inside ``iter_N.tmp`` before the rename
that makes it visible (``checkpoint_layout.commit``), and the trainer compares the checkpoint it would resume
from with its own settings among its first checks, in seconds: the error names the key, both values and what to
do. A checkpoint written before this file existed is not compared (its tensors still are, at load).

Stdlib only: runs before torch is imported.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_resilience.config import ConfigError
from megatron_resilience.records.checkpoint_layout import iter_dirs

SHAPE_FILE = "model_shape.json"
# The model settings that decide a tensor's shape or which tensors exist.
KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
        "max_position_embeddings", "normalization", "position_embedding_type", "share_embeddings_and_output_weights")


def of(model: Any) -> dict[str, Any]:
    """``{key: value}`` of ``model`` (a ``ModelConfig``), defaults resolved (``ffn_hidden_size=None`` -> 4 x hidden)."""
    resolved = {key: getattr(model, key) for key in KEYS}
    if resolved["num_query_groups"] is None:
        resolved["num_query_groups"] = model.num_attention_heads
    if resolved["ffn_hidden_size"] is None:
        resolved["ffn_hidden_size"] = 4 * model.hidden_size
    if resolved["max_position_embeddings"] is None:
        resolved["max_position_embeddings"] = model.seq_length
    return resolved


def written(config: Any) -> dict[str, Any]:
    """What every checkpoint's ``model_shape.json`` holds: the shape, and the data-parallel strategy its tensors are
    sharded for (a DDP checkpoint and a torch FSDP2 one do not load into each other)."""
    return {**of(config.model), "data_parallel_strategy": config.parallel.data_parallel_strategy}


def resume_folder(checkpoint: Any) -> str | None:
    """The folder a resume reads (as ``CheckpointManager`` chooses it): the run's own ``save`` once it holds a
    checkpoint, else ``load``/``save``."""
    if checkpoint.save and checkpoint.load and iter_dirs(checkpoint.save):
        return checkpoint.save
    return checkpoint.load_dir


def check_resume(config: Any) -> None:
    """Raise ``ConfigError`` when the newest checkpoint this run would resume from has another model shape."""
    root = resume_folder(config.checkpoint)
    for step, path in reversed(iter_dirs(root) if root else []):
        try:
            with open(os.path.join(path, SHAPE_FILE), encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            continue  # written before this file existed, or damaged: the load compares its tensors
        mine = of(config.model)
        differ = [k for k in KEYS if k in saved and saved[k] != mine[k]]
        if differ:
            key = differ[0]
            others = "; also " + ", ".join(f"model.{k} ({saved[k]!r} there, {mine[k]!r} here)"
                                           for k in differ[1:]) if differ[1:] else ""
            raise ConfigError(
                f"model.{key}: must be {saved[key]!r} to resume from {path} (the model it holds), got {mine[key]!r}"
                f"{others}. To train another shape, give it its own checkpoint.save folder; the checkpoints there "
                "are valid, keep them")
        strategy = saved.get("data_parallel_strategy", "ddp")  # written before the key existed: DDP, the only one
        if strategy != config.parallel.data_parallel_strategy:
            raise ConfigError(
                f"parallel.data_parallel_strategy: must be {strategy!r} to resume from {path} (the strategy its "
                f"tensors are sharded for; moving a checkpoint between strategies is not supported), got "
                f"{config.parallel.data_parallel_strategy!r}. To train with another strategy, give it its own "
                "checkpoint.save folder; the checkpoints there are valid, keep them")
        return
