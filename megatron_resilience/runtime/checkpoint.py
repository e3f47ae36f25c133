"""Atomic, resumable checkpoints with Megatron-Core ``dist_checkpointing``.

The training loop uses one :class:`CheckpointManager`::

    ckpt = CheckpointManager(config.checkpoint, run_dir=config.run_dir)
    ckpt.load_latest(state)                # resume: newest complete checkpoint, or start fresh
    ...
    if ckpt.should_save(state.step):
        ckpt.save(state)                   # sync, or async with visibility at finalisation
    ckpt.finalize()                        # before exit: wait for pending async saves

Why the care: a job can die at any instant (preemption, a killed rank, a wall
time limit), including in the middle of a save. A save therefore writes
``iter_N.tmp``, all ranks finish and meet at a barrier, and only then rank 0
renames it to ``iter_N`` and rewrites the tracker file (see
:mod:`checkpoint_layout`). Resume never trusts the tracker alone: it scans the
``iter_*`` directories, checks each one, skips incomplete or unreadable ones
with a warning naming them, and falls back to the previous complete one; rank
0 decides and broadcasts, so all ranks load the same checkpoint.

Async saves (``checkpoint.async_save``) use dist_checkpointing's
``AsyncCallsQueue`` with a forked (temporal) writer: the forked child starts in
milliseconds and inherits this process's state (including the CPU compatibility
patches), whereas the persistent worker is a *spawned* interpreter that
re-imports torch on the first save (5-6 s) and calls ``torch.cuda.set_device``,
which fails on CPU. Tensors are staged to host memory before the fork, so
training may modify parameters right away. The rename and tracker update run
as the request's finalisation, on every rank, when the write has finished
everywhere: at the next save, :meth:`maybe_finalize` or :meth:`finalize`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import traceback
from typing import Any

import torch

from megatron_resilience import upstream
from megatron_resilience.config import CheckpointConfig
from megatron_resilience.runtime import checkpoint_layout as layout
from megatron_resilience.runtime import checkpoint_state
from megatron_resilience.runtime.checkpoint_layout import atomic_write_text  # noqa: F401  (public re-export)
from megatron_resilience.runtime.state import TrainState

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "atomic_write_text"]


class _Prewarm:
    """dist_checkpointing's first save starts a helper process (~3 s): start it once per process, in the
    background, when the first saving manager is created, so it overlaps with model and data setup."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-writer-prewarm", daemon=True)
                self._thread.start()
                # A process that fails during setup exits while the thread may still be starting the Manager:
                # multiprocessing's exit handler would then wait forever for a Manager whose shutdown was not
                # registered yet. Registered after multiprocessing's, this handler runs before it.
                atexit.register(self._join_at_exit)

    def _join_at_exit(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=120)

    @staticmethod
    def _run() -> None:
        try:
            upstream.prewarm_checkpoint_writer()
        except Exception:  # noqa: BLE001 - e.g. the process exits during setup; the first save retries
            log.debug("checkpoint: writer prewarm failed", exc_info=True)

    def join(self) -> float:
        """Wait until the writer is ready; returns the seconds waited."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        return time.perf_counter() - start


_PREWARM = _Prewarm()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (the one place where all ranks agree on a decision)."""
    holder = [obj]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (NCCL needs the flag on the GPU, gloo on the CPU)."""
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


class CheckpointManager:
    """Saves and restores a :class:`TrainState`; every method is collective (call it on all ranks)."""

    def __init__(self, config: CheckpointConfig, *, run_dir: str) -> None:
        self.config = config
        self.run_dir = run_dir
        self._latest_step: int | None = None
        self._async_queue = None  # megatron AsyncCallsQueue, created on the first async save
        self._pending: list[tuple[int, str, float]] = []  # (step, tmp path, start time) of unfinalised saves
        self.last_save_seconds: float | None = None  # blocking time of the last save() call
        self.last_load_seconds: float | None = None
        if config.save is not None:
            _PREWARM.start()

    # --- public API -------------------------------------------------------------------------------------------

    @property
    def latest_step(self) -> int | None:
        """The step of the newest checkpoint this run loaded or committed (None before either)."""
        return self._latest_step

    def should_save(self, step: int) -> bool:
        interval = self.config.save_interval
        return self.config.save is not None and interval is not None and step > 0 and step % interval == 0

    def load_latest(self, state: TrainState) -> bool:
        """Restore ``state`` in place from the newest complete checkpoint; False when there is none."""
        root = self.config.load_dir
        if root is None:
            return False
        start = time.perf_counter()
        candidates = layout.complete_checkpoints(root) if _rank() == 0 else None
        candidates = _broadcast_object(candidates)
        if not candidates:
            if _rank() == 0:  # an explicit checkpoint.load with nothing in it is likely a mistake: say so louder
                log.log(logging.WARNING if self.config.load else logging.INFO,
                        "checkpoint: no complete checkpoint under %s; starting from step 0", root)
            return False
        for step in candidates:
            path = os.path.join(root, layout.iter_dir_name(step))
            error, rerun_state = self._try_load(state, path)
            if _all_ok(error is None):
                checkpoint_state.restore_rerun_state(rerun_state)
                self._latest_step = step
                self.last_load_seconds = time.perf_counter() - start
                if _rank() == 0:
                    log.info("checkpoint: resumed from %s (step %d, consumed_samples %d) in %.3f s",
                             path, state.step, state.consumed_samples, self.last_load_seconds)
                    tracked = layout.read_tracker(root)
                    if tracked != step:  # the tracker is a hint: a crash after the rename, or a damaged directory
                        log.warning("checkpoint: %s says %s but the newest loadable checkpoint is %s",
                                    os.path.join(root, layout.TRACKER_FILE), tracked, layout.iter_dir_name(step))
                return True
            if error is not None:
                log.warning("checkpoint: rank %d could not load %s: %s", _rank(), path, error)
            if _rank() == 0:
                log.warning("checkpoint: skipping %s (unreadable on at least one rank); trying the previous one", path)
        raise RuntimeError(
            f"checkpoint: none of the checkpoints under {root} could be loaded "
            f"(tried {[layout.iter_dir_name(s) for s in candidates]}); the model may be partly overwritten, "
            "so training does not start from scratch silently. Remove or fix them, or set checkpoint.load."
        )

    def save(self, state: TrainState) -> None:
        """Write a checkpoint of ``state``; visible (renamed + tracker) when complete on every rank."""
        if self.config.save is None:
            return
        start = time.perf_counter()
        waited = _PREWARM.join()  # the writer's queue is shared by the process: the prewarm must not race a save
        if waited > 0.5 and _rank() == 0:
            log.info("checkpoint: waited %.1f s for dist_checkpointing's writer process to start", waited)
        self.maybe_finalize(blocking=True)  # one save in flight at a time: its tmp dir and ours never race
        from megatron.core import dist_checkpointing

        root, step = self.config.save, state.step
        tmp = os.path.join(root, layout.iter_dir_name(step) + layout.TMP_SUFFIX)
        if _rank() == 0:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(tmp):
                layout.remove_stale_tmp(root)
            os.makedirs(tmp)
        torch.distributed.barrier()
        sharded = checkpoint_state.build_sharded_state_dict(state, is_loading=False)
        request = dist_checkpointing.save(
            sharded, tmp, sharded_strategy=self._save_strategy(),
            async_sharded_save=self.config.async_save, content_metadata=checkpoint_state.content_metadata(),
        )
        if request is None:
            self._commit(step, tmp, start)
        else:
            request.add_finalize_fn(lambda: self._commit(step, tmp, start))
            self._queue().schedule_async_request(request)
            self._pending.append((step, tmp, start))
        self.last_save_seconds = time.perf_counter() - start
        if _rank() == 0 and request is not None:  # a sync save already logged "committed ..."
            log.info("checkpoint: scheduled async save of step %d in %.3f s", step, self.last_save_seconds)

    def maybe_finalize(self, *, blocking: bool = False) -> list[int]:
        """Commit async saves whose writes finished on all ranks; returns their steps. Collective."""
        if self._async_queue is None or not self._pending:
            return []
        done = self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        steps = [self._pending.pop(0)[0] for _ in done]
        return steps

    def finalize(self) -> None:
        """Wait for pending async saves and commit them (call before the process exits)."""
        self.maybe_finalize(blocking=True)
        if self._async_queue is not None:
            self._async_queue.close()
            self._async_queue = None

    # --- internals --------------------------------------------------------------------------------------------

    def _save_strategy(self):
        """torch_dist, with saving of replicated shards spread over the data-parallel ranks."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = get_default_save_sharded_strategy("torch_dist")
        if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        return strategy

    def _queue(self):
        if self._async_queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = AsyncCallsQueue(persistent=False)  # forked writer; see module docstring
        return self._async_queue

    def _commit(self, step: int, tmp: str, start: float) -> None:
        """Every rank has written its part of ``tmp``: rank 0 publishes it, then everyone continues."""
        torch.distributed.barrier()
        root = self.config.save
        if _rank() == 0:
            final = layout.commit(root, tmp, step)
            layout.remove_stale_tmp(root)
            if self.config.keep_last_n is not None:
                layout.apply_retention(root, self.config.keep_last_n, just_saved=step)
            log.info("checkpoint: committed %s (%.3f s after the save started)", final, time.perf_counter() - start)
        torch.distributed.barrier()
        self._latest_step = step

    def _try_load(self, state: TrainState, path: str) -> tuple[str | None, dict | None]:
        """Load ``path`` into ``state``: (error text or None, the saved rerun state machine state or None).

        No collective may be skipped on error. The rerun state is applied by the caller once every rank has
        loaded the same checkpoint.
        """
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        try:
            common = dist_checkpointing.load_common_state_dict(path)
            template = checkpoint_state.loading_template(
                state, dist_checkpointing.load_content_metadata(preloaded_state_dict=common),
                saved_world_size=int(common.get("world_size", -1)), common=common)
            loaded = dist_checkpointing.load(template, path)
            checkpoint_state.apply_loaded(state, loaded)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure: fall back to the previous one
            where = traceback.extract_tb(err.__traceback__)[-1]
            log.debug("checkpoint: loading %s failed", path, exc_info=True)
            return f"{type(err).__name__}: {err} (at {where.filename}:{where.lineno})", None
        return None, loaded.get(checkpoint_state.RERUN_KEY)
