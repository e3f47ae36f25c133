"""Which node failed: every host the evidence names, in what role, and the one(s) the strongest evidence blames.

Lines name hosts for different reasons, and the wrong reading excludes a healthy node:

==================  ==========================================================  ========
role                named by                                                    strength
==================  ==========================================================  ========
``failed``          ``srun: error: Node failure on <node>``; Slurm's record: a  100
                    node of the attempt that ``scontrol show node`` reports
                    DOWN/DRAIN/FAIL/NOT_RESPONDING (with its reason)
``hardware``        a GPU/driver line of that host (``NVRM: Xid``, ECC, CUDA    90
                    errors, Megatron's rerun machine naming the node)
``first_failure``   the host of the launcher's first failed rank               70
                    (``[ft_launcher<pid>@<host>] failed (exitcode: ...)``), else
                    the first ``srun: error: <node>: task <n>: Exited ...`` line
``stalled_rank``    the host of a rank nvidia-resiliency-ext found hanging     70
``peer``            the remote peer an NCCL/IB error names                      50
``failed_rank``     a later rank failure (a peer that failed after the first)   40
``reporter``        the host that printed an error about something else         30
                    (``<host>:<pid>:<tid> [gpu] NCCL WARN ...``)
``batch_host``      slurmstepd's ``*** JOB <id> ON <host> CANCELLED ...`` line:  10
                    the batch host, whatever failed
==================  ==========================================================  ========

Monitors name hosts through named groups: ``failed_node`` (role ``failed``), ``peer``, ``batch_host``,
and ``host`` (its role from the line: hardware, first failure, stalled rank, else reporter). A host
that is an IP address is mapped to the node with that ``NodeAddr`` when exactly one node has it.

The suspects are the attempt's nodes at the highest strength present. On a multi-node attempt two
readings never make a suspect: a ``batch_host`` (it names the batch host, not the failure), and the
reporter of an error about a remote peer (``<host>:... NCCL WARN NET/IB : Got completion from peer
<addr>``: the reporter is the healthy end that noticed; when the peer maps to no node of the attempt,
nothing is blamed). Evidence that names no node blames nothing — unless the attempt ran on one node,
which is then the suspect (role ``only_node``). Every mention is kept (host, node, role, line,
source) for the ledger and the report's per-node table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.monitors import Signal
from megatron_resilience.jobs.root_cause import RootCause, first_failure

STRENGTH = {"failed": 100, "hardware": 90, "first_failure": 70, "stalled_rank": 70, "peer": 50, "failed_rank": 40,
            "reporter": 30, "batch_host": 10}
RANK_FAILURE_MONITORS = ("worker_failed_exitcode", "srun_task_failed")
NODE_STATE_MONITOR = "slurm_node_state"
# Node states (``scontrol show node``) that say the node itself failed or was taken out.
FAILED_NODE_STATES = ("DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "UNKNOWN")


@dataclass(frozen=True)
class Mention:
    host: str  # as the line wrote it
    node: str | None  # the attempt's Slurm node it maps to (None: not one of the attempt's nodes)
    role: str
    line: str
    source: str
    about_peer: bool = False  # a reporter of an error about its remote peer (never the suspect on many nodes)

    @property
    def strength(self) -> int:
        return STRENGTH[self.role]

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "node": self.node, "role": self.role, "line": self.line[:300],
                "source": self.source}


def node_state_signals(states: dict[str, dict[str, str]]) -> list[Signal]:
    """Slurm's record of the attempt's nodes as signals: a node that is down/drained/failing is ``failed``."""
    out = []
    for node, info in states.items():
        flags = set(str(info.get("state") or "").upper().replace("*", "").split("+"))
        if flags & set(FAILED_NODE_STATES):
            out.append(Signal(monitor=NODE_STATE_MONITOR, error_type="node_fail", subsystem="node", severity="info",
                              line=f"scontrol show node {node}: State={info.get('state')} Reason={info.get('reason')}",
                              source="slurm", fields={"failed_node": node, "reason": str(info.get("reason") or "")}))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact host list (``nid[003-005,9],gpu1``) as names, without asking Slurm."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        found = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not found:
            out.append(part)
            continue
        prefix, ranges, suffix = found.groups()
        for item in ranges.split(","):
            first, _, last = item.partition("-")
            width = len(first)
            for n in range(int(first), int(last or first) + 1):
                out.append(f"{prefix}{n:0{width}d}{suffix}")
    return out


def to_node(host: str, nodes: list[str], addresses: dict[str, str]) -> str | None:
    """A host as a line names it (short or full name, ``IP<port>``, ``IP:port``) -> one of the attempt's nodes."""
    bare = host.split("<")[0]
    if bare.count(":") == 1:
        bare = bare.split(":")[0]
    if bare in nodes:
        return bare
    short = bare.split(".")[0]
    named = [n for n in nodes if n.split(".")[0] == short]
    if len(named) == 1:
        return named[0]
    by_addr = [n for n in nodes if addresses.get(n) == bare]
    return by_addr[0] if len(by_addr) == 1 else None


