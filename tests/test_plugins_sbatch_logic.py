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


# --- FaultTolerancePlugin: the whole rendered sbatch script, attempt after attempt ----------------------------------
# The script is rendered by ``preview`` (the plugins and nemo_run's own FT template) and run unchanged by bash.
# Stubs stand in for what cannot run here: ``srun`` (the ft_launcher step: it fails, finishes or is preempted as
# the plan says) and ``scontrol`` (records requeues). Each requeue starts the next attempt with
# SLURM_RESTART_COUNT + 1, as Slurm does; the real-Slurm proof is tests/slurm (test_3b).

SRUN_STUB = """#!/bin/bash
case "$*" in *hostname*) echo 127.0.0.1; exit 0;; esac
action=$(echo "$PLAN" | cut -d' ' -f$(( ${SLURM_RESTART_COUNT:-0} + 1 )))
case "$action" in
  fail) exit 1;;
  finish) touch "$FAULT_TOL_FINISHED_FLAG_FILE"; exit 0;;
  preempt) exit 0;;  # ft_launcher: every rank saved and exited 0 (stop_reason.json: exit_code 0, finished false)
  rerun17) touch "$FAULT_TOL_FINISHED_FLAG_FILE"; exit 17;;
esac
echo "no plan for attempt ${SLURM_RESTART_COUNT:-0}" >&2; exit 99
"""


def ft_script(tmp_path, retries: int) -> tuple[str, str]:
    """(rendered sbatch script, job directory on the "cluster") for FT + preemption with ``retries``."""
    from megatron_resilience.config import CheckpointConfig
    from megatron_resilience.entry import pretrain
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    cluster = tmp_path / "cluster"
    task = run.Partial(pretrain, run_dir=str(tmp_path / "run"),
                       checkpoint=run.Config(CheckpointConfig, save=str(tmp_path / "run" / "ckpt")))
    executor = run.SlurmExecutor(account="acct", partition="batch", nodes=1, ntasks_per_node=2, time="04:00:00",
                                 tunnel=run.LocalTunnel(job_dir=str(cluster)))
    script = preview(task, executor, [FaultTolerancePlugin(num_job_retries_on_failure=retries), PreemptionPlugin()],
                     name="gpt")
    job_dir = str(cluster / "gpt" / "gpt_preview" / "gpt")
    os.makedirs(job_dir)
    # preview masks torchrun's random rendezvous id as "<random>" (a redirection to bash): put a number back
    return script.replace("--rdzv-id <random>", "--rdzv-id 1234"), job_dir


def run_attempts(tmp_path, script: str, plan: str) -> list[tuple[int, list[str]]]:
    """Run the batch script as Slurm would: again after each requeue. [(exit code, scontrol requeue calls)]."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN_STUB), ("scontrol", '#!/bin/bash\n'
                                                         'case "$1" in show) echo localhost;; *) echo "$@" >> "$CALLS";; esac\n')):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    attempts: list[tuple[int, list[str]]] = []
    for restart in range(len(plan.split())):
        calls = tmp_path / f"calls_{restart}"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "PLAN": plan, "CALLS": str(calls),
               "SLURM_JOB_NODELIST": "localhost", **({"SLURM_RESTART_COUNT": str(restart)} if restart else {})}
        proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode != 99, proc.stderr
        requeues = calls.read_text().splitlines() if calls.exists() else []
        attempts.append((proc.returncode, requeues))
        if not requeues:
            break
    return attempts


REQUEUED = ["requeue 42"]


# (num_job_retries_on_failure, what each attempt's step does) -> [(batch script exit code, scontrol calls)], job results
@pytest.mark.parametrize("retries, plan, attempts, results", [
    # every attempt fails: 1 + num_job_retries_on_failure attempts, the last one ends non-zero (Slurm: FAILED)
    (2, "fail fail fail fail", [(1, REQUEUED), (1, REQUEUED), (1, [])], ["0 F", "1 F", "2 F"]),
    (0, "fail fail", [(1, [])], ["0 F"]),
    (0, "finish", [(0, [])], ["0 S"]),
    (2, "fail finish", [(1, REQUEUED), (0, [])], ["0 F", "1 S"]),
    # a preempted attempt (exit 0, not finished) is requeued and recorded as a success: no failure retry spent,
    # even with none to spend, and the count of failures in a row starts again after it
    (0, "preempt preempt finish", [(0, REQUEUED), (0, REQUEUED), (0, [])], ["0 S", "1 S", "2 S"]),
    (0, "preempt fail fail", [(0, REQUEUED), (1, [])], ["0 S", "1 F"]),
    (1, "fail preempt fail fail fail", [(1, REQUEUED), (0, REQUEUED), (1, REQUEUED), (1, [])],
     ["0 F", "1 S", "2 F", "3 F"]),
    # rerun state machine's exit 17 touches the finished flag: not requeued, and the job ends FAILED (exit 17)
    (2, "rerun17 finish", [(17, [])], ["0 F"]),
])
def test_ft_job_attempts_requeues_and_final_exit_code(tmp_path, retries, plan, attempts, results):
    script, job_dir = ft_script(tmp_path, retries)
    assert f"export TORCHX_MAX_RETRIES={retries + 1}\n" in script
    assert run_attempts(tmp_path, script, plan) == attempts
    with open(os.path.join(job_dir, "gpt_job_results")) as f:
        assert f.read().splitlines() == [f"42 {r}" for r in results]


def test_ft_job_requeued_after_its_failure_limit_exits_1_without_running(tmp_path):
    """A job requeued by hand (or by the scheduler) after its last allowed failure does not run again."""
    script, job_dir = ft_script(tmp_path, 0)
    attempts = run_attempts(tmp_path, script, "fail")
    assert attempts == [(1, [])]
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "PLAN": "finish finish",
           "CALLS": str(tmp_path / "calls_x"), "SLURM_RESTART_COUNT": "1"}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "Job failures limit reached (1)" in proc.stdout
    assert not os.path.exists(os.path.join(job_dir, "gpt_finished_flag"))
