"""The first rank to fail is the root cause; its peers' communication errors are the consequence.

When a rank dies (``kill -9``, a segfault, the OOM killer), every other rank's next collective fails:
gloo's ``Connection closed by peer`` / ``reset by peer``, NCCL's remote error or watchdog timeout.
Those lines are loud (tracebacks) while the dead rank usually says nothing at all; ranked by type
alone, the survivors' symptom would win and an attempt whose rank was killed would read as a
transient communication error (requeued by ``megatron_transient``).

The launcher says who failed first: torchelastic (torchrun, ft_launcher) logs the *first observed*
failure as ``failed (exitcode: N) local_rank: R (pid: P)`` (a negative code is the signal that
killed it), prefixed ``[ft_launcher<pid>@<host>]`` by ft_launcher. Given that line:

* rank-tagged (``[rankN]:``) communication errors of *other* ranks are consequences: they no longer
  decide, and the classification says how many peers lost contact, in one line;
* the first rank's own error lines (its OOM, its exception, its watchdog timeout) still decide;
* with nothing of its own to say, the first rank's ending decides: killed by a signal (``killed``),
  or an exit code no line explains (``unknown``).

``[rankN]:`` is a global rank, the launcher's line names a *local* one: on several nodes local rank 0 of the
second node is not rank 0. The failed rank's global rank is taken, in this order, from the launcher's failure
summary (the record with the same pid: ``rank : G (local_rank: L)``), else from its node's place in the
attempt's node list (the host of ``[ft_launcher<pid>@<host>]``, or srun's ``--label`` task number: one
launcher per node) times the ranks per node (node-rank order, what ``--node-rank $SLURM_NODEID`` and
ft_launcher's infrastructure group rank give), else it is the local rank when the attempt ran on one node
(node list and ranks per node come from the caller, ``AttemptEvidence.nodes`` and ``ranks_per_node``.
``attempts.end_attempt`` leaves them out on purpose: under torchrun's and ft_launcher's c10d rendezvous a node's
group rank follows the order the agents joined in, not Slurm's node list, so there the summary and what follows
decide, while the attribution maps the line's host to its node). When it cannot be known, a rank killed by a signal from
outside (anything but its own SIGABRT, which the NCCL watchdog raises after printing its timeout) printed
nothing after the kill, so every peer's symptom line is a consequence; a rank that exited with a code is
compared by its local rank (exact on one node).
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass, field

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.monitors import Signal

FIRST_FAILURE_MONITOR = "worker_failed_exitcode"
PEER_SYMPTOMS = taxonomy.PEER_SYMPTOMS  # what a surviving rank raises because another rank is gone
# srun --label: the task number that prefixes every line of a task (one launcher per node: its node's index).
SRUN_LABEL = re.compile(r"^(\d+): ")
# torch.distributed's prefix of a rank's lines: the rank of a symptom whose monitor does not capture one
RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
SELF_ABORT = int(_signal.SIGABRT)  # a rank's own abort (NCCL watchdog, C++ terminate): it may have said why
LAUNCHER_STOPS = (int(_signal.SIGINT), int(_signal.SIGTERM))  # the launcher stopping the survivors


@dataclass
class RootCause:
    signal: Signal  # the launcher's first-failure line (or a failure summary record)
    rank: str  # as the launcher names it: the local rank of a first-failure line, the global one of a summary
    exit_code: int
    host: str | None
    global_rank: str | None = None  # the ``[rankN]:`` number of this rank, when it can be known
    pid: str | None = None
    consequences: list[Signal] = field(default_factory=list)  # the peers' symptoms, no longer deciding

    @property
    def killed_by(self) -> int | None:
        return -self.exit_code if self.exit_code < 0 else None

    @property
    def label(self) -> str:
        """How the reason names it: ``rank 3``, or ``local rank 0`` when its global rank is unknown."""
        return f"rank {self.global_rank}" if self.global_rank is not None else f"local rank {self.rank}"

    def owns(self, rank: str) -> bool:
        """Whether a ``[rankN]:`` line (global rank ``rank``) is this rank's own."""
        if self.global_rank is not None:
            return rank == self.global_rank
        if self.killed_by is not None and self.killed_by != SELF_ABORT:
            return False  # killed from outside: it printed nothing after the kill, every symptom is a peer's
        return rank == self.rank  # the local rank: exact on one node

    def peers_line(self) -> str:
        """One line for what the peers printed (instead of their chained tracebacks)."""
        ranks = sorted({rank_of(s) for s in self.consequences}, key=int)
        kinds = sorted({s.error_type for s in self.consequences if s.error_type in PEER_SYMPTOMS})
        return (f"rank(s) {','.join(ranks)} lost contact with another rank ({', '.join(kinds)}: a consequence, "
                f"{len({s.line for s in self.consequences})} line(s))")


