"""A healthy run with one in-job restart reads as healthy: no traceback, no ERROR line, no Python warning; the
restart line says which attempt it is and what was lost; progress lines show an ETA.

The run is ``make demo`` made small (``examples/demo.py``'s ``build`` and ``launch``: the gpt_tiny recipe
on 2 CPU ranks under the real ft_launcher through ``run.Experiment`` with both plugins, rank 1 SIGKILLed),
and the log is the job's combined launcher + ranks log, the one a person opens.

Two kinds of upstream lines stay, and only them (docs/trainer.md): the launcher's one ERROR line that
reports the killed rank (that is the fault itself), and, on a machine without NVML (no GPU driver, as
here), nvidia-resiliency-ext's NIC health check reporting that NVML cannot be loaded.
"""

import ctypes.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from demo import build, launch
    task, executor, plugins = build(sys.argv[2], max_steps=12, fault_step=7, save_interval=4)
    state, job_dir = launch(task, executor, plugins)
    print("RESULT", state, job_dir)
""")

NO_NVML = ctypes.util.find_library("nvidia-ml") is None
# nvidia-resiliency-ext's NIC health check without NVML: an ERROR with a traceback, then two more ERROR lines.
NVML_NOISE = (r"\[ERROR\] \[ft_launcher\d+@[^]]+\] (NVML Error: NVML Shared Library Not Found|"
              r"Failed to shut down NVML: Uninitialized|"
              r"gpu_ib_map is empty\. Disable NIC health check for local_rank: \d)")
KILL_REPORT = r"\[ERROR\] \[ft_launcher\d+@[^]]+\] failed \(exitcode: -9\) local_rank: 1 \(pid: \d+\) of binary: "
LAUNCHER_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d ")


def without_known_upstream_lines(log: str) -> tuple[list[str], int]:
    """The log's lines minus the allowed upstream ones (a traceback goes with the ERROR line it follows)."""
    kept, kills, skipping = [], 0, False
    for line in log.splitlines():
        if skipping and not LAUNCHER_LINE.match(line) and not line.startswith("[default"):
            continue  # the traceback under an NVML ERROR line
        skipping = False
        if NO_NVML and re.search(NVML_NOISE, line):
            skipping = True
            continue
        if re.search(KILL_REPORT, line):
            kills += 1
            continue
        kept.append(line)
    return kept, kills


@pytest.fixture
def private_dir():
    """Outside pytest's rotating tmp: pytest sessions running beside this one may prune it mid-run."""
    path = tempfile.mkdtemp(prefix="megatron_resilience_healthy_log_")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_a_healthy_run_with_one_in_job_restart_logs_no_traceback_no_error_no_warning(private_dir):
    tmp_path = private_dir
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", RUN, os.path.join(ROOT, "examples"), str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    state, job_dir = proc.stdout.split("RESULT ", 1)[1].split()
    assert state == "SUCCEEDED"
    (log_path,) = [os.path.join(d, f) for d, _, files in os.walk(job_dir) for f in files if f == "combined.log"]
    log = open(log_path, errors="replace").read()
    assert "SIMULATED FAULT" in log and "will restart worker group" in log  # the restart happened

    lines, kills = without_known_upstream_lines(log)
    assert kills == 1
    assert [line for line in lines if "Traceback" in line] == []
    assert [line for line in lines if "[ERROR]" in line or " ERROR " in line] == []
    assert [line for line in lines if re.search(r"\w+Warning: ", line)] == []  # Python warnings

    setups = [line.split("megatron_resilience: ", 1)[1] for line in lines if "megatron_resilience: setup: " in line]
    assert len(setups) == 2
    assert setups[0].endswith("; attempt: in-job restart 0, requeue 0; no checkpoint; nothing logged before")
    assert setups[1].startswith("setup: resumed at step 4 (consumed_samples=32)")
    assert setups[1].endswith("; attempt: in-job restart 1, requeue 0; checkpoint at step 4; lost: steps 5-6 logged "
                              "before this start (2 steps, recomputed now)")
    progress = [line for line in lines if "megatron_resilience.metrics: step " in line]
    assert len(progress) >= 12 and all(re.search(r" \| ETA \d+(h\d\dm|m\d\ds|s)$", line) for line in progress)
    assert progress[-1].split("metrics: ", 1)[1].startswith("step 12/12 |") and progress[-1].endswith("| ETA 0s")

    run_dir = os.path.join(str(tmp_path / "runs"), "gpt_tiny")
    starts = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"start"' in line]
    assert [(s["attempt"]["in_job_restart"], s["attempt"]["slurm_restart"], s["resumed_from"],
             s["last_logged_step"]) for s in starts] == [(0, 0, None, None), (1, 0, 4, 6)]
