"""How many nodes a requeued attempt asks for, and each attempt's world and data-parallel size in the ledger.

With ``FaultTolerancePlugin(min_nodes=MIN)`` (job-level config ``min_nodes`` and ``nodes``, the job's full
size), every decision to requeue also decides the next attempt's node count, from Slurm's view now:

    available = the partition's nodes that can take the job now (``sinfo``: idle or mixed), plus the nodes of
                the attempt that just ended (the requeue frees them), minus the job's excluded nodes and
                nodes that are down, drained or failing, or carry a flag that keeps new work off them now
                (``*`` not responding, ``$`` maintenance, ``!``/``%`` power down, ``@``/``^`` reboot, ``-``
                planned for another job: ``slurm.usable_now``); powered-off (``~``) or powering-up (``#``)
                nodes count, as Slurm boots them for the job
    next      = min(nodes, max(MIN, available))

So a job whose node was excluded or died, in a partition without a spare, starts again at once on the nodes
that exist (never fewer than MIN: then it waits for MIN), and a later attempt grows back to the full size once
nodes return. It is applied to the requeued (pending) job with ``scontrol update JobId=J NumNodes=N
NumTasks=N x tasks per node`` (Slurm ignores a node count its NumTasks cannot fit), or as ``sbatch --nodes=N``
when the watcher resubmits. A range (``--nodes=MIN-MAX``) alone is not enough: Slurm 22.05 (cons_tres)
allocates its lowest count even with every node idle, so it would never grow back (measured here).

Shrinking keeps the training the same: the trainer resumes the checkpoint at the smaller data-parallel size
with the same global batch (``checkpointing/reshard.py``); the plugin checked every size in the range at submit time.
"""

from __future__ import annotations

import time
from typing import Any

from megatron_resilience.jobs import slurm
from megatron_resilience.jobs.node_exclusion import lookback_of, standing

FREE_STATES = ("idle", "mixed")


def plan(cfg: Any, record: dict[str, Any], decision: Any, history: list[dict[str, Any]], *,
         partition: str | None, states: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The next attempt's node count when ``decision`` requeues and it differs from this attempt's, else None.

    ``states``: node -> Slurm state of the job's partition (None: read with ``sinfo``).
    """
    if getattr(cfg, "min_nodes", None) is None or decision.action != "requeue":
        return None
    full, least = int(cfg.nodes), int(cfg.min_nodes)
    ran_on = list(record.get("nodes") or [])
    if decision.exclude_applied or decision.exclude_lifted:  # this decision rewrote the job's ExcNodeList
        excluded = set(decision.exclude_applied)
    else:  # the list as the earlier decisions left it (lifted and expired exclusions are gone)
        load = getattr(cfg, "load_policy", None)
        excluded = set(standing(history, record.get("end") or time.time(),
                                lookback_s=lookback_of(load() if load else None))[0])
    if states is None:
        states = slurm.partition_node_states(partition)
    free = {n for n, s in states.items() if slurm.split_state(s)[0] in FREE_STATES and slurm.usable_now(s)}
    usable = {n for n in ran_on if slurm.usable_now(states.get(n, "allocated"))}
    available = sorted((free | usable) - excluded)
    nodes = min(full, max(least, len(available)))
    was = len(ran_on) or full
    if nodes == was:
        return None
    why = (f"{len(available)} node(s) can take it now ({','.join(available) or 'none'}): "
           + (f"grows back to {nodes} of {full}" if nodes > was else
              f"shrinks to {nodes} of {full} (min_nodes={least}) instead of waiting for a replacement"))
    return {"nodes": nodes, "was": was, "full": full, "min_nodes": least, "available": available,
            "tasks": nodes * int(cfg.ntasks_per_node or 1), "reason": why}


def resize_command(job_id: str, count: dict[str, Any]) -> list[str]:
    return ["scontrol", "update", f"JobId={job_id}", f"NumNodes={count['nodes']}", f"NumTasks={count['tasks']}"]


def carry_out(ledger: Any, record: dict[str, Any], job_id: str, *, by: str) -> str | None:
    """Apply the record's ``node_count`` to the requeued job (write-ahead through the ledger); the log line."""
    count = record.get("node_count")
    if not count:
        return None
    ok, output = ledger.perform("resize", resize_command(job_id, count), by=by, job_id=job_id, nodes=count["nodes"])
    return (f"next attempt on {count['nodes']} node(s): {count['reason']}: "
            + ("NumNodes set" if ok else f"NumNodes NOT set: {output}"))


def attempt_sizes(mine: list[dict[str, Any]]) -> dict[str, Any]:
    """The world and data-parallel size of an attempt (its last in-job cycle) and of each cycle, from the
    trainer's ``start`` records of that attempt (an elastic launcher may change them between cycles)."""
    sizes = [{"world_size": r.get("world_size"), "tp": r.get("tp"), "pp": r.get("pp"), "dp": r.get("dp")}
             for r in mine if r.get("kind") == "start"]
    if not sizes:
        return {}
    return {"world_size": sizes[-1]["world_size"], "dp": sizes[-1]["dp"], "sizes": sizes}
