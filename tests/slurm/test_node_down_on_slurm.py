"""Issue 10/23 on the multi-node instance: a node set DOWN under a running two-node job is recovered by the watcher.

Runs on the private multi-node instance (``multinode_cluster``; the shared single-node cluster's node is never set
DOWN): the job goes to the ``faults`` partition and starts on its reserved node (the lowest ``Weight``) and one other
(the batch host); the reserved node is drained and set DOWN; Slurm ends the attempt NODE_FAIL and requeues it, the
watcher records it (node_fail) and excludes the node that went down, not the batch host that slurmstepd's line
names, and the job resumes from its checkpoint on two other nodes, ends COMPLETED, and its losses equal an
uninterrupted two-node run's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

from resilience_support.agents import free_port

from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import use_cluster, wait_for_job
from slurm.jobs import submit, wait_until
from slurm.watcher_scenario import Watcher

run = import_nemo_run()

from megatron_resilience.plugins import PreemptionPlugin, RestartPolicyPlugin  # noqa: E402
from slurm.joblevel_jobs import SAVE, WATCHED_STEPS, ledger, states, tiny  # noqa: E402


def resume(node: str) -> None:
    """Bring the node back (a test took it down); fine if it is usable already."""
    proc = subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True,
                          text=True, timeout=60)
    state = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True,
                           timeout=60).stdout.split()
    assert proc.returncode == 0 or (state and state[0] in ("idle", "mixed", "allocated")), (proc.stderr, state)


def test_node_down_is_recovered_by_the_watcher(multinode_cluster, nemorun_home, slurm_tmp):
    """A node set DOWN under a running two-node job: Slurm ends the attempt NODE_FAIL and requeues it; nothing inside
    the job decides. The watcher records it (node_fail) and excludes the node that went down — not the batch host,
    which slurmstepd's "CANCELLED ... DUE TO NODE FAILURE" line names — and the job resumes on other nodes."""
    cluster = multinode_cluster
    assert cluster.fault_partition and cluster.fault_nodes, cluster
    node = cluster.fault_nodes[0]  # reserved: no other test's job runs there (scripts/slurm/multinode.env)
    root = os.path.join(slurm_tmp, "joblevel_node_down")
    os.makedirs(root, exist_ok=True)

    def plugins():
        return [PreemptionPlugin(), RestartPolicyPlugin(policy="megatron_transient")]

    def executor(c):
        # one torchrun per node, meeting at the head node on a port of its own (other jobs share this machine)
        return c.executor(time="00:30:00", nodes=2, ntasks_per_node=1, launcher=run.Torchrun(rdzv_port=free_port()))

    with use_cluster(cluster):
        ref_task = tiny(root, "jl_node_down_ref", max_steps=WATCHED_STEPS, num_nodes=2)
        ref = submit("jl_node_down_ref", ref_task, executor(cluster), plugins(), run_dir=ref_task.run_dir)
        task = tiny(root, "jl_node_down", max_steps=WATCHED_STEPS, num_nodes=2)
        # The faults partition spans every node; its reserved node has the lowest Weight, so the job starts there
        # and on one other node (scripts/slurm/render.sh); its next attempt may run on any two others.
        faults = dataclasses.replace(cluster, partition=cluster.fault_partition)
        job = submit("jl_node_down", task, executor(faults), plugins(), run_dir=task.run_dir)
        wait_until(lambda: SAVE in job.checkpoint_steps(), timeout=900, interval=0.2, what="the first checkpoint")
        info = job.info()
        first_nodes = subprocess.check_output(["scontrol", "show", "hostnames", info["NodeList"]], text=True).split()
        batch_host = info["BatchHost"]
        assert node in first_nodes and len(first_nodes) == 2 and batch_host != node, job.describe()
        watch_log = os.path.join(root, "watch.log")
        watcher = Watcher(job.run_dir, cluster.env, watch_log)
        try:
            # DRAIN first: this cluster's ReturnToService=2 brings a DOWN node back as soon as its (living) slurmd
            # registers again, a failed node would not; drained, it stays out until RESUME. Then DOWN: Slurm's
            # node-failure path (the attempt ends NODE_FAIL and the --requeue job is requeued at once).
            for state in ("DRAIN", "DOWN"):  # Reason mr-test*: scripts/slurm/start.sh leaves it so
                subprocess.run(["scontrol", "update", f"NodeName={node}", f"State={state}",
                                "Reason=mr-test-joblevel"], check=True)
            final = wait_for_job(job.slurm_id, timeout=1200)
            watcher.proc.wait(timeout=300)  # it ends with the chain
        finally:
            resume(node)
            if watcher.proc.poll() is None:
                watcher.kill()
            watcher.log.close()
        ref_final = wait_for_job(ref.slurm_id, timeout=1200)
        out = open(watch_log).read()
        assert final["JobState"] == "COMPLETED", f"{out}\n{job.describe()}"
        assert watcher.proc.returncode == 0, out
        assert ref_final["JobState"] == "COMPLETED", ref.describe()
        assert states(job) == ["NODE_FAIL", "COMPLETED"], job.describe()
        first, second = ledger(job, "attempt")
        cls, decision = first["classification"], first["decision"]
        assert (first["by"], cls["error_type"], decision["action"], decision["exclude_applied"]) == \
            ("watcher", "node_fail", "requeue", [node]), json.dumps(first)
        assert sorted(first["nodes"]) == sorted(first_nodes) and first["slurm_state"] == "NODE_FAIL", json.dumps(first)
        # every host the evidence named, and why the down node (not the batch host) was blamed
        roles = {(m["node"], m["role"]) for m in cls["host_evidence"]}
        assert (node, "failed") in roles and (batch_host, "failed") not in roles, cls["host_evidence"]
        assert cls["hosts"] == [node], cls
        # (drained, so still out of service when the watcher looks: DOWN+DRAIN, or IDLE+DRAIN once its slurmd is back)
        assert any(m["role"] == "failed" and re.match(rf"scontrol show node {node}: State=\S*DRAIN\S* "
                                                      r"Reason=mr-test-joblevel", m["line"])
                   for m in cls["host_evidence"]), cls["host_evidence"]
        # slurmstepd's real line, captured from this job: it names the batch host, as a batch host
        assert any(m["role"] == "batch_host" and m["node"] == batch_host and "DUE TO NODE FAILURE" in m["line"]
                   for m in cls["host_evidence"]), cls["host_evidence"]
        outcomes = [(o["action"], o["ok"]) for o in ledger(job, "outcome")]
        assert outcomes == [("exclude_nodes", True)], outcomes  # Slurm requeued it; the watcher only excludes
        assert (second["by"], second["classification"]["error_type"], second["slurm_restart"]) == \
            ("batch", "finished", 1), json.dumps(second)
        assert len(second["nodes"]) == 2 and node not in second["nodes"], json.dumps(second)
        [final_record] = ledger(job, "final")
        assert (final_record["outcome"], final_record["message"]) == ("finished", "training finished after 2 "
                                                                      "attempt(s)"), final_record
        starts = job.starts()  # resumed from the newest checkpoint (the trainer may save on Slurm's SIGTERM)
        assert len(starts) == 2 and starts[0] == 0 and starts[1] >= SAVE, job.describe()
        assert second["resumed_from"] == starts[1], json.dumps(second)
        assert sorted(ref.losses()) == list(range(1, WATCHED_STEPS + 1)), ref.describe()
        assert job.losses() == ref.losses(), job.describe()
        report = subprocess.run([sys.executable, "-m", "megatron_resilience.report", job.run_dir],
                                capture_output=True, text=True, timeout=300, env=cluster.env)
        table = report.stdout.split("per node:\n", 1)[1].split("\n\n", 1)[0]
        assert re.search(rf"^{node} +\| 0 +\| 0: node_fail +\| \d+% +\| 0$", table, re.M), report.stdout
        assert re.search(rf"^{batch_host} +\| 0,1 +\| - +\| - +\| -$", table, re.M), report.stdout
