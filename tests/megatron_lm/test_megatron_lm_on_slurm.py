"""Megatron-LM's real trainer on the real Slurm cluster, under the plugins, as its users submit it (issue 32).

``pretrain_gpt.py`` (megatron-core 0.19.2's ``megatron.training``, on CPU through the lane's CPU layer) through
``run.Script`` on a ``SlurmExecutor`` with FaultTolerancePlugin + PreemptionPlugin + RestartPolicyPlugin
(``megatron_transient``), 2 ranks under ft_launcher 0.7.0, ``--save`` only (the plugins add ``--load``). Once the
step-5 checkpoint exists, ``scancel -s SIGTERM`` signals the job step (what ``--signal`` without ``B:`` does):
ft_launcher forwards it, Megatron-LM's exit-signal handler saves and every rank exits 0 (``--ckpt-format torch``:
with ``torch_dist`` the save at a forwarded signal fails, ``test_megatron_lm_local.py``). The batch script's
decision reads Megatron-LM's own log and checkpoint tracker: a preemption, requeued without spending a failure
retry; the second attempt resumes from the signal's checkpoint, finishes, and the job is COMPLETED once — never
requeued again, though Megatron-LM never touches ``$FAULT_TOL_FINISHED_FLAG_FILE``. The goodput report reads the
chain from the same logs. A second job, submitted beside it, raises an exception in Megatron-LM's training loop (its
own fault injector): classified from the traceback, and ``megatron_transient`` stops the job. Nothing is mocked but
the GPU (the CPU layer).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from megatron_lm_run import ENV, HERE, NEWEST, SCRIPT, iteration_losses, tiny_gpt_args
from slurm.cluster import wait_for_job
from slurm.jobs import scancel_signal, submit, wait_until

from megatron_resilience.jobs.policies import load_policy
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

TRAIN_ITERS = 20
SAVE_INTERVAL = 5
KILL_AT = 8


def _submit(cluster, root: str, name: str, extra: tuple[str, ...], *, script: str = SCRIPT,
            env: dict[str, str] | None = None, **ft) -> tuple[object, str]:
    ckpt = os.path.join(root, name, "ckpt")
    task = run.Script(path=script, entrypoint="python", args=tiny_gpt_args(
        train_iters=TRAIN_ITERS, save=ckpt, save_interval=SAVE_INTERVAL, extra=extra))
    plugins = [FaultTolerancePlugin(nvrx_version="0.7", num_job_retries_on_failure=1, **ft), PreemptionPlugin(),
               RestartPolicyPlugin(policy="megatron_transient")]
    executor = cluster.executor(time="00:30:00", ntasks_per_node=2, env_vars={**ENV, **(env or {})})
    return submit(name, task, executor, plugins, run_dir=os.path.join(root, name)), ckpt


def _ledger(job) -> list[dict]:
    with open(os.path.join(job.job_dir, "job_ledger.jsonl")) as f:  # no run_dir of ours: the job dir has it
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def jobs(slurm_cluster, nemorun_home, slurm_tmp):
    """Four jobs at once: ``chain`` (SIGTERM after the first checkpoint), ``exception`` (Megatron-LM's own fault
    injector raises in rank 1's training loop after step 3; no in-job restart, so the job-level decision acts),
    ``killed`` (rank 1 SIGKILLed inside step 8 of the first worker group: ``kill_rank_at_step.py``) and
    ``baseline`` (uninterrupted; every job's losses are compared with it)."""
    if not os.path.isdir(os.path.join(NEWEST, "megatron", "training")):
        pytest.fail(f"{NEWEST} has no megatron.training: run scripts/newest/install.sh .venv-newest (make does)")
    root = os.path.join(slurm_tmp, "megatron_lm_on_slurm")
    chain, ckpt = _submit(slurm_cluster, root, "mlm_sigterm", ("--ckpt-format", "torch"))
    exception, _ = _submit(slurm_cluster, root, "mlm_exception", (
        "--fault-injector-ranks", "1", "--fault-injector-fault-types", "workload_exc",
        "--fault-injector-fault-delay", "0", "--fault-injector-delay-start-iteration", "3"), num_in_job_restarts=0)
    killed, killed_ckpt = _submit(slurm_cluster, root, "mlm_killed", ("--ckpt-format", "torch"),
                                  script=os.path.join(HERE, "kill_rank_at_step.py"),
                                  env={"KILL_RANK_AT_STEP": str(KILL_AT), "KILL_RANK": "1"})
    baseline, _ = _submit(slurm_cluster, root, "mlm_baseline", ("--ckpt-format", "torch"))
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    wait_until(lambda: os.path.exists(tracker), timeout=1200, interval=0.1, what="Megatron-LM's first checkpoint")
    scancel_signal(chain)
    out = {}
    for name, job in (("chain", chain), ("exception", exception), ("killed", killed), ("baseline", baseline)):
        out[name] = {"job": job, "final": wait_for_job(job.slurm_id, timeout=1500), "ledger": _ledger(job)}
    out["chain"]["ckpt"], out["killed"]["ckpt"] = ckpt, killed_ckpt
    return out


@pytest.fixture(scope="module")
def chain(jobs):
    return jobs["chain"]


def test_sigterm_saves_the_job_is_requeued_without_a_retry_and_completed_once(chain):
    job, final = chain["job"], chain["final"]
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    assert [a["State"] for a in job.attempts()] == ["REQUEUED", "COMPLETED"], job.describe()
    attempts = [r for r in chain["ledger"] if r.get("kind") == "attempt"]
    assert [(a["classification"]["error_type"], a["decision"]["action"]) for a in attempts] == [
        ("preempted", "requeue"), ("finished", "stop")], job.describe()
    # the preemption spent none of the policy's restart budgets (the stop decision has none left to report)
    assert attempts[0]["decision"]["budget_left"] == load_policy("megatron_transient").max_restarts
    first = job.attempt_log(0)
    assert "exiting program after receiving SIGTERM." in first, first[-4000:]


def test_the_requeued_attempt_resumes_from_the_signals_checkpoint_and_matches_the_uninterrupted_losses(chain, jobs):
    job = chain["job"]
    first, second = iteration_losses(job.attempt_log(0)), iteration_losses(job.attempt_log(1))
    saved_at = max(first)  # the signal's save is of the last step the first attempt logged
    assert SAVE_INTERVAL <= saved_at < TRAIN_ITERS, job.describe()
    assert (min(second), max(second)) == (saved_at + 1, TRAIN_ITERS), job.describe()
    with open(os.path.join(chain["ckpt"], "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == TRAIN_ITERS
    assert "[after training is done]" in job.attempt_log(1)
    baseline = iteration_losses(jobs["baseline"]["job"].attempt_log(0))
    assert_equal_but_the_two_step_mean({**first, **second}, baseline, resumed_from=saved_at)


def assert_equal_but_the_two_step_mean(losses: dict[int, str], baseline: dict[int, str], *, resumed_from: int):
    """Every step's loss as Megatron-LM prints it equals the uninterrupted run's, but the second iteration line of
    the resumed process, which Megatron-LM logs as the mean of that process's first two steps."""
    second = resumed_from + 2
    assert sorted(losses) == sorted(baseline) == list(range(1, TRAIN_ITERS + 1))
    assert {k: v for k, v in losses.items() if k != second} == {k: v for k, v in baseline.items() if k != second}
    if second <= TRAIN_ITERS:  # a process that trained one step has no second line
        assert abs(float(losses[second]) - (float(baseline[second - 1]) + float(baseline[second])) / 2) <= 1e-6


def test_the_report_reads_the_chain_from_megatron_lms_own_logs(chain):
    """No ``metrics.jsonl``: the report reads Megatron-LM's log lines, the tracker, the ledger and sacct."""
    job = chain["job"]
    saved_at = max(iteration_losses(job.attempt_log(0)))
    proc = subprocess.run([sys.executable, "-m", "megatron_resilience.report", job.job_dir, "--png", "none"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")] for line in proc.stdout.splitlines()
            if re.match(r"^[01] \| ", line)]
    # restart, state, exit, why it ended, decision, steps, resumed from
    assert [[r[2], r[7], r[8], r[9], r[10], r[11], r[12]] for r in rows] == [
        ["0", "REQUEUED", "0", "preempted (metrics)", "requeue; left c3/s2/t1", f"1-{saved_at}", "0"],
        ["1", "COMPLETED", "0", "finished (checkpoint)", "stop", f"{saved_at + 1}-{TRAIN_ITERS}", str(saved_at)],
    ], proc.stdout
    assert re.search(r"^  0: \S+ preempted \(preemption, fault from signal\): ", proc.stdout, re.M), proc.stdout
    assert re.search(r"^recommended: --save-interval=\d+ \(Daly's ", proc.stdout, re.M), proc.stdout
    assert "final: training finished after 2 attempt(s)" in proc.stdout


def test_an_exception_in_megatron_lms_loop_is_classified_from_its_traceback_and_the_policy_stops_the_job(jobs):
    got = jobs["exception"]
    job, final = got["job"], got["final"]
    assert (final["JobState"], final["Restarts"]) == ("FAILED", "0"), job.describe()
    assert [a["State"] for a in job.attempts()] == ["FAILED"], job.describe()
    (attempt,) = [r for r in got["ledger"] if r.get("kind") == "attempt"]
    cls, decision = attempt["classification"], attempt["decision"]
    assert (cls["error_type"], cls["source"], decision["action"]) == ("python_exception", "log", "stop"), attempt
    assert "InjectedException" in job.attempt_log(0)
    (final_record,) = [r for r in got["ledger"] if r.get("kind") == "final"]
    assert final_record["outcome"] != "finished", final_record


def test_a_killed_rank_is_restarted_in_job_resumes_and_the_job_is_completed_once(jobs):
    got, baseline = jobs["killed"], jobs["baseline"]
    job, final = got["job"], got["final"]
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    log = job.attempt_log(0)
    assert f"successfully loaded checkpoint from {got['ckpt']} [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration " \
           f"{SAVE_INTERVAL}" in log, log[-4000:]
    assert [(a["classification"]["error_type"], a["decision"]["action"]) for a in got["ledger"]
            if a.get("kind") == "attempt"] == [("finished", "stop")], job.describe()
    assert_equal_but_the_two_step_mean(iteration_losses(log), iteration_losses(baseline["job"].attempt_log(0)),
                                       resumed_from=SAVE_INTERVAL)
    b = baseline["final"]
    assert (b["JobState"], b["ExitCode"], b["Restarts"]) == ("COMPLETED", "0:0", "0"), baseline["job"].describe()
