"""Atomic, resumable checkpoints with Megatron-Core ``dist_checkpointing``.

The training loop uses one :class:`CheckpointManager`::

    ckpt = CheckpointManager(config.checkpoint, run_dir=config.run_dir, max_steps=config.train.max_steps)
    ckpt.load_latest(state)                # resume: newest complete checkpoint, or start fresh
    ...
    if ckpt.should_save(state.step):
        ckpt.save(state, reason="interval")    # sync, or async (committed when the write is done)
    ckpt.maybe_finalize()                  # every step: commit async saves whose write finished (no wait)
    for record in ckpt.take_durable(): ... # what became durable: step, start/durable times, bytes
    ckpt.finalize()                        # before exit: wait for pending async saves

Why the care: a job can die at any instant (preemption, a killed rank, a wall time limit), including in the
middle of a save. A save therefore writes ``iter_N.tmp``, all ranks finish and meet at a barrier, and only then
rank 0 renames it to ``iter_N`` and rewrites the tracker file (see :mod:`checkpoint_layout`). Resume never trusts
the tracker alone: it scans the ``iter_*`` directories, checks each one, skips incomplete or unreadable ones
with a warning naming them, and falls back to the previous complete one; rank 0 decides and broadcasts, so all
ranks load the same checkpoint.

Nothing slow stands between a save request and a durable checkpoint: the
save path's imports and dist_checkpointing's write-results queue are set up
when the manager is created (during setup), and that queue is a pipe owned by
this process, not the spawned server process upstream starts on the first save
(see :mod:`megatron_resilience.upstream.dist_checkpointing`): the first save of
a process costs what every save costs, and a preemption signal forwarded to the
process group kills nothing the save needs.

Async saves (``checkpoint.async_save``) write in a forked child: it starts in
milliseconds and inherits this process's state (including the CPU compatibility
patches and the preemption handler). Tensors are staged to host memory before
the fork, so training may modify parameters right away. The loop polls every
step without blocking (:meth:`maybe_finalize`: one small all-reduce while a save
is in flight); once the write has finished on every rank, the rename and tracker
update run, so a crash loses at most one save interval.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_resilience import upstream
from megatron_resilience.checkpointing import fsdp_dtensor, readable, reshard
from megatron_resilience.checkpointing import state_dict as checkpoint_state
from megatron_resilience.checkpointing.interval import AdaptiveInterval
from megatron_resilience.config import CheckpointConfig, ConfigError
from megatron_resilience.records import checkpoint_layout as layout
from megatron_resilience.runtime import collectives
from megatron_resilience.runtime.state import TrainState

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager"]


@dataclass(kw_only=True)
class _Save:
    """One save from request to durable (the ``checkpoint`` record of metrics.jsonl)."""

    step: int
    reason: str
    is_async: bool
    tmp: str
    start_time: float  # time.time() when the save was requested
    start_perf: float
    first_in_process: bool
    blocking_s: float | None = None  # how long save() held up training

    def record(self, *, path: str, nbytes: int | None) -> dict[str, Any]:
        durable = time.time()
        return {"step": self.step, "reason": self.reason, "tier": "persistent", "async": self.is_async,
                "start_time": self.start_time,
                "blocking_s": self.blocking_s, "durable_time": durable, "lag_s": durable - self.start_time,
                "bytes": nbytes, "first_in_process": self.first_in_process, "path": path}


_SAVED_IN_PROCESS: list[int] = []  # steps this process has saved (any manager): is a save the process's first?


class _DelayedWrite:
    """An async write that waits before it reports done (``checkpoint.simulated_slow_save``; runs in the fork)."""

    def __init__(self, write, seconds: float) -> None:
        self.write, self.seconds = write, seconds

    def __call__(self, *args, **kwargs):
        result = self.write(*args, **kwargs)
        time.sleep(self.seconds)
        return result


class CheckpointManager:
    """Saves and restores a :class:`TrainState`; every method is collective (call it on all ranks)."""

    model_shape: dict | None = None  # written into every checkpoint (runtime/model_shape.py; set by its builder)

    def __init__(self, config: CheckpointConfig, *, run_dir: str, max_steps: int | None = None,
                 resume_check: Callable[[dict | None, str], Any] | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        # checkpoint.interval_policy=young_daly: the interval is chosen at restarts and after periodic saves
        self.interval = AdaptiveInterval(config, run_dir=run_dir, max_steps=max_steps) \
            if config.interval_policy == "young_daly" and config.save is not None else None
        # Called with a checkpoint's saved layout and path before its tensors are read (reshard.check_resume); its
        # ConfigError ends the load: another TP/PP size is a setting to fix, not a damaged checkpoint.
        self.resume_check = resume_check
        self.best = layout.BestCheckpoints(config.save, config.keep_best) if config.keep_best else None
        if self.best is not None and self.best.stale and collectives.rank() == 0:
            self._repair_best_list()
        self._latest_step: int | None = None
        self._async_queue = None  # megatron AsyncCallsQueue, created on the first async save
        self._pending: list[_Save] = []  # async saves scheduled and not yet committed, oldest first
        self._durable: list[dict[str, Any]] = []  # records of committed saves not yet taken by the loop
        self.last_save_seconds: float | None = None  # blocking time of the last save() call
        self.last_load_seconds: float | None = None
        if config.save is not None:
            upstream.install_write_results_queue()  # imports and queue now, not inside the first save

    # --- public API -------------------------------------------------------------------------------------------

    @property
    def latest_step(self) -> int | None:
        """The step of the newest checkpoint this run loaded or committed (None before either)."""
        return self._latest_step

    def should_save(self, step: int) -> bool:
        if self.interval is not None:
            return self.interval.due(step)
        interval = self.config.save_interval
        return self.config.save is not None and interval is not None and step > 0 and step % interval == 0

    def newest_complete_step(self) -> int | None:
        """Collective: the step of the newest complete checkpoint a resume would load (None: none)."""
        _, candidates = self._resume_root(announce=False)
        return candidates[0] if candidates else None

    def take_interval_changes(self) -> list[dict[str, Any]]:
        """``checkpoint_interval`` records of the decisions since the last call (young_daly; rank 0)."""
        return self.interval.take_events() if self.interval is not None else []

    def note_validation(self, step: int, loss: float) -> bool:
        """``checkpoint.keep_best``: the validation loss of ``step``; True when its checkpoint should be saved now."""
        return self.best is not None and self.best.note(step, loss)

    def wants_best(self, step: int) -> bool:
        return self.best is not None and self.best.wants(step)

    def load_latest(self, state: TrainState) -> bool:
        """Restore ``state`` in place from the newest complete checkpoint; False when there is none."""
        resumed = self._load_latest(state)
        if self.interval is not None:
            self.interval.after_restart(state.step)
        return resumed

    def _resume_root(self, *, announce: bool = True) -> tuple[str | None, list[int] | None]:
        """The folder to resume from and its complete checkpoints (newest first; rank 0 lists, every rank gets it).

        With ``load`` (a starting point: pretrained weights, another run) and a different ``save`` folder, the
        run's own progress wins once ``save`` holds a complete checkpoint: a restart after the first save resumes
        the run where it stopped instead of going back to ``load`` and losing every step since (NeMo's
        AutoResume does the same; Megatron-LM users set ``--load`` and ``--save`` to one folder for it).
        """
        cfg = self.config
        if cfg.load is not None and cfg.save is not None and os.path.abspath(cfg.load) != os.path.abspath(cfg.save):
            own = collectives.broadcast_object(readable.complete_checkpoints(cfg.save) if collectives.rank() == 0
                                               else None)
            if own:
                if announce and collectives.rank() == 0:
                    log.info("checkpoint: %s holds this run's own checkpoints: resuming from there, not from "
                             "checkpoint.load=%s", cfg.save, cfg.load)
                return cfg.save, own
        root = cfg.load_dir
        if root is None:
            return None, None
        return root, collectives.broadcast_object(readable.complete_checkpoints(root) if collectives.rank() == 0
                                                  else None)

    def _load_latest(self, state: TrainState) -> bool:
        root, candidates = self._resume_root()
        if root is None:
            return False
        start = time.perf_counter()
        if not candidates:
            if self.config.load_required:  # the resume asked for is not there: never train from scratch silently
                raise ConfigError(f"checkpoint.load: no complete checkpoint under {root!r} to resume from; "
                                  "checkpoint.load_optional=true starts from step 0 when it holds none")
            if collectives.rank() == 0:
                log.log(logging.WARNING if self.config.load else logging.INFO,
                        "checkpoint: no complete checkpoint under %s; starting from step 0%s", root,
                        " (checkpoint.load_optional=true)" if self.config.load_optional else "")
            return False
        for step in candidates:
            path = os.path.join(root, layout.iter_dir_name(step))
            error, rerun_state = self._try_load(state, path)
            if collectives.all_ok(error is None):
                checkpoint_state.restore_rerun_state(rerun_state)
                self._latest_step = step
                self.last_load_seconds = time.perf_counter() - start
                if collectives.rank() == 0:
                    log.info("checkpoint: resumed from %s (step %d, consumed_samples %d) in %.3f s",
                             path, state.step, state.consumed_samples, self.last_load_seconds)
                    tracked = layout.read_tracker(root)
                    if tracked != step:  # the tracker is a hint: a crash after the rename, or a damaged directory
                        log.warning("checkpoint: %s says %s but the newest loadable checkpoint is %s",
                                    os.path.join(root, layout.TRACKER_FILE), tracked, layout.iter_dir_name(step))
                return True
            if error is not None:
                log.warning("checkpoint: rank %d could not load %s: %s", collectives.rank(), path, error)
            if collectives.rank() == 0:
                log.warning("checkpoint: skipping %s (unreadable on at least one rank); trying the previous one", path)
        raise RuntimeError(
            f"checkpoint: none of the checkpoints under {root} could be loaded "
            f"(tried {[layout.iter_dir_name(s) for s in candidates]}); the model may be partly overwritten, "
            "so training does not start from scratch silently. Remove or fix them, or set checkpoint.load."
        )

    @property
    def pending_steps(self) -> list[int]:
        """Steps of async saves scheduled but not yet committed (the same on every rank)."""
        return [save.step for save in self._pending]

    def save(self, state: TrainState, *, reason: str = "interval") -> None:
        """Write a checkpoint of ``state``; visible (renamed + tracker) when complete on every rank."""
        if self.config.save is None:
            return
        self.maybe_finalize(blocking=True)  # one save in flight at a time: its tmp dir and ours never race
        from megatron.core import dist_checkpointing

        root, step = self.config.save, state.step
        save = _Save(step=step, reason=reason, is_async=self.config.async_save, start_time=time.time(),
                     start_perf=time.perf_counter(), first_in_process=not _SAVED_IN_PROCESS,
                     tmp=os.path.join(root, layout.iter_dir_name(step) + layout.TMP_SUFFIX))
        _SAVED_IN_PROCESS.append(step)
        if collectives.rank() == 0:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(save.tmp):
                layout.remove_stale_tmp(root)
            os.makedirs(save.tmp)
        torch.distributed.barrier()
        if fsdp_dtensor.is_fsdp_dtensor(state):  # Megatron-FSDP: DCP of its DTensors
            request = fsdp_dtensor.save_async(state, save.tmp) if save.is_async else fsdp_dtensor.save(state, save.tmp)
        else:
            sharded = checkpoint_state.build_sharded_state_dict(state, is_loading=False)
            request = dist_checkpointing.save(
                sharded, save.tmp, sharded_strategy=self._save_strategy(), async_sharded_save=save.is_async,
                content_metadata=checkpoint_state.content_metadata(), **upstream.checkpoint_save_kwargs(),
            )
        delay = self._simulated_delay(step)
        if request is None:
            time.sleep(delay)
            self._commit(save)
        else:
            if delay:
                request = request._replace(async_fn=_DelayedWrite(request.async_fn, delay))
            request.add_finalize_fn(lambda: self._commit(save))
            self._queue().schedule_async_request(request)
            self._pending.append(save)
            save.blocking_s = self.last_save_seconds = time.perf_counter() - save.start_perf
            if collectives.rank() == 0:  # a sync save already logged "committed ..."
                log.info("checkpoint: scheduled async save of step %d in %.3f s", step, save.blocking_s)
        self.last_save_seconds = save.blocking_s
        if self.interval is not None:
            if reason == "interval":
                self.interval.after_save(step, save.blocking_s, periodic=True)
            else:  # a keep_best save, or one at a stop or the end: nothing to decide, no extra collective
                self.interval.last_save_step = step

    def maybe_finalize(self, *, blocking: bool = False) -> list[int]:
        """Commit async saves whose writes finished on all ranks; returns their steps. Collective.

        Without ``blocking`` it never waits: one small all-reduce while a save is in flight, nothing otherwise.
        """
        if self._async_queue is None or not self._pending:
            return []
        done = self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        return [self._pending.pop(0).step for _ in done]

    def take_durable(self) -> list[dict[str, Any]]:
        """Records of the saves committed since the last call (``bytes`` is counted on rank 0 only)."""
        records, self._durable = self._durable, []
        return records

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

    def _simulated_delay(self, step: int) -> float:
        """``checkpoint.simulated_slow_save`` seconds on the job's first attempt (ft_launcher and Slurm), else 0."""
        delay = self.config.simulated_slow_save
        first_attempt = all(os.environ.get(name, "0") == "0"
                            for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        if not delay or not first_attempt:
            return 0.0
        if collectives.rank() == 0:
            log.warning("checkpoint: checkpoint.simulated_slow_save: the save of step %d waits %.1f s before it is "
                        "committed (first attempt only)", step, delay)
        return delay

    def _queue(self):
        if self._async_queue is None:
            self._async_queue = upstream.checkpoint_async_calls_queue()
        return self._async_queue

    def _repair_best_list(self) -> None:
        """Rank 0: ``best_checkpoints.json`` from the folders' marks (the marks alone protected them meanwhile)."""
        if self.best.unlisted:
            log.warning("checkpoint: %s did not list %s (a crash after the commit, before the list was written); "
                        "listed again from the validation loss recorded in the checkpoint",
                        os.path.join(self.config.save, layout.BEST_FILE),
                        ", ".join(layout.iter_dir_name(s) for s in self.best.unlisted))
        self.best.write()

    def _commit(self, save: _Save) -> None:
        """Every rank has written its part of ``save.tmp``: rank 0 publishes it, then everyone continues."""
        torch.distributed.barrier()
        root, step = self.config.save, save.step
        final, nbytes = os.path.join(root, layout.iter_dir_name(step)), None
        best = self.best.commit(step) if self.best is not None else None  # every rank ranks it the same way
        if collectives.rank() == 0:  # a best checkpoint's loss goes inside it before the rename: see BestCheckpoints
            final = layout.commit(root, save.tmp, step, best=best, shape=self.model_shape)
            nbytes = layout.directory_bytes(final)
            layout.remove_stale_tmp(root)
            if best is not None:
                self.best.write()
                log.info("checkpoint: step %d is among the %d best by %s (%.6g): kept apart from keep_last_n",
                         step, self.best.keep, layout.BEST_METRIC, best["validation_loss"])
            if self.config.keep_last_n is not None:
                layout.apply_retention(root, self.config.keep_last_n, just_saved=step,
                                       protected=self.best.steps() if self.best is not None else frozenset())
            log.info("checkpoint: committed %s (%.3f s after the save started)", final,
                     time.perf_counter() - save.start_perf)
        torch.distributed.barrier()
        self._latest_step = step
        if not save.is_async:
            save.blocking_s = time.perf_counter() - save.start_perf
        self._durable.append(save.record(path=final, nbytes=nbytes))

    def _try_load(self, state: TrainState, path: str) -> tuple[str | None, dict | None]:
        """Load ``path`` into ``state``: (error text or None, the saved rerun state machine state or None).

        No collective may be skipped on error. The rerun state is applied by the caller once every rank has
        loaded the same checkpoint.
        """
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        try:
            common = readable.load_common(path)
            if self.resume_check is not None:
                self.resume_check(common.get(reshard.LAYOUT_KEY), path)
            if fsdp_dtensor.is_fsdp_dtensor(state):
                fsdp_dtensor.load(state, path, common)
                return None, None
            template = checkpoint_state.loading_template(
                state, dist_checkpointing.load_content_metadata(preloaded_state_dict=common),
                saved_world_size=int(common.get("world_size", -1)), common=common)
            loaded = dist_checkpointing.load(template, path)
            checkpoint_state.apply_loaded(state, loaded)
        except ConfigError:  # the same on every rank (the same common state): this job cannot resume it
            raise
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure: fall back to the previous one
            where = traceback.extract_tb(err.__traceback__)[-1]
            log.debug("checkpoint: loading %s failed", path, exc_info=True)
            return f"{type(err).__name__}: {err} (at {where.filename}:{where.lineno})", None
        return None, loaded.get(checkpoint_state.RERUN_KEY)
