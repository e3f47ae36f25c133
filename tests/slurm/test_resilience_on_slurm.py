"""Issue 6: the plugins and the trainer against real sbatch, signals and requeues (tiny GPT on CPU).

Every job goes through NeMo-Run's ``SlurmExecutor`` with a ``LocalTunnel`` and our plugins, exactly as
a user on a login node submits it; attempts and states are counted from Slurm's own records.

To keep the wall time small, one module fixture submits everything and waits once:

1. ``limit``: the only job where timing is the point. ``--time=1`` with ``PreemptionPlugin(preempt_time=30)``;
   it starts right after slurmctld's 30 s tick (see ``jobs.tick_probe``) and runs alone until its warning
   signal, so startup on a busy 2-core machine cannot eat the minute. Once it is requeued, its limit is
   raised to 30 minutes with ``scontrol update``: a 1-minute job signalled 30 s before its end would be
   signalled again before the resumed run finished its setup (a real job has hours, not seconds).
2. Everything else at once: uninterrupted references, the ``scancel -s SIGTERM`` jobs (where only the
   handler logic matters), fault tolerance, rerun exit codes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

from slurm.cluster import wait_for_job
from slurm.jobs import Job, scancel_signal, submit, tick_probe, wait_until

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402
from megatron_resilience.recipes import RECIPES  # noqa: E402

LIMIT_STEPS = 1500  # more than 2 ranks train in the ~15 s between setup and the warning signal
STEPS = 100
SIGNAL_AFTER_STEP = 5  # scancel jobs: signal once training is under way
SCANCEL_JOBS = ("script", "inline", "torchrun")


def tiny(root: str, name: str, *, max_steps: int, save_interval: int | None, ranks: int = 2, **edits):
    """The ``gpt_tiny`` recipe (fault tolerance, straggler reports, rerun state machine, exit handler on)."""
    task = RECIPES["gpt_tiny"](dir=root, name=name, num_nodes=1, num_gpus_per_node=ranks)
    task.train.max_steps = max_steps
    task.checkpoint.save_interval = save_interval
    for key, value in edits.items():
        section, field = key.split("__")
        setattr(getattr(task, section), field, value)
    return task


def trainer_args(run_dir: str, max_steps: int) -> list[str]:
    """``python -m megatron_resilience`` overrides equal to ``tiny(...)`` (same numerics as the Partial)."""
    return [f"run_dir={run_dir}", f"train.max_steps={max_steps}", "train.device=cpu",
            f"checkpoint.save={run_dir}/checkpoints", "checkpoint.save_interval=10",
            "ft.enabled=true", "ft.calc_ft_timeouts=true", "rerun.rerun_mode=validate_results"]


def _signal_when_training(job: Job, sent: dict) -> None:
    """Background: once the first run has logged SIGNAL_AFTER_STEP steps, ``scancel -s SIGTERM`` its steps."""
    try:
        wait_until(lambda: job.last_step() >= SIGNAL_AFTER_STEP, timeout=900, interval=0.1,
                   what=f"{job.name} to train {SIGNAL_AFTER_STEP} steps")
        sent[job.name] = scancel_signal(job)
    except Exception as err:  # noqa: BLE001 - reported by the test that needs it
        sent[job.name] = err


@pytest.fixture(scope="module")
def jobs(slurm_cluster, nemorun_home, slurm_tmp):
    root = os.path.join(slurm_tmp, "runs")
    cluster = slurm_cluster
    js: dict[str, Job] = {}
    t0 = time.monotonic()

    def partial(name, ranks=2, launcher="torchrun", time="00:30:00", plugins=(), extra=None, **task_kw):
        task = tiny(root, name, ranks=ranks, **task_kw)
        executor = cluster.executor(time=time, ntasks_per_node=ranks, launcher=launcher, **(extra or {}))
        js[name] = submit(name, task, executor, list(plugins), run_dir=task.run_dir)

    def script(name, task, ranks, launcher, plugins):
        js[name] = submit(name, task, cluster.executor(time="00:30:00", ntasks_per_node=ranks, launcher=launcher),
                          plugins, run_dir=os.path.join(root, name))

    def ft_and_preemption(preempt_time=60):
        return [FaultTolerancePlugin(num_in_job_restarts=2, num_job_retries_on_failure=2),
                PreemptionPlugin(preempt_time=preempt_time)]

    # 1. The time-limit job, alone, started just after a tick: FT + preemption, 2 ranks under ft_launcher.
    probe = tick_probe(cluster)
    partial("limit", launcher=None, time="00:01:00", plugins=ft_and_preemption(preempt_time=30),
            max_steps=LIMIT_STEPS, save_interval=None,
            extra={"additional_parameters": {"dependency": f"afterany:{probe}"}})
    limit = js["limit"]
    wait_until(lambda: int(limit.info().get("Restarts", 0)) >= 1 or limit.info().get("JobState") in
               ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=240, interval=0.5,
               what="the 1-minute job's first run to end")
    if limit.info().get("JobState") in ("PENDING", "REQUEUED", "RUNNING"):
        subprocess.run(["scontrol", "update", f"JobId={limit.slurm_id}", "TimeLimit=30"], check=True)

    # 2. Everything else at once.
    partial("ref_limit", max_steps=LIMIT_STEPS, save_interval=None)
    partial("ref", max_steps=STEPS, save_interval=10)
    partial("ref_1rank", ranks=1, launcher=None, max_steps=STEPS, save_interval=10)
    # Signal delivery (scancel -s SIGTERM, like --signal without B:) for each task form:
    script("script", run.Script(path="megatron_resilience", m=True, entrypoint="python",
                                args=trainer_args(os.path.join(root, "script"), STEPS)), 2, None,
           ft_and_preemption())
    inline = "cd /tmp\npython -m megatron_resilience " + " ".join(trainer_args(os.path.join(root, "inline"), STEPS))
    script("inline", run.Script(inline=inline + "\n"), 1, None, [PreemptionPlugin(preempt_time=60)])
    partial("torchrun", max_steps=STEPS, save_interval=10, plugins=[PreemptionPlugin(preempt_time=60)])
    # Fault tolerance: a rank killed at step 25 (checkpoints every 10 steps).
    partial("ft_killed", launcher=None, plugins=ft_and_preemption(), max_steps=STEPS, save_interval=10,
            ft__simulate_fault=True, ft__simulated_fault_type="rank_killed", ft__simulated_fault_rank=1,
            ft__simulated_fault_step=25)
    # In-job restarts exhausted on every attempt: the data files do not exist, so every rank fails in setup.
    partial("ft_exhausted", ranks=1, launcher=None, max_steps=STEPS, save_interval=10,
            plugins=[FaultTolerancePlugin(num_in_job_restarts=1, num_job_retries_on_failure=2)],
            data__data_path=[os.path.join(root, "no_such_dataset")])
    for code, kind in ((17, "transient_error"), (16, "persistent_error")):
        partial(f"rerun_{code}", launcher=None, max_steps=12, save_interval=4,
                plugins=[FaultTolerancePlugin(num_in_job_restarts=1, num_job_retries_on_failure=2)],
                rerun__rerun_mode="validate_results", rerun__error_injection_rate=8,
                rerun__error_injection_type=kind)

    sent: dict = {}
    threads = [threading.Thread(target=_signal_when_training, args=(js[n], sent), daemon=True)
               for n in SCANCEL_JOBS]
    for t in threads:
        t.start()
    finals = {name: wait_for_job(job.slurm_id, timeout=1200) for name, job in js.items()}
    for t in threads:
        t.join(timeout=10)

    # 5. A finished run that is requeued anyway (node failure, an operator) must not train again.
    requeued_by_hand = None
    if finals["ft_killed"]["JobState"] == "COMPLETED":
        subprocess.run(["scontrol", "requeue", js["ft_killed"].slurm_id], check=True)
        wait_until(lambda: js["ft_killed"].info().get("Restarts") != finals["ft_killed"]["Restarts"], timeout=60,
                   what="the requeue to register")
        requeued_by_hand = wait_for_job(js["ft_killed"].slurm_id, timeout=300)
    wall = time.monotonic() - t0
    print(f"\nSlurm jobs done in {wall:.0f} s")
    return {"jobs": js, "finals": finals, "sent": sent, "requeued_by_hand": requeued_by_hand, "wall": wall}


def _restart_log(job: Job, restart: int) -> str:
    """The job step's log of one Slurm run (restart 0 = first run): launcher and all ranks."""
    names = [p for p in os.listdir(job.job_dir) if p.startswith("log-") and p.endswith(f"_{restart}.out")]
    assert len(names) == 1, f"no log of run {restart}: {os.listdir(job.job_dir)}\n{job.describe()}"
    return open(os.path.join(job.job_dir, names[0]), errors="replace").read()


