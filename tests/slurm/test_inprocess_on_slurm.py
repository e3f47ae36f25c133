"""Issue 24 on the real Slurm clusters: in-process restart through ``FaultTolerancePlugin(inprocess_restart=True)``.

* srun takes the last ``--kill-on-bad-exit``: with the plugin's ``=0`` after nemo_run's forced ``=1``, a task
  that exits non-zero leaves the others running (the control without it: they are killed);
* two jobs on one node at once (the default cluster's node): a reference and one whose rank 1 raises at step 5.
  Each binds its own port block (ft_launcher's rendezvous and the trainer's stores: the logs name the ports),
  nothing reports ``EADDRINUSE``; the faulty one restarts in-process, finishes, and its losses equal the
  reference's bitwise;
* a two-node job (the multi-node instance: one ft_launcher per node, one rank each) whose rank 1 raises: the
  ranks restart in-process from the in-memory checkpoint (local checkpoints replicated across the two nodes), the
  job completes without an in-job or job-level restart, losses bitwise the reference's. (An exception leaves the
  srun tasks, the launchers, running with either ``--kill-on-bad-exit``: what the plugin's ``=0`` changes, a
  task that exits non-zero no longer taking the others with it, is the first test's.)

Submitted as a user would (``run.Experiment``, ``SlurmExecutor``); asserted from Slurm's records, the logs and
``metrics.jsonl``.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from loadgen import saturated
from resilience_support.ports import reserve

from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import use_cluster, wait_for_job
from slurm.jobs import submit

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin  # noqa: E402
from megatron_resilience.recipes import RECIPES  # noqa: E402

STEPS = 20
PORTS = re.compile(r"stores on ports (\d+)-(\d+) \(from MEGATRON_RESILIENCE_JOB_PORT\)")


def _task(root: str, name: str, nodes: int, per_node: int, *, fault: bool):
    task = RECIPES["gpt_tiny"](dir=root, name=name, num_nodes=nodes, num_gpus_per_node=per_node)
    task.train.max_steps = STEPS
    task.straggler.enabled = False
    if fault:
        task.ft.simulate_fault, task.ft.simulated_fault_type = True, "exception"
        task.ft.simulated_fault_rank, task.ft.simulated_fault_step = 1, 5
    return task


def _plugin(root: str, name: str, **kwargs) -> FaultTolerancePlugin:
    return FaultTolerancePlugin(num_in_job_restarts=1, num_job_retries_on_failure=0, inprocess_restart=True,
                                local_checkpoint_dir=os.path.join(root, name, "local"), local_checkpoint_interval=2,
                                **kwargs)


def _srun_survivor(kill_flags: list[str]) -> str:
    script = 'if [ "$SLURM_PROCID" = 0 ]; then exit 3; fi; sleep 8; echo "task $SLURM_PROCID survived"'
    proc = subprocess.run(["srun", "--ntasks=2", "--time=1", *kill_flags, "bash", "-c", script],
                          capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


def test_srun_takes_the_last_kill_on_bad_exit(slurm_cluster):
    assert "task 1 survived" in _srun_survivor(["--kill-on-bad-exit=1", "--kill-on-bad-exit=0"])
    assert "task 1 survived" not in _srun_survivor(["--kill-on-bad-exit=1"])  # the control: nemo_run's flag alone


@pytest.fixture(scope="module")
def jobs(slurm_cluster, multinode_cluster, nemorun_home, slurm_tmp):
    root = os.path.join(slurm_tmp, "inprocess_runs")
    js, finals = {}, {}
    block = reserve()  # two Slurm instances share this machine and may hand out equal job ids
    try:
        with saturated(seconds=1800):
            for name, fault in (("ip_ref", False), ("ip_exception", True)):
                executor = slurm_cluster.executor(time="00:30:00", ntasks_per_node=2)
                js[name] = submit(name, _task(root, name, 1, 2, fault=fault), executor, [_plugin(root, name)],
                                  run_dir=os.path.join(root, name))
            with use_cluster(multinode_cluster) as cluster:
                # the test cluster's two nodes are one host: nvidia-resiliency-ext 0.7's rendezvous refuses two
                # launchers on one host unless told that it is meant (a real cluster has one per node)
                executor = cluster.executor(time="00:30:00", nodes=2, ntasks_per_node=1,
                                            env_vars={"MEGATRON_RESILIENCE_JOB_PORT": str(block.base),
                                                      "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1"})
                plugin = _plugin(root, "ip_2nodes", replication_factor=2)
                js["ip_2nodes"] = submit("ip_2nodes", _task(root, "ip_2nodes", 2, 1, fault=True), executor, [plugin],
                                         run_dir=os.path.join(root, "ip_2nodes"))
                finals["ip_2nodes"] = wait_for_job(js["ip_2nodes"].slurm_id, timeout=1500)
            for name in ("ip_ref", "ip_exception"):
                finals[name] = wait_for_job(js[name].slurm_id, timeout=1500)
    finally:
        block.release()
    return {"jobs": js, "finals": finals}


def _inprocess_ladder(job) -> list[tuple]:
    out = []
    for r in job.records():
        if r.get("kind") == "start":
            out.append(("start", r["attempt"]["in_job_restart"], r["attempt"]["inprocess_restart"], r["resumed_tier"]))
        elif r.get("kind") == "inprocess_restart":
            out.append(("inprocess_restart", r["cause"], r["restored_from"]["tier"]))
    return out


def test_two_jobs_on_one_node_own_their_ports_and_the_faulty_one_restarts_in_process(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    ref, job = js["ip_ref"], js["ip_exception"]
    for name in ("ip_ref", "ip_exception"):
        info = finals[name]
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), \
            js[name].describe()
    blocks = []
    for j in (ref, job):
        log = j.log()
        assert "EADDRINUSE" not in log, j.describe()
        ports = {m.groups() for m in PORTS.finditer(log)}
        assert len(ports) == 1, j.describe()  # one block per job, the same in every call of the training function
        base = int(next(iter(ports))[0])
        assert base == 25000 + int(j.slurm_id) % 1942 * 4, j.describe()  # exported by the batch script
        blocks.append(base)
    assert blocks[0] != blocks[1]
    assert _inprocess_ladder(job) == [("start", 0, 0, None), ("inprocess_restart", "exception on rank 1", "memory"),
                                      ("start", 0, 1, "memory")], job.describe()
    assert job.losses() == ref.losses() and sorted(ref.losses()) == list(range(1, STEPS + 1)), job.describe()


def test_a_two_node_job_restarts_in_process_after_an_exception_and_completes_in_one_attempt(jobs):
    js, finals = jobs["jobs"], jobs["finals"]
    job, ref = js["ip_2nodes"], js["ip_ref"]
    info = finals["ip_2nodes"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.describe()
    log = job.attempt_log(0)
    assert "exception:cuda_oom on rank 1" in log, job.describe()
    assert "will restart worker group" not in log, job.describe()  # neither agent restarted its workers
    assert _inprocess_ladder(job) == [("start", 0, 0, None), ("inprocess_restart", "exception on rank 1", "memory"),
                                      ("start", 0, 1, "memory")], job.describe()
    assert "replica groups [(0, 1)]" in log, job.describe()  # each node's local checkpoint held by the other too
    assert job.losses() == ref.losses(), job.describe()  # 2 nodes x 1 rank computes what 1 node x 2 ranks does
