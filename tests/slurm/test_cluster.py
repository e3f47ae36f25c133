"""The cluster itself, through NeMo-Run's SlurmExecutor + LocalTunnel, as users submit to it."""

from __future__ import annotations

import glob
import os
import subprocess

from megatron_resilience.jobs.slurm import sacct_steps
from slurm.cluster import SCRIPTS, attempts, job_info, wait_for_job
from slurm.jobs import wait_until


def slurm_job_id(exp) -> str:
    """Slurm's job id from a submitted experiment's first job (its handle ends with it)."""
    handle = exp.jobs[0].handle
    assert handle, "job was not submitted"
    return handle.rstrip("/").rsplit("/", 1)[-1]


def test_start_is_idempotent_and_reuses_the_running_cluster(slurm_cluster):
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "start.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "already running" in proc.stderr
    assert f"cluster={slurm_cluster.cluster}" in proc.stdout.splitlines()
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    assert "proctrack/cgroup" in out and "accounting_storage/slurmdbd" in out
    out = subprocess.run(["sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o", "%N %c"], capture_output=True,
                         text=True, check=True).stdout
    assert sorted(set(out.splitlines())) == [f"{node} 16" for node in sorted(slurm_cluster.nodes)]


def test_nemo_run_slurm_executor_runs_a_job_to_completed(slurm_cluster, nemorun_home):
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    executor = slurm_cluster.executor(time="00:02:00")
    task = run.Script(inline='echo "hello from $SLURM_JOB_ID on $(hostname -s) restart=${SLURM_RESTART_COUNT:-0}"\n'
                             'echo "node=$SLURMD_NODENAME"\ngrep -o "freezer:.*" /proc/self/cgroup')
    with run.Experiment("smoke", executor=executor) as exp:
        exp.add(task, name="hello")
        exp.run(detach=True)
    job_id = slurm_job_id(exp)

    info = wait_for_job(job_id, timeout=120)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0")
    assert [(a["State"], a["ExitCode"]) for a in attempts(job_id)] == [("COMPLETED", "0:0")]
    (log,) = glob.glob(os.path.join(nemorun_home, "experiments", "smoke", "smoke_*", "hello", f"log-*_{job_id}_0.out"))
    text = open(log).read()
    assert f"hello from {job_id} on " in text and "restart=0" in text
    # proctrack/cgroup: the step runs in its job's freezer cgroup under its node's slurmd (/slurm_<node>; step 0 is
    # nemo_run's `srun hostname`).
    (node,) = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("node=")]
    assert node in slurm_cluster.nodes
    assert f"freezer:/slurm_{node}/uid_0/job_{job_id}/step_1" in text
    assert job_info(job_id)["Partition"] == slurm_cluster.partition
    # Slurm's record of each step, as the job-level room reads it (jobs/slurm.py): nemo_run's `srun hostname` (0),
    # the task (1) and the batch step, each COMPLETED on that node; under another job's name, nothing.
    name = job_info(job_id)["JobName"]
    steps = wait_until(lambda: (rows := sacct_steps(job_id, name)) and len(rows) == 3 and rows, timeout=60,
                       what="the job's steps in accounting")
    assert sorted((r["JobID"], r["State"], r["NodeList"]) for r in steps) == [
        (f"{job_id}.0", "COMPLETED", node), (f"{job_id}.1", "COMPLETED", node), (f"{job_id}.batch", "COMPLETED", node)]
    assert all(isinstance(r["start_time"], float) for r in steps)
    assert sacct_steps(job_id, name + "-other") == []
