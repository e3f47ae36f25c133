"""Which nodes a requeued attempt avoids, and for how long: the rules a weeks-long run needs from them.

A run meets hundreds of failures; a few nodes cause most of them (a 504-GPU B200 report, arXiv 2605.09370: 3 of
63 nodes caused more than half of all exclusions), and excluding every node ever blamed empties the pool
(AIReSim's "one failure in 7 days" rule did, in every simulated run). So a node is avoided:

- **on repeats**: blamed by the policy's ``exclude_nodes_after`` hardware attributions (default presets: 2)
  within ``EXCLUSION_LOOKBACK_S`` (14 days, as nvidia-resiliency-ext's node attribution), counting the run's
  attempts, their in-job restart cycles and — when the user points runs at one folder
  (``RestartPolicyPlugin.node_history_dir``) — other runs' attributions (``shared_blames``); a rule
  ``requeue_excluding_nodes`` (e.g. ``node_failure``) asks at once for the node(s) its evidence blames;
- **one new node per decision** (``NEW_PER_DECISION``): a correlated event (a switch, a filesystem) blames many
  nodes at once, and the pool must not lose them all to one event; the others are ``deferred`` and come back if
  they are blamed again;
- **when the scheduler already knows**: an attempt's node that ``sinfo`` shows down, drained, failing or not
  responding is excluded before the requeue (in-job restarts reuse the allocation and never see a drain), so a
  node an administrator resumes without a repair does not take the run again; that exclusion ends at the first
  later decision that sees the node usable. A node ``sinfo`` does not list is recorded, not excluded: Slurm
  gives a job no node outside its partition and rejects a name it does not know (``ExcNodeList``);
- **never below what the job needs**: an exclusion that would leave fewer usable nodes than the job's minimum is
  recorded and not applied; an exclusion asked for last more than ``EXCLUSION_LOOKBACK_S`` ago is lifted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_resilience.failures import taxonomy

# An exclusion, or a hardware attribution counted towards one, lasts this long after it was last asked for: a node
# repaired during a weeks-long run comes back, and the pool does not shrink for ever (nvidia-resiliency-ext's node
# attribution looks back 14 days).
EXCLUSION_LOOKBACK_S = 14 * 24 * 3600
# New nodes a decision may exclude on attributions (nvidia-resiliency-ext's node attribution: at most 1 per cycle).
NEW_PER_DECISION = 1
NOT_LISTED = "not listed"
LIFTED_EXPIRED = f"asked for last more than {EXCLUSION_LOOKBACK_S // 86400} days ago"


def expired(lookback_s: float) -> str:
    """Why an exclusion ended: the policy's lookback passed (``exclude_nodes_within_days``)."""
    return LIFTED_EXPIRED if lookback_s == EXCLUSION_LOOKBACK_S else \
        f"asked for last more than {lookback_s / 86400:g} days ago"


def lookback_of(policy: Any) -> float:
    """The policy's attribution lookback in seconds (no policy: nvidia-resiliency-ext's 14 days)."""
    return float(getattr(policy, "exclude_nodes_within_s", EXCLUSION_LOOKBACK_S))
LIFTED_USABLE = "the scheduler shows it usable again"


@dataclass
class Cluster:
    """What the decision needs to know about where the job can run (from ``sinfo``/``scontrol``)."""

    nodes: list[str] = field(default_factory=list)  # the partition's nodes
    unusable: list[str] = field(default_factory=list)  # down / drained / failing / not responding
    partition: str = ""
    states: dict[str, str] = field(default_factory=dict)  # node -> sinfo's state (lower case, flags kept)
    unread: str | None = None  # why sinfo could not be read (None: it was, or nobody asked)