def mentions(signals: list[Signal], nodes: list[str], addresses: dict[str, str] | None = None) -> list[Mention]:
    """Every host named by the signals, in order, with its role."""
    addresses = addresses or {}
    root = first_failure(signals, nodes)  # its host: the launcher's line, or srun's label on the node list
    srun_first = next((s for s in signals if s.monitor == "srun_task_failed"), None)
    # a line about a remote peer, whichever monitor read it (a generic NCCL WARN monitor matches it too)
    peer_lines = {s.line for s in signals if s.fields.get("peer")}
    out: list[Mention] = []
    if root is not None and root.host:
        out.append(Mention(host=root.host, node=to_node(root.host, nodes, addresses), role="first_failure",
                           line=root.signal.line, source=root.signal.source))
    for s in signals:
        for group in ("failed_node", "host", "peer", "batch_host"):
            for host in expand_hostlist(s.fields.get(group) or "") if group == "failed_node" else [s.fields.get(group)]:
                if host:
                    out.append(_mention(s, group, host, root, srun_first, nodes, addresses, peer_lines))
    return out


def _mention(s: Signal, group: str, host: str, root: RootCause | None, srun_first: Signal | None,
             nodes: list[str], addresses: dict[str, str], peer_lines: set[str]) -> Mention:
    if group == "failed_node":
        role = "failed"
    elif group in ("peer", "batch_host"):
        role = group
    elif s.error_type in taxonomy.HOST_EVIDENCE_TYPES and s.fields.get("xid_points_at", "machine") == "machine":
        role = "hardware"  # an Xid the driver handled or the application caused names its host only as reporter
    elif s.monitor in RANK_FAILURE_MONITORS:  # the launcher's root (above), else srun's first task line
        role = "first_failure" if (root is None or not root.host) and s is srun_first else "failed_rank"
    elif s.error_type == "hang":
        role = "stalled_rank"
    else:
        role = "reporter"
    return Mention(host=host, node=to_node(host, nodes, addresses), role=role, line=s.line, source=s.source,
                   about_peer=role == "reporter" and s.line in peer_lines)


def suspects(found: list[Mention], nodes: list[str]) -> tuple[list[str], str]:
    """The attempt's nodes the strongest evidence blames, and why (one line)."""
    several = len(nodes) > 1
    usable = [m for m in found if m.node is not None
              and not (several and (m.role == "batch_host" or m.about_peer))]
    if usable:
        top = max(m.strength for m in usable)
        blamed = list(dict.fromkeys(m.node for m in usable if m.strength == top))
        roles = sorted({m.role for m in usable if m.strength == top})
        return blamed, f"{','.join(blamed)}: {'/'.join(roles)} (strongest of {len(found)} host mention(s))"
    if len(nodes) == 1:
        return [nodes[0]], f"{nodes[0]}: the attempt's only node (no line names a node)"
    reporters = list(dict.fromkeys(m.node for m in found if m.about_peer and m.node))
    if reporters:
        peers = list(dict.fromkeys(m.host for m in found if m.role == "peer")) or ["unnamed"]
        return [], (f"no node blamed: {','.join(reporters)} reported an error about a remote peer "
                    f"({', '.join(peers)}) that is no node of this attempt")
    named = sorted({m.host for m in found})
    return [], (f"no node blamed: the evidence names {', '.join(named)} only as "
                f"{'/'.join(sorted({m.role for m in found}))}" if named else
                "no node blamed: no line names a node of this multi-node attempt")
