"""The shell our plugins add to the sbatch script, run by bash.

The requeue-after-preemption block and the FT config heredoc are cut out of the golden scripts and
run by bash with the job directory moved to a temporary one. ``scontrol`` is a stub that records its
arguments: these tests check the shell logic; the real-Slurm proof (signals, requeues, proctrack/cgroup)
lives in the Slurm test suite.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
GOLDEN_JOB_DIR = "/cluster/experiments/gpt/gpt_preview/gpt"


def block(golden: str, name: str, job_dir: str) -> str:
    with open(os.path.join(GOLDEN, golden)) as f:
        text = f.read()
    found = re.search(rf"# >>> megatron_resilience {name} >>>\n.*?# <<< megatron_resilience {name} <<<\n", text, re.S)
    assert found, f"{name} block missing from {golden}"
    return found.group(0).replace(GOLDEN_JOB_DIR, job_dir)


def run_batch(tmp_path, body: str, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol_calls"
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    stub.chmod(0o755)
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", **env}
    proc = subprocess.run(["bash", "-c", body], env=environment, capture_output=True, text=True, timeout=30)
    return proc, calls.read_text().splitlines() if calls.exists() else []


# The part of nemo_run's plain (non-FT) sbatch template that follows our setup lines.
TAIL = """
exitcode={code}
set -e
if [ $exitcode -ne 0 ]; then
    exit $exitcode
fi
"""


@pytest.mark.parametrize("finished, code, restart, requeued, out", [
    (False, 0, None, True, "Trainer stopped before finishing (preempted): requeueing 42"),
    (True, 0, None, False, ""),
    (False, 1, None, False, ""),  # failures are nemo_run's template's business (TORCHX_MAX_RETRIES)
    (False, 0, "2", True, "requeueing 42"),
])
def test_preemption_requeue_block(tmp_path, finished, code, restart, requeued, out):
    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    trainer = 'touch "$FAULT_TOL_FINISHED_FLAG_FILE"\n' if finished else ""
    env = {"SLURM_RESTART_COUNT": restart} if restart else {}
    body = block("preemption_partial.sh", "PreemptionPlugin requeue", job_dir) + trainer + TAIL.format(code=code)
    proc, calls = run_batch(tmp_path, body, **env)
    assert proc.returncode == code
    assert calls == (["requeue 42"] if requeued else [])
    assert out in proc.stdout


def test_requeued_job_that_already_finished_exits_at_once(tmp_path):
    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    open(os.path.join(job_dir, "gpt_finished_flag"), "w").close()
    body = block("preemption_partial.sh", "PreemptionPlugin requeue", job_dir) + "echo TRAINER-RAN\n" + TAIL.format(code=0)
    proc, calls = run_batch(tmp_path, body, SLURM_RESTART_COUNT="1")
    assert (proc.returncode, calls) == (0, [])
    assert "Training is finished" in proc.stdout and "TRAINER-RAN" not in proc.stdout


def test_first_attempt_removes_a_stale_finished_flag(tmp_path):
    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    open(os.path.join(job_dir, "gpt_finished_flag"), "w").close()
    body = block("preemption_partial.sh", "PreemptionPlugin requeue", job_dir) + TAIL.format(code=0)
    proc, calls = run_batch(tmp_path, body)
    assert calls == ["requeue 42"]
    assert not os.path.exists(os.path.join(job_dir, "gpt_finished_flag"))


def test_ft_heredoc_writes_the_yaml_ft_launcher_reads(tmp_path):
    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    body = block("ft_preemption_partial.sh", "FaultTolerancePlugin ft_launcher config", job_dir)
    proc, _ = run_batch(tmp_path, "set -evx\n" + body)
    assert proc.returncode == 0, proc.stderr
    with open(os.path.join(job_dir, "gpt_ft_cfg.yml")) as f:
        written = f.read()
    assert written == (
        "fault_tolerance:\n  workload_check_interval: 5.0\n  initial_rank_heartbeat_timeout: null\n"
        "  rank_heartbeat_timeout: null\n  rank_section_timeouts:\n    setup: 600.0\n    step: 180.0\n"
        "    checkpointing: 420.0\n  rank_out_of_section_timeout: 300.0\n  rank_termination_signal: SIGKILL\n"
        "  log_level: INFO\n")


def test_ft_golden_has_no_preemption_requeue_block():
    """With ft_launcher, nemo_run's FT teardown requeues; a second requeue from our trap must not exist."""
    for name in ("ft_preemption_partial.sh", "ft_preemption_script.sh", "ft_heartbeats_preemption_inline.sh"):
        with open(os.path.join(GOLDEN, name)) as f:
            assert "PreemptionPlugin requeue" not in f.read()


def test_golden_scripts_are_valid_bash():
    for path in sorted(glob.glob(os.path.join(GOLDEN, "*.sh"))):
        proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"
