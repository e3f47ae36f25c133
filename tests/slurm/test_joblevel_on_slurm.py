"""Issue 10 on the real cluster: why each attempt ended, the policy's decision, the ledger, the watcher.

Every job is the real trainer (``gpt_tiny``, 1 CPU rank) submitted through NeMo-Run's ``SlurmExecutor``
with our plugins, as from a login node; failures are the trainer's own fault injection
(``ft.simulated_fault_type=exception``: a CUDA OOM / NCCL watchdog timeout printed and exited like the
real thing) and Megatron-Core's rerun error injection. What is asserted comes from Slurm's records
(``sacct``), the ledger the batch scripts and the watcher wrote, and the trainer's metrics.

One module fixture submits every job at once and plays the watcher scenario (``watcher_scenario.py``:
a job whose batch shell is SIGKILLed, so nothing inside the job can decide, then watchers killed
mid-decision) from the moment the watched job is submitted. Issue 23: one job gets
SIGTERM in every process, its batch shell too, as real preemption with GraceTime (``scancel --signal=TERM
--full`` for the batch step, a plain ``scancel --signal=TERM`` for the job steps): the batch script waits for
the step, decides and requeues it without a retry, with no watcher.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import wait_for_job
from slurm.jobs import Job, submit, wait_until, waiting_rank
from slurm.watcher_scenario import watcher_scenario

run = import_nemo_run()

from megatron_resilience.jobs.monitors import load_monitors, scan  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin  # noqa: E402
from slurm.joblevel_jobs import SAVE, STEPS, WATCHED_STEPS, ledger, states, tiny  # noqa: E402

# The watched job must still train when its batch shell is killed: its scenario starts as soon as it is submitted,
# and its rank waits this long in every step (no CPU, no effect on the numbers): 400 tiny steps took 21 s under
# load, less than submitting the other jobs took.
WATCHED_SLOWED = waiting_rank(0, 0.1)
BUDGET_POLICY = """\
name: one_crash_restart
description: exit 16 gets one restart, away from the node if another exists
max_restarts: {crash: 1, stall: 0, timeout: 0}
max_attempts_without_progress: 0
default_action: stop
rules:
  - match: {error_type: [rerun_resume]}
    action: requeue_excluding_nodes
