"""Tests against the repo's real single-node Slurm cluster (``scripts/slurm``), which the fixtures start.

Every test in this folder is marked ``slurm``. They are never skipped for a missing Slurm: the
session fixture installs and starts it (CI runs as root on a clean Debian 12 machine).
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

from slurm.cluster import SlurmCluster, multinode_cluster, slurm_cluster  # noqa: F401,F811  (fixtures)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def slurm_tmp() -> str:
    """A folder for this session's job directories and run directories, kept after the session for debugging.

    Not pytest's tmp_path: pytest deletes all but the newest 3 base temp folders of the user, also those of
    another pytest session still running, and Slurm jobs outlive the test that submitted them.
    """
    return tempfile.mkdtemp(prefix="mr-slurm-tests-")


@pytest.fixture(scope="session")
def nemorun_home(slurm_tmp, slurm_cluster: SlurmCluster) -> str:  # noqa: F811  (the fixture above)
    """A private NEMORUN_HOME for the session, so tests never touch the user's ~/.nemo_run.

    nemo_run reads NEMORUN_HOME once at import (and derives its job-directory registry from it then), and
    other test modules may have imported it already: set the env var for jobs and subprocesses, and the two
    module-level values in this process.
    """
    # Not "nemo_run_home": nemo_run rewrites every "/nemo_run" in the sbatch script to the job's host directory.
    home = os.path.join(slurm_tmp, "nrhome")
    os.makedirs(home, exist_ok=True)
    os.environ["NEMORUN_HOME"] = home
    from megatron_resilience.upstream import import_nemo_run

    import_nemo_run()
    from nemo_run import config as nr_config
    from nemo_run.run.torchx_backend.schedulers import slurm as nr_slurm

    nr_config.set_nemorun_home(home)
    nr_slurm.SLURM_JOB_DIRS = os.path.join(home, ".slurm_jobs")
    return home


@pytest.fixture(scope="session", autouse=True)
def _stdin_devnull():
    """nemo_run's LocalTunnel runs sbatch/sacct through invoke, which forwards our stdin to the command;
    under pytest's capture reading stdin raises. Users have a real stdin; tests give it /dev/null."""
    with open(os.devnull) as devnull, pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdin", devnull)
        yield
