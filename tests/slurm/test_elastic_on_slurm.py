"""Issue 25 on the multi-node cluster: a 2-node job whose node goes DOWN with no spare in the partition runs on, on
the node that is left, and grows back to 2 nodes once the node is resumed.

The cluster's ``faults`` partition has three nodes (``multinode_cluster``: mn1, mn2 and the reserved mn3, which
the job's first attempt takes, having the lowest Weight). A blocker job holds mn1 the whole time. The job is the
real trainer (``gpt_tiny``, 1 rank per node, global batch fixed by the plugin) submitted through NeMo-Run with
``FaultTolerancePlugin(min_nodes=1)``, ``PreemptionPlugin`` and a restart policy that requeues node failures
without excluding the node; the watcher runs beside it, as on a login node. Everything under full CPU load.

1. After the first checkpoint mn3 is drained and set DOWN: Slurm ends the attempt NODE_FAIL and requeues it. The
   watcher records it and, with mn1 busy and mn3 down, resizes the pending job to the one node that can take it.
2. The second attempt runs on mn2 alone: the trainer resumes the 2-rank checkpoint at DP=1 (re-sharded, same
   global batch). mn3 is resumed; then ``scancel -s SIGTERM`` (a preemption): the trainer saves and exits 0, the
   batch script's decision requeues it without spending a retry and, mn3 being back, asks for 2 nodes again.
3. The third attempt runs on mn2 and mn3 at DP=2 and finishes.

Asserted from Slurm's accounting, the ledger (each attempt's nodes, world size, DP size, the node counts the
decisions set), the trainer's records (each attempt resumed from the newest checkpoint of the one before; Slurm's
SIGTERM to a job it ends for a node failure usually makes the trainer save, so few or no steps are trained twice,
and those agree within the float tolerance of ``tests/test_elastic_reshard.py``), and the report (throughput per
attempt).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

from loadgen import saturated
from resilience_support.agents import free_port

from megatron_resilience.records.ledger import Ledger
from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import use_cluster, wait_for_job
from slurm.jobs import scancel_signal, submit, wait_until, waiting_rank
from slurm.watcher_scenario import Watcher

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin  # noqa: E402
from megatron_resilience.recipes import RECIPES  # noqa: E402

STEPS = 80
SAVE = 10
POLICY = """\
name: requeue_node_failures
description: node failures and lost batch shells are requeued on whatever nodes there are, none excluded
max_restarts: {crash: 3, stall: 1, timeout: 1}
default_action: stop
rules:
  - match: {error_type: [node_fail, batch_lost]}
    action: requeue
