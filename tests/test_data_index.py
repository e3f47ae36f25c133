"""The mock dataset index is sized for the samples a run reads, and its order never depends on the run's length.

Real Megatron-Core ``MockGPTDataset`` blocks (runtime/mock_data.py), built in this process (no
distributed setup is needed for datasets). Upstream's own ``MockGPTDataset`` through the builder
indexed 1,065,473 training samples (plus as many per validation/test split) for any run at
sequence length 64; these tests pin the sizes exactly.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from megatron_resilience.config.overrides import config_from_overrides
from megatron_resilience.runtime import mock_data


def _datasets(*overrides: str, gbs: int = 8):
    from megatron_resilience.runtime import data

    config = config_from_overrides(["run_dir=/tmp/unused", *overrides])
    return data.build_datasets(config, global_batch_size=gbs)


def test_block_bounds_double_up_to_the_cap():
    assert mock_data.block_bounds(0) == []
    assert mock_data.block_bounds(1) == [(0, 256)]
    assert mock_data.block_bounds(256) == [(0, 256)]
    assert mock_data.block_bounds(257) == [(0, 256), (256, 512)]
    assert mock_data.block_bounds(240) == [(0, 256)]  # 30 steps x global batch 8
    bounds = mock_data.block_bounds(5 * 2**20)
    assert [size for _, size in bounds] == [256 * 2**k for k in range(13)] + [2**20] * 4
    assert all(a + s == b for (a, s), (b, _) in zip(bounds, bounds[1:]))  # contiguous
    assert bounds[-1][0] + bounds[-1][1] >= 5 * 2**20


def test_index_holds_what_the_run_reads(caplog):
    """30 steps x 8 + one evaluation of 2 x 8: 256 train and 256 validation samples, indices of a few hundred."""
    with caplog.at_level(logging.INFO, logger="megatron_resilience.runtime.data"):
        ds = _datasets("train.max_steps=30", "train.eval_interval=10", "train.eval_iters=2")
    assert (len(ds.train), len(ds.valid)) == (256, 256)
    assert ds.train.num_samples == 240 and ds.valid.num_samples == 16
    # GPTDataset indexes whole epochs of the block's documents: a little more than the block.
    assert 256 <= ds.train.index_samples < 512, ds.train.index_samples
    assert "data: MockGPTDataset (null tokenizer), 256 train samples, 256 validation samples " \
           "(the run reads 240 + 16)" in caplog.text


def test_long_run_index_is_at_most_about_twice_the_need():
    ds = _datasets("train.max_steps=20000")  # 160,000 samples
    assert len(ds.train) == 256 * (2**10 - 1) == 261_888
    assert 160_000 <= ds.train.index_samples < 2 * 261_888


def test_samples_do_not_depend_on_max_steps_or_batch_size():
    """What bitwise resume with a larger train.max_steps needs: global sample i is fixed."""
    short, longer = _datasets("train.max_steps=10"), _datasets("train.max_steps=300", gbs=16)
    assert len(short.train) == 256 and len(longer.train) == 256 + 512 + 1024 + 2048 + 4096
    for i in list(range(0, 80)) + [255]:
        a, b = short.train[i], longer.train[i]
        assert a.keys() == b.keys() == {"tokens", "labels", "loss_mask", "position_ids"}  # no attention mask
        assert all(np.array_equal(a[k], b[k]) for k in a), i
    # Blocks differ from each other, and validation differs from training.
    assert not np.array_equal(longer.train[0]["tokens"], longer.train[256]["tokens"])
    valid = _datasets("train.max_steps=10", "train.eval_interval=5", "train.eval_iters=1").valid
    assert not all(np.array_equal(valid[i]["tokens"], short.train[i]["tokens"]) for i in range(8))


def test_sample_shape_and_tokens_come_from_upstream_mock_documents():
    ds = _datasets("train.max_steps=2", "model.seq_length=32", "model.vocab_size=512")
    sample = ds.train[3]
    assert sample["tokens"].shape == sample["labels"].shape == (32,)
    assert np.array_equal(sample["tokens"][1:], sample["labels"][:-1])
    assert int(sample["tokens"].max()) <= 511
    with pytest.raises(IndexError, match=r"mock sample 256 outside \[0, 256\)"):
        ds.train[256]