@dataclass
class Exclusion:
    """What one decision does to the job's ``ExcNodeList`` (copied onto the Decision and into the ledger)."""

    requested: list[str] = field(default_factory=list)  # asked for by this decision (attribution or scheduler)
    blamed: list[str] = field(default_factory=list)  # of those, the ones asked for on attributions
    applied: list[str] = field(default_factory=list)  # the job's whole ExcNodeList after it ([]: unchanged)
    not_applied: str | None = None
    lifted: list[str] = field(default_factory=list)  # nodes whose exclusion ended
    lifted_why: dict[str, str] = field(default_factory=dict)  # node -> LIFTED_EXPIRED | LIFTED_USABLE
    deferred: list[str] = field(default_factory=list)  # blamed, not excluded now (NEW_PER_DECISION)
    scheduler: dict[str, str] = field(default_factory=dict)  # attempt node -> sinfo state that keeps it from work
    scheduler_unread: str | None = None  # sinfo could not be read: drains were not checked


def slurm_node(host: str, cluster: Cluster, attempt_nodes: list[str]) -> str | None:
    """A host named in a log line -> the Slurm node name (short names match; one-node jobs map to their node)."""
    if host in cluster.nodes or host in attempt_nodes:
        return host
    short = host.split(".")[0]
    for node in cluster.nodes + attempt_nodes:
        if node.split(".")[0] == short:
            return node
    return attempt_nodes[0] if len(attempt_nodes) == 1 else None


def blames(history: list[dict[str, Any]], cluster: Cluster) -> list[tuple[str, float | None]]:
    """(node, time) of every hardware attribution in the run: each attempt's classification and each in-job cycle
    that ended in a hardware error (``cycles[k].ended``), once per node per failure."""
    out: list[tuple[str, float | None]] = []
    for a in history:
        nodes = a.get("nodes") or []
        found = [(a.get("classification") or {}, a.get("end"))]
        found += [((c.get("ended") or {}), (c.get("ended") or {}).get("time") or a.get("end"))
                  for c in a.get("cycles") or []]
        for c, when in found:
            if c.get("error_type") in taxonomy.HARDWARE_TYPES:
                for node in sorted({slurm_node(h, cluster, nodes) for h in c.get("hosts") or []} - {None}):
                    out.append((node, when))
    return out


def standing(history: list[dict[str, Any]], now: float, cluster: Cluster | None = None,
             lookback_s: float = EXCLUSION_LOOKBACK_S) -> tuple[list[str], dict[str, str]]:
    """(nodes still excluded, node -> why its exclusion ended). An exclusion asked for on attributions stands until
    ``EXCLUSION_LOOKBACK_S`` after the last decision that asked for it; one asked for only because ``sinfo`` showed
    the node unusable stands until ``cluster`` (a later ``sinfo``) shows it usable; a decision that lifted a node
    ends its exclusion."""
    asked: dict[str, tuple[float, bool]] = {}  # node -> (last asked, by the scheduler only)
    for a in history:
        d = a.get("decision") or {}
        applied = set(d.get("exclude_applied") or [])
        scheduler = d.get("exclude_scheduler") or {}
        for node in d.get("exclude_requested") or []:
            if node in applied:
                asked[node] = (a.get("end") or now, node in scheduler and node not in (d.get("exclude_blamed") or []))
        for node in d.get("exclude_lifted") or []:
            asked.pop(node, None)
    usable = set(cluster.nodes) - set(cluster.unusable) if cluster is not None and not cluster.unread else set()
    ended = {n: (LIFTED_USABLE if by_scheduler and n in usable else expired(lookback_s)) for n, (t, by_scheduler)
             in asked.items() if now - t >= lookback_s or (by_scheduler and n in usable)}
    return [n for n in asked if n not in ended], ended


def scheduler_view(attempt_nodes: list[str], cluster: Cluster) -> dict[str, str]:
    """The attempt's nodes that ``sinfo`` shows unable to take work (node -> state), or does not list."""
    if not cluster.nodes:
        return {}
    out = {}
    for node in attempt_nodes:
        if node not in cluster.nodes:
            out[node] = NOT_LISTED
        elif node in cluster.unusable:
            out[node] = cluster.states.get(node, "unusable")
    return out


