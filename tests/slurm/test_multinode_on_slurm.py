"""Issue 11: two-node Slurm jobs with FaultTolerancePlugin + PreemptionPlugin, on a cluster whose nodes are
separate slurmd daemons on this machine (``multinode_cluster``: the default cluster when it has two nodes,
else the private ``scripts/slurm/multinode.env`` instance beside it).

Each job is ``gpt_tiny`` on 2 nodes x 1 rank, submitted through NeMo-Run's ``SlurmExecutor`` as a user
would: one ft_launcher per node (nemo_run's ``srun ... ft_launcher --nnodes 2``), rendezvous over c10d at
the head node. Proven, with every core saturated by the load generator from submission to the end:

* the job step ran one task on each of the two nodes (Slurm's accounting);
* a rank killed on one node: both nodes' agents restart their worker groups inside the job, the run
  resumes from the step-20 checkpoint, ends COMPLETED without a requeue, losses equal an uninterrupted run;
* ``scancel -s SIGTERM`` (what ``--signal`` does at the time limit) reaches every rank on both nodes:
  each node's agent forwards it to its rank, all ranks stop after the same step, checkpoint, exit 0; the
  job is requeued without spending a failure retry, resumes from that checkpoint, ends COMPLETED, and its
  per-step losses equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading

import pytest
from loadgen import saturated
from resilience_support.agents import free_port
from resilience_support.stop import finish_record, finished_at

from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import SlurmCluster, use_cluster, wait_for_job
from slurm.jobs import Job, signal_when_training, submit, tiny_task

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402

NODES = 2
STEPS = 60
SIGNAL_AFTER_STEP = 5
LAUNCHER = re.compile(r"\[ft_launcher(\d+)@")


def _task(root: str, name: str, **edits):
    """``gpt_tiny`` on one rank per node of ``NODES``, ``STEPS`` steps, a checkpoint every 10 steps; ``edits``."""
    return tiny_task(root, name, nodes=NODES, ranks=1, max_steps=STEPS, save_interval=10, **edits)


@pytest.fixture(scope="module")
def cluster(multinode_cluster: SlurmCluster):
    with use_cluster(multinode_cluster) as c:
        yield c


@pytest.fixture(scope="module")
def jobs(cluster, nemorun_home, slurm_tmp):
    assert len(cluster.nodes) >= NODES, cluster
    root = os.path.join(slurm_tmp, "multinode_runs")
    js: dict[str, Job] = {}

    def two_nodes(name, **edits):
        task = _task(root, name, **edits)
        # A port of our own for the c10d store on the head node: nemo_run's default (29500) would be shared by
        # every multi-node job on this one machine.
        executor = cluster.executor(time="00:30:00", nodes=NODES, ntasks_per_node=1,
                                    launcher=run.Torchrun(rdzv_port=free_port()))
        plugins = [FaultTolerancePlugin(num_in_job_restarts=2, num_job_retries_on_failure=2),
                   PreemptionPlugin(preempt_time=60)]
        js[name] = submit(name, task, executor, plugins, run_dir=task.run_dir)

    sent: dict = {}
    with saturated(seconds=1800):
        two_nodes("mn_ref")
        two_nodes("mn_killed", ft__simulate_fault=True, ft__simulated_fault_type="rank_killed",
                  ft__simulated_fault_rank=1, ft__simulated_fault_step=25)
        two_nodes("mn_signalled")
        signaller = threading.Thread(target=signal_when_training, args=(js["mn_signalled"], sent, SIGNAL_AFTER_STEP),
                                     daemon=True)
        signaller.start()
        finals = {name: wait_for_job(job.slurm_id, timeout=1500) for name, job in js.items()}
        signaller.join(timeout=10)
    return {"jobs": js, "finals": finals, "sent": sent}


def _assert_finished(job: Job) -> None:
    stop = job.stop_reason()
    assert finish_record(stop) == finished_at(STEPS), job.describe()


def _launcher_pids(lines: list[str]) -> set[str]:
    return {m.group(1) for line in lines if (m := LAUNCHER.search(line))}


def _trainer_steps(job: Job) -> list[dict[str, str]]:
    """Slurm's record of each run's training step (nemo_run's step 0 is `srun hostname`): nodes and tasks."""
    fields = ["JobID", "NodeList", "NTasks"]
    out = subprocess.run(["sacct", "-D", "-n", "-P", "-j", job.slurm_id, "-o", ",".join(fields)],
                         capture_output=True, text=True, check=True).stdout
    rows = [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]
    return [r for r in rows if r["JobID"] == f"{job.slurm_id}.1"]


def _nodes(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_every_two_node_job_ran_one_launcher_on_each_node(jobs, cluster):
    for name, job in jobs["jobs"].items():
        steps = _trainer_steps(job)
        assert steps, job.describe()
        for step in steps:
            assert step["NTasks"] == "2" and len(set(_nodes(step["NodeList"]))) == NODES, (name, steps)
            assert set(_nodes(step["NodeList"])) <= set(cluster.nodes), (name, steps)
        log = job.attempt_log(0)
        assert len(_launcher_pids(log.splitlines())) == NODES, job.describe()
        assert re.search(r"has joined round 0 of the rendezvous '\S+' as rank 1 in a world of size 2", log)


def test_rank_killed_on_one_node_restarts_both_agents_in_job_with_equal_losses(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job, ref = js["mn_killed"], js["mn_ref"]
    assert (finals["mn_ref"]["JobState"], finals["mn_ref"]["Restarts"]) == ("COMPLETED", "0"), ref.describe()
    info = finals["mn_killed"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    lines = job.attempt_log(0).splitlines()
    fault = next(i for i, line in enumerate(lines) if "SIMULATED FAULT at" in line)
    assert "rank_killed on rank 1" in lines[fault], job.describe()
    after = lines[fault:]
    # Both nodes' agents restarted their worker groups and met again in the next rendezvous round.
    restarted = _launcher_pids([line for line in after if "will restart worker group" in line])
    rejoined = _launcher_pids([line for line in after if re.search(r"has joined round 1 of the rendezvous", line)])
    assert len(restarted) == NODES and restarted == rejoined, job.describe()
    assert job.starts() == [0, 20], job.describe()
    assert job.losses() == ref.losses() and sorted(ref.losses()) == list(range(1, STEPS + 1)), job.describe()
    _assert_finished(job)


def test_sigterm_reaches_every_rank_on_both_nodes_and_the_requeued_job_resumes_with_equal_losses(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job, ref = js["mn_signalled"], js["mn_ref"]
    assert isinstance(jobs["sent"].get("mn_signalled"), float), f"{jobs['sent']}\n{job.describe()}"
    first = job.attempt_log(0).splitlines()
    # Each node's agent forwarded the signal to its rank; every rank agreed to stop after the same step.
    forwarded = [line for line in first if re.search(r"Sending process \d+ closing signal SIGTERM", line)]
    assert len(forwarded) == NODES and len(_launcher_pids(forwarded)) == NODES, job.describe()
    stop = [re.search(r"stopping after step (\d+): SIGTERM received; saving a checkpoint and exiting 0", line)
            for line in first]
    (stopped,) = {int(m.group(1)) for m in stop if m}
    assert stopped >= SIGNAL_AFTER_STEP and stopped in job.checkpoint_steps(), job.describe()
    info = finals["mn_signalled"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    assert [a["State"] for a in job.attempts()] == ["REQUEUED", "COMPLETED"], job.describe()
    assert job.job_results() == [f"{job.slurm_id} 0 S", f"{job.slurm_id} 1 S"], job.describe()  # no retry spent
    assert job.starts() == [0, stopped], job.describe()
    assert job.losses() == ref.losses(), job.describe()
    _assert_finished(job)
