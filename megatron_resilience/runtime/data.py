"""GPT training data and a batch order that resumes exactly from ``consumed_samples``.

Datasets come from Megatron-Core: ``GPTDataset`` over indexed ``.bin/.idx``
files through ``BlendedMegatronDatasetBuilder``, or, when ``data.data_path`` is
empty, ``MockGPTDataset`` blocks indexed for the samples the run reads
(:mod:`~megatron_resilience.runtime.mock_data`). Megatron-Core has no sampler, so
:class:`GlobalBatchSampler` fixes the order: global sample ``i`` is always the
same dataset index, a step consumes ``global_batch_size`` consecutive samples,
and each data-parallel rank takes its ``micro_batch_size`` slice of every
``micro_batch_size * dp`` chunk (Megatron-LM's layout). Resuming therefore needs
only ``TrainState.consumed_samples``.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from megatron_resilience.config import ConfigError, PretrainConfig

log = logging.getLogger(__name__)


class VocabFileTokenizer:
    """The two facts the GPT dataset needs from a GPT-2 tokenizer: vocabulary size and end-of-document id.

    Indexed datasets are already tokenized, so reading ``vocab.json`` suffices
    (no HuggingFace dependency on compute nodes).
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if "<|endoftext|>" not in vocab:
            raise ConfigError(f"data.vocab_file: no '<|endoftext|>' token in {vocab_file!r}")
        self.vocab_size = len(vocab)
        self.eod = vocab["<|endoftext|>"]
        self.pad = self.eod
        self.unique_identifiers = OrderedDict(
            {"class": "megatron_resilience.gpt2", "vocab_file": vocab_file, "merge_file": merge_file})


def build_tokenizer(config: PretrainConfig):
    d, m = config.data, config.model
    if d.tokenizer == "gpt2":
        tok = VocabFileTokenizer(d.vocab_file, d.merge_file)
        if tok.vocab_size > m.vocab_size:
            raise ConfigError(f"model.vocab_size: must be >= the tokenizer's {tok.vocab_size} tokens, "
                              f"got {m.vocab_size}")
        return tok
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(m.vocab_size - 1)  # ids 0..vocab-2, end-of-document = vocab-1


@dataclass(kw_only=True)
class Datasets:
    train: Any
    valid: Any | None


def needed_samples(config: PretrainConfig, *, global_batch_size: int) -> tuple[int, int]:
    """(train, validation) samples the run reads: ``max_steps`` global batches, ``eval_iters`` per evaluation.

    Every evaluation reads the same batches from validation sample 0, so one evaluation's worth suffices.
    """
    t = config.train
    return t.max_steps * global_batch_size, (t.eval_iters * global_batch_size if t.eval_interval else 0)


def _dataset_config(config: PretrainConfig, *, random_seed: int):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    d = config.data
    return GPTDatasetConfig(
        random_seed=random_seed,
        sequence_length=config.model.seq_length,
        blend=None if d.is_mock else get_blend_from_list(d.data_path),
        split=d.split,
        path_to_cache=d.cache_dir,
        tokenizer=build_tokenizer(config),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # Plain causal masks: every attention backend builds the mask itself (sdpa/TE: the causal kernel;
        # unfused: Megatron's cached default mask, the same values), so batches carry no [b, 1, s, s] tensor.
        create_attention_mask=False,
    )


