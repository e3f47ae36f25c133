"""The multi-node lane starts from an empty private instance: jobs an interrupted benchmark or test left there
(slurmctld runs them again after a restart; one held ``mn1`` through a CI run) are cancelled, and nodes it took
down and never gave back are resumed, with a warning."""

from __future__ import annotations

import os
import subprocess

import pytest

from slurm.cluster import cancel_leftover_jobs, resume_nodes_left_down
from slurm.jobs import wait_until


def test_a_job_left_on_the_multinode_instance_is_cancelled_with_a_warning(multinode_cluster):
    cluster = multinode_cluster
    env = {**os.environ, "SLURM_CONF": cluster.slurm_conf}
    left = subprocess.run(["sbatch", "--parsable", f"--partition={cluster.partition}", "--job-name=mr-left-behind",
                           "--output=/dev/null", "--time=10", "--wrap", "sleep 600"], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip().split(";")[0]
    try:
        with pytest.warns(UserWarning, match=rf"jobs left by an earlier run; cancelled: \['{left} mr-left-behind "):
            assert cancel_leftover_jobs(cluster) == [left]
        assert subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True,
                              timeout=60).stdout.split() == []
        state = wait_until(lambda: subprocess.run(["sacct", "-X", "-n", "-P", "-j", left, "-o", "State"], env=env,
                                                  capture_output=True, text=True).stdout.split(),
                           timeout=60, what="the cancelled job's record")
        assert state[0].startswith("CANCELLED"), state
        assert cancel_leftover_jobs(cluster) == []  # nothing left: no warning, nothing cancelled
    finally:
        subprocess.run(["scancel", left], env=env, capture_output=True)


def test_a_node_an_interrupted_run_left_down_is_resumed_and_no_other(multinode_cluster):
    """A CI run killed while the node-down test held the reserved node DOWN left the next run's two-node jobs
    without the node they start on (2 failures). The lane resumes nodes down for this repo's reasons
    (``mr-test-*``, ``chaos-*``) at its start, with a warning; a node down for another reason stays down."""
    cluster = multinode_cluster
    env = {**os.environ, "SLURM_CONF": cluster.slurm_conf}
    ours, theirs = cluster.fault_nodes[0], cluster.nodes[-1]

    def state(node):
        return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T|%E"], env=env, capture_output=True, text=True,
                              timeout=60).stdout.split()[0]

    def down(node, reason):
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", f"Reason={reason}"], env=env,
                       check=True, timeout=60)

    try:
        down(ours, "mr-test-left-behind")
        down(theirs, "maintenance")
        with pytest.warns(UserWarning, match=rf"nodes an earlier run took down and never resumed: \['{ours}'\]"):
            assert resume_nodes_left_down(cluster) == [ours]
        assert wait_until(lambda: state(ours).startswith("idle"), timeout=60, what=f"{ours} idle")
        assert state(theirs).split("|")[0].startswith("down") and state(theirs).endswith("|maintenance")
        assert resume_nodes_left_down(cluster) == []
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={ours},{theirs}", "State=RESUME"], env=env,
                       capture_output=True, timeout=60)
