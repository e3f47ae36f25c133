"""The whole rendered sbatch script, attempt after attempt, with the job-level decision in its EXIT trap.

Each script is rendered by ``preview`` (our plugins and nemo_run's own templates) and run unchanged by
bash, once per attempt, as Slurm would run it: again after each requeue, with ``SLURM_RESTART_COUNT``
incremented. The EXIT trap runs the real ``python -m megatron_resilience.jobs.batch_exit`` (the real
classifier, policies and ledger). Stubs stand in for what cannot run here: ``srun`` (the job step: it
fails, finishes, is preempted, writes a corpus log, ... as the plan says), ``scontrol`` (records
requeues and exclusions; ``show job`` reports the job state the case needs) and ``sinfo`` (the
partition's nodes); the script, stubs and attempt loop are tests/sbatch_attempts.py. The real-Slurm proof is
tests/slurm/test_joblevel_on_slurm.py.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from sbatch_attempts import REQUEUED, ledger, render, results, run_attempts

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")

# --- without a RestartPolicyPlugin: nemo_run's rule, decided by the classifier or by the bash fallback -----------

BROKEN = "/bin/false"  # the classifier cannot run: the trap must fall back to nemo_run's own decision


FT_PLANS = [
    # every attempt fails: 1 + num_job_retries_on_failure attempts, the last one ends non-zero (Slurm: FAILED)
    (2, "fail fail fail fail", [(1, REQUEUED), (1, REQUEUED), (1, [])], ["0 F", "1 F", "2 F"]),
    (0, "fail fail", [(1, [])], ["0 F"]),
    (0, "finish", [(0, [])], ["0 S"]),
    (2, "fail finish", [(1, REQUEUED), (0, [])], ["0 F", "1 S"]),
    # a preempted attempt (exit 0, not finished) is requeued and spends no failure retry, even with none to
    # spend, and the count of failures in a row starts again after it
    (0, "preempt preempt finish", [(0, REQUEUED), (0, REQUEUED), (0, [])], ["0 S", "1 S", "2 S"]),
    (0, "preempt fail fail", [(0, REQUEUED), (1, [])], ["0 S", "1 F"]),
    # the launcher exited 1 after a preemption (a rank the signal reached before its handler): nemo_run's template
    # wrote F, the decision rewrites it to S, so that nemo_run's own count (the fallback's) spends no retry either
    (0, "preempt1 preempt1 finish", [(1, REQUEUED), (1, REQUEUED), (0, [])], ["0 S", "1 S", "2 S"]),
    (1, "fail preempt fail fail fail", [(1, REQUEUED), (0, REQUEUED), (1, REQUEUED), (1, [])],
     ["0 F", "1 S", "2 F", "3 F"]),
    # rerun state machine's exit 17 touches the finished flag: not requeued, and the job ends FAILED (exit 17)
    (2, "rerun17 finish", [(17, [])], ["0 F"]),
]


# (num_job_retries_on_failure, what each attempt's step does) -> [(batch script exit code, scontrol calls)], results;
# the classifier reproduces nemo_run's rule for every plan; the fallback is nemo_run's own code (three plans).
@pytest.mark.parametrize("python, retries, plan, attempts, job_results",
                         [(sys.executable, *p) for p in FT_PLANS] + [(BROKEN, *FT_PLANS[i]) for i in (0, 5, 7)])
def test_ft_job_without_policy_follows_nemo_runs_rule(tmp_path, python, retries, plan, attempts, job_results):
    job = render(tmp_path, ft=True, retries=retries)
    assert f"export TORCHX_MAX_RETRIES={retries + 1}\n" in job["script"]
    got, outputs = run_attempts(job, plan, python=python)
    assert got == attempts
    assert results(job) == [f"42 {r}" for r in job_results]
    fell_back = any("the job-level classifier failed" in o for o in outputs)
    assert fell_back == (python == BROKEN)
    if python != BROKEN:
        assert len(ledger(job, "attempt")) == len(attempts)
        assert all(r["policy"] == "nemo_run" for r in ledger(job, "attempt"))


@pytest.mark.parametrize("python, attempts", [
    # the classifier: a preemption never spends one of the failure retries (executor.retries=1)
    (sys.executable, [(1, REQUEUED), (1, REQUEUED), (1, REQUEUED), (0, [])]),
    # nemo_run's plain template alone counted every requeue (SLURM_RESTART_COUNT): the failure is not retried
    (BROKEN, [(1, REQUEUED), (1, REQUEUED), (1, [])]),
])
def test_preemption_requeues_do_not_spend_failure_retries_without_ft(tmp_path, python, attempts):
    job = render(tmp_path, ft=False, retries=1)
    assert "export TORCHX_MAX_RETRIES=1\n" in job["script"]
    got, _ = run_attempts(job, "preempt1 preempt1 fail finish", python=python)
    assert got == attempts


@pytest.mark.parametrize("plan, attempts", [
    ("finish", [(0, [])]),
    ("preempt finish", [(0, REQUEUED), (0, [])]),
    ("fail", [(1, [])]),  # executor.retries=0
    ("rerun17", [(17, [])]),
])
def test_plain_template_without_policy(tmp_path, plan, attempts):
    job = render(tmp_path, ft=False)
    assert run_attempts(job, plan)[0] == attempts


def test_ft_do_not_restart_exit_code_is_honoured(tmp_path):
    """ft_launcher's "do not restart" (exit 93, nvidia-resiliency-ext >= 0.6) stops the job with retries left."""
    job = render(tmp_path, ft=True, retries=2)
    got, outputs = run_attempts(job, "norestart finish")
    assert got == [(93, [])]
    [attempt] = ledger(job, "attempt")
    assert attempt["classification"]["error_type"] == "do_not_restart"
    assert attempt["classification"]["fields"]["reason"] == "no_progress"
    assert ledger(job, "final")[0]["outcome"] == "stopped"


