"""The multi-node lane starts from an empty private instance: jobs an interrupted benchmark or test left there
(slurmctld runs them again after a restart; one held ``mn1`` through a CI run) are cancelled, with a warning."""

from __future__ import annotations

import os
import subprocess

import pytest

from slurm.cluster import cancel_leftover_jobs
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