"""
def fault(kind: str, step: int) -> dict:
    return dict(ft__simulate_fault=True, ft__simulated_fault_type="exception", ft__simulated_fault_exception=kind,
                ft__simulated_fault_rank=0, ft__simulated_fault_step=step)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, nemorun_home, slurm_tmp):
    root = os.path.join(slurm_tmp, "joblevel")
    os.makedirs(root, exist_ok=True)
    budget = os.path.join(root, "one_crash_restart.yaml")
    with open(budget, "w") as f:
        f.write(BUDGET_POLICY)
    js: dict[str, Job] = {}
    t0 = time.monotonic()

    def job(name, plugins, launcher=None, **task_kw):
        task = tiny(root, f"jl_{name}", **task_kw)
        executor = slurm_cluster.executor(time="00:30:00", ntasks_per_node=1, launcher=launcher)
        js[name] = submit(f"jl_{name}", task, executor, plugins, run_dir=task.run_dir)

    transient = [PreemptionPlugin(), RestartPolicyPlugin(policy="megatron_transient")]
    job("watched", transient, max_steps=WATCHED_STEPS, **WATCHED_SLOWED)
    scenario: dict = {}

    def watch_scenario() -> None:  # from its first checkpoint on, while the other jobs are submitted
        try:
            scenario.update(watcher_scenario(js["watched"], slurm_cluster, os.path.join(root, "watch"),
                                            first_checkpoint=SAVE))
        except BaseException as err:  # noqa: BLE001 - raised by the fixture below
            scenario["error"] = err

    scenario_thread = threading.Thread(target=watch_scenario, daemon=True)
    scenario_thread.start()
    job("ref", transient)
    job("oom", transient, **fault("cuda_oom", 5))
    job("nccl", [FaultTolerancePlugin(num_in_job_restarts=0, num_job_retries_on_failure=0), *transient],
        **fault("nccl_timeout", 15))
    job("rerun_17", transient, max_steps=12, save_interval=4, rerun__rerun_mode="validate_results",
        rerun__error_injection_rate=8, rerun__error_injection_type="transient_error")
    job("rerun_16", [PreemptionPlugin(), RestartPolicyPlugin(policy=budget)], max_steps=12, save_interval=4,
        rerun__rerun_mode="validate_results", rerun__error_injection_rate=8,
        rerun__error_injection_type="persistent_error")
    job("cancelled", [PreemptionPlugin(), RestartPolicyPlugin(policy="megatron_aggressive")])
    job("fullterm", transient)
    full: dict = {}
    fullterm = threading.Thread(target=signal_job_when_training, args=(js["fullterm"], full, 5), daemon=True)
    fullterm.start()

    wait_until(lambda: js["cancelled"].last_step() >= 3, timeout=900, interval=0.2, what="cancelled to train")
    subprocess.run(["scancel", js["cancelled"].slurm_id], check=True)  # a person's scancel
    fullterm.join(timeout=1200)
    scenario_thread.join(timeout=3000)
    if "error" in scenario:
        raise scenario["error"]
    finals = {n: wait_for_job(j.slurm_id, timeout=1200) for n, j in js.items() if n != "watched"}
    once = subprocess.run([sys.executable, "-m", "megatron_resilience.watch", js["cancelled"].run_dir, "--once"],
                          env=slurm_cluster.env, capture_output=True, text=True, timeout=300)
    print(f"\njob-level Slurm jobs done in {time.monotonic() - t0:.0f} s")
    return {"jobs": js, "finals": finals, "scenario": scenario, "cancel_watch": once, "full": full}


def signal_job_when_training(job: Job, sent: dict, after_step: int) -> None:
    """For a thread: SIGTERM to every process of the job, the batch shell included, as real preemption with
    GraceTime does, once the first attempt trained ``after_step`` steps. On Slurm 22.05 ``scancel --signal=TERM
    --full`` reaches the batch step only (its shell and the ``srun`` client; measured: the job step's process gets
    nothing), so the job steps get theirs from a plain ``scancel --signal=TERM`` right after."""
    try:
        wait_until(lambda: job.last_step() >= after_step, timeout=900, interval=0.2, what=f"{job.name} to train")
        subprocess.run(["scancel", "--signal=TERM", "--full", job.slurm_id], check=True, capture_output=True)
        subprocess.run(["scancel", "--signal=TERM", job.slurm_id], check=True, capture_output=True)
        sent["time"] = time.time()
    except Exception as err:  # noqa: BLE001 - reported by the test
        sent["error"] = err


def test_oom_style_failure_is_not_retried(jobs):
    job = jobs["jobs"]["oom"]
    assert states(job) == ["FAILED"], job.describe()
    [attempt] = ledger(job, "attempt")
    cls, decision = attempt["classification"], attempt["decision"]
    assert (cls["error_type"], cls["source"], cls["fields"]["alloc"], decision["action"]) == \
        ("cuda_oom", "log", "2.00 GiB", "stop"), attempt
    assert any("torch.OutOfMemoryError: CUDA out of memory" in line for line in cls["evidence"])
    [final] = ledger(job, "final")
    assert final["outcome"] == "stopped" and final["message"].startswith(
        "NOT restarted after 1 attempt(s): cuda_oom is not restarted: cuda_oom is in exclude_error_types of policy "
        "megatron_transient"), final


def test_nccl_timeout_style_failure_is_requeued_and_finishes_with_equal_losses(jobs):
    js = jobs["jobs"]
    job, ref = js["nccl"], js["ref"]
    assert states(job) == ["REQUEUED", "COMPLETED"], job.describe()
    first, second = ledger(job, "attempt")
    assert (first["classification"]["error_type"], first["classification"]["signal"],
            first["decision"]["action"], first["decision"]["spent"]) == \
        ("nccl_timeout", "SIGABRT", "requeue", "stall"), first
    assert first["decision"]["budget_left"] == {"crash": 3, "stall": 1, "timeout": 1}
    assert (second["classification"]["error_type"], second["decision"]["outcome"]) == ("finished", "finished")
    assert job.starts() == [0, SAVE], job.describe()  # the fault at step 15: resumed from the step-10 checkpoint
    assert sorted(ref.losses()) == list(range(1, STEPS + 1)), ref.describe()
    assert job.losses() == ref.losses()
    assert second["resumed_from"] == SAVE and second["recomputed_steps"] == 14 - SAVE


def test_rerun_exit_17_stops(jobs):
    job = jobs["jobs"]["rerun_17"]
    assert states(job) == ["FAILED"], job.describe()
    [attempt] = ledger(job, "attempt")
    assert (attempt["exit_code"], attempt["classification"]["error_type"], attempt["decision"]["action"]) == \
        (17, "rerun_failed_validation", "stop")
    assert job.attempts()[0]["ExitCode"] == "17:0"


def test_rerun_exit_16_is_requeued_with_the_exclusion_recorded_and_the_budget_counts_only_attempts_without_progress(
        jobs):
    """Megatron's rerun machine saves at the step before the suspicious one and exits 16, so an attempt that reaches
    it usually advanced the checkpoint. The policy allows 1 crash restart *without progress*: every attempt that
    advanced is requeued (its budget refilled), and the chain ends finished or, at a repeat without progress, stopped
    with the basis on record. How many persistent errors Megatron injects (rate 8) is its own draw."""
    job = jobs["jobs"]["rerun_16"]
    attempts = ledger(job, "attempt")
    first = attempts[0]
    d = first["decision"]
    assert (first["classification"]["error_type"], d["action"]) == ("rerun_resume", "requeue"), first
    assert d["exclude_requested"] == first["nodes"] and len(first["nodes"]) == 1, first
    partition_nodes = subprocess.check_output(["sinfo", "-h", "-N", "-o", "%N"], text=True).split()
    if len(set(partition_nodes)) == 1:  # the only node: recorded, not applied, and the job was not stranded
        assert d["exclude_applied"] == [] and "would leave 0 usable node(s)" in d["exclude_not_applied"], d
    else:
        assert d["exclude_applied"] == first["nodes"] and first["nodes"] != attempts[1]["nodes"], d
    failed = [a for a in attempts if a["classification"]["error_type"] == "rerun_resume"]
    advanced = [a for a in failed if (a["checkpoint_step"] or 0) > (a["resumed_from"] or 0)]
    assert all(a["decision"]["action"] == "requeue" and a["decision"]["budget_left"]["crash"] == 0
               for a in advanced), attempts  # the 1-restart budget, spent and refilled each time
    [final] = ledger(job, "final")
    last = attempts[-1]
    if last["classification"]["error_type"] == "finished":
        assert states(job) == ["REQUEUED"] * (len(attempts) - 1) + ["COMPLETED"], job.describe()
        assert final["outcome"] == "finished" and last["last_step"] == 12, final
    else:  # stopped: the last attempt did not advance, and the final message names why
        assert states(job) == ["REQUEUED"] * (len(attempts) - 1) + ["FAILED"], job.describe()
        assert last not in advanced and final["outcome"] in ("budget_exhausted", "no_progress"), final
        assert last["decision"]["fingerprint"].startswith("rerun_resume @ "), last
        assert final["message"].startswith(f"NOT restarted after {len(attempts)} attempt(s): "), final
    assert final["message"] in job.log()  # the batch script said it


def test_a_persons_scancel_is_never_retried(jobs):
    job = jobs["jobs"]["cancelled"]
    assert states(job) == ["CANCELLED"], job.describe()
    attempts = ledger(job, "attempt")
    # the EXIT trap had Slurm's KillWait to record it; the watcher records it otherwise
    assert [a["classification"]["error_type"] for a in attempts] == ["user_cancel"], attempts
    assert [f["outcome"] for f in ledger(job, "final")] == ["cancelled"]
    # captured from this real job: slurmstepd's own line, as the always-on monitors read it (issue 23, section 3)
    found = [s for s in scan([("log", line) for line in job.log().splitlines()], load_monitors([]))
             if s.monitor == "slurm_cancelled_by_user" and s.fields["job"] == job.slurm_id]
    assert found, job.describe()
    # (a slurmd of a MULTIPLE_SLURMD build names its stepd "slurmstepd-<node>")
    assert re.fullmatch(rf"slurmstepd(-\S+)?: error: \*\*\* JOB {job.slurm_id} ON \S+ CANCELLED AT \S+ \*\*\*",
                        found[0].line), found[0].line
    assert found[0].fields["batch_host"] == attempts[0]["nodes"][0]
    assert not [i for i in ledger(job, "intent") if i["action"] in ("requeue", "sbatch")]
    assert jobs["cancel_watch"].returncode == 0, jobs["cancel_watch"].stdout


def test_signal_to_the_whole_job_batch_shell_included_is_a_free_requeue_without_a_watcher(jobs):
    """Issue 23: ``scancel --signal=TERM --full`` reaches the batch shell too. It waits for the step (the trainer
    saves and exits 0), decides itself — a preemption, requeued without spending a retry — and the requeued job
    resumes from that checkpoint with the uninterrupted run's losses. No watcher runs for this job."""
    js = jobs["jobs"]
    job, ref = js["fullterm"], js["ref"]
    assert "time" in jobs["full"], jobs["full"]
    assert states(job) == ["REQUEUED", "COMPLETED"], job.describe()
    first, second = ledger(job, "attempt")
    assert (first["by"], first["batch_signal"], first["classification"]["error_type"],
            first["classification"]["source"], first["decision"]["action"], first["decision"]["spent"]) == \
        ("batch", "SIGTERM", "preempted", "stop_reason", "requeue", None), json.dumps(first)
    assert first["decision"]["budget_left"] == {"crash": 3, "stall": 2, "timeout": 1}
    assert "megatron_resilience: the batch shell received SIGTERM (preemption, scancel --full); the job step has " \
           "ended: deciding" in job.log()
    assert [(i["action"], i["by"]) for i in ledger(job, "intent")] == [("requeue", "batch")]
    assert (second["by"], second["classification"]["error_type"], second["decision"]["outcome"]) == \
        ("batch", "finished", "finished")
    starts = job.starts()
    assert len(starts) == 2 and starts[0] == 0 and starts[1] == first["checkpoint_step"] >= 5, job.describe()
    assert job.losses() == ref.losses(), job.describe()


