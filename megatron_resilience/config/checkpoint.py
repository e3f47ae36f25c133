"""Checkpointing with Megatron-Core dist_checkpointing: where, how often, how many to keep."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_resilience.config._validate import check_int, check_non_negative, check_types, fail


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = None  # directory; None -> never save
    load: str | None = None  # directory to resume from; None -> same as `save`
    # A `load` folder other than `save` must hold a checkpoint; true: start from step 0 (and say so) when it has none.
    load_optional: bool = False
    save_interval: int | None = None  # steps; None -> only at the end / on graceful exit
    keep_last_n: int | None = None  # None -> keep every checkpoint
    async_save: bool = False
    save_on_exit: bool = True  # save when training ends (max_steps, signal, duration, straggler)
    # Testing aid, like ft.simulate_fault: on the job's first attempt only, every save waits this many seconds
    # after writing and before it is committed, to rehearse a preemption signal during a save, or a save at the
    # signal that cannot finish before the launcher kills the ranks. 0 = off.
    simulated_slow_save: float = 0.0

    def __post_init__(self) -> None:
        check_types(self, "checkpoint")
        for name in ("save", "load"):
            if getattr(self, name) == "":
                fail(f"checkpoint.{name}", "must be a directory path or None", "")
        check_int("checkpoint.save_interval", self.save_interval, minimum=1, allow_none=True)
        check_int("checkpoint.keep_last_n", self.keep_last_n, minimum=1, allow_none=True)
        check_non_negative("checkpoint.simulated_slow_save", self.simulated_slow_save)
        if self.simulated_slow_save and self.save is None:
            fail("checkpoint.save", "must be set when checkpoint.simulated_slow_save is set", None)
        if self.save_interval is not None and self.save is None:
            fail("checkpoint.save", "must be set when checkpoint.save_interval is set", None)
        if self.load_optional and self.load is None:
            fail("checkpoint.load", "must be set when checkpoint.load_optional is true", None)
        if self.async_save and self.save is None:
            fail("checkpoint.save", "must be set when checkpoint.async_save is true", None)

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
