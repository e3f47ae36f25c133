"""Issue 6: the plugins and the trainer against real sbatch, signals and requeues (tiny GPT on CPU).

Every job goes through NeMo-Run's ``SlurmExecutor`` with a ``LocalTunnel`` and our plugins, exactly as
a user on a login node submits it; attempts and states are counted from Slurm's own records.

One module fixture submits every job at once and waits once. Nothing here depends on how fast the
machine is (the suite must pass with both cores saturated):

- ``limit``: a real time limit with ``PreemptionPlugin(preempt_time=300)``. It is submitted with 30 minutes;
  once it trains (however long its setup took), its limit is lowered with ``scontrol update`` to the minute
  that ends 310-330 s later, so Slurm's own warning (``--signal=SIGTERM@300``, sent on slurmctld's 30 s tick
  once the end is <= 330 s away) arrives at its next tick, while it trains, >= 280 s before the limit (a
  process's first save took 3 minutes on this machine under other suites' load). Once requeued, its limit
  goes back to 30 minutes. ``LIMIT_STEPS`` last longer than the wait for that tick even on a quiet machine (its
  rank 0 sleeps 0.1 s in every step).
- the ``scancel -s SIGTERM`` jobs (``Script``, inline ``Script`` with 2 tasks launched by ``srun`` and no
  launcher, torchrun ``Partial``): signalled once they train; checkpoint, requeue, resume with losses equal to
  an uninterrupted run;
- fault tolerance (a killed rank in sections mode, also under torch FSDP2 and Megatron-FSDP, a hung rank in
  heartbeats mode, exhausted restarts), rerun exit codes, status and logs from a later session.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from resilience_support.launch import log_time
from resilience_support.stop import finish_record, finished_at

from megatron_resilience.upstream import import_nemo_run
from slurm.jobs import Job
from slurm.resilience_jobs import (
    FSDP2_FAULT_STEP,
    FSDP2_STEPS,
    HB,
    HB_INITIAL,
    LIMIT_STEPS,
    SHARDED_JOBS,
    SIGNAL_AFTER_STEP,
    STEPS,
    submit_and_wait,
)

run = import_nemo_run()



@pytest.fixture(scope="module")
def jobs(slurm_cluster, nemorun_home, slurm_tmp):
    return submit_and_wait(slurm_cluster, slurm_tmp)


def _stopped_by_signal(job: Job, ranks: int, *, launcher: bool = True) -> int:
    """The step after which the first run stopped on SIGTERM; asserts that every rank got the signal."""
    first = job.attempt_log(0)
    m = re.search(r"stopping after step (\d+): SIGTERM received; saving a checkpoint and exiting 0", first)
    assert m, job.describe()
    if ranks > 1 and launcher:  # the launcher is the step's task: it forwards the signal to each rank's process
        forwarded = set(re.findall(r"Sending process (\d+) closing signal SIGTERM", first))
        assert len(forwarded) == ranks, job.describe()
    return int(m.group(1))


def _assert_resumed_and_completed(job: Job, finals: dict, *, max_steps: int, ranks: int, ref: Job | None = None,
                                  launcher: bool = True) -> int:
    stopped = _stopped_by_signal(job, ranks, launcher=launcher)
    info = finals[job.name]
    runs = job.attempts()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    assert [a["State"] for a in runs] == ["REQUEUED", "COMPLETED"], job.describe()
    assert stopped in job.checkpoint_steps(), job.describe()
    assert job.starts() == [0, stopped], job.describe()  # the requeued run resumed from the signal's checkpoint
    # Every step logged exactly once: none lost, none trained twice.
    assert [r["step"] for r in job.records() if r.get("kind") == "train"] == list(range(1, max_steps + 1))
    if ref is not None:
        expected = ref.losses()
        assert sorted(expected) == list(range(1, max_steps + 1)), ref.describe()
        assert job.losses() == expected  # bit-identical per-step losses: nothing computed differently
    stop = job.stop_reason()
    assert finish_record(stop) == finished_at(max_steps)
    return stopped


# --- 1. a real time limit with preempt_time=300 --------------------------------------------------------------------


def test_1a_time_limit_warning_reaches_every_rank_before_the_limit(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    limit, update = js["limit"], jobs["limit_update"]
    assert "error" not in update and update.get("minutes"), f"time limit not set: {update}\n{limit.describe()}"
    stopped = _stopped_by_signal(limit, ranks=2)
    # Causality, not timing: the limit was lowered while the job trained; the warning stopped it later, before
    # it finished; the first run ended by the requeue (not TIMEOUT) before its new limit.
    assert update["step"] <= stopped < LIMIT_STEPS, (update, stopped, limit.describe())
    first = limit.attempts()[0]
    assert first["State"] == "REQUEUED", limit.describe()
    h, m, s = (int(x) for x in first["Elapsed"].split(":"))
    assert h * 3600 + m * 60 + s < update["minutes"] * 60, (update, first)
    signal_log = next(line for line in limit.attempt_log(0).splitlines() if "stopping after step" in line)
    assert log_time(signal_log) > update["wall"] - 1, (update, signal_log)  # after the limit was set
    assert finals["limit"]["JobState"] == "COMPLETED", limit.describe()


def test_1b_time_limit_checkpoint_requeue_resume_every_step_once(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    limit = js["limit"]
    # Losses equal to an uninterrupted run after a signal's checkpoint: test_2b (the same stop, save and resume).
    _assert_resumed_and_completed(limit, finals, max_steps=LIMIT_STEPS, ranks=2)
    # Both runs are recorded as successes: the preemption spent none of the job's failure retries.
    assert limit.job_results() == [f"{limit.slurm_id} 0 S", f"{limit.slurm_id} 1 S"], limit.describe()


# --- 2. the signal reaches the trainer for Partial and Script tasks ----------------------------------------------

TASK_FORMS = {
    "script": 'run.Script(path="megatron_resilience", m=True) under ft_launcher, 2 ranks',
    "inline": "run.Script(inline=...), 2 tasks launched by srun, no launcher (the plugin makes the python line exec)",
    "torchrun": "run.Partial under torchrun, 2 ranks, PreemptionPlugin alone",
}
LAUNCHED_BY = {"script": True, "inline": False, "torchrun": True}


@pytest.mark.parametrize("name", list(TASK_FORMS), ids=list(TASK_FORMS))
def test_2a_scancel_sigterm_reaches_every_rank_of_each_task_form(jobs, name):
    js = jobs["jobs"]
    sent = jobs["sent"].get(name)
    assert isinstance(sent, float), f"{name}: signal not sent: {sent!r}\n{js[name].describe()}"
    assert _stopped_by_signal(js[name], 2, launcher=LAUNCHED_BY[name]) >= SIGNAL_AFTER_STEP


@pytest.mark.parametrize("name", list(TASK_FORMS), ids=list(TASK_FORMS))
def test_2b_signalled_job_checkpoints_requeues_and_resumes_with_equal_losses(jobs, name):
    _assert_resumed_and_completed(jobs["jobs"][name], jobs["finals"], max_steps=STEPS, ranks=2, ref=jobs["jobs"]["ref"],
                                  launcher=LAUNCHED_BY[name])


def test_2c_srun_without_launcher_runs_one_world_of_two_ranks(jobs):
    """tests/golden/preemption_inline.sh's shape: each srun task finds its rank, the world and the rendezvous from
    Slurm's variables; one world of 2 (not two worlds of 1 writing the same run directory)."""
    job = jobs["jobs"]["inline"]
    for restart in (0, 1):
        log = job.attempt_log(restart)
        assert log.count("distributed: world_size=2 tp=1 pp=1 dp=2 device=cpu backend=gloo") == 1, job.describe()
        m = re.search(r"distributed: started by srun without a launcher: rank = SLURM_PROCID, world size = "
                      r"SLURM_STEP_NUM_TASKS = 2, local rank = SLURM_LOCALID; rendezvous (\S+):(\d+)", log)
        assert m and m.group(1) == "127.0.0.1" and int(m.group(2)) == 15000 + int(job.slurm_id) % 10000, log[-3000:]
        assert "Sending process" not in log  # no launcher in between: Slurm signalled each rank itself
    starts = [r for r in job.records() if r.get("kind") == "start"]
    assert [(r["world_size"], r["dp"]) for r in starts] == [(2, 2), (2, 2)], starts  # rank 0 alone writes metrics


