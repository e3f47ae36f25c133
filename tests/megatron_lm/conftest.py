"""The Slurm fixtures for the lane's tests on the real clusters (``test_megatron_lm_on_slurm.py``,
``test_megatron_lm_chaos_on_slurm.py``): the same session fixtures as ``tests/slurm`` (the single-node cluster, the
multi-node instance, a private NEMORUN_HOME, a job folder kept after the session)."""

from slurm.cluster import multinode_cluster, slurm_cluster  # noqa: F401  (fixtures)
from slurm.conftest import _stdin_devnull, nemorun_home, slurm_tmp  # noqa: F401  (fixtures)
