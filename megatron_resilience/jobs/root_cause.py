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

Limitation: ``local_rank`` is compared with the global rank of ``[rankN]:`` lines, exact on one node;
on several nodes a peer whose global rank equals the failed local rank is kept as its own line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_resilience.jobs.monitors import Signal

FIRST_FAILURE_MONITOR = "worker_failed_exitcode"
# What a surviving rank raises because another rank is gone (not a cause of its own).
PEER_SYMPTOMS = ("communication_error", "watchdog_timeout", "nccl_timeout", "nccl_error")


@dataclass
class RootCause:
    signal: Signal  # the launcher's first-failure line
    rank: str
    exit_code: int
    host: str | None
    consequences: list[Signal] = field(default_factory=list)  # the peers' symptoms, no longer deciding

    @property
    def killed_by(self) -> int | None:
        return -self.exit_code if self.exit_code < 0 else None

    def peers_line(self) -> str:
        """One line for what the peers printed (instead of their chained tracebacks)."""
        ranks = sorted({s.fields["rank"] for s in self.consequences}, key=int)
        kinds = sorted({s.error_type for s in self.consequences if s.error_type in PEER_SYMPTOMS})
        return (f"rank(s) {','.join(ranks)} lost contact with another rank ({', '.join(kinds)}: a consequence, "
                f"{len({s.line for s in self.consequences})} line(s))")


def _failures(signals: list[Signal]) -> list[RootCause]:
    """Every failed rank the launcher reported, in order: its first-failure lines, then its summary records."""
    out = [RootCause(signal=s, rank=s.fields.get("rank", ""), exit_code=int(s.fields["exitcode"]),
                     host=s.fields.get("host"))
           for s in signals if s.monitor == FIRST_FAILURE_MONITOR
           and s.fields.get("exitcode", "").lstrip("-").isdigit()]
    record: dict[str, str] = {}
    for s in signals:  # host, rank, exitcode lines of one summary record follow each other
        if s.monitor == "torchelastic_failure_host":
            record = {"host": s.fields["summary_host"]}
        elif s.monitor == "torchelastic_failure_rank":
            record["rank"] = s.fields["summary_rank"]
        elif s.monitor == "torchelastic_failure_exitcode" and "rank" in record:
            out.append(RootCause(signal=s, rank=record["rank"], exit_code=int(s.fields["exitcode"]),
                                 host=record.get("host")))
            record = {}
    return out


def first_failure(signals: list[Signal]) -> RootCause | None:
    """The rank that failed first, from the launcher's lines, else None.

    The launcher's first-failure line wins, unless that rank itself only lost contact with a peer: two ranks
    that ended within one poll of the launcher are ordered by the second they ended in, and a peer's symptom may
    be named first. Then the first reported rank without a symptom of its own is the root, preferring one killed
    by a signal other than the launcher's own stop (SIGTERM/SIGINT sent to the survivors).
    """
    failed = _failures(signals)
    if not failed:
        return None
    symptomatic = {s.fields.get("rank") for s in signals if s.error_type in PEER_SYMPTOMS and s.fields.get("rank")}
    if failed[0].rank not in symptomatic:
        return failed[0]
    clean = [f for f in failed if f.rank not in symptomatic]
    killed = [f for f in clean if f.killed_by is not None and f.killed_by not in (2, 15)]
    return (killed or clean or failed)[0]


def split_consequences(deciding: list[Signal], root: RootCause | None) -> list[Signal]:
    """The deciding signals without the peers' symptoms of the root cause (recorded on ``root``)."""
    if root is None:
        return deciding
    # a symptom line may match other monitors too (a gloo error is also an uncaught exception): by line
    symptom_lines = {s.line for s in deciding if s.error_type in PEER_SYMPTOMS}
    kept = []
    for s in deciding:
        rank = s.fields.get("rank")
        if s.line in symptom_lines and rank is not None and rank != root.rank:
            root.consequences.append(s)
        else:
            kept.append(s)
    return kept
