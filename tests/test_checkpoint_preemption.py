"""Preemption and async checkpoints with the real launchers, 2 CPU ranks, the production settings
(``parallel.use_distributed_optimizer=true checkpoint.async_save=true train.exit_signal_handler=true``):

- the newest-stack bug (issue 17): SIGTERM to ft_launcher (FT on) after ~28 steps, an async interval save at 20:
  exit 0, the checkpoint at the signal's step complete, no ``.tmp`` left, and the resumed run's losses equal an
  uninterrupted run's;
- a rank killed right after an async interval save was committed resumes from that interval (the save is
  committed by the per-step poll, not by the next save);
- a signal during setup (torchrun): every rank exits 0 at once (setup on a loaded node may outlast torchrun's
  30 s grace), nothing lost, and the next attempt trains from where the job was;
- a save at the signal that cannot finish before torchrun's kill (``checkpoint.simulated_slow_save`` >
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``): ``stop_reason.json``, written before that save, still says "stopped by the
  signal, resume from the previous checkpoint" with the lost steps; the next attempt resumes from there.

Every launch is independent and they run concurrently (a thread pool per module). Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from resilience_support.launch import launch, wait_for

pytestmark = pytest.mark.slow

PRODUCTION = ["parallel.use_distributed_optimizer=true", "train.exit_signal_handler=true", "train.max_steps=40"]
ASYNC_20 = ["checkpoint.async_save=true", "checkpoint.save_interval=20"]
WAIT = 900  # per launch; generous: other suites load the same 2 cores
REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


# --- launches -----------------------------------------------------------------------------------------------------


class Torchrun:
    """``torchrun --standalone --nproc-per-node=2 -m megatron_resilience``, output in ``<run_dir>/launcher.log``."""

    def __init__(self, run_dir: Path, overrides: list[str], env: dict[str, str]) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.log_path = run_dir / "launcher.log"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "megatron_resilience", f"run_dir={run_dir}",
                 f"checkpoint.save={run_dir / 'ckpt'}", *overrides],
                cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = WAIT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"torchrun did not finish in {timeout}s; log tail:\n{self.log()[-3000:]}") from None


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if kind is None or r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}  # a re-run step keeps its last value


def entries(run_dir: Path) -> list[str]:
    return sorted(os.listdir(run_dir / "ckpt"))


def stop_reason(run_dir: Path) -> dict:
    return json.loads((run_dir / "stop_reason.json").read_text())


def _reference(root: Path):
    run = launch(root / "reference", PRODUCTION + ASYNC_20, max_restarts=0)
    run.wait(WAIT)
    return run


def _issue17(root: Path):
    """SIGTERM to ft_launcher (as Slurm signals the step's task) once step 28 is logged."""
    overrides = PRODUCTION + ASYNC_20
    first = launch(root / "issue17", overrides, max_restarts=1, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"})
    wait_for(lambda: len(records(first.run_dir, "train")) >= 28, timeout=WAIT, what="step 28")
    first.proc.send_signal(signal.SIGTERM)
    first.wait(WAIT)
    first.extra = {"stop_reason": stop_reason(first.run_dir), "entries": entries(first.run_dir),
                   "log": first.log()}
    second = launch(root / "issue17", overrides, max_restarts=1)
    second.wait(WAIT)
    return first, second


def _killed_after_commit(root: Path):
    """SIGKILL rank 1 as soon as the async save of step 20 is committed (ft_launcher restarts the workers)."""
    run = launch(root / "killed", PRODUCTION + ASYNC_20, max_restarts=1)
    committed = f"checkpoint: committed {run.run_dir / 'ckpt' / 'iter_0000020'}"
    wait_for(lambda: committed in run.log() or run.proc.poll() is not None, timeout=WAIT, interval=0.05,
             what="the commit of step 20")
    trained = max(losses(run.run_dir), default=0)
    workers = run.worker_pids()
    if 1 in workers:
        os.kill(workers[1][0], signal.SIGKILL)
    run.wait(WAIT)
    run.extra = {"killed_after_step": trained, "killed": 1 in workers}
    return run


def _setup_signal(root: Path):
    """SIGTERM to torchrun while the ranks are still setting up (after the handler's start-up line)."""
    run_dir = root / "setup_signal"
    first = Torchrun(run_dir, PRODUCTION + ASYNC_20, env={})
    # Rank 0 announces its handler before importing torch and Megatron-Core; 2 s later every rank has its handler
    # and is still importing ("distributed:" comes 0.4 s before the first step on a quiet machine: too late).
    wait_for(lambda: "handler installed at process start" in first.log() or first.proc.poll() is not None,
             timeout=WAIT, interval=0.05, what="the trainer's setup")
    time.sleep(2.0)
    first.proc.send_signal(signal.SIGTERM)
    code = first.wait()
    first_result = {"code": code, "stop_reason": stop_reason(run_dir), "records": records(run_dir),
                    "log": first.log()}
    second = Torchrun(run_dir, PRODUCTION + ASYNC_20, env={"SLURM_RESTART_COUNT": "1"})
    return first_result, second.wait(), second


def _slow_save_killed(root: Path):
    """The save at the signal takes 60 s (first attempt), torchrun kills the ranks 5 s after forwarding it."""
    run_dir = root / "slow_save"
    overrides = PRODUCTION + ["checkpoint.save_interval=10"]
    first = Torchrun(run_dir, overrides + ["checkpoint.simulated_slow_save=60"],
                     env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"})
    # The periodic save of step 10 is slow too (sync): signal once it is committed and training goes on.
    wait_for(lambda: max(losses(run_dir), default=0) >= 12 or first.proc.poll() is not None, timeout=WAIT,
             what="step 12")
    first.proc.send_signal(signal.SIGTERM)
    code = first.wait()
    first_result = {"code": code, "stop_reason": stop_reason(run_dir), "entries": entries(run_dir),
                    "log": first.log()}
    second = Torchrun(run_dir, overrides + ["checkpoint.simulated_slow_save=60"], env={"SLURM_RESTART_COUNT": "1"})
    return first_result, second.wait(), second


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    jobs = {"reference": _reference, "issue17": _issue17, "killed": _killed_after_commit,
            "setup_signal": _setup_signal, "slow_save": _slow_save_killed}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(fn, root) for name, fn in jobs.items()}
        return {name: future for name, future in futures.items()}


def _result(runs, name):
    return runs[name].result()


def _reference_losses(runs) -> dict[int, float]:
    ref = _result(runs, "reference")
    assert ref.returncode == 0, ref.log()[-3000:]
    out = losses(ref.run_dir)
    assert sorted(out) == list(range(1, 41)), ref.log()[-3000:]
    return out


# --- the tests ----------------------------------------------------------------------------------------------------


def test_issue17_signal_after_an_async_interval_save_ends_with_the_signal_checkpoint(runs):
    first, second = _result(runs, "issue17")
    log = first.extra["log"]
    assert first.returncode == 0, log[-4000:]  # ft_launcher: all ranks exited 0 after the forwarded SIGTERM
    stop = first.extra["stop_reason"]
    step = stop["step"]
    assert 28 <= step < 40, log[-4000:]
    assert stop == {"reason": "signal", "step": step, "exit_code": 0, "finished": False, "checkpoint_step": step,
                    "lost_steps": 0, "checkpoint_at_stop": "saved", "signal": stop["signal"]}
    assert stop["signal"]["signal"] == "SIGTERM" and stop["signal"]["count"] == 1
    assert first.extra["entries"] == ["iter_0000020", f"iter_{step:07d}", "latest_checkpointed_iteration.txt"]
    for rank in (0, 1):  # one line per rank: the signal, when, during what
        assert len(re.findall(rf"\[rank {rank}\] .*received SIGTERM at \d{{4}}-", log)) == 1, log[-4000:]
    assert "Traceback" not in log.split("stopping after step")[1], log[-4000:]
    # The resumed run continues from the signal's checkpoint with the losses of an uninterrupted run.
    assert second.returncode == 0, second.log()[-3000:]
    assert [r["step"] for r in records(first.run_dir, "start")] == [0, step]
    assert losses(first.run_dir) == _reference_losses(runs)
    signal_records = records(first.run_dir, "signal")
    assert [(r["signal"], r["step"], r["before_training"]) for r in signal_records] == [("SIGTERM", step, False)]
    saved = {r["step"]: r for r in records(first.run_dir, "checkpoint")}
    assert sorted(saved) == [20, step, 40]
    assert saved[20]["async"] and saved[20]["reason"] == "interval" and saved[step]["reason"] == "signal"
    assert saved[step]["start_time"] >= signal_records[0]["first_received_time"]
    assert os.listdir(first.run_dir / "ckpt").count("latest_checkpointed_iteration.txt") == 1
    assert not [n for n in entries(first.run_dir) if n.endswith(".tmp")]


def test_rank_killed_right_after_an_async_interval_commit_resumes_from_that_interval(runs):
    run = _result(runs, "killed")
    log = run.log()
    assert run.extra["killed"], log[-4000:]
    # The commit of step 20 came from the per-step poll while training went on (not from a later save or
    # the end of the run): the kill landed before step 40.
    assert 20 <= run.extra["killed_after_step"] < 40, log[-4000:]
    assert run.returncode == 0, log[-4000:]
    starts = [r["step"] for r in records(run.run_dir, "start")]
    assert starts == [0, 20], log[-4000:]
    assert losses(run.run_dir) == _reference_losses(runs)


def test_signal_during_setup_exits_at_once_and_loses_nothing(runs):
    first, code, second = _result(runs, "setup_signal")
    stop, log = first["stop_reason"], first["log"]
    assert stop == {"reason": "signal", "step": 0, "exit_code": 0, "finished": False, "checkpoint_step": None,
                    "lost_steps": 0, "checkpoint_at_stop": "not needed", "signal": stop["signal"]}, log[-4000:]
    assert stop["signal"]["received_during"] == "setup", log[-4000:]
    assert [r["kind"] for r in first["records"]] == ["signal"], first["records"]  # no step, no checkpoint
    for rank in (0, 1):  # each rank left on its own, right away (not after finishing its setup)
        assert f"[rank {rank}] megatron_resilience.resilience.preemption: received SIGTERM at " in log, log[-4000:]
    assert log.count("nothing trained yet, exiting 0") == 2 and "forcefully exiting via 9" not in log, log[-4000:]
    assert code == 0, second.log()[-3000:]
    assert losses(second.run_dir) == _reference_losses(runs)


def test_save_at_the_signal_cut_off_by_the_launcher_still_requeues_from_the_previous_checkpoint(runs):
    first, code, second = _result(runs, "slow_save")
    stop, log = first["stop_reason"], first["log"]
    assert first["code"] != 0, log[-4000:]  # torchrun killed the ranks mid-save
    step = stop["step"]
    # Written before the save at the signal: stopped by the signal, resume from 10, the lost steps on record.
    assert stop == {"reason": "signal", "step": step, "exit_code": 0, "finished": False, "checkpoint_step": 10,
                    "lost_steps": step - 10, "checkpoint_at_stop": "pending", "signal": stop["signal"]}, log[-4000:]
    assert step > 10 and first["entries"] == ["iter_0000010", f"iter_{step:07d}.tmp",
                                              "latest_checkpointed_iteration.txt"]
    assert code == 0, second.log()[-3000:]
    resumed = second.log()
    assert f"skipping {second.run_dir / 'ckpt' / f'iter_{step:07d}.tmp'}" in resumed
    assert [r["step"] for r in records(second.run_dir, "start")] == [0, 10]
    assert losses(second.run_dir) == _reference_losses(runs)
