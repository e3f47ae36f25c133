"""The jobs of ``test_resilience_on_slurm.py``, submitted together and waited for (:func:`submit_and_wait`), and the
settings its tests check them against: time limit, scancel per task form, FT sections and heartbeats (DDP, torch
FSDP2 and Megatron-FSDP), exhausted in-job restarts, rerun exit codes."""

from __future__ import annotations

import os
import threading
import time

from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import wait_for_job
from slurm.jobs import Job, requeue_when_completed, signal_when_training, submit, tiny_task, waiting_rank
from slurm.time_limit import limit_back_after_first_run, limit_when_training

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402

# The limit job must still train when the warning comes: up to 40 s waiting for its run time to reach 30-50 s past
# a minute, then <= 30 s to slurmctld's tick. Its rank 0 waits 0.1 s in every step (a sleep: no CPU, no effect on
# the numbers), so 800 steps last >= 80 s even on a quiet machine, and the requeued run's remaining steps cost
# little CPU on a loaded one (3000 plain steps, 72 s quiet, took over 20 minutes beside the other suites).
LIMIT_STEPS = 800
LIMIT_SLOWED = waiting_rank(0, 0.1)
LIMIT_UPDATE_AFTER_STEP = 5
LIMIT_PREEMPT_TIME = 300  # a whole number of minutes (see _limit_when_training); a first save took 3 minutes
PREEMPT_TIME = 300  # the scancel jobs: how long torchrun/ft_launcher wait for the ranks to save (a first save took
# over 60 s on this machine under other suites' load); the signal itself is sent by the test at once
STEPS = 100
# ft_heartbeats: setup, healthy steps and a process's first save (no heartbeat while saving; it took 3 minutes
# under other suites' load) fit inside these.
HB_INITIAL, HB = 600.0, 180.0
SIGNAL_AFTER_STEP = 5  # scancel jobs: signal once training is under way
SCANCEL_JOBS = ("script", "inline", "torchrun")
FSDP2_STEPS, FSDP2_FAULT_STEP = 30, 29  # checkpoints at 10, 20, 30; steps 21-28 trained twice
_KILLED_AT_29 = dict(max_steps=FSDP2_STEPS, save_interval=10, ft__simulate_fault=True,
                    ft__simulated_fault_type="rank_killed", ft__simulated_fault_rank=1,
                    ft__simulated_fault_step=FSDP2_FAULT_STEP)
# The sharded jobs (issue 33): name -> (strategy, checkpoint format on disk, the task's edits). torch FSDP2 needs
# untied embeddings; Megatron-FSDP (optim_grads_params by default) writes fsdp_dtensor checkpoints.
SHARDED_JOBS = {
    "ft_fsdp2": ("torch_fsdp2", "torch_dist", dict(_KILLED_AT_29, parallel__data_parallel_strategy="torch_fsdp2",
                                                   model__share_embeddings_and_output_weights=False)),
    "ft_megatron_fsdp": ("megatron_fsdp", "fsdp_dtensor",
                         dict(_KILLED_AT_29, parallel__data_parallel_strategy="megatron_fsdp",
                              checkpoint__ckpt_format="fsdp_dtensor")),
}


def trainer_args(run_dir: str, max_steps: int) -> list[str]:
    """``python -m megatron_resilience`` overrides equal to ``tiny_task(...)`` (same numerics as the Partial)."""
    return [f"run_dir={run_dir}", f"train.max_steps={max_steps}", "train.device=cpu",
            f"checkpoint.save={run_dir}/checkpoints", "checkpoint.save_interval=10",
            "ft.enabled=true", "ft.calc_ft_timeouts=true", "rerun.rerun_mode=validate_results"]


