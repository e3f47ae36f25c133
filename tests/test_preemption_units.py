"""The preemption handler on its own, in fresh interpreters (signals are process-wide): no torch, fast.

A signal during setup makes the process leave at once, exit 0, with its log line, the ``signal`` record and a
stop_reason.json that says "stopped by the signal, nothing lost"; after setup it is only recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DURING_SETUP = """
import os, signal, sys, time
from megatron_resilience.resilience.preemption import install_at_process_start
run_dir, ckpt = sys.argv[1], sys.argv[2]
install_at_process_start(True, "SIGTERM", run_dir=run_dir, checkpoint_root=ckpt)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("still running", flush=True)
sys.exit(3)
"""

_AFTER_SETUP = """
import os, signal, sys
from megatron_resilience.resilience.preemption import handler_for, install_at_process_start
handler = install_at_process_start(True, "SIGTERM", run_dir=sys.argv[1], checkpoint_root=None)
handler.phase = "step 7"
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)
assert handler_for("SIGTERM", rank=0) is handler
print(handler.received, handler.count, handler.received_during, flush=True)
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "0"})


def test_signal_during_setup_exits_0_at_once_with_its_records(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20\n")
    proc = _run(_DURING_SETUP, str(tmp_path), str(ckpt))
    assert proc.returncode == 0 and "still running" not in proc.stdout, proc.stderr
    assert "preemption: received SIGTERM at " in proc.stderr
    assert "(phase: setup; pid " in proc.stderr and "nothing trained yet, exiting 0" in proc.stderr
    stop = json.loads((tmp_path / "stop_reason.json").read_text())
    assert stop == {"reason": "signal", "step": 20, "exit_code": 0, "finished": False, "checkpoint_step": 20,
                    "lost_steps": 0, "checkpoint_at_stop": "not needed", "signal": stop["signal"]}
    assert stop["signal"]["received_during"] == "setup" and stop["signal"]["count"] == 1
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (record["kind"], record["signal"], record["step"], record["before_training"]) == ("signal", "SIGTERM", 20,
                                                                                           True)


def test_signal_after_setup_is_only_recorded_and_a_second_one_changes_nothing(tmp_path):
    proc = _run(_AFTER_SETUP, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "2", "step", "7"]
    assert not (tmp_path / "stop_reason.json").exists()
