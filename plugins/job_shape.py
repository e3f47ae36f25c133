"""One rank per GPU: the ranks a job starts per node must match the GPUs it asks Slurm for, with a fix that
passes every other check.

``executor.gpus_per_node=3`` with 8 ranks per node (or 16 ranks on 8 GPUs) puts several ranks on one GPU
or leaves GPUs idle; it used to be a warning of the FaultTolerancePlugin only, and its suggested fix
(``ntasks_per_node=3``) then failed the TP x PP check. Ranks per node are what every launcher starts:
``torchrun_nproc_per_node`` when set, else ``ntasks_per_node`` (nemo_run gives torchrun/ft_launcher
``--nproc-per-node`` from it and keeps one task per node; a plain srun starts one rank per task).

The fix offered is the largest ranks-per-node count, up to the GPUs asked for, that passes the config's
job-size checks (TP x PP divides the world size, the global batch divides, the memory estimate fits):
``ntasks_per_node=<gpus>`` when the node's GPUs all fit, else both fields set to the count that does.
"""

from __future__ import annotations

from typing import Any

from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.config.validate import check_int
from megatron_resilience.upstream import import_nemo_run


def ranks_per_node(executor: Any) -> int:
    per_node = getattr(executor, "torchrun_nproc_per_node", None) or executor.ntasks_per_node
    return per_node if isinstance(per_node, int) else per_node[0]


def world_size(executor: Any) -> int:
    """Ranks the job starts: nodes x ranks per node. The one definition (submit-time checks, the CLI's summary):
    on Slurm the ranks per node are the launcher's processes (``ranks_per_node``: nemo_run renders one srun task
    per node for torchrun/ft_launcher), elsewhere nemo_run's own ``nproc_per_node``."""
    run = import_nemo_run()
    nodes = executor.nnodes()
    per_node = ranks_per_node(executor) if isinstance(executor, run.SlurmExecutor) else executor.nproc_per_node()
    check_int("executor.nodes", nodes, minimum=1)
    check_int("executor.ntasks_per_node", per_node, minimum=1)
    return nodes * per_node


def _fits(config: PretrainConfig | None, world_size: int) -> str | None:
    """None when ``world_size`` ranks pass the config's job-size checks, else why not."""
    if config is None:
        return None
    try:
        config.validate_world_size(world_size)
    except ConfigError as err:
        return str(err)
    return None


def check_ranks_per_node(executor: Any, config: PretrainConfig | None) -> None:
    gpus = getattr(executor, "gpus_per_node", None)
    if not gpus or not isinstance(gpus, int):
        return
    nodes, ranks = executor.nnodes(), ranks_per_node(executor)
    field = "executor.torchrun_nproc_per_node" if getattr(executor, "torchrun_nproc_per_node", None) else \
        "executor.ntasks_per_node"
    check_int(field, ranks, minimum=1)  # a count that is no count is named first, as the Python API does
    if ranks == gpus:
        return
    problem = (f"executor.gpus_per_node: must equal the ranks per node ({field}={ranks}; one rank per GPU), "
               f"got {gpus}")
    if _fits(config, nodes * gpus) is None:
        raise ConfigError(f"{problem}; set {field}={gpus}")
    why = _fits(config, nodes * gpus)
    for count in range(gpus - 1, 0, -1):
        if _fits(config, nodes * count) is None:
            raise ConfigError(f"{problem}; {nodes} node(s) x {gpus} GPUs do not fit this job ({why}): set "
                              f"executor.gpus_per_node={count} and {field}={count}")
    raise ConfigError(f"{problem}; no count of ranks per node up to {gpus} on {nodes} node(s) fits this job "
                      f"({why}): change executor.nodes or the parallel layout")