def _job_results(job: Job) -> list[str]:
    """nemo_run's FT sbatch bookkeeping: one '<job id> <restart> S|F' line per Slurm run."""
    (path,) = [os.path.join(job.job_dir, p) for p in os.listdir(job.job_dir) if p.endswith("_job_results")]
    return open(path).read().split("\n")[:-1]


def _stopped_by_signal(job: Job, ranks: int) -> int:
    """The step after which the first run stopped on SIGTERM; asserts that every rank got the signal."""
    first = _restart_log(job, 0)
    m = re.search(r"stopping after step (\d+): SIGTERM received; saving a checkpoint and exiting 0", first)
    assert m, job.describe()
    if ranks > 1:  # the launcher is the step's task: it forwards the signal to each rank's process
        forwarded = set(re.findall(r"Sending process (\d+) closing signal SIGTERM", first))
        assert len(forwarded) == ranks, job.describe()
    return int(m.group(1))


def _assert_resumed_and_completed(job: Job, ref: Job, finals: dict, *, max_steps: int, ranks: int) -> int:
    stopped = _stopped_by_signal(job, ranks)
    info = finals[job.name]
    runs = job.attempts()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    assert [a["State"] for a in runs] == ["REQUEUED", "COMPLETED"], job.describe()
    assert stopped in job.checkpoint_steps(), job.describe()
    assert job.starts() == [0, stopped], job.describe()  # the requeued run resumed from the signal's checkpoint
    losses, expected = job.losses(), ref.losses()
    assert sorted(expected) == list(range(1, max_steps + 1)), ref.describe()
    assert losses == expected  # bit-identical per-step losses: no step lost, none trained twice differently
    assert job.stop_reason() == {"reason": "finished", "step": max_steps, "exit_code": 0, "finished": True}
    return stopped