def submit_and_wait(slurm_cluster, slurm_tmp) -> dict:
    """Every job of the module, submitted together (their observers started as each is submitted), waited for;
    what the tests read: the jobs, their final Slurm states, the signals sent, the requeue by hand, the limit's
    update."""
    root = os.path.join(slurm_tmp, "runs")
    cluster = slurm_cluster
    js: dict[str, Job] = {}
    t0 = time.monotonic()
    # Each scancel job's observer starts as soon as that job is submitted: the later submissions take minutes on a
    # loaded machine, and a job that trained to the end before its observer started was never signalled (seen:
    # the script form finished at 02:17:43, the signal left at 02:18:08, after the last submission).
    sent: dict = {}
    threads: list[threading.Thread] = []

    def signal_once_training(name):
        threads.append(threading.Thread(target=signal_when_training, args=(js[name], sent, SIGNAL_AFTER_STEP),
                                        daemon=True))
        threads[-1].start()

    def partial(name, ranks=2, launcher="torchrun", time="00:30:00", plugins=(), extra=None, **task_kw):
        task = tiny_task(root, name, ranks=ranks, **task_kw)
        executor = cluster.executor(time=time, ntasks_per_node=ranks, launcher=launcher, **(extra or {}))
        js[name] = submit(name, task, executor, list(plugins), run_dir=task.run_dir)

    def script(name, task, ranks, launcher, plugins):
        js[name] = submit(name, task, cluster.executor(time="00:30:00", ntasks_per_node=ranks, launcher=launcher),
                          plugins, run_dir=os.path.join(root, name))

    def ft_and_preemption(preempt_time=PREEMPT_TIME):
        return [FaultTolerancePlugin(num_in_job_restarts=2, num_job_retries_on_failure=2),
                PreemptionPlugin(preempt_time=preempt_time)]

    # The time-limit job: FT + preemption, 2 ranks under ft_launcher; its limit is set once it trains.
    partial("limit", launcher=None, time="00:30:00", plugins=ft_and_preemption(preempt_time=LIMIT_PREEMPT_TIME),
            max_steps=LIMIT_STEPS, save_interval=None, **LIMIT_SLOWED)
    partial("ref", max_steps=STEPS, save_interval=10)
    # Signal delivery (scancel -s SIGTERM, like --signal without B:) for each task form:
    script("script", run.Script(path="megatron_resilience", m=True, entrypoint="python",
                                args=trainer_args(os.path.join(root, "script"), STEPS)), 2, None,
           ft_and_preemption())
    signal_once_training("script")
    # 2 tasks launched by srun, no launcher (tests/golden/preemption_inline.sh): each task is one rank, which reads
    # its rank, the world size and the rendezvous from Slurm's variables.
    inline = "cd /tmp\npython -m megatron_resilience " + " ".join(trainer_args(os.path.join(root, "inline"), STEPS))
    script("inline", run.Script(inline=inline + "\n"), 2, None, [PreemptionPlugin(preempt_time=PREEMPT_TIME)])
    signal_once_training("inline")
    partial("torchrun", max_steps=STEPS, save_interval=10, plugins=[PreemptionPlugin(preempt_time=PREEMPT_TIME)])
    signal_once_training("torchrun")
    # Fault tolerance: a rank killed at step 25 (checkpoints every 10 steps).
    partial("ft_killed", launcher=None, plugins=ft_and_preemption(), max_steps=STEPS, save_interval=10,
            ft__simulate_fault=True, ft__simulated_fault_type="rank_killed", ft__simulated_fault_rank=1,
            ft__simulated_fault_step=25)
    # The same fault under torch FSDP2 and Megatron-FSDP (parameters, gradients and Adam state sharded over the 2
    # ranks): killed at the start of step FSDP2_FAULT_STEP, so the first run's steps after the step-20 checkpoint
    # are the uninterrupted run the resumed steps are compared with (no second job).
    for name, (_, _, edits) in SHARDED_JOBS.items():
        partial(name, launcher=None, plugins=ft_and_preemption(), **edits)
    # Heartbeats mode through the plugin: a rank hung at step 25 misses its heartbeat; restart, resume from 20.
    partial("ft_heartbeats", launcher=None, max_steps=STEPS, save_interval=10,
            plugins=[FaultTolerancePlugin(num_in_job_restarts=2, num_job_retries_on_failure=0,
                                          initial_rank_heartbeat_timeout=HB_INITIAL, rank_heartbeat_timeout=HB,
                                          workload_check_interval=1.0, calc_ft_timeouts=False)],
            # calc_ft_timeouts off: the timeouts chosen here stay (learned ones would replace them after a save)
            ft__mode="heartbeats", ft__simulate_fault=True, ft__simulated_fault_type="rank_hung",
            ft__simulated_fault_rank=0, ft__simulated_fault_step=25)
    # In-job restarts exhausted on every attempt: the data files are gone by the time the job runs (they exist at
    # submission, where the plugins check them, and are removed right after), so every rank fails in setup.
    gone = os.path.join(root, "removed_dataset")
    os.makedirs(root, exist_ok=True)
    for ext in (".bin", ".idx"):
        open(gone + ext, "w").close()
    partial("ft_exhausted", ranks=1, launcher=None, max_steps=STEPS, save_interval=10,
            plugins=[FaultTolerancePlugin(num_in_job_restarts=1, num_job_retries_on_failure=2)],
            data__data_path=[gone])
    for ext in (".bin", ".idx"):
        os.remove(gone + ext)
    for code, kind in ((17, "transient_error"), (16, "persistent_error")):
        partial(f"rerun_{code}", launcher=None, max_steps=12, save_interval=4,
                plugins=[FaultTolerancePlugin(num_in_job_restarts=1, num_job_retries_on_failure=2)],
                rerun__rerun_mode="validate_results", rerun__error_injection_rate=8,
                rerun__error_injection_type=kind)

    limit = js["limit"]
    limit_update: dict = {}
    limiter = threading.Thread(target=limit_when_training, args=(limit, limit_update),
                               kwargs={"after_step": LIMIT_UPDATE_AFTER_STEP, "warning": LIMIT_PREEMPT_TIME},
                               daemon=True)
    limiter.start()

    restorer = threading.Thread(target=limit_back_after_first_run, args=(limit, limiter, 30), daemon=True)
    restorer.start()

    assert len(threads) == len(SCANCEL_JOBS)  # one observer per scancel job, each started at its submission
    requeue = {}
    requeuer = threading.Thread(target=requeue_when_completed, args=(js["ft_killed"], requeue), daemon=True)
    requeuer.start()
    finals = {name: wait_for_job(job.slurm_id, timeout=1500) for name, job in js.items() if name != "ft_killed"}
    for t in [*threads, limiter, restorer, requeuer]:
        t.join(timeout=600)
    assert "error" not in requeue, requeue
    finals["ft_killed"] = requeue["final"]
    wall = time.monotonic() - t0
    print(f"\nSlurm jobs done in {wall:.0f} s")
    return {"jobs": js, "finals": finals, "sent": sent, "requeued_by_hand": requeue.get("again"), "wall": wall,
            "limit_update": limit_update}