def build_datasets(config: PretrainConfig, *, global_batch_size: int) -> Datasets:
    """Train (and validation when evaluating) datasets sized for the whole run. Call on every rank.

    Indexed data: Megatron-Core's ``GPTDataset`` through ``BlendedMegatronDatasetBuilder`` with the
    run's sample counts (its index covers whole epochs of the corpus; cached in ``data.cache_dir``).
    Mock data: :class:`~megatron_resilience.runtime.mock_data.RunSizedMockData` (see there).
    """
    d = config.data
    train_samples, valid_samples = needed_samples(config, global_batch_size=global_batch_size)
    if d.is_mock:
        from megatron_resilience.runtime.mock_data import RunSizedMockData

        ds_config = _dataset_config(config, random_seed=config.train.seed)
        train = RunSizedMockData(ds_config, num_samples=train_samples, stream=0)
        valid = RunSizedMockData(ds_config, num_samples=valid_samples, stream=1) if valid_samples else None
        name = "MockGPTDataset"
    else:
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset

        ds_config = _dataset_config(config, random_seed=config.train.seed)
        # Built on every rank (tiny index files; no cross-rank caching protocol needed).
        train, valid, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [train_samples, valid_samples or None, None], lambda: True, ds_config).build()
        name = "GPTDataset"
    if train is None or len(train) == 0:
        raise ConfigError(f"data.split: gives no training samples for data.data_path={d.data_path}")
    if valid_samples and (valid is None or len(valid) == 0):
        raise ConfigError("data.split: gives no validation samples but "
                          f"train.eval_interval={config.train.eval_interval}")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        log.info("data: %s (%s tokenizer), %d train samples%s (the run reads %d%s)", name, d.tokenizer, len(train),
                 f", {len(valid)} validation samples" if valid_samples else "", train_samples,
                 f" + {valid_samples}" if valid_samples else "")
    return Datasets(train=train, valid=valid if valid_samples else None)


class GlobalBatchSampler:
    """Deterministic micro-batches of dataset indices for one data-parallel rank.

    Starts at ``consumed_samples``; wraps around the dataset if it is shorter than the run.
    """

    def __init__(self, *, dataset_len: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> None:
        self.dataset_len = dataset_len
        self.position = consumed_samples  # global samples consumed so far
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        start = self.position + self.dp_rank * self.micro_batch_size
        self.position += self.micro_batch_size * self.dp_size
        return [(start + j) % self.dataset_len for j in range(self.micro_batch_size)]


class MicroBatchIterator:
    """Yields collated micro-batches (dict of tensors) on ``device`` in sampler order.

    With ``num_workers > 0`` a ``torch.utils.data.DataLoader`` reads ahead in worker processes
    (same order: the sampler fixes it); ``worker_init_fn`` runs in each worker.
    """

    def __init__(self, dataset: Any, sampler: GlobalBatchSampler, device: torch.device, *,
                 num_workers: int = 0, worker_init_fn: Callable[[int], None] | None = None) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self._loader = None
        if num_workers > 0:
            self._loader = iter(torch.utils.data.DataLoader(
                dataset, batch_sampler=sampler, num_workers=num_workers, worker_init_fn=worker_init_fn,
                pin_memory=device.type == "cuda", collate_fn=torch.utils.data.default_collate))

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._loader is not None:
            batch = next(self._loader)
        else:
            batch = torch.utils.data.default_collate([self.dataset[i] for i in next(self.sampler)])
        if self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch


def _iterator(dataset: Any, config: PretrainConfig, *, consumed_samples: int, device: torch.device,
              worker_init_fn: Callable[[int], None] | None):
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import RerunDataIterator

    sampler = GlobalBatchSampler(
        dataset_len=len(dataset), consumed_samples=consumed_samples, micro_batch_size=config.train.micro_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(), dp_size=parallel_state.get_data_parallel_world_size())
    return RerunDataIterator(MicroBatchIterator(dataset, sampler, device, num_workers=config.data.num_workers,
                                                worker_init_fn=worker_init_fn))


def train_iterator(datasets: Datasets, config: PretrainConfig, *, consumed_samples: int, device: torch.device,
                   worker_init_fn: Callable[[int], None] | None = None):
    """The training iterator from ``consumed_samples``, wrapped for the rerun state machine's replay."""
    return _iterator(datasets.train, config, consumed_samples=consumed_samples, device=device,
                     worker_init_fn=worker_init_fn)


def valid_iterator(datasets: Datasets, config: PretrainConfig, *, device: torch.device,
                   worker_init_fn: Callable[[int], None] | None = None):
    """A fresh validation iterator from sample 0: every evaluation sees the same batches (comparable losses)."""
    if datasets.valid is None:
        return None
    return _iterator(datasets.valid, config, consumed_samples=0, device=device, worker_init_fn=worker_init_fn)