def wanted(policy: Any, requeue_excluding: bool, cls: Any, history: list[dict[str, Any]], current: dict[str, Any],
           cluster: Cluster, now: float, shared_blames: list[tuple[str, float | None]] = ()) -> list[str]:
    """The nodes this failure's attributions ask to exclude, most-blamed first: those a ``requeue_excluding_nodes``
    rule's evidence blames, and those blamed now that reach ``policy.exclude_nodes_after`` attributions within the
    lookback (this run's and, with a shared folder, other runs'). ``current``: the attempt's record so far."""
    attempt_nodes = current.get("nodes") or []
    blamed_now = [n for n in dict.fromkeys(slurm_node(h, cluster, attempt_nodes) for h in cls.hosts) if n]
    out: list[str] = []
    if requeue_excluding:
        # No host named by the evidence: a one-node attempt's node is the suspect; of many, none is singled out.
        out += blamed_now or (list(attempt_nodes) if len(attempt_nodes) == 1 else [])
    if policy.exclude_nodes_after > 0:
        current = {**current, "classification": {"error_type": cls.error_type, "hosts": list(cls.hosts)},
                   "nodes": attempt_nodes, "end": now}  # with its in-job cycles
        # blamed by this attempt: its ending when that was hardware, and its in-job cycles that ended in a hardware
        # error (an attempt ended by a preemption may have restarted three times for one lemon's GPU)
        in_attempt = list(dict.fromkeys(node for node, _ in blames([current], cluster)))
        counts: dict[str, int] = {}
        for node, when in blames(history + [current], cluster) + list(shared_blames):
            if now - (when if when is not None else now) < lookback_of(policy):
                counts[node] = counts.get(node, 0) + 1
        repeat = sorted((n for n in in_attempt if counts.get(n, 0) >= policy.exclude_nodes_after),
                        key=lambda n: -counts[n])
        out = repeat + out
    return list(dict.fromkeys(out))


def plan(wanted_nodes: list[str], history: list[dict[str, Any]], attempt_nodes: list[str], cluster: Cluster, *,
         min_nodes: int | None, now: float, lookback_s: float = EXCLUSION_LOOKBACK_S) -> Exclusion:
    """The exclusion a requeue applies: the standing list, at most ``NEW_PER_DECISION`` new blamed node(s), the
    attempt's nodes the scheduler keeps from work, within what leaves the job enough usable nodes."""
    already, ended = standing(history, now, cluster, lookback_s)
    out = Exclusion(scheduler_unread=(f"sinfo could not be read ({cluster.unread}): nodes the scheduler drains were "
                                      "not checked") if cluster.unread else None)
    new = [n for n in wanted_nodes if n not in already]
    blamed = [n for n in wanted_nodes if n in already] + new[:NEW_PER_DECISION]
    out.deferred = new[NEW_PER_DECISION:]
    out.scheduler = scheduler_view(attempt_nodes, cluster)
    drained = [n for n, state in out.scheduler.items() if state != NOT_LISTED and n not in already]
    out.lifted = [n for n in ended if n not in blamed and n not in drained]
    out.lifted_why = {n: ended[n] for n in out.lifted}
    out.blamed = blamed
    asked = list(dict.fromkeys(blamed + drained))
    if not asked:
        out.applied = already if out.lifted else []
        return out
    out.requested = asked
    combined = list(dict.fromkeys(already + asked))
    usable = [n for n in cluster.nodes if n not in combined and n not in cluster.unusable]
    # A job with a node range (FaultTolerancePlugin.min_nodes) can start on fewer nodes (jobs/requeue_size.py).
    needed = max(1, min_nodes or len(attempt_nodes))
    if not cluster.nodes:
        out.not_applied = "the partition's nodes are unknown (sinfo gave none)"
    elif len(usable) < needed:
        out.not_applied = (
            f"excluding {','.join(combined)} would leave {len(usable)} usable node(s) in partition "
            f"{cluster.partition or '?'} ({','.join(cluster.nodes)}) and the job needs {needed}: the job would "
            "never start, so it is requeued without the exclusion")
        if drained:  # nodes the scheduler keeps from work cost the job nothing: they are excluded all the same
            out.applied = list(dict.fromkeys(already + drained))
    else:
        out.applied = combined
    if out.lifted and not out.applied:
        out.applied = already  # what still stands, without the ended ones
    return out
