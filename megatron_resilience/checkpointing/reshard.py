"""Resuming a checkpoint at another data-parallel size: what may change between attempts, what may not.

When a node is lost and no spare exists, the next attempt (or the next in-job cycle of an elastic
ft_launcher) runs on fewer ranks; when nodes return, on more. Tensor and pipeline parallel sizes are the
model's shape on the ranks and stay fixed; the data-parallel size (DP) is what the ranks allow. Megatron-Core's
distributed checkpointing re-shards model and optimizer over the data-parallel ranks at load: model tensors
are global shards keyed by TP/PP position, and the distributed optimizer's ``dp_reshardable`` format
stores each bucket without its padding to a DP multiple (``checkpoint_state.SHARDING_METADATA``), so DP=4
state loads bitwise at DP=2 or DP=1 and back.

The training stays the same when the global batch does: the sample order depends only on
``consumed_samples`` and the global batch (``runtime/data.py``), each rank takes more or fewer
micro-batches (global batch / (micro batch x DP)), and the learning-rate schedule and step count continue.
Only the order in which gradients are summed changes (an all-reduce over more ranks vs accumulation over
more micro-batches), so losses agree with an uninterrupted run up to float rounding, not bitwise (and with
dropout on, the per-rank dropout draws differ, as the RNG states of another world size are not restored).

A checkpoint records the layout it was written with (``layout`` in its common state, since this module);
:func:`check_resume` compares it with this job's before any tensor is read:

* another TP or PP size: refused (only DP may change), naming both layouts;
* another DP with ``train.global_batch_size`` unset: the global batch would silently follow the DP size
  (micro batch x DP), which is another training: refused, naming both sizes and the value to set; when the
  new DP does not divide the checkpoint's global batch (micro batch x DP must divide it), setting it would
  fail too, so the refusal names both DP sizes and the data-parallel sizes that can continue it instead;
* another DP with the global batch kept: logged (what changes per rank);
* an explicitly different ``train.global_batch_size``: the user's choice, logged as a warning.

What the job's size alone rules out (fewer ranks than one TP x PP replica, a DP that does not divide the
global batch set) fails earlier, in ``PretrainConfig.validate_world_size``, before torch loads and without the
checkpoint: that message names the job's DP and the global batch, not the checkpoint's DP.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_resilience.config import ConfigError

log = logging.getLogger(__name__)

LAYOUT_KEY = "layout"  # in the checkpoint's common state
FIELDS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
          "global_batch_size", "micro_batch_size")


class ReshardError(ConfigError):
    """A checkpoint cannot be resumed with this job's layout; raised on every rank before any tensor is read."""


def layout(*, world_size: int, tp: int, pp: int, dp: int, global_batch_size: int,
           micro_batch_size: int) -> dict[str, int]:
    return dict(zip(FIELDS, (world_size, tp, pp, dp, global_batch_size, micro_batch_size)))


def describe(lay: dict[str, Any]) -> str:
    """``TP=2 x PP=1 x DP=2 (4 ranks), global batch 16 = 2 micro-batches x 4 x DP 2``."""
    gbs, mbs, dp = lay.get("global_batch_size"), lay.get("micro_batch_size"), lay["data_parallel_size"]
    batch = f", global batch {gbs} = {gbs // (mbs * dp)} micro-batches x {mbs} x DP {dp}" if gbs and mbs else ""
    return (f"TP={lay['tensor_model_parallel_size']} x PP={lay['pipeline_model_parallel_size']} x DP={dp} "
            f"({lay['world_size']} ranks){batch}")


def check_resume(saved: dict[str, Any] | None, path: str, *, current: dict[str, Any], global_batch_explicit: bool,
                 announce: bool = True) -> str | None:
    """Refuse (``ReshardError``) or describe resuming the checkpoint at ``path`` with the layout ``current``.

    ``saved`` is the checkpoint's ``layout`` (None for checkpoints written before it existed: nothing is
    checked). Returns the log line for a change of DP size, else None; ``announce`` (rank 0) logs what changes.
    """
    if not saved:
        return None
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    if any(saved.get(k) != current[k] for k in keys):
        raise ReshardError(
            f"parallel: the checkpoint {path} was written with {describe(saved)}; this job has {describe(current)}. "
            "Only the data-parallel size may change when resuming: set parallel.tensor_model_parallel_size="
            f"{saved.get('tensor_model_parallel_size')} and parallel.pipeline_model_parallel_size="
            f"{saved.get('pipeline_model_parallel_size')}, or start from another checkpoint (checkpoint.load)")
    saved_gbs, gbs = saved.get("global_batch_size"), current["global_batch_size"]
    dp_changed = saved.get("data_parallel_size") != current["data_parallel_size"]
    if saved_gbs is not None and saved_gbs != gbs:
        if not global_batch_explicit:
            _check_dp_divides(saved, path, current)
            raise ReshardError(
                f"train.global_batch_size: the checkpoint {path} was written with {describe(saved)}; unset, the "
                f"global batch follows this job's size and would be {gbs} ({describe(current)}), another training. "
                f"Set train.global_batch_size={saved_gbs} to continue the same training at DP="
                f"{current['data_parallel_size']} (or set the new size explicitly)")
        if announce:
            log.warning("checkpoint: global batch %d -> %d (train.global_batch_size set to another size than the "
                        "checkpoint's): the training continues with the new batch size", saved_gbs, gbs)
    if not dp_changed:
        return None
    line = (f"checkpoint: resuming {path}, written with {describe(saved)}, with {describe(current)}: model and "
            f"optimizer re-sharded over {current['data_parallel_size']} data-parallel rank(s)")
    if announce:
        log.info("%s", line)
    return line


def _check_dp_divides(saved: dict[str, Any], path: str, current: dict[str, Any]) -> None:
    """Refuse, naming both DP sizes, a resume whose DP cannot carry the checkpoint's global batch at all.

    Only reachable with ``train.global_batch_size`` unset (an explicit one was checked against this DP before
    torch loaded): then the refusal below would advise setting the checkpoint's global batch, which this DP
    does not divide, and the user would meet a second refusal that no longer names the checkpoint's DP.
    """
    saved_gbs, mbs, dp = saved["global_batch_size"], current["micro_batch_size"], current["data_parallel_size"]
    if saved_gbs % (mbs * dp) == 0:
        return
    fits = [d for d in range(1, saved_gbs // mbs + 1) if saved_gbs % (mbs * d) == 0]
    raise ReshardError(
        f"train.global_batch_size: the checkpoint {path} was written with {describe(saved)}; this job's data-parallel "
        f"size {dp} (TP={current['tensor_model_parallel_size']} x PP={current['pipeline_model_parallel_size']} x "
        f"DP={dp}, {current['world_size']} ranks) cannot continue its global batch {saved_gbs}: it is not a multiple "
        f"of train.micro_batch_size * data-parallel size = {mbs} * {dp} = {mbs * dp}. Data-parallel sizes that can, "
        f"with train.micro_batch_size={mbs}: {fits or 'none'} (run on a node count that gives one); or set "
        f"train.global_batch_size to a multiple of {mbs * dp} (another training)")