# --- 1. a real 1-minute limit with preempt_time=30 ---------------------------------------------------------------


def test_1a_time_limit_warning_reaches_every_rank_before_the_limit(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    limit = js["limit"]
    stopped = _stopped_by_signal(limit, ranks=2)
    assert 0 < stopped < LIMIT_STEPS, limit.describe()  # the signal came while training, not during setup
    first = limit.attempts()[0]
    # Slurm's warning came and the ranks stopped before the 1-minute limit: the first run ended by the
    # requeue, in under 60 s, not by TIMEOUT.
    h, m, s = (int(x) for x in first["Elapsed"].split(":"))
    assert first["State"] == "REQUEUED" and h * 3600 + m * 60 + s < 60, limit.describe()
    assert finals["limit"]["JobState"] == "COMPLETED", limit.describe()


def test_1b_time_limit_checkpoint_requeue_resume_with_equal_losses(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    limit = js["limit"]
    _assert_resumed_and_completed(limit, js["ref_limit"], finals, max_steps=LIMIT_STEPS, ranks=2)
    # Both runs are recorded as successes: the preemption spent none of the job's failure retries.
    assert _job_results(limit) == [f"{limit.slurm_id} 0 S", f"{limit.slurm_id} 1 S"], limit.describe()


# --- 2. the signal reaches the trainer for Partial and Script tasks ----------------------------------------------

TASK_FORMS = {
    "script": 'run.Script(path="megatron_resilience", m=True) under ft_launcher, 2 ranks',
    "inline": "run.Script(inline=...), no launcher: the plugin turns `srun bash script.sh`'s python line into exec",
    "torchrun": "run.Partial under torchrun, 2 ranks, PreemptionPlugin alone",
}


@pytest.mark.parametrize("name, ranks", [("script", 2), ("inline", 1), ("torchrun", 2)], ids=list(TASK_FORMS))
def test_2a_scancel_sigterm_reaches_every_rank_of_each_task_form(jobs, name, ranks):
    js = jobs["jobs"]
    sent = jobs["sent"].get(name)
    assert isinstance(sent, float), f"{name}: signal not sent: {sent!r}\n{js[name].describe()}"
    assert _stopped_by_signal(js[name], ranks) >= SIGNAL_AFTER_STEP


@pytest.mark.parametrize("name, ref, ranks", [
    ("script", "ref", 2),
    ("inline", "ref_1rank", 1),
    ("torchrun", "ref", 2),
], ids=list(TASK_FORMS))
def test_2b_signalled_job_checkpoints_requeues_and_resumes_with_equal_losses(jobs, name, ref, ranks):
    _assert_resumed_and_completed(jobs["jobs"][name], jobs["jobs"][ref], jobs["finals"], max_steps=STEPS,
                                  ranks=ranks)


# --- 3. fault tolerance: in-job restart, then job requeues until the failure limit -------------------------------


def test_3a_killed_rank_is_restarted_in_job_and_finishes(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job = js["ft_killed"]
    info = finals["ft_killed"]  # before test 5's requeue by hand
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    log = _restart_log(job, 0)
    assert "SIMULATED FAULT" in log and "rank_killed on rank 1" in log, job.describe()
    assert "will restart worker group" in log, job.describe()
    assert job.starts()[:2] == [0, 20], job.describe()  # in-job restart resumed from the step-20 checkpoint
    assert job.losses() == js["ref"].losses()


def _assert_every_run_exhausted_its_in_job_restarts(job: Job, runs: int) -> None:
    for restart in range(runs):
        log = _restart_log(job, restart)
        # The first worker group and its one in-job restart both failed in setup, then ft_launcher gave up.
        assert log.count("cannot be found at the path prefix") == 2, job.describe()
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
    assert _job_results(job) == [f"{job.slurm_id} {n} F" for n in range(len(runs))], job.describe()


def test_3b_retries_count_is_num_job_retries_on_failure_and_the_job_ends_failed(jobs):
    job = jobs["jobs"]["ft_exhausted"]
    # num_job_retries_on_failure=2: the first attempt and two requeues, each failing; Slurm says FAILED.
    assert [a["State"] for a in job.attempts()] == ["REQUEUED", "REQUEUED", "FAILED"], job.describe()


# --- 4. rerun state machine exit codes --------------------------------------------------------------------------


def test_4_rerun_exit_17_is_not_requeued_and_16_is(jobs):
    js = jobs["jobs"]
    r17, r16 = js["rerun_17"], js["rerun_16"]
    assert [a["State"] for a in r17.attempts()] in (["FAILED"], ["COMPLETED"]), r17.describe()
    assert jobs["finals"]["rerun_17"]["Restarts"] == "0", r17.describe()
    assert r17.stop_reason()["exit_code"] == 17, r17.describe()
    assert "failed (exitcode: 17)" in r17.log()
    assert int(jobs["finals"]["rerun_16"]["Restarts"]) >= 1, r16.describe()
    assert r16.attempts()[0]["State"] == "REQUEUED", r16.describe()
    assert "failed (exitcode: 16)" in _restart_log(r16, 0), r16.describe()


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