def test_watcher_killed_between_deciding_and_submitting_leaves_exactly_one_live_job(jobs):
    js, s = jobs["jobs"], jobs["scenario"]
    job, ref = js["watched"], js["ref"]
    assert (s["first"]["JobState"], s["first"]["ExitCode"]) == ("FAILED", "0:9"), job.describe()
    assert max(s["counts"]) == 1 and s["counts"][-1] == 0, (s["counts"], s["seen"])
    assert s["last"]["JobState"] == "COMPLETED", s
    assert s["w3"].returncode == 0, s["w3"].stdout + s["w3"].stderr
    [attempt_a, attempt_b] = ledger(job, "attempt")
    assert (attempt_a["by"], attempt_a["classification"]["error_type"], attempt_a["decision"]["action"]) == \
        ("watcher", "batch_lost", "requeue"), attempt_a
    assert (attempt_b["by"], attempt_b["job_id"], attempt_b["classification"]["error_type"]) == \
        ("batch", s["second"], "finished")
    intents = [(i["action"], i["by"]) for i in ledger(job, "intent")]
    assert intents == [("requeue", "watcher"), ("sbatch", "watcher"), ("sbatch", "watcher")], intents
    outcomes = [(o["action"], o["ok"], o.get("new_job_id")) for o in ledger(job, "outcome")]
    assert outcomes == [("requeue", False, None), ("sbatch", False, None), ("sbatch", True, s["second"])], outcomes
    assert "adopted live job" in ledger(job, "outcome")[-1]["output"]
    [final] = ledger(job, "final")
    assert final["outcome"] == "finished"
    assert job.starts()[0] == 0 and job.starts()[1] >= SAVE, job.describe()
    losses = job.losses()
    assert sorted(losses) == list(range(1, WATCHED_STEPS + 1)), job.describe()
    assert {s: losses[s] for s in ref.losses()} == ref.losses()  # the reference's steps: 1..STEPS


def test_report_shows_the_chain(jobs):
    job = jobs["jobs"]["nccl"]
    out = subprocess.run([sys.executable, "-m", "megatron_resilience.report", job.run_dir, "--logs"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
    assert [r.split(" | ")[9].strip() for r in rows] == ["nccl_timeout (log)", "finished (stop_reason)"], out.stdout
    assert "goodput: " in out.stdout and os.path.exists(os.path.join(job.run_dir, "attempts_timeline.png"))
    assert f"==> attempt 0 (job {job.slurm_id}, restart 0)" in out.stdout  # every attempt's log, not only the first
    assert f"==> attempt 1 (job {job.slurm_id}, restart 1)" in out.stdout
