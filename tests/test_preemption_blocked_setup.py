"""A signal during setup while the main thread is blocked in a C call: the process still leaves at once, exit 0.

The case long-form run 6 met (docs/goodput.md): after an in-job restart, rank 0 left on the preemption and rank 1,
connecting to a TCPStore that rank 0 had hosted, stayed in torch's C++ retry loop (which swallows EINTR, so Python's
handler never runs) until the launcher killed it. Here a fresh interpreter installs the handler as a trainer does,
then connects to a port nothing listens on with a 10-minute store timeout; SIGTERM must end it with the handler's
log line and records. Without the setup watcher (``preemption.py``) it stays in the store for 10 minutes: the wait
below gives up after 5 and the test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BLOCKED_IN_SETUP = """
import datetime, sys
from megatron_resilience.resilience.preemption import install_at_process_start
install_at_process_start(True, "SIGTERM", run_dir=sys.argv[1], checkpoint_root=None)
from torch.distributed import TCPStore
print("connecting", flush=True)
TCPStore("127.0.0.1", int(sys.argv[2]), world_size=2, is_master=False, timeout=datetime.timedelta(minutes=10))
print("the store returned", flush=True)
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_signal_reaches_a_rank_blocked_in_a_store_connect_during_setup(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_IN_SETUP, str(tmp_path), str(_closed_port())], cwd=REPO,
                            env={**os.environ, "RANK": "0"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "connecting", proc.stderr.read()
        time.sleep(3)  # inside the store's connect loop
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "the store returned" not in out, err[-3000:]
    assert "(phase: setup; pid " in err and "nothing trained yet, exiting 0" in err, err[-3000:]
    stop = json.loads((tmp_path / "stop_reason.json").read_text())
    assert (stop["reason"], stop["exit_code"], stop["checkpoint_at_stop"]) == ("signal", 0, "not needed")
    assert stop["signal"]["received_during"] == "setup" and stop["signal"]["count"] == 1
