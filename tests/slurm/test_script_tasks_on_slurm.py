"""Issue 13 on the real cluster: a stand-alone training script configured through a converter, not our trainer.

``examples/argparse_trainer.py`` takes argparse flags only. Submitted as a user would, through NeMo-Run's
``SlurmExecutor`` with ``FaultTolerancePlugin`` and ``PreemptionPlugin`` given
``script_args_converter_fn=megatron_lm_args``, on 2 ranks under ft_launcher. Once it has saved a
checkpoint, ``scancel -s SIGTERM`` signals the job step (as ``--signal`` without ``B:`` does): ft_launcher
forwards it, the script saves and exits 0, nemo_run's FT sbatch logic requeues the job, the second run
resumes from that checkpoint, finishes, touches ``$FAULT_TOL_FINISHED_FLAG_FILE`` and is not requeued
again. What reached the script is read from its own report (one JSON line per run).
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import wait_for_job
from slurm.jobs import scancel_signal, submit, wait_until

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, megatron_lm_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "argparse_trainer.py")
ITERS = 60


@pytest.fixture(scope="module")
def script_job(slurm_cluster, nemorun_home, slurm_tmp):
    root = os.path.join(slurm_tmp, "script_tasks")
    os.makedirs(root, exist_ok=True)
    ckpt, report = os.path.join(root, "ckpt"), os.path.join(root, "report.jsonl")
    task = run.Script(path=EXAMPLE, entrypoint="python",
                      args=["--train-iters", str(ITERS), "--step-time", "0.2", "--save-interval", "5",
                            "--save", ckpt, "--report", report])
    plugins = [FaultTolerancePlugin(script_args_converter_fn=megatron_lm_args, num_in_job_restarts=1,
                                    num_job_retries_on_failure=1, setup_timeout=612.0, step_timeout=182.0,
                                    checkpointing_timeout=422.0, out_of_section_timeout=302.0),
               PreemptionPlugin(script_args_converter_fn=megatron_lm_args)]
    executor = slurm_cluster.executor(time="00:30:00", ntasks_per_node=2)
    job = submit("argparse_script", task, executor, plugins, run_dir=root)
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    wait_until(lambda: os.path.exists(tracker), timeout=900, interval=0.2, what="the script's first checkpoint")
    sent = scancel_signal(job)
    final = wait_for_job(job.slurm_id, timeout=1200)
    with open(report) as f:
        reports = [json.loads(line) for line in f]
    return {"job": job, "final": final, "sent": sent, "reports": reports, "ckpt": ckpt}


def test_script_receives_the_ft_settings_and_the_preemption_signal(script_job):
    job, reports = script_job["job"], script_job["reports"]
    assert len(reports) == 2, job.describe()
    first = reports[0]
    assert first["argv"][-3:] == ["--enable-ft-package", "--calc-ft-timeouts", "--exit-signal-handler"]
    assert first["ft"] == {"connected": True,
                           "rank_section_timeouts": {"setup": 612.0, "step": 182.0, "checkpointing": 422.0},
                           "rank_out_of_section_timeout": 302.0, "initial_rank_heartbeat_timeout": None,
                           "rank_heartbeat_timeout": None}, job.describe()
    assert (first["stopped"], first["signal"]["signal"], first["slurm_restart"]) == ("signal", "SIGTERM", 0)
    assert first["signal"]["wall_time"] >= script_job["sent"] - 1.0
    assert 5 <= first["finished_step"] < ITERS
    log = job.log()
    assert "rank 1: SIGTERM received" in log and "rank 0: SIGTERM received" in log, job.describe()


def test_requeued_run_resumes_from_the_signals_checkpoint_and_the_job_completes(script_job):
    job, final, reports = script_job["job"], script_job["final"], script_job["reports"]
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    assert [a["State"] for a in job.attempts()] == ["REQUEUED", "COMPLETED"], job.describe()
    second = reports[1]
    assert (second["resumed_from"], second["stopped"], second["finished_step"], second["slurm_restart"]) == (
        reports[0]["finished_step"], "finished", ITERS, 1), job.describe()
    assert second["ft"]["connected"] is True


def test_the_sbatch_script_asks_slurm_for_the_signal(script_job):
    exp_dir = os.path.dirname(script_job["job"].job_dir)
    (script,) = [p for p in os.listdir(exp_dir) if p.endswith("_sbatch.sh")]
    text = open(os.path.join(exp_dir, script)).read()
    assert "#SBATCH --signal=SIGTERM@60" in text
    assert "--exit-signal-handler" in text and "--enable-ft-package" in text and "ft_launcher" in text


# --- Issue 22: a Megatron-LM-style script never touches the finished flag ---------------------------------------
# The same script with --like-megatron-lm: it never touches $FAULT_TOL_FINISHED_FLAG_FILE and ends with
# Megatron-LM's "[after training is done]" line, as pretrain_gpt.py does; its trainer is recognised from its
# flags (no converter given). Before issue 22 nemo_run's FT sbatch logic requeued such a finished run forever.
MLM_ITERS = 20


@pytest.fixture(scope="module")
def megatron_lm_style_jobs(slurm_cluster, nemorun_home, slurm_tmp):
    jobs = {}
    for name, extra in (("mlm_finishes", []), ("mlm_crashes_once", ["--fail-in-attempt", "0"])):
        root = os.path.join(slurm_tmp, name)
        os.makedirs(root, exist_ok=True)
        task = run.Script(path=EXAMPLE, entrypoint="python",
                          args=["--train-iters", str(MLM_ITERS), "--step-time", "0.05", "--save-interval", "5",
                                "--save", os.path.join(root, "ckpt"), "--report", os.path.join(root, "report.jsonl"),
                                "--like-megatron-lm", *extra])
        plugins = [FaultTolerancePlugin(num_in_job_restarts=0, num_job_retries_on_failure=2), PreemptionPlugin()]
        jobs[name] = (submit(name, task, slurm_cluster.executor(time="00:20:00", ntasks_per_node=2), plugins,
                             run_dir=root), root)
    out = {}
    for name, (job, root) in jobs.items():
        final = wait_for_job(job.slurm_id, timeout=1200)
        with open(os.path.join(root, "report.jsonl")) as f:
            reports = [json.loads(line) for line in f]
        ledger = os.path.join(job.job_dir, "job_ledger.jsonl")  # no run_dir of ours: the ledger is in the job dir
        with open(ledger) as f:
            records = [r for r in map(json.loads, f) if r.get("kind") == "attempt"]
        out[name] = {"job": job, "final": final, "reports": reports, "records": records}
    return out


def test_a_finished_megatron_lm_style_run_is_completed_once(megatron_lm_style_jobs):
    got = megatron_lm_style_jobs["mlm_finishes"]
    job, final, reports, records = got["job"], got["final"], got["reports"], got["records"]
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    assert [a["State"] for a in job.attempts()] == ["COMPLETED"], job.describe()
    assert [(r["stopped"], r["finished_step"]) for r in reports] == [("finished", MLM_ITERS)]
    # the plugins recognised Megatron-LM's flags: FT's, --load (Megatron-LM resumes only from it) and the handler
    ckpt = reports[0]["argv"][reports[0]["argv"].index("--save") + 1]
    assert reports[0]["argv"][-5:] == ["--enable-ft-package", "--calc-ft-timeouts", "--load", ckpt,
                                       "--exit-signal-handler"]
    assert [(r["classification"]["error_type"], r["classification"]["source"], r["decision"]["action"])
            for r in records] == [("finished", "checkpoint", "stop")], job.describe()
    assert "[after training is done]" in job.attempt_log(0)


def test_a_crashed_megatron_lm_style_run_is_requeued_then_completed(megatron_lm_style_jobs):
    got = megatron_lm_style_jobs["mlm_crashes_once"]
    job, final, reports, records = got["job"], got["final"], got["reports"], got["records"]
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    assert [a["State"] for a in job.attempts()] == ["REQUEUED", "COMPLETED"], job.describe()
    assert "failing Slurm attempt 0 on purpose" in job.attempt_log(0)
    assert [(r["slurm_restart"], r["stopped"], r["finished_step"]) for r in reports] == [(1, "finished", MLM_ITERS)]
    assert [(r["classification"]["source"], r["decision"]["action"]) for r in records] == [
        ("exit_code", "requeue"), ("checkpoint", "stop")], job.describe()
