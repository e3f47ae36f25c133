"""``FaultTolerancePlugin(min_nodes=...)``: a lost node without a spare shrinks the job instead of stopping it.

NeMo-Run's launchers and torchrun speak of ``nnodes=MIN:MAX``; ``min_nodes`` is MIN, ``executor.nodes`` MAX.
What ``setup`` does with it (SlurmExecutor; other executors run one fixed set of nodes):

* checks, before anything is submitted, that every node count in MIN..MAX can run the task: a world that
  tensor x pipeline parallel divides, and (our trainer) a data-parallel size that divides the global batch.
  An unset ``train.global_batch_size`` would follow DP (micro batch x DP) and change the training on fewer
  nodes, so it is fixed at the full size's value (logged); resuming at another DP then re-shards the
  checkpoint (``checkpointing/reshard.py``) and continues the same training;
* ft_launcher's ``--nnodes`` becomes the range up to the nodes the attempt was given
  (``MIN:$SLURM_JOB_NUM_NODES``), so an attempt the job-level decision resized runs on the nodes it got.
  Where the release's rendezvous is elastic (nvidia-resiliency-ext <= 0.5, ``upstream.launcher``), a node
  lost mid-run leaves the surviving agents to re-form the group at the smaller size inside the same
  allocation (srun gets ``--kill-on-bad-exit=0 --wait=0``, so the dead node's agent does not end them).
  From 0.6 a range means hot spares (MIN active nodes), so ``--nnodes`` is the attempt's node count and a
  lost node ends the attempt; the next one starts on the nodes that exist;
* the job-level config gets MIN, MAX and the tasks per node: when an attempt ends and is requeued, the
  decision asks Slurm for as many nodes as the partition can give now (never fewer than MIN, never more
  than MAX), so a job whose node was excluded or died starts again at once on fewer nodes, and a later
  attempt grows back once nodes return (``megatron_resilience/jobs/requeue_size.py``);
* with ft_launcher's ``min-healthy`` restart policy on an elastic range (``restart_policy='min-healthy'``, or
  ``inprocess_restart=True``, which picks it on 0.4/0.5): a warning, not a refusal. ft_launcher turns
  upscaling off in that mode (0.4.1 ``launcher.py``: ``upscaling_enabled = restart_policy != "min-healthy"``):
  a node that joins after a rendezvous round closed (one that started late, more than the last call after
  MIN nodes joined) waits on the redundancy list until the next restart, and a node on the waiting list makes
  the agents raise ("This should not happen with min-healthy mode"); restarts are counted by rendezvous
  round, for the whole job. The shrink itself and the job-level grow-back still work, which is what
  docs/elastic.md promises for this combination, so the job is not refused: the user is told what changes
  and which setting keeps upscaling (``restart_policy='any-failed'``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins.job_plan import plan_of
from megatron_resilience.upstream.launcher import elastic_node_range, version_text

log = logging.getLogger("megatron_resilience.plugins")

NAME = "FaultTolerancePlugin"


def remembered(executor: Any) -> dict[str, int] | None:
    """What ``setup`` recorded for the job-level config: min_nodes, nodes, ntasks_per_node (None: no range)."""
    return plan_of(executor).node_range


def ft_launcher_nnodes(min_nodes: int, version: tuple[int, ...]) -> str:
    return f"{min_nodes}:$SLURM_JOB_NUM_NODES" if elastic_node_range(version) else "$SLURM_JOB_NUM_NODES"


def setup(min_nodes: int | None, *, editor: Any, executor: Any, profile: Any, version: tuple[int, ...],
          restart_policy: str | None = None, inprocess_restart: bool = False) -> None:
    """Check the range against the task and the executor and record it (see the module docstring).

    ``restart_policy``: the ft_launcher policy the plugin renders; ``inprocess_restart``: True when that policy is
    ``inprocess_restart=True``'s choice rather than the user's (the warning says which key set it).
    """
    if min_nodes is None:
        return
    nodes = int(getattr(executor, "nodes", None) or 1)
    if not profile.node_range:
        if min_nodes != nodes:
            raise ConfigError(f"{NAME}.min_nodes={min_nodes}: a node range needs a SlurmExecutor ({profile.name} "
                              f"runs one fixed set of nodes); leave min_nodes unset")
        return
    if min_nodes > nodes:
        raise ConfigError(f"{NAME}.min_nodes: must be between 1 and the job's node count executor.nodes={nodes}, "
                          f"got {min_nodes}")
    warn_min_healthy(min_nodes, nodes, restart_policy, inprocess_restart=inprocess_restart, version=version)
    per_node = int(executor.torchrun_nproc_per_node or executor.ntasks_per_node or 1)
    if editor is not None:
        _check_task(min_nodes, nodes, per_node, editor)
    else:
        log.warning("%s: min_nodes=%d: the task is not megatron_resilience's trainer: make sure its global batch "
                    "stays fixed (and divisible) on %d..%d nodes and that it resumes at another data-parallel size",
                    NAME, min_nodes, min_nodes, nodes)
    elastic = elastic_node_range(version)
    log.info("%s: min_nodes=%d: ft_launcher --nnodes %s (%s); the job-level decision resizes a requeued attempt to "
             "the %d..%d nodes the partition can give", NAME, min_nodes, ft_launcher_nnodes(min_nodes, version),
             f"nvidia-resiliency-ext {version_text(version)}: the survivors of a lost node re-form the group at the "
             "smaller size inside the allocation; srun --kill-on-bad-exit=0 --wait=0 keeps them running" if elastic
             else f"nvidia-resiliency-ext {version_text(version)} reads a node range as hot spares: a lost node ends "
             "the attempt", min_nodes, nodes)
    # One ft_launcher per node: nemo_run renders ntasks_per_node=1 for it (the ranks are its children).
    plan_of(executor).node_range = {"min_nodes": min_nodes, "nodes": nodes, "ntasks_per_node": 1}


def warn_min_healthy(min_nodes: int, nodes: int, restart_policy: str | None, *, inprocess_restart: bool,
                     version: tuple[int, ...]) -> str | None:
    """The warning for ``min-healthy`` on an elastic node range (module docstring); returns it (None: none)."""
    if restart_policy != "min-healthy" or min_nodes >= nodes or not elastic_node_range(version):
        return None
    source = (f"{NAME}.restart_policy='min-healthy'" if not inprocess_restart else
              f"{NAME}.restart_policy='min-healthy' (chosen by {NAME}.inprocess_restart=True)")
    message = (
        f"{NAME}.min_nodes={min_nodes} with {source} on nvidia-resiliency-ext {version_text(version)}: ft_launcher "
        f"turns upscaling off in min-healthy mode, so a node that joins after a rendezvous round closed (one that "
        f"started late) is not added to the running job until the next restart, and in-job restarts are counted per "
        f"rendezvous round for the whole job; a lost node still shrinks the job, and the job level grows it back "
        f"at the next requeue. To let a late node join inside the allocation, set {NAME}.restart_policy='any-failed'"
        + (" (with inprocess_restart=True every dead process then restarts all workers)" if inprocess_restart else ""))
    log.warning("%s", message)
    return message


def _check_task(min_nodes: int, nodes: int, per_node: int, editor: Any) -> None:
    tp, pp = editor.get("parallel.tensor_model_parallel_size"), editor.get("parallel.pipeline_model_parallel_size")
    mbs, gbs = editor.get("train.micro_batch_size"), editor.get("train.global_batch_size")
    counts = range(min_nodes, nodes + 1)
    misfits = [n for n in counts if (n * per_node) % (tp * pp)]
    if misfits:
        fits = [n for n in range(1, nodes + 1) if all((k * per_node) % (tp * pp) == 0 for k in range(n, nodes + 1))]
        raise ConfigError(f"{NAME}.min_nodes: at {misfits[0]} node(s) x {per_node} rank(s) the world size "
                          f"{misfits[0] * per_node} is not a multiple of tensor x pipeline parallel = {tp * pp}; "
                          f"allowed values: {fits or 'none (use a node count TP x PP divides)'}, got {min_nodes}")
    dps = [n * per_node // (tp * pp) for n in counts]
    if gbs is None:
        gbs = mbs * dps[-1]
        editor.set("train.global_batch_size", gbs, f"min_nodes={min_nodes}: fixed at the full size's micro batch "
                   f"x DP {dps[-1]}, so the training stays the same on fewer nodes")
    step = math.lcm(*(mbs * dp for dp in dps))
    if gbs % step:
        raise ConfigError(
            f"train.global_batch_size: must be a multiple of train.micro_batch_size * data-parallel size at every "
            f"node count {NAME}.min_nodes={min_nodes} allows ({min_nodes}..{nodes} nodes: DP "
            f"{', '.join(map(str, dps))}, micro batch {mbs}): allowed values are multiples of {step}, got {gbs}")
