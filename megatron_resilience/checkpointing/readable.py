"""Which checkpoints under a save folder a resume can read: what dist_checkpointing writes last is there and the
common state names the step the folder's name says.

The names and the layout are ``records.checkpoint_layout``'s (stdlib only, read by every room); this check opens
dist_checkpointing's metadata, so it needs megatron-core and lives on the compute node.
"""

from __future__ import annotations

import logging
import os

from megatron_resilience.records.checkpoint_layout import TMP_RE, iter_dirs

log = logging.getLogger(__name__)


def why_incomplete(path: str, step: int) -> str | None:
    """Why ``path`` cannot be a complete checkpoint of ``step``; None when it looks complete.

    Checks what dist_checkpointing writes last (``metadata.json``, and the
    torch_dist ``.metadata`` index) and reads the small common state (step,
    scheduler, data position), so a truncated or foreign directory is caught
    before any rank starts loading tensors from it.
    """
    from megatron.core.dist_checkpointing.core import maybe_load_config
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        config = maybe_load_config(path)
    except Exception as err:  # noqa: BLE001 - any parse error means "not readable"
        return f"unreadable metadata.json ({type(err).__name__}: {err})"
    if config is None:
        return "no metadata.json (the save did not finish)"
    has_index = os.path.exists(os.path.join(path, ".metadata"))  # DCP's index: torch_dist and fsdp_dtensor
    if config.sharded_backend in ("torch_dist", "fsdp_dtensor") and not has_index:
        return "no .metadata index (the save did not finish)"
    try:  # megatron-core >= 0.17 reads it from the torch_dist shards: a damaged one raises CheckpointException
        common = load_common(path, config.sharded_backend)
    except (Exception, CheckpointException) as err:  # noqa: BLE001
        return f"unreadable common state ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    saved_step = common.get("step") if isinstance(common, dict) else None
    if saved_step != step:
        return f"holds step {saved_step!r}, expected {step}"
    return None


def load_common(path: str, sharded_backend: str | None = None) -> dict:
    """The common state (step, scheduler, data position, layout) of the checkpoint in ``path``: dist_checkpointing's
    ``load_common_state_dict`` for torch_dist, ``common.pt`` for fsdp_dtensor (``fsdp_dtensor.py``; megatron-core
    has no loading strategy named after that backend)."""
    from megatron.core import dist_checkpointing

    if sharded_backend is None:
        from megatron.core.dist_checkpointing.core import maybe_load_config

        config = maybe_load_config(path)
        sharded_backend = None if config is None else config.sharded_backend
    if sharded_backend == "fsdp_dtensor":
        import torch

        return torch.load(os.path.join(path, "common.pt"), map_location="cpu", weights_only=True)
    return dist_checkpointing.load_common_state_dict(path)


def complete_checkpoints(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root``, newest first; warns about each one skipped."""
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if TMP_RE.match(name):
            log.warning("checkpoint: skipping %s: a save that never finished (cut off mid-write)",
                        os.path.join(root, name))
    steps = []
    for step, path in reversed(iter_dirs(root)):
        reason = why_incomplete(path, step)
        if reason is None:
            steps.append(step)
        else:
            log.warning("checkpoint: skipping %s: %s", path, reason)
    return steps
