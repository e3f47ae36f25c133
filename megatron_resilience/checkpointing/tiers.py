"""Two checkpoint tiers and the choice between them on resume: persistent, node-local (replicated), in memory.

``TieredCheckpoints`` is what the loop talks to (the interface of ``CheckpointManager``, plus local saves):

- **persistent**: ``CheckpointManager`` (dist_checkpointing on the shared filesystem, ``checkpoint.save``);
- **local** (``checkpoint.local_dir`` every ``checkpoint.local_interval`` steps): each rank writes the shards it
  holds to node-local storage with nvidia-resiliency-ext's ``LocalCheckpointManager`` (write ``.dirty``, then
  rename: a half-written file is never read), replicated to ``checkpoint.replication_factor - 1`` peers on
  other nodes; ``checkpoint.local_keep_last_n`` per rank. Only the same parallel layout reads it back (the
  session folder names the run and its world/TP/PP sizes);
- **memory** (with in-process restart): a CPU copy of the newest local save, kept by the process across
  in-process restarts: restoring it reads no file at all.

Resume (:meth:`TieredCheckpoints.load_latest`, collective) takes the newest step that every rank can read:
a local step counts when every rank's part exists on some rank (its own or a replica, fetched then), a memory
step when every rank holds it. On equal steps the cheaper tier wins (memory, local, persistent); a local
checkpoint older than the persistent one is ignored. A persistent checkpoint saved while the rerun state
machine diagnoses a step carries that diagnosis: it supersedes the other tiers' checkpoints of its step and
later ones (they are discarded). Rank 0 logs which tier and step it chose and why. Then every rank removes
its unfinished local saves (a ``.dirty`` file left by a save cut off mid-write would make every later save of
that step fail) and its local parts of steps after the one resumed, and logs what it removed.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import zlib
from typing import Any

import torch

from megatron_resilience.checkpointing import state_dict as checkpoint_state
from megatron_resilience.checkpointing.manager import CheckpointManager
from megatron_resilience.config import PretrainConfig
from megatron_resilience.runtime import collectives, model_shape
from megatron_resilience.runtime.state import TrainState
from megatron_resilience.upstream import nvrx_local_checkpoint as nvrx_local

log = logging.getLogger(__name__)

TIERS = ("memory", "local", "persistent")  # cheapest first: the order that breaks ties
# session -> (step, CPU tensor-aware state dict): module state, so it lives across in-process restarts
_MEMORY: dict[str, tuple[int, Any]] = {}


def session_name(run_dir: str, *, world: int, tp: int, pp: int) -> str:
    """Local checkpoints of this run and this parallel layout (another layout cannot read them)."""
    path = os.path.abspath(run_dir)
    return f"{os.path.basename(path) or 'run'}-{zlib.crc32(path.encode()):08x}-w{world}tp{tp}pp{pp}"


class LocalTier:
    """Node-local saves through nvidia-resiliency-ext, and the in-memory copy of the newest one."""

    def __init__(self, config: PretrainConfig, *, world: int, tp: int, pp: int, timeout) -> None:
        ckpt = config.checkpoint
        self.interval = ckpt.local_interval
        self.session = session_name(config.run_dir, world=world, tp=tp, pp=pp)
        self.keep_in_memory = config.inprocess.enabled
        strategy, self.cliques = None, None
        if ckpt.replication_factor > 1:
            jump = ckpt.replication_jump or int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
            why = ckpt.replication_groups_fit(world, jump)
            if why is not None:
                from megatron_resilience.config import ConfigError

                raise ConfigError(f"checkpoint.replication_factor: {why}")
            strategy, self.cliques = nvrx_local.replication_strategy(factor=ckpt.replication_factor, jump=jump,
                                                                     timeout=timeout)
        self.manager = nvrx_local.local_checkpoint_manager(ckpt.local_dir, self.session,
                                                           keep_last_n=ckpt.local_keep_last_n, strategy=strategy)
        if collectives.rank() == 0:
            replicas = f"replica groups {self.cliques}" if self.cliques else "no replicas"
            log.info("checkpoint: local tier under %s every %d steps (%s%s)",
                     os.path.join(ckpt.local_dir, self.session), self.interval, replicas,
                     "; newest also kept in memory for in-process restarts" if self.keep_in_memory else "")

    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0

    def save(self, state: TrainState) -> dict[str, Any]:
        """Collective. Returns the ``checkpoint`` record (tier local)."""
        start_time, start = time.time(), time.perf_counter()
        tasd = nvrx_local.tensor_aware_state_dict(checkpoint_state.build_sharded_state_dict(state, is_loading=False))
        if self.keep_in_memory:
            tensors = tasd.pop_tensors()
            snapshot = copy.deepcopy(tasd)  # hollow: only the metadata is copied here
            snapshot.insert_tensors([t.detach().to("cpu", copy=True) for t in tensors])
            tasd.insert_tensors(tensors)
            _MEMORY[self.session] = (state.step, snapshot)
        nbytes = sum(t.nbytes for t in tasd.tensors)
        self.manager.save(tasd, state.step)  # sync; every rank's part (and replicas) complete, or it raises
        seconds = time.perf_counter() - start
        durable = time.time()
        return {"step": state.step, "reason": "interval", "tier": "local", "async": False, "start_time": start_time,
                "blocking_s": seconds, "durable_time": durable, "lag_s": durable - start_time, "bytes": nbytes,
                "first_in_process": None, "path": str(self.manager.local_ckpt_dir)}

    def newest_local(self) -> int | None:
        """Collective: the newest step whose every rank's part exists on some rank (own or replica)."""
        step = self.manager.find_latest()
        return None if step < 0 else step

    def newest_memory(self) -> int | None:
        """Collective: the step every rank holds in memory (None unless all hold the same one)."""
        held = _MEMORY.get(self.session)
        low, high = collectives.all_min_max(held[0] if held is not None else -1)
        return low if low == high and low >= 0 else None

    def load(self, state: TrainState, tier: str, step: int) -> None:
        """Collective: restore ``state`` from ``tier`` (memory or local) at ``step``."""
        if tier == "memory":
            tasd = copy.deepcopy(_MEMORY[self.session][1])  # the restored model must not alias the kept copy
        else:
            self.manager.find_latest()
            missing = self.manager.ranks_without_own_part(step)
            if missing and collectives.rank() == 0:
                log.warning("checkpoint: the local parts of rank(s) %s for step %d are not on their nodes (a lost or "
                            "replaced node): fetching them from their replicas (groups %s)", missing, step,
                            self.cliques)
            tasd, _ = self.manager.load()
        common = tasd.common_state_dict
        template = checkpoint_state.loading_template(state, checkpoint_state.SHARDING_METADATA,
                                                     saved_world_size=int(common.get("world_size", -1)),
                                                     common=common)
        live = checkpoint_state.live_tensors(template)  # FSDP2 loads into these (checkpoint_state.apply_loaded)
        loaded = nvrx_local.to_state_dict(tasd, template)
        checkpoint_state.apply_loaded(state, loaded, live=live)
        checkpoint_state.restore_rerun_state(loaded.get(checkpoint_state.RERUN_KEY))
        if int(loaded["step"]) != step:
            raise RuntimeError(f"checkpoint: the {tier} checkpoint holds step {loaded['step']}, expected {step}")

    def forget_after(self, step: int) -> None:
        """After a (re)start resumed ``step``: drop this rank's unfinished saves and its files and memory copy of
        later steps (see ``nvrx_local.forget_after``); the next save of those steps would fail or mix timelines."""
        removed = self.manager.forget_after(step)
        held = _MEMORY.get(self.session)
        if held is not None and held[0] > step:
            del _MEMORY[self.session]
        if removed:
            log.info("checkpoint: rank %d removed local files of saves cut off mid-write or newer than the step "
                     "resumed (%d): %s", collectives.rank(), step, ", ".join(os.path.basename(p) for p in removed))

    def discard_from(self, step: int) -> None:
        """Drop this rank's local files and memory copy of ``step`` and later (superseded by a persistent one)."""
        removed = self.manager.discard_from(step)
        held = _MEMORY.get(self.session)
        if held is not None and held[0] >= step:
            del _MEMORY[self.session]
        if removed and collectives.rank() == 0:
            log.info("checkpoint: local checkpoints of step %d and later discarded (the persistent checkpoint of "
                     "step %d carries the rerun state machine's diagnosis)", step, step)