def test_requeued_job_that_already_finished_exits_at_once(tmp_path):
    job = render(tmp_path, ft=False)
    open(os.path.join(job["job_dir"], "gpt_finished_flag"), "w").close()
    job["script"] = job["script"].replace("# Command 1", "echo TRAINER-RAN\n# Command 1")
    got, outputs = run_attempts(job, "x finish", restarts=[1])
    assert got == [(0, [])]
    assert "Training is finished" in outputs[0] and "TRAINER-RAN" not in outputs[0]


def test_first_attempt_removes_a_stale_finished_flag(tmp_path):
    job = render(tmp_path, ft=False)
    open(os.path.join(job["job_dir"], "gpt_finished_flag"), "w").close()
    got, _ = run_attempts(job, "preempt finish")
    assert got == [(0, REQUEUED), (0, [])]


def test_stale_stop_reason_of_an_earlier_attempt_is_ignored(tmp_path):
    job = render(tmp_path, ft=False)
    os.makedirs(job["run_dir"])
    with open(os.path.join(job["run_dir"], "stop_reason.json"), "w") as f:
        json.dump({"reason": "signal", "step": 3, "exit_code": 0, "finished": False}, f)
    got, _ = run_attempts(job, "x fail", restarts=[1])  # a crash; the file is an earlier attempt's
    assert got == [(1, [])]


# --- with a RestartPolicyPlugin -----------------------------------------------------------------------------------


def test_policy_oom_is_not_retried(tmp_path):
    job = render(tmp_path, ft=True, retries=2, policy="megatron_transient")
    got, outputs = run_attempts(job, "oom finish")
    assert got == [(1, [])]
    [attempt] = ledger(job, "attempt")
    assert (attempt["classification"]["error_type"], attempt["decision"]["action"]) == ("cuda_oom", "stop")
    assert attempt["classification"]["fields"]["alloc"] == "2.00 GiB"
    [final] = ledger(job, "final")
    assert final["outcome"] == "stopped"
    assert "megatron_resilience: NOT restarted after 1 attempt(s): cuda_oom is not restarted" in outputs[0]
    assert os.path.exists(os.path.join(job["job_dir"], "gpt_job_level_stopped"))


def test_policy_nccl_timeout_is_requeued_then_finishes(tmp_path):
    job = render(tmp_path, ft=True, policy="megatron_transient")
    got, _ = run_attempts(job, "nccl finish")
    assert got == [(1, REQUEUED), (0, [])]
    first, second = ledger(job, "attempt")
    assert first["classification"]["error_type"] == "nccl_timeout"
    assert first["decision"]["budget_left"] == {"crash": 3, "stall": 1, "timeout": 1}
    assert second["classification"]["error_type"] == "finished"
    intents = ledger(job, "intent")
    assert [i["command"] for i in intents] == [["scontrol", "requeue", "42"]]
    assert [o["ok"] for o in ledger(job, "outcome")] == [True]


