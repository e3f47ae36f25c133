"""The checkpoint writer's results queue (upstream/dist_checkpointing.PipeResultsQueue): no server process,
and no deadlock however large the results, for the two writers dist_checkpointing uses with it (the trainer
process itself for sync saves, a forked child for async saves). Pure stdlib: fast, no torch."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal

import pytest

from megatron_resilience.upstream.dist_checkpointing import PipeResultsQueue

BIG = {"results": [("item", i, "x" * 100) for i in range(30_000)]}  # ~3.5 MB pickled: far beyond a pipe buffer


def _put_and_exit(results: PipeResultsQueue, payload) -> None:
    results.put(payload)


def test_forked_writer_with_large_results_exits_before_the_trainer_reads():
    """dist_checkpointing learns that a forked write is done when the child has exited, and only then reads
    the results: the child must be able to exit with results far larger than the pipe buffer."""
    results = PipeResultsQueue()
    child = multiprocessing.get_context("fork").Process(target=_put_and_exit, args=(results, BIG))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert results.get_nowait() == BIG
    with pytest.raises(queue.Empty):
        results.get_nowait()


def test_sync_writer_in_the_same_process():
    results = PipeResultsQueue()
    results.put(BIG)
    results.put({"second": 2})
    assert results.get_nowait() == BIG
    assert results.get_nowait() == {"second": 2}


def test_a_preemption_signal_kills_no_part_of_it():
    """The queue is served by this process: SIGTERM to the process group (what torchrun/ft_launcher forward)
    has nothing else to kill. Here: the handler only records the signal, and the queue still works."""
    results = PipeResultsQueue()
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        signal.raise_signal(signal.SIGTERM)
        child = multiprocessing.get_context("fork").Process(target=_put_and_exit, args=(results, {"ok": 1}))
        child.start()
        child.join(timeout=120)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM] and multiprocessing.active_children() == []
    assert results.get_nowait() == {"ok": 1}


def test_it_cannot_travel_to_a_spawned_writer():
    with pytest.raises(TypeError, match="forked checkpoint writer"):
        pickle.dumps(PipeResultsQueue())