# --- 3. fault tolerance: in-job restart, then job requeues until the failure limit -------------------------------


def test_3a_killed_rank_is_restarted_in_job_and_finishes(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job = js["ft_killed"]
    info = finals["ft_killed"]  # before test 5's requeue by hand
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    log = job.attempt_log(0)
    assert "SIMULATED FAULT" in log and "rank_killed on rank 1" in log, job.describe()
    assert "will restart worker group" in log, job.describe()
    assert job.starts()[:2] == [0, 20], job.describe()  # in-job restart resumed from the step-20 checkpoint
    assert job.losses() == js["ref"].losses()


@pytest.mark.parametrize("name", sorted(SHARDED_JOBS))
def test_3a_sharded_killed_rank_is_restarted_in_job_and_resumes_exact(jobs, name):
    """torch FSDP2 and Megatron-FSDP (issue 33): rank 1 killed at the start of step 29, ft_launcher restarts both ranks
    inside the job, they resume from the sharded step-20 checkpoint and train steps 21-28 again with the losses of
    their first, uninterrupted pass, bit for bit (model shards, Adam state, data position and schedule all
    restored); every checkpoint in the strategy's own format."""
    strategy, ckpt_format, _ = SHARDED_JOBS[name]
    job = jobs["jobs"][name]
    info = jobs["finals"][name]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    assert [a["State"] for a in job.attempts()] == ["COMPLETED"], job.describe()
    log = job.attempt_log(0).splitlines()
    fault = next(i for i, line in enumerate(log) if "SIMULATED FAULT" in line)
    assert "rank_killed on rank 1 (pid" in log[fault] and f"at the start of step {FSDP2_FAULT_STEP}" in log[fault]
    restart = next(i for i, line in enumerate(log) if "will restart worker group" in line)
    resumed = next(i for i, line in enumerate(log) if "setup: resumed at step 20 (consumed_samples=160)" in line)
    assert fault < restart < resumed, (fault, restart, resumed)
    assert sum("distributed: world_size=2 tp=1 pp=1 dp=2" in line for line in log) == 2, job.describe()
    assert job.starts() == [0, 20], job.describe()
    first, after = job.losses_per_start()
    assert sorted(first) == list(range(1, FSDP2_FAULT_STEP)), job.describe()
    assert sorted(after) == list(range(21, FSDP2_STEPS + 1)), job.describe()
    again = range(21, FSDP2_FAULT_STEP)
    assert {s: after[s] for s in again} == {s: first[s] for s in again}  # bitwise, as metrics.jsonl holds them
    assert finish_record(job.stop_reason()) == finished_at(FSDP2_STEPS)
    # On disk: sharded checkpoints in the strategy's format, each saying which strategy its tensors are sharded for.
    assert job.checkpoint_steps() == [10, 20, 30], job.describe()
    for step in job.checkpoint_steps():
        folder = os.path.join(job.run_dir, "checkpoints", f"iter_{step:07d}")
        with open(os.path.join(folder, "metadata.json")) as f:
            assert json.load(f)["sharded_backend"] == ckpt_format
        with open(os.path.join(folder, "model_shape.json")) as f:
            assert json.load(f)["data_parallel_strategy"] == strategy


def test_3a_heartbeats_mode_hung_rank_is_restarted_in_job_and_finishes(jobs):
    """FaultTolerancePlugin with the task's ft.mode=heartbeats: heartbeat timeouts only, a hung rank detected by
    the missing heartbeat, in-job restart, resume from the step-20 checkpoint, losses of an uninterrupted run."""
    js, finals = jobs["jobs"], jobs["finals"]
    job = js["ft_heartbeats"]
    info = finals["ft_heartbeats"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    log = job.attempt_log(0).splitlines()
    connected = f"FT: connected to the rank monitor (mode=heartbeats); heartbeat timeouts: initial={HB_INITIAL:.2f}s " \
                f"subsequent={HB:.2f}s"
    fault = next(i for i, line in enumerate(log) if "SIMULATED FAULT" in line)
    assert "rank_hung on rank 0" in log[fault] and "at the start of step 25" in log[fault], job.describe()
    assert any(connected in line for line in log[:fault]), job.describe()
    # Order: the hang, then the missing heartbeat, then the restart, then the resume from step 20.
    missed = next(i for i, line in enumerate(log) if "Did not get subsequent heartbeat" in line)
    restart = next(i for i, line in enumerate(log) if "will restart worker group" in line)
    resumed = next(i for i, line in enumerate(log) if "setup: resumed at step 20" in line)
    assert fault < missed < restart < resumed, (fault, missed, restart, resumed)
    assert f"Waited {HB:.2f} seconds" in log[missed]
    assert not any("Section '" in line for line in log)  # no section timeouts in heartbeats mode
    assert job.starts() == [0, 20], job.describe()
    assert job.losses() == js["ref"].losses()


def _assert_every_run_exhausted_its_in_job_restarts(job: Job, runs: int) -> None:
    for restart in range(runs):
        log = job.attempt_log(restart)
        # The first worker group and its one in-job restart both failed in setup (the trainer's path check, before
        # torch loads), then ft_launcher gave up.
        assert log.count("megatron_resilience: data.data_path: must name indexed datasets") == 2, job.describe()
        assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in log, job.describe()
        assert "Some rank(s) exited with non-zero exit code" in log, job.describe()


def test_3b_exhausted_in_job_restarts_are_requeued_then_the_job_stops(jobs):
    job = jobs["jobs"]["ft_exhausted"]
    info = jobs["finals"]["ft_exhausted"]
    runs = job.attempts()
    assert len(runs) >= 2 and all(a["State"] == "REQUEUED" for a in runs[:-1]), job.describe()
    assert len(runs) <= 1 + 2  # num_job_retries_on_failure=2: never more requeues than that
    assert int(info["Restarts"]) == len(runs) - 1, job.describe()  # stopped: no requeue pending
    _assert_every_run_exhausted_its_in_job_restarts(job, len(runs))
    assert job.job_results() == [f"{job.slurm_id} {n} F" for n in range(len(runs))], job.describe()


def test_3b_retries_count_is_num_job_retries_on_failure_and_the_job_ends_failed(jobs):
    job = jobs["jobs"]["ft_exhausted"]
    # num_job_retries_on_failure=2: the first attempt and two requeues, each failing; Slurm says FAILED.
    assert [a["State"] for a in job.attempts()] == ["REQUEUED", "REQUEUED", "FAILED"], job.describe()


# --- 4. rerun state machine exit codes --------------------------------------------------------------------------


def test_4_rerun_exit_17_is_not_requeued_and_16_is(jobs):
    js = jobs["jobs"]
    r17, r16 = js["rerun_17"], js["rerun_16"]
    # Not requeued, and FAILED (docs/faults.md's promise): a result that failed validation is for a person to look at.
    assert [a["State"] for a in r17.attempts()] == ["FAILED"], r17.describe()
    assert jobs["finals"]["rerun_17"]["ExitCode"] != "0:0", r17.describe()
    assert jobs["finals"]["rerun_17"]["Restarts"] == "0", r17.describe()
    assert r17.stop_reason()["exit_code"] == 17, r17.describe()
    assert "failed (exitcode: 17)" in r17.log()
    assert int(jobs["finals"]["rerun_16"]["Restarts"]) >= 1, r16.describe()
    assert r16.attempts()[0]["State"] == "REQUEUED", r16.describe()
    assert "failed (exitcode: 16)" in r16.attempt_log(0), r16.describe()


# --- 5. a finished run is never requeued --------------------------------------------------------------------------


def test_5_a_finished_run_is_never_requeued(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    for name in ("limit", "script", "inline", "ft_killed"):
        assert finals[name]["JobState"] == "COMPLETED", js[name].describe()
    # Requeued by hand after it finished: the new run sees the finished flag and exits without training.
    job = js["ft_killed"]
    again = jobs["requeued_by_hand"]
    assert again is not None and (again["JobState"], again["ExitCode"]) == ("COMPLETED", "0:0"), job.describe()
    restart = int(again["Restarts"])
    assert restart >= 1
    sbatch_log = job.log()
    assert "Training is finished" in sbatch_log, job.describe()
    assert len(job.starts()) == 2  # the first start and the in-job restart; none after the requeue


# --- 6. status and logs from a later session, as a notebook user would ----------------------------------------------


def test_6_experiment_from_id_status_and_logs(jobs, nemorun_home, slurm_cluster):
    """A new Python process (a later notebook session) rebuilds two experiments by id and reads them."""
    js = jobs["jobs"]
    code = (
        "from megatron_resilience.upstream import import_nemo_run\n"
        "run = import_nemo_run()\n"
        "if __name__ == '__main__':\n"
        "    for exp_id, name in EXPERIMENTS:\n"
        "        exp = run.Experiment.from_id(exp_id)\n"
        "        status = exp.status(return_dict=True)\n"
        "        print('STATUS', {k: str(v['status']) for k, v in status.items()}, flush=True)\n"
        "        print('LOGS', name, flush=True)\n"
        "        exp.logs(job_id=name)\n"
    ).replace("EXPERIMENTS", repr([(js[n].exp_id, n) for n in ("ref", "script")]))
    env = {**slurm_cluster.env, "NEMORUN_HOME": nemorun_home, "COLUMNS": "200"}
    # nemo_run prints the log lines on stderr: one stream keeps them after their "LOGS <name>" line.
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=180, env=env, stdin=subprocess.DEVNULL)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "STATUS {'ref': 'SUCCEEDED'}" in out and "STATUS {'script': 'SUCCEEDED'}" in out, out[-3000:]
    ref_logs, script_logs = out.split("LOGS ref", 1)[1].split("LOGS script", 1)
    assert f"step {STEPS}/{STEPS} | loss" in ref_logs, ref_logs[-3000:]
    # For a requeued job nemo_run shows the first run's log (log-*_0.out): here, the preemption stop.
    assert "SIGTERM received; saving a checkpoint" in script_logs, script_logs[-3000:]