def test_policy_stop_ends_with_a_final_record_and_a_clear_message(tmp_path):
    """The same NCCL timeout three times, no attempt leaving a newer checkpoint: a loop, stopped naming the failure
    (its fingerprint); the repeat rule decides before megatron_transient's stall budget (2, spent) is looked at."""
    job = render(tmp_path, ft=True, policy="megatron_transient")
    got, outputs = run_attempts(job, "nccl nccl nccl nccl")
    assert got == [(1, REQUEUED), (1, REQUEUED), (1, [])]
    attempts = ledger(job, "attempt")
    assert [a["decision"]["budget_left"]["stall"] for a in attempts] == [1, 0, 0]
    assert [a["decision"]["repeats_without_progress"] for a in attempts] == [1, 2, 3]
    [final] = ledger(job, "final")
    assert final["outcome"] == "no_progress"
    assert final["message"].startswith(
        "NOT restarted after 3 attempt(s): the same failure 3 times in a row without advancing the checkpoint: "
        f"{attempts[-1]['decision']['fingerprint']}")
    assert attempts[-1]["decision"]["fingerprint"] == (  # the corpus line, numbers masked, cut at 160 characters
        "nccl_timeout @ localhost: [rankN]:[EN N:N:N.N ProcessGroupNCCL.cpp:N] [Rank N] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=N, OpType=_ALLGATHER_BASE, NumelIn=N, NumelOu")
    assert final["message"] in outputs[-1]
    # requeued by hand afterwards: the stopped run does not start again
    got, outputs = run_attempts(job, "nccl nccl nccl finish", restarts=[3])
    assert got == [(1, [])] and "megatron_resilience: this run was stopped: NOT restarted" in outputs[0]


@pytest.mark.parametrize("nodes, partition, calls, not_applied", [
    # two nodes: the node Megatron's rerun machine named is excluded from the requeued job
    ("nid004410", "nid004410,nid004411", REQUEUED + ["update JobId=42 ExcNodeList=nid004410"], None),
    # the only node: excluding it would strand the job, so the exclusion is recorded, not applied
    ("nid004410", "nid004410", REQUEUED, "excluding nid004410 would leave 0 usable node(s) in partition batch"),
])
def test_policy_exit_16_requeues_excluding_the_node(tmp_path, nodes, partition, calls, not_applied):
    job = render(tmp_path, ft=True, policy="megatron_transient")
    got, outputs = run_attempts(job, "rerun16", nodes=nodes, partition=partition)
    assert got == [(16, calls)]
    [attempt] = ledger(job, "attempt")
    decision = attempt["decision"]
    assert (attempt["classification"]["error_type"], decision["exclude_requested"]) == ("rerun_resume", ["nid004410"])
    if not_applied:
        assert decision["exclude_applied"] == [] and decision["exclude_not_applied"].startswith(not_applied)
    else:
        assert decision["exclude_applied"] == ["nid004410"] and decision["exclude_not_applied"] is None
        assert [i["action"] for i in ledger(job, "intent")] == ["requeue", "exclude_nodes"]


def test_policy_user_scancel_is_never_retried(tmp_path):
    """scancel: the trainer still catches SIGTERM and saves (stop_reason "signal"), but a person stopped the job."""
    job = render(tmp_path, ft=True, policy="megatron_aggressive")
    got, _ = run_attempts(job, "preempt finish", job_state="CANCELLED")
    assert got == [(0, [])]
    [attempt] = ledger(job, "attempt")
    assert attempt["classification"]["error_type"] == "user_cancel"
    assert ledger(job, "final")[0]["outcome"] == "cancelled"


def test_policy_classifier_failure_falls_back_to_nemo_runs_rule(tmp_path):
    job = render(tmp_path, ft=True, retries=1, policy="megatron_transient")
    got, outputs = run_attempts(job, "oom oom oom", python=BROKEN)
    assert got == [(1, REQUEUED), (1, [])]  # nemo_run's rule: 1 + num_job_retries_on_failure attempts
    assert all("the job-level classifier failed (exit 1); falling back to nemo_run's decision" in o for o in outputs)


