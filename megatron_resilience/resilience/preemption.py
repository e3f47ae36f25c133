"""Graceful exit on a scheduler signal (preemption, wall-time warning): checkpoint, then exit 0.

Slurm sends ``--signal=SIGTERM@N`` to the job step, but not necessarily to every
rank at the same moment, and a rank that stops alone hangs the others in their
next collective. So the handler only records the signal; at the end of each step
every rank contributes its flag to one all-reduce (``ResilienceHooks.after_step``)
and all ranks stop together, after the same step, save the checkpoint and exit 0
without marking the training finished, so the job is requeued and resumes.

The previous handlers are restored when training ends. Dataloader worker
processes inherit nothing useful: ``dataloader_worker_init_fn`` makes them
ignore the signal so they are not killed before the main process has saved.
"""

from __future__ import annotations

import signal
from types import FrameType

from megatron_resilience.resilience.log import get_logger


class DistributedSignalHandler:
    def __init__(self, signal_name: str, *, rank: int) -> None:
        self.signal_name = signal_name
        self.signum = signal.Signals[signal_name]
        self.rank = rank
        self.log = get_logger("preemption", rank)
        self.received = False
        self._previous = None
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: a signal handler runs between bytecodes, possibly inside a collective.
        self.received = True

    def restore(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


def _ignore_in_worker(signal_name: str) -> None:
    signal.signal(signal.Signals[signal_name], signal.SIG_IGN)


class DataloaderWorkerInit:
    """Picklable ``worker_init_fn`` for torch DataLoader workers (spawned workers need a top-level class)."""

    def __init__(self, signal_name: str, chained=None) -> None:
        self.signal_name = signal_name
        self.chained = chained

    def __call__(self, worker_id: int) -> None:
        _ignore_in_worker(self.signal_name)
        if self.chained is not None:
            self.chained(worker_id)
