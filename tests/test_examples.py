"""The examples run as users would run them: the resilient demo, the Python script, the CLI walkthrough, the notebook."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _env(tmp_path) -> dict:
    """A private NeMo-Run home, so the test never touches the user's ~/.nemo_run."""
    return {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemo_run_home"), "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_make_demo_survives_a_killed_rank_with_zero_lost_steps(tmp_path):
    """`make demo`: 2 CPU ranks under the real ft_launcher via run.Experiment; rank 1 SIGKILLed at step 25."""
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "demo.py"), "--dir", str(tmp_path / "runs"),
         "--plot", str(tmp_path / "demo.png")],
        capture_output=True, text=True, timeout=400, env=_env(tmp_path), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "demo: job SUCCEEDED" in out
    assert "steps:        40/40 completed, last step 40 (finished)" in out
    assert "restarts:     1 (after step 24 -> resumed from checkpoint at step 20)" in out
    assert "checkpoints:  4 at steps [10, 20, 30, 40]" in out
    assert "lost steps:   0\n" in out
    assert "recomputed:   4 steps after the last checkpoint before the fault; losses bit-identical on re-run" in out

    (summary_path,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "runs") for f in files
                       if f == "demo_summary.json"]
    summary = json.load(open(summary_path))
    assert (summary["lost_steps"], summary["restarts"], summary["resumed_from"], summary["checkpoints"]) == \
        (0, 1, [20], [10, 20, 30, 40])
    # The restart really went through ft_launcher: its log names the dead rank and the restart.
    launcher_log = "".join(open(os.path.join(d, f), errors="replace").read()
                           for d, _, files in os.walk(tmp_path / "nemo_run_home") for f in files
                           if f == "combined.log")
    assert "SIMULATED FAULT" in launcher_log and "rank_killed on rank 1" in launcher_log
    assert "will restart worker group" in launcher_log
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
