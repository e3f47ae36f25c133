"""The preemption handler on its own, in fresh interpreters (signals are process-wide): no torch, fast.

A signal during setup makes the process leave at once, exit 0, with its log line, the ``signal`` record and a
stop_reason.json that says "stopped by the signal, nothing lost"; after setup it is only recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


# A survivor of a peer's death: its collective raised "Connection closed by peer" mid-step (here: raised by the
# setup, which is stubbed; the lost-peer path and the handler are the real ones), it decided to exit 1, and
# ft_launcher's teardown SIGTERM reaches it while it tears down (stubbed teardown sends it: the moment seen in
# the long chaos run, tests/joblevel_corpus/stale_stop_record_then_xid_in_setup.log). The first stage
# "after step 12" is where the handler would write "stopped on a signal, exit 0".
_FAILED_THEN_TORN_DOWN = """
import os, signal, sys, time
from megatron_resilience import trainer
from megatron_resilience.config import PretrainConfig, TrainingConfig
from megatron_resilience.resilience.preemption import install_at_process_start
from megatron_resilience.runtime.setup_timeline import SetupTimeline
run_dir, where = sys.argv[1], sys.argv[2]
config = PretrainConfig(run_dir=run_dir, train=TrainingConfig(exit_signal_handler=True, exit_signal="SIGTERM"))
handler = install_at_process_start(True, "SIGTERM", run_dir=run_dir, checkpoint_root=None)
def setup(config, hooks, start_time, timeline):
    if where == "after a step":
        hooks._phase("after step 12", 12)
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:4471")
def teardown():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("torn down:", handler.count, handler.received_during, flush=True)
trainer._setup, trainer._teardown = setup, teardown
trainer._train(config, 0, 2, time.monotonic(), SetupTimeline(), None, None)
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


@pytest.mark.parametrize("where", ["in setup", "after a step"])
def test_a_rank_leaving_for_a_lost_peer_stays_a_failure_when_the_launchers_sigterm_arrives(tmp_path, where):
    proc = _run(_FAILED_THEN_TORN_DOWN, str(tmp_path), where)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "torn down: 1 failed (RuntimeError)" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert ("rank 0: lost contact with another rank (RuntimeError: Connection closed by peer); exiting with code 1 "
            "so the launcher restarts the worker group") in proc.stderr
    assert "nothing trained yet, exiting 0" not in proc.stderr
    assert not (tmp_path / "stop_reason.json").exists()