"""
SLOWED = waiting_rank(0, 0.1)


def _sbatch(*args: str) -> str:
    return subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True).stdout.strip()


def _set(node: str, *states: str) -> None:
    for state in states:  # DRAIN first: ReturnToService=2 would bring a DOWN node with a living slurmd right back
        subprocess.run(["scontrol", "update", f"NodeName={node}", f"State={state}", "Reason=mr-test-elastic"],
                       check=True)


def _resume(node: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=60)


def _trained_since_start(job, index: int) -> int:
    """Train records written after the trainer's ``index``-th start (0 = the first attempt's)."""
    starts, count = -1, 0
    for record in job.records():
        if record.get("kind") == "start":
            starts += 1
        elif record.get("kind") == "train" and starts == index:
            count += 1
    return count


def _nodes(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True).stdout.split()


def test_node_lost_without_a_spare_shrinks_to_one_node_and_grows_back(multinode_cluster, nemorun_home, slurm_tmp):
    cluster = multinode_cluster
    assert cluster.fault_partition and len(cluster.nodes) >= 2 and cluster.fault_nodes, cluster
    lost, busy = cluster.fault_nodes[0], cluster.nodes[0]  # mn3 (the job starts there), mn1 (held by the blocker)
    root = os.path.join(slurm_tmp, "elastic")
    os.makedirs(root, exist_ok=True)
    policy = os.path.join(root, "requeue_node_failures.yaml")
    with open(policy, "w") as f:
        f.write(POLICY)
    task = RECIPES["gpt_tiny"](dir=root, name="elastic", num_nodes=2, num_gpus_per_node=1)
    task.train.max_steps, task.checkpoint.save_interval, task.checkpoint.async_save = STEPS, SAVE, False
    for key, value in SLOWED.items():
        section, field = key.split("__")
        setattr(getattr(task, section), field, value)
    with use_cluster(cluster):  # SLURM_CONF: this cluster's, also for the accounting read by the assertions
        job, second_nodes = _play(cluster, task, policy, root, lost, busy)
        _check(job, cluster, second_nodes)
    _compare_with_an_uninterrupted_run(job, task, root)


def _compare_with_an_uninterrupted_run(job, task, root: str) -> None:
    """Every step the chain trained (at DP 2, DP 1 after the shrink, DP 2 after the growth) against an uninterrupted
    run of the same task at DP 2 (torchrun, 2 ranks on this machine): within the bound docs/elastic.md states."""
    from conftest import read_metrics, run_torchrun
    from test_elastic_reshard import LOSS_TOLERANCE

    from megatron_resilience.config.overrides import config_to_overrides
    from megatron_resilience.recipes import to_config

    ref_dir = os.path.join(root, "reference")
    own = ("run_dir=", "checkpoint.save=", "checkpoint.load=")
    overrides = [o for o in config_to_overrides(to_config(task)) if not o.startswith(own)]
    proc = run_torchrun(2, [f"run_dir={ref_dir}", f"checkpoint.save={ref_dir}/ckpt", *overrides], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    reference = {r["step"]: r["loss"] for r in read_metrics(ref_dir)}
    chain = {r["step"]: r["loss"] for r in job.records() if r.get("kind") == "train"}  # the last run of each step
    assert sorted(reference) == sorted(chain) == list(range(1, STEPS + 1))
    worst = max(abs(chain[s] - reference[s]) for s in reference)
    assert worst <= LOSS_TOLERANCE, (worst, {s: (chain[s], reference[s]) for s in reference
                                             if abs(chain[s] - reference[s]) > LOSS_TOLERANCE})


def _play(cluster, task, policy: str, root: str, lost: str, busy: str):
    """The scenario of the module docstring, under full CPU load; returns the job and the second attempt's nodes."""
    faults = dataclasses.replace(cluster, partition=cluster.fault_partition)
    with saturated(seconds=1800):
        job = None
        blocker = _sbatch(f"--partition={cluster.fault_partition}", f"--nodelist={busy}", "--exclusive",
                          "--time=30", "--job-name=mr-elastic-blocker", "--output=/dev/null", "--wrap", "sleep 1800")
        watcher = None
        try:
            wait_until(lambda: subprocess.run(["squeue", "-h", "-j", blocker, "-o", "%T"], capture_output=True,
                                              text=True).stdout.strip() == "RUNNING", timeout=120, what="the blocker")
            executor = faults.executor(time="00:30:00", nodes=2, ntasks_per_node=1,
                                       launcher=run.Torchrun(rdzv_port=free_port()))
            job = submit("elastic", task, executor, [
                FaultTolerancePlugin(min_nodes=1, num_in_job_restarts=1, num_job_retries_on_failure=2),
                PreemptionPlugin(preempt_time=60), RestartPolicyPlugin(policy=policy)], run_dir=task.run_dir)
            wait_until(lambda: SAVE in job.checkpoint_steps(), timeout=900, interval=0.2, what="the first checkpoint")
            # Started once the first attempt is in the ledger (it finds the job's config there), as on a login node.
            watcher = Watcher(job.run_dir, cluster.env, os.path.join(root, "watch.log"))
            first_nodes = _nodes(job.info()["NodeList"])
            assert sorted(first_nodes) == sorted([lost, cluster.nodes[1]]), job.describe()
            _set(lost, "DRAIN", "DOWN")
            wait_until(lambda: _trained_since_start(job, 1) >= 3, timeout=900, interval=0.2,
                       what="the second attempt to train")
            second_nodes = _nodes(job.info()["NodeList"])
            _resume(lost)
            wait_until(lambda: job.info().get("JobState") == "RUNNING", timeout=60, what="running")
            scancel_signal(job)
            final = wait_for_job(job.slurm_id, timeout=1500)
            watcher.proc.wait(timeout=300)
        finally:
            _resume(lost)
            subprocess.run(["scancel", blocker], capture_output=True)
            if job is not None and job.info().get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
                subprocess.run(["scancel", job.slurm_id], capture_output=True)  # a failed test leaves nothing queued
            if watcher is not None:
                if watcher.proc.poll() is None:
                    watcher.kill()
                watcher.log.close()
    watch_log = open(os.path.join(root, "watch.log")).read()
    assert final["JobState"] == "COMPLETED", f"{watch_log}\n{job.describe()}"
    assert len(second_nodes) == 1 and lost not in second_nodes, job.describe()
    return job, second_nodes


