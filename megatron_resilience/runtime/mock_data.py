"""Mock GPT data indexed for the samples a run reads, with an order that does not depend on the run's length.

Megatron-Core's ``MockGPTDataset`` always draws 100,000 mock documents (and, through
``BlendedMegatronDatasetBuilder``, a train, a validation and a test split of a third
each); ``GPTDataset`` indexes whole epochs, so a 30-step run at sequence length 64
built an index of 1,065,473 samples per split, seconds of every (re)start.

:class:`RunSizedMockData` builds only what the run reads, out of blocks of upstream
``MockGPTDataset`` (``GPTDataset`` indexing, shuffling and sample layout unchanged),
each over its own small set of mock documents:

- block ``k`` holds global samples ``[start_k, start_k + size_k)``; sizes double from
  256 samples up to 2**20 (``block_bounds``), so the index is at most about twice what
  the run reads (and at most 2**20 samples more for long runs);
- a block's contents depend only on its number, the seed and the sequence length, never on
  ``train.max_steps``: a run resumed with a larger ``max_steps`` (or a different global
  batch) reads exactly the samples an uninterrupted run reads, which bitwise resume needs.
  (One upstream ``GPTDataset`` sized for the run would reshuffle everything when its size changes.)
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
from typing import Any

import numpy as np

FIRST_BLOCK_SAMPLES = 256
MAX_BLOCK_SAMPLES = 1 << 20
_MEAN_DOCUMENT_TOKENS = 2048  # upstream mock documents are uniform in [1, 4095] tokens
_STREAM_SEEDS = 1 << 16  # document seeds: block k of stream s uses s * _STREAM_SEEDS + k


def block_bounds(num_samples: int) -> list[tuple[int, int]]:
    """``[(start, size), ...]`` of the blocks covering samples ``[0, num_samples)``."""
    bounds, start, size = [], 0, FIRST_BLOCK_SAMPLES
    while start < num_samples:
        bounds.append((start, size))
        start += size
        size = min(2 * size, MAX_BLOCK_SAMPLES)
    return bounds


def _documents_for(samples: int, seq_length: int) -> int:
    """Mock documents that usually fill one epoch of ``samples`` sequences (GPTDataset adds epochs if not)."""
    return math.ceil(1.25 * samples * (seq_length + 1) / _MEAN_DOCUMENT_TOKENS) + 2


def _mock_documents(tokenizer: Any, *, num_documents: int, seed: int):
    """Upstream's mock documents (counting sequences ended by end-of-document), ``num_documents`` of them."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    class Documents(MockGPTLowLevelDataset):
        size = num_documents  # upstream hard-codes 100,000 here

    Documents.seed = seed
    return Documents(tokenizer)


@contextlib.contextmanager
def _no_cache_warnings():
    """Mock indices are never cached (they take milliseconds): mute upstream's per-block "Unable to save" warning."""
    logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class RunSizedMockData:
    """Global sample ``i`` of the mock stream, for ``i < len(self)`` (at least ``num_samples``)."""

    def __init__(self, ds_config: Any, *, num_samples: int, stream: int) -> None:
        from megatron.core.datasets.gpt_dataset import MockGPTDataset
        from megatron.core.datasets.utils import Split

        self.num_samples = num_samples
        self.starts: list[int] = []
        self.blocks: list[Any] = []
        bounds = block_bounds(num_samples)
        for k, (start, size) in enumerate(bounds):
            documents = _mock_documents(ds_config.tokenizer, seed=stream * _STREAM_SEEDS + k,
                                        num_documents=_documents_for(size, ds_config.sequence_length))
            with _no_cache_warnings():
                block = MockGPTDataset(documents, None, np.arange(len(documents), dtype=np.int32), size,
                                       Split.train if stream == 0 else Split.valid, ds_config)
            self.starts.append(start)
            self.blocks.append(block)
        self._end = bounds[-1][0] + bounds[-1][1] if bounds else 0

    def __len__(self) -> int:
        return self._end

    @property
    def index_samples(self) -> int:
        """Samples indexed by the blocks' ``GPTDataset`` indices (whole epochs of their documents)."""
        return sum(len(block) for block in self.blocks)

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self._end:
            raise IndexError(f"mock sample {idx} outside [0, {self._end})")
        k = bisect.bisect_right(self.starts, idx) - 1
        return self.blocks[k][idx - self.starts[k]]
