"""The shell our plugins add to the sbatch script, run by bash.

The requeue-after-preemption block and the FT config heredoc are cut out of the golden scripts and
run by bash (with nemo_run's own end of the script) with the job and run directories moved to
temporary ones; the trainer's stop_reason.json is produced by the trainer's own writer. ``scontrol`` is a stub that records its
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


GOLDEN_RUN_DIR = "/lustre/runs/gpt"


def golden_text(golden: str) -> str:
    with open(os.path.join(GOLDEN, golden)) as f:
        return f.read()


def block(golden: str, name: str, job_dir: str, run_dir: str = GOLDEN_RUN_DIR) -> str:
    found = re.search(rf"# >>> megatron_resilience {name} >>>\n.*?# <<< megatron_resilience {name} <<<\n",
                      golden_text(golden), re.S)
    assert found, f"{name} block missing from {golden}"
    return found.group(0).replace(GOLDEN_JOB_DIR, job_dir).replace(GOLDEN_RUN_DIR, run_dir)


def tail(golden: str, code: int) -> str:
    """nemo_run's own end of the script (after the srun), with the srun's exit code set to ``code``."""
    text = golden_text(golden).split("\n\n# ==> ")[0]
    return f"exitcode={code}\n" + text[text.index("exitcode=$?") + len("exitcode=$?"):] + "\n"


def run_batch(tmp_path, body: str, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol_calls"
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    stub.chmod(0o755)
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "TORCHX_MAX_RETRIES": "0", **env}
    proc = subprocess.run(["bash", "-c", body], env=environment, capture_output=True, text=True, timeout=30)
    return proc, calls.read_text().splitlines() if calls.exists() else []


def trainer_writes_stop_reason(run_dir: str, reason: str, code: int) -> str:
    """Shell that writes the file exactly as the trainer does (its own writer, run here to get the bytes)."""
    from types import SimpleNamespace

    from megatron_resilience.resilience.hooks import STOP_REASON_FILE, ResilienceHooks
    from megatron_resilience.plugins.preemption import STOP_REASON_FILE as PLUGIN_STOP_REASON_FILE

    assert PLUGIN_STOP_REASON_FILE == STOP_REASON_FILE
    scratch = os.path.join(run_dir, "scratch")
    ResilienceHooks._write_stop_reason(SimpleNamespace(config=SimpleNamespace(run_dir=scratch)),
                                       SimpleNamespace(step=10), reason, code)
    with open(os.path.join(scratch, STOP_REASON_FILE)) as f:
        content = f.read()
    return f"cat > {run_dir}/{STOP_REASON_FILE} <<'EOF'\n{content}\nEOF\n"


FINISHED = 'touch "$FAULT_TOL_FINISHED_FLAG_FILE"\n'


# (trainer's ending, srun exit code, TORCHX_MAX_RETRIES, SLURM_RESTART_COUNT) -> scontrol calls
@pytest.mark.parametrize("ending, code, retries, restart, calls", [
    (("signal", 0), 1, "0", None, ["requeue 42"]),  # torchrun exits 1 after forwarding SIGTERM
    (("signal", 0), 0, "0", None, ["requeue 42"]),  # no launcher: python's own exit 0
    (("signal", 0), 1, "2", None, ["requeue 42"]),  # nemo_run's template requeues; the trap does not again
    (("signal", 0), 1, "2", "2", ["requeue 42"]),  # retries used up by earlier requeues: the trap requeues
    (("duration", 0), 0, "0", "1", ["requeue 42"]),
    (("finished", 0), 0, "0", None, []),
    (("rerun:16", 16), 16, "0", None, []),  # 16/17 are the template's (and retries') business
    (None, 1, "0", None, []),  # crash: no stop_reason.json
])
def test_preemption_requeue_block(tmp_path, ending, code, retries, restart, calls):
    job_dir, run_dir = str(tmp_path / "job"), str(tmp_path / "run")
    os.makedirs(job_dir)
    os.makedirs(run_dir)
    trainer = ""
    if ending is not None:
        trainer = trainer_writes_stop_reason(run_dir, *ending) + (FINISHED if ending[0] == "finished" else "")
    env = {"TORCHX_MAX_RETRIES": retries, **({"SLURM_RESTART_COUNT": restart} if restart else {})}
    golden = "preemption_partial.sh"
    body = block(golden, "PreemptionPlugin requeue", job_dir, run_dir) + trainer + tail(golden, code)
    proc, scontrol = run_batch(tmp_path, body, **env)
    assert proc.returncode == code, proc.stderr
    assert scontrol == calls
    if calls and code == 0:
        assert "Trainer stopped before finishing" in proc.stdout


def test_stale_stop_reason_of_an_earlier_attempt_is_ignored(tmp_path):
    job_dir, run_dir = str(tmp_path / "job"), str(tmp_path / "run")
    os.makedirs(job_dir)
    os.makedirs(run_dir)
    golden = "preemption_partial.sh"
    stale = trainer_writes_stop_reason(run_dir, "signal", 0)
    body = stale + block(golden, "PreemptionPlugin requeue", job_dir, run_dir) + tail(golden, 1)  # then a crash
    proc, scontrol = run_batch(tmp_path, body, SLURM_RESTART_COUNT="1")
    assert (proc.returncode, scontrol) == (1, [])


def test_requeued_job_that_already_finished_exits_at_once(tmp_path):
    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    open(os.path.join(job_dir, "gpt_finished_flag"), "w").close()
    golden = "preemption_partial.sh"
    body = block(golden, "PreemptionPlugin requeue", job_dir, str(tmp_path)) + "echo TRAINER-RAN\n" + tail(golden, 0)
    proc, calls = run_batch(tmp_path, body, SLURM_RESTART_COUNT="1")
    assert (proc.returncode, calls) == (0, [])
    assert "Training is finished" in proc.stdout and "TRAINER-RAN" not in proc.stdout


def test_first_attempt_removes_a_stale_finished_flag(tmp_path):
    job_dir, run_dir = str(tmp_path / "job"), str(tmp_path / "run")
    os.makedirs(job_dir)
    os.makedirs(run_dir)
    open(os.path.join(job_dir, "gpt_finished_flag"), "w").close()
    golden = "preemption_partial.sh"
    body = (block(golden, "PreemptionPlugin requeue", job_dir, run_dir) + trainer_writes_stop_reason(run_dir, "signal", 0)
            + tail(golden, 0))
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