def _check(job, cluster, second_nodes: list[str]) -> None:
    """Slurm's accounting, the ledger, the trainer's records and the report of the finished chain."""
    states = [a["State"].split()[0] for a in job.attempts()]
    assert states[0] == "NODE_FAIL" and states[-1] == "COMPLETED" and len(states) == 3, job.describe()
    ledger = Ledger(os.path.join(job.run_dir, "job_ledger.jsonl"))
    a0, a1, a2 = ledger.attempts()
    assert (a0["by"], a0["classification"]["error_type"], a0["decision"]["action"]) == ("watcher", "node_fail",
                                                                                        "requeue"), json.dumps(a0)
    assert (a0["world_size"], a0["dp"], len(a0["nodes"])) == (2, 2, 2), json.dumps(a0)
    assert (a0["node_count"]["nodes"], a0["node_count"]["was"], a0["node_count"]["available"]) == \
        (1, 2, second_nodes), json.dumps(a0)
    assert (a1["by"], a1["classification"]["error_type"], a1["decision"]["spent"]) == ("batch", "preempted", None)
    assert (a1["world_size"], a1["dp"], a1["nodes"]) == (1, 1, second_nodes), json.dumps(a1)
    assert (a1["node_count"]["nodes"], a1["node_count"]["was"]) == (2, 1), json.dumps(a1)
    assert (a2["classification"]["error_type"], a2["world_size"], a2["dp"], len(a2["nodes"])) == \
        ("finished", 2, 2, 2), json.dumps(a2)
    # No in-job restart happened: each attempt is one cycle (two agents' logs in one step log are not two cycles).
    assert [len(a["cycles"]) for a in (a0, a1, a2)] == [1, 1, 1], [a["cycles"] for a in (a0, a1, a2)]
    # One ft_launcher per node of each attempt: the resized 1-node attempt ran one agent, not the submitted two.
    launchers = [len(set(re.findall(r"\[ft_launcher(\d+)@", job.attempt_log(i)))) for i in range(3)]
    assert launchers == [2, 1, 2], launchers
    resizes = [(o["action"], o["ok"]) for o in ledger.records("outcome") if o.get("action") == "resize"]
    assert resizes == [("resize", True), ("resize", True)], ledger.records("outcome")

    starts = [(r["step"], r["world_size"], r["dp"]) for r in job.records() if r.get("kind") == "start"]
    assert [s[1:] for s in starts] == [(2, 2), (1, 1), (2, 2)] and starts[1][0] >= SAVE, starts
    trained = [(r["step"], r["loss"]) for r in job.records() if r.get("kind") == "train"]
    assert sorted({s for s, _ in trained}) == list(range(1, STEPS + 1))
    # Slurm SIGTERMs the steps of a job it ends for a node failure: the trainer usually saves then and nothing is
    # trained twice; steps that were (the save did not make it) must agree across DP=2 and DP=1.
    first_run = {s: loss for s, loss in trained[:a0["last_step"]]}
    again = {s: loss for s, loss in trained[a0["last_step"]:] if s <= a0["last_step"]}
    from test_elastic_reshard import LOSS_TOLERANCE

    assert all(abs(again[s] - first_run[s]) <= LOSS_TOLERANCE for s in again), (again, first_run)
    assert a1["resumed_from"] == starts[1][0] and starts[2][0] == a1["checkpoint_step"], (starts, a1)

    report = subprocess.run([sys.executable, "-m", "megatron_resilience.report", job.run_dir, "--png", "none"],
                            capture_output=True, text=True, env=cluster.env, timeout=120)
    assert report.returncode == 0, report.stderr
    rows = report.stdout.split("throughput per attempt", 1)[1].splitlines()[2:5]
    assert [[c.strip() for c in r.split("|")][:7] for r in rows] == [
        ["0", job.slurm_id, "0", "0", "2", "2", "2"], ["1", job.slurm_id, "1", "0", "1", "1", "1"],
        ["2", job.slurm_id, "2", "0", "2", "2", "2"]], report.stdout
