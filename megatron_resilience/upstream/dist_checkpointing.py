"""megatron-core dist_checkpointing: the checkpoint writer's results queue and async strategy, per version.

| megatron-core | ``strategies.filesystem_async._results_queue`` made by | ``dist_checkpointing.save`` |
|---|---|---|
| 0.13-0.16 (0.16.1 checked) | ``_get_write_results_queue()`` | no ``async_strategy`` |
| 0.17+ (0.19.2 checked) | ``get_write_results_queue(mp_mode="spawn")`` | ``async_strategy`` "nvrx" (default), "mcore" |

Every torch_dist save, sync or async, hands its write results (which file holds which tensor bytes) back
through that module-level queue, which upstream creates lazily, on the first save, as
``multiprocessing.get_context("spawn").Manager().Queue()``: a fresh interpreter serving the queue. Two
failures came from that server process:

- the first save of every process waited for the interpreter to start and import torch (3-6 s quiet,
  tens of seconds on a loaded node) - right between a preemption signal and a durable checkpoint when the
  signal came before the first periodic save;
- torchrun and ft_launcher forward the preemption signal with ``os.killpg`` to each rank's process group,
  which holds the server too: it died on SIGTERM and the save the signal asked for failed
  (``BrokenPipeError`` in ``put`` for sync saves; ``ConnectionRefusedError``/``'ForkAwareLocal' object has no
  attribute 'connection'``/``EOFError`` for async ones), leaving ``iter_N.tmp`` and a non-zero exit.

:class:`PipeResultsQueue` replaces it before the first save: a pipe owned by the rank process, no server
process at all. It serves the writers this project uses: the calling process itself (sync saves) and the
*forked* async writer (``AsyncCallsQueue(persistent=False)``, which inherits the pipe). A *spawned* persistent
writer cannot use it (the queue travels inside a pickled request): :func:`checkpoint_async_calls_queue` never makes one.

Async strategy: ``"mcore"`` everywhere (0.19 logs once that it is deprecated). nvidia-resiliency-ext's
``"nvrx"`` strategy writes with a persistent worker whose SIGTERM handler exits (0.7.0): the preemption
signal would kill the writer of the very checkpoint it asks for; its forked alternative warns on every save.
The sync path of 0.19 is ``"mcore"`` already, so both modes share one writer.

Importing this module never imports torch or megatron.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import queue
import threading
from typing import Any


class PipeResultsQueue:
    """The two calls dist_checkpointing makes on its write-results queue (``put``, ``get_nowait``), on a pipe.

    Writers (this process, or a child forked from it) ``put`` a pickled message into the pipe, serialized by
    a lock shared across the fork. A daemon thread of the owning process drains the pipe as messages arrive,
    so a writer never blocks on a full pipe buffer: the forked writer can exit (which is how the trainer
    learns the write is done) however large its results are. ``get_nowait`` first takes whatever is complete
    in the pipe, so a result put just before the writer exited is never reported missing.
    """

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._write_lock = ctx.Lock()
        self._read_lock = threading.Lock()
        self._items: queue.Queue = queue.Queue()
        self._owner = os.getpid()
        threading.Thread(target=self._drain_forever, name="ckpt-write-results", daemon=True).start()

    def put(self, obj: Any) -> None:
        with self._write_lock:
            self._writer.send(obj)

    def get_nowait(self) -> Any:
        self._drain_ready()
        return self._items.get_nowait()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self._drain_ready()
        return self._items.get(block=block, timeout=timeout)

    def _drain_ready(self) -> None:
        if os.getpid() != self._owner:
            raise RuntimeError("PipeResultsQueue: only the process that created it reads it")
        with self._read_lock:
            while self._reader.poll(0):
                self._items.put(self._reader.recv())

    def _drain_forever(self) -> None:
        try:
            while True:
                self._reader.poll(None)  # wakes when a writer starts a message (or the pipe closes)
                self._drain_ready()
        except (EOFError, OSError):  # the process is shutting down
            return

    def __reduce__(self):
        raise TypeError("PipeResultsQueue cannot be pickled: use a forked checkpoint writer (persistent=False)")


_QUEUE: PipeResultsQueue | None = None


def install_write_results_queue() -> PipeResultsQueue:
    """Put a :class:`PipeResultsQueue` behind dist_checkpointing's writers (idempotent; call during setup).

    Also imports dist_checkpointing's save path now, during setup, instead of inside the first save.
    """
    global _QUEUE
    from megatron.core import dist_checkpointing  # noqa: F401  (the save path's imports, paid during setup)
    from megatron.core.dist_checkpointing.strategies import filesystem_async, fully_parallel, torch  # noqa: F401

    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError("megatron-core's dist_checkpointing has no strategies.filesystem_async._results_queue: "
                           "this version is not supported by megatron_resilience.upstream.dist_checkpointing")
    if _QUEUE is None or _QUEUE._owner != os.getpid():
        _QUEUE = PipeResultsQueue()
    if filesystem_async._results_queue is not _QUEUE:
        filesystem_async._results_queue = _QUEUE
    return _QUEUE


def checkpoint_save_kwargs() -> dict[str, Any]:
    """Extra keyword arguments for ``dist_checkpointing.save``: the ``"mcore"`` writer where there is a choice."""
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


def checkpoint_async_calls_queue():
    """megatron-core's ``AsyncCallsQueue`` with a forked (temporal) writer per save.

    The forked writer starts in milliseconds, inherits the trainer's state (CPU compatibility patches, the
    preemption handler, which only records the signal, so the writer finishes) and the results pipe. The
    persistent writer is a spawned interpreter: slow to start, and it calls ``torch.cuda.set_device``.
    """
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue(persistent=False)


def dcp_async_save_request(state_dict: dict[str, Any], path: str, then: list) -> Any:
    """An ``AsyncRequest`` writing ``state_dict`` (DTensors and plain values) as a torch distributed checkpoint into
    ``path`` with megatron-core's async writer, for the manager's queue: collective now (DCP's planning), the write in
    the forked writer, then on every rank DCP's finalize (the coordinator writes ``.metadata``) and ``then``.

    What Megatron-LM 0.19.2's ``save_checkpoint`` does for ``--ckpt-format fsdp_dtensor --async-save``
    (``megatron/training/checkpointing.py``, ``async_utils.get_save_and_finalize_callbacks``), with the pieces both
    megatron-core 0.16 and 0.19 ship: ``FileSystemWriterAsync``, ``save_state_dict_async_plan`` and
    ``save_state_dict_async_finalize``. Planning with torch's ``DefaultSavePlanner`` writes the same layout as a
    synchronous ``torch.distributed.checkpoint.save``, so either loads with ``torch.distributed.checkpoint.load``.
    """
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from torch.distributed.checkpoint import DefaultSavePlanner

    install_write_results_queue()  # the forked writer reports its results through this process's pipe
    writer = FileSystemWriterAsync(path)
    planned = save_state_dict_async_plan(state_dict, writer, None, 0, planner=DefaultSavePlanner())[0]
    write, preload, write_args = writer.get_save_function_and_args()

    def finalize() -> None:
        save_state_dict_async_finalize(*planned)
        for fn in then:
            fn()

    return AsyncRequest(write, write_args, [finalize], preload_fn=preload)
