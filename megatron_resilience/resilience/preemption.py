"""Graceful exit on a scheduler signal (preemption, wall-time warning): checkpoint, then exit 0.

Slurm sends ``--signal=SIGTERM@N`` to the job step, but not necessarily to every
rank at the same moment, and a rank that stops alone hangs the others in their
next collective. So the handler only records the signal (when, during what); at
the end of each step every rank contributes its flag to one all-reduce
(``ResilienceHooks.after_step``) and all ranks stop together, after the same
step, save the checkpoint and exit 0 without marking the training finished, so
the job is requeued and resumes.

The handler is installed as the first thing a trainer process does
(:func:`install_at_process_start`, before torch and Megatron-Core are imported).
A signal during setup - imports, model and data build, checkpoint load - needs
no checkpoint (nothing was trained) and no agreement: each rank writes its log
line, rank 0 the ``signal`` record and ``stop_reason.json`` (stopped by the
signal, nothing lost), and the process exits 0 at once - setup on a loaded node
can take longer than the launcher waits before it kills (30 s for torchrun by
default) - also when the main thread is stuck in a C call then (``_watch_setup``). A signal at the very end of
setup is agreed before the first step
(``ResilienceHooks.stop_requested``). Only the launcher's and the interpreter's
own start-up precede the handler.

A second signal changes nothing (it is counted and logged). The previous
handlers are restored when training ends. Dataloader worker processes inherit
nothing useful: ``dataloader_worker_init_fn`` makes them ignore the signal so
they are not killed before the main process has saved. A forked checkpoint
writer inherits the recording handler, so the signal never kills the writer of
the checkpoint it asks for.

No torch here: this module is imported before torch is.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

from megatron_resilience.resilience.log import get_logger
from megatron_resilience.resilience.stop_reason import append_metrics_record, write_stop_reason

# The phase of a rank that is leaving with its own failure (``mark_failed``). A signal then is not a stop: it is
# ft_launcher's SIGTERM to the survivors after another rank died, and the process exits 1 as it decided; recording
# "stopped on a signal, exit 0" would make the next attempt read a preemption that never happened.
FAILED = "failed"
# How long the setup watcher leaves the main thread to run the handler itself (it logs and exits the same way).
SETUP_WATCH_GRACE_S = 1.0


def _clock(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall)) + f".{int(wall % 1 * 1000):03d}"


class DistributedSignalHandler:
    def __init__(self, signal_name: str, *, rank: int) -> None:
        self.signal_name = signal_name
        self.signum = signal.Signals[signal_name]
        self.rank = rank
        self.log = None  # created on first use: get_logger may configure logging, which the trainer does later
        self.received = False
        self.received_at: float | None = None  # time.time() of the first signal
        self.received_during: str | None = None  # what the process was doing then (``phase``)
        self.count = 0
        self.phase = "setup"  # set by the hooks: "setup", "step 12", "checkpoint save of step 20", "exit"
        self.completed_step: int | None = None  # the last step trained when ``phase`` was set (None in setup)
        self.run_dir: str | None = None  # where to leave stop_reason.json when exiting during setup
        self.checkpoint_root: str | None = None
        self.source: dict | None = None  # who sent the signal when not the scheduler: {"cloud_notice": {...}}
        self._reported = 0  # signals already logged
        self._previous = None
        self._installed = False
        self._leaving = threading.Lock()  # one exit during setup: the handler's or the watcher's
        self._wakeup: tuple[int, int] | None = None  # (previous wakeup fd, ours) while the setup watcher runs

    def install(self) -> None:
        if self._installed:
            return
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True
        self._watch_setup()

    def _watch_setup(self) -> None:
        """Leave during setup even while the main thread is blocked in a C call.

        Python runs a handler only in the main thread, between bytecodes: a rank in a C call of its setup never
        runs it. Long-form run 6 met it: after an in-job restart, rank 0 left on the preemption at once and rank 1,
        connecting to a TCPStore on rank 0 (torch retries inside C++ and swallows EINTR), stayed up until the
        launcher's kill 2 minutes later. The interpreter's own C-level handler still writes the signal's number to
        the wakeup fd at once; a thread reads it and, if the main thread has not left within
        ``SETUP_WATCH_GRACE_S``, takes the same exit. After setup it does nothing: the steps return to Python and
        the handler only records. Needs the main thread (``signal.set_wakeup_fd``); elsewhere the handler alone.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self._wakeup = (previous, write_end)
        threading.Thread(target=self._read_wakeups, args=(read_end,), name="setup-signal-watcher",
                         daemon=True).start()

    def _read_wakeups(self, read_end: int) -> None:
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                data = b""
            if not data:  # the write end closed: ``restore``
                os.close(read_end)
                return
            if self.signum not in data or self.phase != "setup" or self.run_dir is None:
                continue
            time.sleep(SETUP_WATCH_GRACE_S)
            if self.phase == "setup":
                if self.count == 0:  # the handler never ran: the main thread is in C
                    self._handle(self.signum, None)
                else:
                    self._leave_during_setup()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only record: a signal handler runs between bytecodes, possibly inside a collective or a write
        # to the log stream (logging from here could interleave with, or re-enter, that write).
        if self.received_at is None:
            self.received_at = time.time()
            self.received_during = self.phase
        first = self.count == 0
        self.count += 1
        self.received = True
        if self.phase.startswith(FAILED):
            return  # the launcher tearing down a group this rank is already leaving with its own failure
        if self.phase == "setup" and self.run_dir is not None:
            self._leave_during_setup()
        elif first and self.rank == 0 and self.run_dir is not None and self.completed_step is not None:
            self._record_pending_stop()

    def mark_failed(self, err: BaseException) -> None:
        """This rank leaves with ``err`` (exit 1): a signal from now on is only counted, never a stop record or an
        exit 0. Not for in-process restart, where the same process trains again."""
        self.phase, self.completed_step = f"{FAILED} ({type(err).__name__})", None

    def _record_pending_stop(self) -> None:
        """stop_reason.json says "stopped by the signal" from the moment it arrives, before the ranks agree on
        the stop: a save already under way (a slow periodic save) may outlast the launcher's grace period, and
        the attempt must still read as preempted (requeued, resuming from the newest complete checkpoint).
        The stop itself rewrites it with the exact step. Only ``os``-level writes (see ``_handle``)."""
        from megatron_resilience.records.checkpoint_layout import read_tracker  # stdlib only at import

        tracked = read_tracker(self.checkpoint_root) if self.checkpoint_root else None
        write_stop_reason(self.run_dir, {
            "reason": "signal", "step": self.completed_step, "exit_code": 0, "finished": False,
            "checkpoint_step": tracked, "lost_steps": self.completed_step - (tracked or 0),
            "checkpoint_at_stop": "pending", "signal": self.describe()})

    def _leave_during_setup(self) -> None:
        """Exit 0 now: nothing was trained, so nothing is lost. Only ``os``-level writes (see ``_handle``). Once:
        the handler and the setup watcher may both get here."""
        from megatron_resilience.records.checkpoint_layout import read_tracker  # stdlib only at import

        if not self._leaving.acquire(blocking=False):
            return

        tracked = read_tracker(self.checkpoint_root) if self.checkpoint_root else None
        os.write(2, (f"[rank {self.rank}] megatron_resilience.resilience.preemption: received {self.signal_name} at "
                     f"{_clock(self.received_at)} (phase: setup; pid {os.getpid()}): nothing trained yet, exiting 0 "
                     "(the job should be requeued and resume)\n").encode())
        if self.rank == 0:
            signal_fields = {**self.describe(), "first_received_time": self.received_at, "step": tracked,
                             "before_training": True}
            append_metrics_record(self.run_dir, "signal", signal_fields)
            write_stop_reason(self.run_dir, {
                "reason": "signal", "step": tracked or 0, "exit_code": 0, "finished": False,
                "checkpoint_step": tracked, "lost_steps": 0, "checkpoint_at_stop": "not needed",
                "signal": self.describe()})
        os._exit(0)

    def report(self) -> None:
        """One log line per rank for signals not yet logged: which signal, when, during what (any rank)."""
        if self.count == self._reported:
            return
        if self.log is None:
            self.log = get_logger("preemption", self.rank)
        if self._reported == 0:
            via = " from a cloud preemption notice" if self.source else ""
            self.log.warning(f"received {self.signal_name}{via} at {_clock(self.received_at)} "
                             f"(phase: {self.received_during}; pid {os.getpid()})")
        if self.count > 1:
            self.log.warning(f"received {self.signal_name} {self.count} times; the first one stops the run, "
                             "later ones change nothing")
        self._reported = self.count

    def describe(self) -> dict:
        """This rank's view, for the ``signal`` record of metrics.jsonl and stop_reason.json."""
        return {"signal": self.signal_name, "received_time": self.received_at, "received_during": self.received_during,
                "count": self.count, **(self.source or {})}

    def restore(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            previous, ours = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(ours)  # the watcher reads the end of its pipe and stops
            self._wakeup = None


_PROCESS_HANDLER: DistributedSignalHandler | None = None


def install_at_process_start(enabled: bool, signal_name: str, *, run_dir: str,
                             checkpoint_root: str | None) -> DistributedSignalHandler | None:
    """Install the handler now (first thing in a trainer process); ``handler_for`` returns it later.

    Until setup ends (the hooks change ``phase``), the signal makes the process leave at once (exit 0);
    ``checkpoint_root`` (where checkpoints are loaded from) names the step the next attempt resumes from.
    Logs nothing (logging is configured after this): the caller announces it.
    """
    global _PROCESS_HANDLER
    if not enabled:
        return None
    rank = int(os.environ.get("RANK", "0"))
    if _PROCESS_HANDLER is None or _PROCESS_HANDLER.signal_name != signal_name or not _PROCESS_HANDLER._installed:
        _PROCESS_HANDLER = DistributedSignalHandler(signal_name, rank=rank)
        _PROCESS_HANDLER.run_dir, _PROCESS_HANDLER.checkpoint_root = run_dir, checkpoint_root
        _PROCESS_HANDLER.install()
    return _PROCESS_HANDLER


def handler_for(signal_name: str, *, rank: int) -> DistributedSignalHandler:
    """The handler installed at process start for ``signal_name``, else a new one (installed by the hooks)."""
    global _PROCESS_HANDLER
    if _PROCESS_HANDLER is not None and _PROCESS_HANDLER.signal_name == signal_name and _PROCESS_HANDLER._installed:
        _PROCESS_HANDLER.rank = rank
        _PROCESS_HANDLER.log = get_logger("preemption", rank)
        return _PROCESS_HANDLER
    _PROCESS_HANDLER = DistributedSignalHandler(signal_name, rank=rank)
    return _PROCESS_HANDLER


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