def test_ft_heredoc_writes_the_yaml_ft_launcher_reads(tmp_path):
    with open(os.path.join(GOLDEN, "ft_preemption_partial.sh")) as f:
        text = f.read()
    found = re.search(r"# >>> megatron_resilience FaultTolerancePlugin ft_launcher config >>>\n.*?"
                      r"# <<< megatron_resilience FaultTolerancePlugin ft_launcher config <<<\n", text, re.S)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    body = found.group(0).replace("/cluster/experiments/gpt/gpt_preview/gpt", str(job_dir))
    proc = subprocess.run(["bash", "-c", "set -evx\n" + body], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert (job_dir / "gpt_ft_cfg.yml").read_text() == (
        "fault_tolerance:\n  workload_check_interval: 5.0\n  initial_rank_heartbeat_timeout: null\n"
        "  rank_heartbeat_timeout: null\n  rank_section_timeouts:\n    setup: 600.0\n    step: 180.0\n"
        "    checkpointing: 420.0\n  rank_out_of_section_timeout: 300.0\n  rank_termination_signal: SIGKILL\n"
        "  log_level: INFO\n")


def test_golden_scripts_are_valid_bash():
    for path in sorted(glob.glob(os.path.join(GOLDEN, "*.sh"))):
        proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


@pytest.mark.parametrize("ft, plan", [(True, "fullterm finish"), (False, "fullterm finish"),
                                      (True, "fullterm_killed finish")])
def test_the_batch_shell_survives_the_schedulers_signal_and_requeues_without_a_retry(tmp_path, ft, plan):
    """scancel --signal=TERM --full / PreemptMode with GraceTime: the batch shell is signalled while the step runs.
    It waits for the step, decides (a preemption: requeued, no retry spent), and the next attempt finishes."""
    job = render(tmp_path, ft=ft, policy="megatron_transient")
    got, outputs = run_attempts(job, plan)
    assert got == [(0 if plan.startswith("fullterm ") else 143, REQUEUED), (0, [])], outputs
    first, second = ledger(job, "attempt")
    assert "megatron_resilience: the batch shell received SIGTERM (preemption, scancel --full); the job step has " \
           "ended: deciding" in outputs[0], (outputs[0], first)
    assert (first["batch_signal"], first["classification"]["error_type"], first["decision"]["action"],
            first["decision"]["spent"]) == ("SIGTERM", "preempted", "requeue", None), first
    assert first["decision"]["budget_left"] == {"crash": 3, "stall": 2, "timeout": 1}
    assert (second["classification"]["error_type"], second["decision"]["outcome"]) == ("finished", "finished")
    if ft:
        assert results(job) == ["42 0 S", "42 1 S"]  # nemo_run's own record spends no retry either


@pytest.mark.parametrize("plan, attempts, outcome, error_type", [
    ("fail finish", [(1, [])], "monitor_only", "unknown"),
    ("oom finish", [(1, [])], "monitor_only", "cuda_oom"),
    ("preempt finish", [(0, [])], "monitor_only", "preempted"),  # not even a preemption is requeued
    ("finish", [(0, [])], "finished", "finished"),
])
def test_monitor_only_records_every_attempt_and_never_requeues(tmp_path, plan, attempts, outcome, error_type):
    """RestartPolicyPlugin(policy=None): classified and recorded; neither a policy nor executor.retries requeues."""
    job = render(tmp_path, ft=True, retries=3, monitor_only=True)
    got, outputs = run_attempts(job, plan)
    assert got == attempts
    [attempt] = ledger(job, "attempt")
    assert (attempt["policy"], attempt["classification"]["error_type"], attempt["decision"]["action"]) == \
        ("monitor_only", error_type, "record")
    [final] = ledger(job, "final")
    assert final["outcome"] == outcome
    assert f"megatron_resilience: monitor-only: attempt 0 ended {error_type} (" in outputs[0]
    assert not os.path.exists(os.path.join(job["job_dir"], "gpt_job_level_stopped"))  # a later requeue may run


def test_the_job_step_gets_the_ft_launcher_flags_and_its_own_session(tmp_path):
    """FaultTolerancePlugin's srun wrapper (ft_launcher flags nemo_run has no field for, srun --kill-on-bad-exit=0
    for in-process restart) and the job-level block's srun in a session of its own (setsid -w) compose: the step
    runs with the flags inserted AND outside the batch shell's session."""
    job = render(tmp_path, ft=True, policy="megatron_transient",
                 ft_args={"nvrx_version": "0.6", "max_no_progress_cycles": 4, "inprocess_restart": True})
    calls = tmp_path / "srun_calls"
    got, outputs = run_attempts(job, "finish", env_extra={"SRUN_CALLS": str(calls)})
    assert got == [(0, [])], outputs
    [step] = [line for line in calls.read_text().splitlines() if " ft_launcher " in line]
    pid, sid, argv = step.split(" ", 2)
    assert pid == sid, step  # srun leads a session of its own: a signal to the batch shell's group misses it
    # srun takes the last --kill-on-bad-exit (tests/slurm/test_inprocess_on_slurm.py checks it on Slurm)
    assert " --wait=60 --kill-on-bad-exit=1 --kill-on-bad-exit=0 ft_launcher --ft-max-no-progress-cycles 4 " \
        "--ft-workload_check_interval 5.0 " in argv, argv
