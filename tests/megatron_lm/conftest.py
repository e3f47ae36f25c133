"""The Slurm fixtures for the lane's test on the real cluster (``test_megatron_lm_on_slurm.py``): the same session
fixtures as ``tests/slurm`` (the cluster, a private NEMORUN_HOME, a job folder kept after the session)."""

from slurm.cluster import slurm_cluster  # noqa: F401  (fixture)
from slurm.conftest import _stdin_devnull, nemorun_home, slurm_tmp  # noqa: F401  (fixtures)
