"""A signal during a step that ends on a periodic save stops the run before that save starts.

The stop is recorded (stop_reason.json says "signal") before anything slow runs; the step is then saved once,
as the stop's checkpoint, not as an interval save that the launcher's grace period may cut off with nothing on
record (the newest-lane Slurm run that ended FAILED instead of requeued). One process, a fresh interpreter
(signals are process-wide): the real trainer with the SIGTERM sent from inside step 10's training step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SIGNAL_IN_STEP_10 = """
import os, signal, sys
from megatron_resilience.__main__ import main
from megatron_resilience.runtime import loop

real_step = loop.train_step

def train_step(ctx):
    if ctx.state.step + 1 == 10:
        os.kill(os.getpid(), signal.SIGTERM)  # as Slurm's --signal, in the middle of the step
    return real_step(ctx)

loop.train_step = train_step
main(sys.argv[1:])
"""


def test_signal_in_a_save_step_stops_first_and_saves_once_as_the_stop(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_STEP_10, f"run_dir={run_dir}", "train.max_steps=20",
         "checkpoint.save_interval=10", f"checkpoint.save={run_dir / 'ckpt'}", "train.exit_signal_handler=true"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [(r["step"], r["reason"]) for r in records if r["kind"] == "checkpoint"]
    assert saves == [(10, "signal")], saves  # no interval save of step 10 ahead of the stop
    assert max(r["step"] for r in records if r["kind"] == "train") == 10
    stop = json.loads((run_dir / "stop_reason.json").read_text())
    assert (stop["reason"], stop["step"], stop["checkpoint_step"], stop["lost_steps"], stop["checkpoint_at_stop"]) \
        == ("signal", 10, 10, 0, "saved"), stop
    assert stop["signal"]["received_during"] == "step 10", stop
    assert "stopping after step 10: SIGTERM received; saving a checkpoint and exiting 0" in proc.stderr
    assert sorted(os.listdir(run_dir / "ckpt")) == ["iter_0000010", "latest_checkpointed_iteration.txt"]


_SIGNAL_IN_SLOW_SAVE = """
import os, signal, sys
from megatron_resilience.__main__ import main
from megatron_resilience.runtime import loop

real_save = loop.save_checkpoint

def save_checkpoint(ctx, reason):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives as the periodic save starts; the save then takes 60 s
    return real_save(ctx, reason)

loop.save_checkpoint = save_checkpoint
main(sys.argv[1:])
"""


def test_signal_during_a_save_the_launcher_cuts_off_still_reads_as_preempted(tmp_path):
    """The save outlasts the grace period and the process is SIGKILLed (as torchrun does after
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before the ranks ever agree on the stop: stop_reason.json, written by the
    handler when the signal came, already says "signal", so the job-level decision requeues the attempt."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGNAL_IN_SLOW_SAVE, f"run_dir={run_dir}", "train.max_steps=20",
         "checkpoint.save_interval=10", f"checkpoint.save={run_dir / 'ckpt'}", "train.exit_signal_handler=true",
         "checkpoint.simulated_slow_save=60"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("w"), start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    stop_file = run_dir / "stop_reason.json"
    try:
        deadline = time.monotonic() + 240
        while not stop_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's SIGKILL, mid-save
        proc.wait(timeout=60)
    err = (tmp_path / "stderr").read_text()
    stop = json.loads(stop_file.read_text())
    assert {k: stop[k] for k in ("reason", "step", "exit_code", "finished", "checkpoint_step", "lost_steps",
                                 "checkpoint_at_stop")} == {
        "reason": "signal", "step": 10, "exit_code": 0, "finished": False, "checkpoint_step": None,
        "lost_steps": 10, "checkpoint_at_stop": "pending"}, err[-3000:]
    assert stop["signal"]["received_during"] == "after step 10", stop  # sent just before the save began
    assert not (run_dir / "ckpt" / "iter_0000010").exists()  # the save never finished