def rank_of(s: Signal) -> str | None:
    """The global rank a line is from: its monitor's ``rank`` field, else its ``[rankN]:`` prefix."""
    if s.fields.get("rank"):
        return s.fields["rank"]
    found = RANK_PREFIX.search(s.line)
    return found.group(1) if found else None


def _node_index(host: str | None, nodes: list[str]) -> int | None:
    """The place of ``host`` (full or short name) in the attempt's node list, else None."""
    if not host:
        return None
    if host in nodes:
        return nodes.index(host)
    short = [i for i, n in enumerate(nodes) if n.split(".")[0] == host.split(".")[0]]
    return short[0] if len(short) == 1 else None


def _summary_records(signals: list[Signal]) -> list[RootCause]:
    """torchelastic's ChildFailedError records (host, rank, exitcode lines follow each other): global ranks."""
    out: list[RootCause] = []
    record: dict[str, str] = {}
    for s in signals:
        if s.monitor == "torchelastic_failure_host":
            record = {"host": s.fields["summary_host"]}
        elif s.monitor == "torchelastic_failure_rank":
            record["rank"] = s.fields["summary_rank"]
        elif s.monitor == "torchelastic_failure_exitcode" and "rank" in record:
            out.append(RootCause(signal=s, rank=record["rank"], exit_code=int(s.fields["exitcode"]),
                                 host=record.get("host"), global_rank=record["rank"], pid=s.fields.get("pid")))
            record = {}
    return out


def _global_rank(s: Signal, local: str, host: str | None, summaries: list[RootCause], nodes: list[str],
                 ranks_per_node: int | None) -> tuple[str | None, str | None]:
    """(global rank, host) of a first-failure line, as far as the summary or the node list tell."""
    pid = s.fields.get("pid")
    same = [r for r in summaries if pid and r.pid == pid
            and (not host or not r.host or r.host.split(".")[0] == host.split(".")[0])]
    if same:
        return same[0].global_rank, host or same[0].host
    index = _node_index(host, nodes)
    label = SRUN_LABEL.match(s.line)
    if index is None and not host and label and int(label.group(1)) < len(nodes):
        index = int(label.group(1))
        host = nodes[index]
    if len(nodes) == 1:
        return local, host
    if index is not None and ranks_per_node:
        return str(index * ranks_per_node + int(local)), host
    return None, host


def _failures(signals: list[Signal], nodes: list[str], ranks_per_node: int | None) -> list[RootCause]:
    """Every failed rank the launcher reported, in order: its first-failure lines, then its summary records."""
    summaries = _summary_records(signals)
    out = []
    for s in signals:
        if s.monitor != FIRST_FAILURE_MONITOR or not s.fields.get("exitcode", "").lstrip("-").isdigit():
            continue
        local = s.fields.get("rank", "")
        rank, host = _global_rank(s, local, s.fields.get("host"), summaries, nodes, ranks_per_node)
        out.append(RootCause(signal=s, rank=local, exit_code=int(s.fields["exitcode"]), host=host,
                             global_rank=rank, pid=s.fields.get("pid")))
    return out + summaries


def first_failure(signals: list[Signal], nodes: list[str] = (), ranks_per_node: int | None = None) \
        -> RootCause | None:
    """The rank that failed first, from the launcher's lines, else None.

    ``nodes``: the attempt's Slurm node list, in order; ``ranks_per_node``: training ranks per node (both where
    known: they turn a launcher's local rank into the global rank of ``[rankN]:`` lines).

    The launcher's first-failure line wins, unless that rank itself only lost contact with a peer: two ranks
    that ended within one poll of the launcher are ordered by the second they ended in, and a peer's symptom may
    be named first. Then the first reported rank without a symptom of its own is the root, preferring one killed
    by a signal other than the launcher's own stop (SIGTERM/SIGINT sent to the survivors).
    """
    failed = _failures(signals, list(nodes), ranks_per_node)
    if not failed:
        return None
    symptomatic = {rank_of(s) for s in signals if s.error_type in PEER_SYMPTOMS} - {None}

    def lost_contact(f: RootCause) -> bool:
        return any(f.owns(rank) for rank in symptomatic)

    if not lost_contact(failed[0]):
        return failed[0]
    clean = [f for f in failed if not lost_contact(f)]
    killed = [f for f in clean if f.killed_by is not None and f.killed_by not in LAUNCHER_STOPS]
    return (killed or clean or failed)[0]


def split_consequences(deciding: list[Signal], root: RootCause | None) -> list[Signal]:
    """The deciding signals without the peers' symptoms of the root cause (recorded on ``root``)."""
    if root is None:
        return deciding
    # a symptom line may match other monitors too (a gloo error is also an uncaught exception): by line
    symptom_lines = {s.line for s in deciding if s.error_type in PEER_SYMPTOMS}
    kept = []
    for s in deciding:
        rank = rank_of(s)
        if s.line in symptom_lines and rank is not None and not root.owns(rank):
            root.consequences.append(s)
        else:
            kept.append(s)
    return kept