def choose_tier(steps: dict[str, int | None]) -> tuple[str, int, str] | None:
    """(tier, step, why) of the checkpoint to resume from, given each tier's newest complete step (None: none).

    The newest step wins; on equal steps the cheapest tier (memory, local, persistent); older ones are ignored.
    """
    available = {tier: step for tier, step in steps.items() if step is not None}
    if not available:
        return None
    newest = max(available.values())
    tier = next(t for t in TIERS if available.get(t) == newest)
    why = "the newest" if list(available.values()).count(newest) == 1 else \
        "the newest; on equal steps the cheapest tier is read"
    older = ", ".join(t for t in TIERS if t in available and available[t] < newest)
    found = ", ".join(f"{t} {'none' if steps.get(t) is None else f'step {steps[t]}'}" for t in TIERS)
    ignored = f"; older, ignored: {older}" if older else ""
    return tier, newest, f"{why}{ignored}; found: {found}"


class TieredCheckpoints:
    """The persistent ``CheckpointManager`` plus an optional local tier: what the loop calls ``ctx.checkpoints``."""

    def __init__(self, persistent: CheckpointManager, local: LocalTier | None) -> None:
        self.persistent = persistent
        self.local = local
        self.resumed_from: dict[str, Any] = {"tier": None, "step": None}
        self._local_records: list[dict[str, Any]] = []
        self.last_local_step: int | None = None

    # --- the CheckpointManager interface the loop uses ---------------------------------------------------------
    @property
    def config(self):
        return self.persistent.config

    @property
    def latest_step(self) -> int | None:
        return self.persistent.latest_step

    @property
    def pending_steps(self) -> list[int]:
        return self.persistent.pending_steps

    def should_save(self, step: int) -> bool:
        return self.persistent.should_save(step)

    def note_validation(self, step: int, loss: float) -> bool:
        return self.persistent.note_validation(step, loss)

    def wants_best(self, step: int) -> bool:
        return self.persistent.wants_best(step)

    def save(self, state: TrainState, *, reason: str = "interval") -> None:
        self.persistent.save(state, reason=reason)
        if self.local is not None and checkpoint_state.rerun_state_to_save() is not None:
            self.local.discard_from(state.step)

    def maybe_finalize(self, *, blocking: bool = False) -> list[int]:
        return self.persistent.maybe_finalize(blocking=blocking)

    def take_interval_changes(self) -> list[dict[str, Any]]:
        return self.persistent.take_interval_changes()

    def take_durable(self) -> list[dict[str, Any]]:
        records, self._local_records = self._local_records + self.persistent.take_durable(), []
        return records

    def finalize(self) -> None:
        self.persistent.finalize()

    # --- the local tier ---------------------------------------------------------------------------------------
    def should_save_local(self, step: int) -> bool:
        return self.local is not None and self.local.should_save(step) and step != self.last_local_step

    def save_local(self, state: TrainState) -> float:
        record = self.local.save(state)
        self.last_local_step = state.step
        self._local_records.append(record)
        return record["blocking_s"]

    # --- resume -------------------------------------------------------------------------------------------------
    def load_latest(self, state: TrainState) -> bool:
        """Restore the newest checkpoint every rank can read, from the cheapest tier that has it. Collective."""
        if self.local is None:
            resumed = self.persistent.load_latest(state)
            self.resumed_from = {"tier": "persistent" if resumed else None,
                                 "step": self.persistent.latest_step if resumed else None}
            return resumed
        start = time.perf_counter()
        steps = {"memory": self.local.newest_memory() if self.local.keep_in_memory else None,
                 "local": self.local.newest_local(),
                 "persistent": self.persistent.newest_complete_step()}
        choice = choose_tier(steps)
        if choice is None:
            self.resumed_from = {"tier": None, "step": None}
            resumed = self.persistent.load_latest(state)  # nothing anywhere: its "starting from step 0" line
            self.local.forget_after(state.step)
            return resumed
        tier, newest, why = choice
        if collectives.rank() == 0:
            log.info("checkpoint: resuming from the %s checkpoint of step %d (%s)", tier, newest, why)
        if tier == "persistent":
            resumed = self.persistent.load_latest(state)
            newest = self.persistent.latest_step
        else:
            try:
                self.local.load(state, tier, newest)
                resumed = True
            except Exception as err:  # noqa: BLE001 - a damaged local copy: the persistent tier is the fallback
                log.warning("checkpoint: rank %d could not read the %s checkpoint of step %d (%s: %s); falling back "
                            "to the persistent tier", collectives.rank(), tier, newest, type(err).__name__, err)
                resumed = None
            if not collectives.all_ok(resumed is True):
                tier, resumed = "persistent", self.persistent.load_latest(state)
                newest = self.persistent.latest_step
            elif self.persistent.interval is not None:  # young_daly: the restart's decision, as the tier would
                self.persistent.interval.after_restart(state.step)
        self.resumed_from = {"tier": tier if resumed else None, "step": newest if resumed else None}
        self.local.forget_after(state.step)
        self.persistent.last_load_seconds = time.perf_counter() - start
        if collectives.rank() == 0 and tier != "persistent":
            log.info("checkpoint: resumed from the %s checkpoint (step %d, consumed_samples %d) in %.3f s", tier,
                     state.step, state.consumed_samples, self.persistent.last_load_seconds)
        return bool(resumed)


def build_checkpoints(config: PretrainConfig, *, dist, resume_check=None) -> TieredCheckpoints:
    """The run's checkpoint tiers (collective when a local tier with replicas is configured). ``resume_check``
    vets a persistent checkpoint's saved layout before its tensors are read (``reshard.check_resume``)."""
    from megatron_resilience.runtime.distributed import group_timeout

    persistent = CheckpointManager(config.checkpoint, run_dir=config.run_dir, max_steps=config.train.max_steps,
                                   resume_check=resume_check)
    persistent.model_shape = model_shape.written(config)
    local = None
    if config.checkpoint.local_dir is not None:
        local = LocalTier(config, world=dist.world_size, tp=dist.tp, pp=dist.pp,
                          timeout=group_timeout(config, torch.distributed.get_backend()))
    return TieredCheckpoints(persistent, local)
