"""Rank 0 SIGKILLed ten times in one job, once in each moment of its life, and the job restarts every time.

Rank 0 hosts the process-group store on the job's own port (``runtime/job_store.py``). When a rank 0 died while a
process it had forked (the async checkpoint writer) lived on, that child kept the port bound and every in-job
restart's rank 0 failed to bind it (issue 35: a 15-minute chaos job lost 13 minutes that way). Now forked
children close their copy of the listening socket and die with the rank (``runtime/forked_children.py``), and the
store binds once, without waiting: a port still in use is an error, which here would cost an extra restart.

The real trainer (2 CPU ranks, gloo) under the real ft_launcher with exactly 10 in-job restarts allowed; the test
kills rank 0 at each moment (just started, importing, store just bound, loading the checkpoint, in a step, with
an async save in flight) and asserts: the launcher finished with exit 0 after the 10 kills (so no restart failed
for any other reason), no bind or store connection failed, the first save's writer (a forked child of the killed
rank, held alive on purpose by ``checkpoint.simulated_slow_save``) and the writers it forked died with it, and
every step trained in several attempts has the same loss each time (the resumes are exact).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from resilience_support.launch import launch, wait_for

pytestmark = pytest.mark.slow

# (moment, the marker in rank 0's new log lines at which it is killed; None: as soon as its process exists)
MOMENTS = [
    ("a save in flight", "checkpoint: scheduled async save of step"),  # first attempt: the writer waits 60 s
    ("right after the restart", None),
    ("importing", "FT: connected to the rank monitor"),
    ("store just bound", "process-group store on this job's port"),
    ("loading the checkpoint", "] megatron_resilience.runtime.data: data:"),
    ("in a step", "megatron_resilience.metrics: step "),
    ("a save in flight", "checkpoint: scheduled async save of step"),
    ("store just bound", "process-group store on this job's port"),
    ("in a step", "megatron_resilience.metrics: step "),
    ("loading the checkpoint", "] megatron_resilience.runtime.data: data:"),
]
WAIT = 1200  # the whole job, on a loaded 2-core machine


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def killed_ten_times(tmp_path_factory):
    run = launch(tmp_path_factory.mktemp("rank0") / "run", [
        "train.max_steps=60", "checkpoint.save_interval=4", "checkpoint.async_save=true",
        "checkpoint.simulated_slow_save=60", "train.log_interval=1"], max_restarts=len(MOMENTS))
    kills = []
    for cycle, (moment, marker) in enumerate(MOMENTS):
        def rank0_of_this_cycle():
            if run.proc.poll() is not None:
                raise AssertionError(f"the launcher ended before kill {cycle}:\n{run.log()[-4000:]}")
            workers = run.worker_pids()
            return workers[0][0] if 0 in workers and workers[0][1] == cycle else None

        pid = wait_for(rank0_of_this_cycle, timeout=WAIT, interval=0.05, what=f"rank 0 of attempt {cycle}")
        start = len(run.log())
        if marker is not None:
            def marked():
                if run.proc.poll() is not None:
                    raise AssertionError(f"the launcher ended before kill {cycle}:\n{run.log()[-4000:]}")
                new = run.log()[start:]
                return any(marker in line and "[rank 0]" in line for line in new.splitlines())

            wait_for(marked, timeout=WAIT, interval=0.05, what=f"'{marker}' in attempt {cycle}")
        children = [c for c in _descendants(pid) if _alive(c)]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # a writer left alive would wait out its 60 s slow save, and longer
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        kills.append({"moment": moment, "pid": pid, "children": children,
                      "outlived": [c for c in children if _alive(c)]})
    returncode = run.wait(WAIT)
    return {"run": run, "kills": kills, "returncode": returncode}


def test_ten_kills_of_rank_0_ten_restarts_and_the_run_finishes(killed_ten_times):
    run = killed_ten_times["run"]
    log = run.log()
    assert killed_ten_times["returncode"] == 0, log[-5000:]
    assert [k["moment"] for k in killed_ten_times["kills"]] == [m for m, _ in MOMENTS]
    assert run.stop_reason()["reason"] == "finished" and run.stop_reason()["step"] == 60
    assert run.flag.exists()


def test_no_bind_and_no_store_connection_ever_failed(killed_ten_times):
    log = killed_ten_times["run"].log()
    assert "cannot bind port" not in log and "cannot reach rank 0's store" not in log
    assert "EADDRINUSE" not in log and "Address already in use" not in log


def test_the_first_saves_writer_died_with_the_killed_rank(killed_ten_times):
    first = killed_ten_times["kills"][0]
    assert first["children"], "the first save's writer (a forked child of rank 0) was not running at the kill"
    assert [k["outlived"] for k in killed_ten_times["kills"]] == [[]] * len(MOMENTS)


def test_every_step_trained_twice_has_the_same_loss(killed_ten_times):
    by_step: dict[int, set] = {}
    for record in killed_ten_times["run"].train_records(last_per_step=False):
        by_step.setdefault(record["step"], set()).add(record["loss"])
    assert sorted(by_step) == list(range(1, 61))
    assert {s: v for s, v in by_step.items() if len(v) > 1} == {}
