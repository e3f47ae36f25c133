"""Checkpointing with Megatron-Core dist_checkpointing: where, how often, how many to keep.

Two tiers: the persistent one (``save``/``save_interval``, a shared filesystem) and an optional
non-persistent one (``local_dir``/``local_interval``: each rank's part on node-local storage, replicated to
``replication_factor - 1`` peers ``replication_jump`` ranks away, i.e. on other nodes), saved more often
because it is cheap. Resume takes the newest complete checkpoint of either tier (checkpointing/tiers.py).
Names follow Megatron-LM's ``--non-persistent-local-ckpt-dir``, ``--non-persistent-save-interval``,
``--replication-factor`` and ``--replication-jump``.

How often (persistent tier): ``interval_policy="fixed"`` saves every ``save_interval`` steps. ``"young_daly"`` lets the
trainer choose the interval itself (``checkpointing/interval.py``): Daly's optimum for the save
cost C it measures and the run's mean time between failures M (its own once it has seen 3 failures,
``expected_mtbf_hours`` until then), recomputed after every save and every restart; ``save_interval`` is
the first interval, until a save has been measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_resilience.config.validate import (
    check_choice,
    check_int,
    check_non_negative,
    check_positive,
    check_types,
    fail,
)

INTERVAL_POLICIES = ("fixed", "young_daly")
# Megatron-LM's --ckpt-format values this trainer writes: torch_dist (dist_checkpointing; DDP and torch FSDP2) and
# fsdp_dtensor (torch distributed checkpoint of Megatron-FSDP's DTensors, the only format Megatron-FSDP saves).
CKPT_FORMATS = ("torch_dist", "fsdp_dtensor")


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = None  # directory; None -> never save
    # directory to start from (pretrained weights, another run); None -> same as `save`. Once `save` holds a
    # checkpoint of this run, restarts resume from there instead (no work since the start is lost).
    load: str | None = None
    # A `load` folder other than `save` must hold a checkpoint; true: start from step 0 (and say so) when it has none.
    load_optional: bool = False
    save_interval: int | None = None  # steps; None -> only at the end / on graceful exit
    keep_last_n: int | None = None  # None -> keep every checkpoint
    # Also keep the N checkpoints with the lowest validation loss, outside the keep_last_n rotation: a step whose
    # evaluation ranks among them is saved then (needs train.eval_interval). None -> off.
    keep_best: int | None = None
    async_save: bool = False
    save_on_exit: bool = True  # save when training ends (max_steps, signal, duration, straggler)
    # Testing aid, like ft.simulate_fault: on the job's first attempt only, every save waits this many seconds
    # after writing and before it is committed, to rehearse a preemption signal during a save, or a save at the
    # signal that cannot finish before the launcher kills the ranks. 0 = off.
    simulated_slow_save: float = 0.0
    local_dir: str | None = None  # node-local folder of the non-persistent tier; None -> no local checkpoints
    local_interval: int | None = None  # steps between local saves (None -> no local saves)
    local_keep_last_n: int = 1  # local checkpoints kept per rank (the local tier's own keep-last-N)
    replication_factor: int = 1  # ranks holding each rank's local part, itself included; 1 -> no replicas
    replication_jump: int | None = None  # rank distance to a replica; None -> ranks per node (replicas on other nodes)
    interval_policy: str = "fixed"  # "fixed": every save_interval steps; "young_daly": chosen by the trainer
    # The job's expected mean time between failures, in hours: young_daly's M until the run has seen 3 failures
    # (the report also uses it for E*). Required with young_daly.
    expected_mtbf_hours: float | None = None
    # None -> the data-parallel strategy's format: fsdp_dtensor for megatron_fsdp, torch_dist otherwise
    ckpt_format: str | None = None

    def __post_init__(self) -> None:
        check_types(self, "checkpoint")
        for name in ("save", "load"):
            if getattr(self, name) == "":
                fail(f"checkpoint.{name}", "must be a directory path or None", "")
        check_int("checkpoint.save_interval", self.save_interval, minimum=1, allow_none=True)
        check_int("checkpoint.keep_last_n", self.keep_last_n, minimum=1, allow_none=True)
        check_int("checkpoint.keep_best", self.keep_best, minimum=1, allow_none=True)
        if self.keep_best is not None and self.save is None:
            fail("checkpoint.save", "must be set when checkpoint.keep_best is set", None)
        check_non_negative("checkpoint.simulated_slow_save", self.simulated_slow_save)
        if self.simulated_slow_save and self.save is None:
            fail("checkpoint.save", "must be set when checkpoint.simulated_slow_save is set", None)
        if self.save_interval is not None and self.save is None:
            fail("checkpoint.save", "must be set when checkpoint.save_interval is set", None)
        if self.load_optional and self.load is None:
            fail("checkpoint.load", "must be set when checkpoint.load_optional is true", None)
        if self.async_save and self.save is None:
            fail("checkpoint.save", "must be set when checkpoint.async_save is true", None)
        if self.local_dir == "":
            fail("checkpoint.local_dir", "must be a directory path or None", "")
        check_int("checkpoint.local_interval", self.local_interval, minimum=1, allow_none=True)
        check_int("checkpoint.local_keep_last_n", self.local_keep_last_n, minimum=1)
        check_int("checkpoint.replication_factor", self.replication_factor, minimum=1)
        check_int("checkpoint.replication_jump", self.replication_jump, minimum=1, allow_none=True)
        if self.local_interval is not None and self.local_dir is None:
            fail("checkpoint.local_dir", "must be set when checkpoint.local_interval is set", None)
        if self.local_dir is not None and self.local_interval is None:
            fail("checkpoint.local_interval", "must be set when checkpoint.local_dir is set", None)
        if self.replication_factor > 1 and self.local_dir is None:
            fail("checkpoint.replication_factor", "needs checkpoint.local_dir (replicas are of local checkpoints)",
                 self.replication_factor)
        if self.replication_jump is not None and self.replication_factor == 1:
            fail("checkpoint.replication_jump", "needs checkpoint.replication_factor > 1", self.replication_jump)
        check_choice("checkpoint.interval_policy", self.interval_policy, INTERVAL_POLICIES)
        if self.ckpt_format is not None:
            check_choice("checkpoint.ckpt_format", self.ckpt_format, CKPT_FORMATS)
        check_positive("checkpoint.expected_mtbf_hours", self.expected_mtbf_hours, allow_none=True)
        if self.interval_policy == "young_daly":
            if self.expected_mtbf_hours is None:
                fail("checkpoint.expected_mtbf_hours", "must be set (hours > 0) with checkpoint.interval_policy="
                     "'young_daly': it is the failure rate until the run has measured its own", None)
            if self.save_interval is None:
                fail("checkpoint.save_interval", "must be set with checkpoint.interval_policy='young_daly': it is "
                     "the first interval, until a save has been measured", None)

    @property
    def load_dir(self) -> str | None:
        return self.load or self.save

    @property
    def load_required(self) -> bool:
        """An explicit ``load`` that is not the ``save`` folder (where a first attempt finds nothing) and not
        marked optional: a resume the user asked for, so a folder without a checkpoint is an error."""
        if self.load is None or self.load_optional:
            return False
        return self.save is None or os.path.abspath(self.load) != os.path.abspath(self.save)

    def replication_groups_fit(self, world_size: int, ranks_per_node: int) -> str | None:
        """Why the replication settings cannot split ``world_size`` ranks into replica groups (None: they can)."""
        if self.replication_factor == 1:
            return None
        jump = self.replication_jump or ranks_per_node
        span = jump * self.replication_factor
        if world_size % span:
            return (f"world size {world_size} is not a multiple of checkpoint.replication_jump x "
                    f"checkpoint.replication_factor = {jump} x {self.replication_factor} = {span}")
        return None
