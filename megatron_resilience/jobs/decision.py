"""What to do after an attempt: stop, requeue (excluding nodes), or cancel — with the budget left and why.

``decide`` applies a :class:`~megatron_resilience.jobs.policies.Policy` to a classification and the
chain of earlier attempts (ledger records). ``decide_like_nemo_run`` is the behaviour without a
policy (no ``RestartPolicyPlugin``): nemo_run's own requeue rule — FT template: requeue until the
finished flag exists or ``TORCHX_MAX_RETRIES`` attempts *in a row* failed; plain template: requeue a
failure while ``TORCHX_MAX_RETRIES`` exceeds the failures so far — with two corrections: a
preempted attempt never counts as a failure (nemo_run's plain template counted every requeue), and
ft_launcher's "do not restart" exit code and a person's ``scancel`` are honoured.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.classifier import Classification
from megatron_resilience.jobs.node_exclusion import (
    EXCLUSION_LOOKBACK_S,
    LIFTED_EXPIRED,
    Cluster,
    Exclusion,
    lookback_of,
    plan,
    wanted,
)
from megatron_resilience.jobs.policies import Policy

__all__ = ["Cluster", "Decision", "EXCLUSION_LOOKBACK_S", "decide", "decide_like_nemo_run", "decide_monitor_only",
           "fingerprint", "made_progress"]


@dataclass
class Decision:
    action: str  # "stop" | "requeue" | "scancel" | "record" (monitor-only: nothing done)
    reason: str
    final: bool = False  # the chain of attempts ends here
    outcome: str | None = None  # when final: finished | cancelled | stopped | budget_exhausted | no_progress
    spent: str | None = None  # the budget mode this requeue spends
    budget_left: dict[str, int] | None = None
    exclude_requested: list[str] = field(default_factory=list)
    exclude_applied: list[str] = field(default_factory=list)  # the job's whole ExcNodeList after this decision
    exclude_not_applied: str | None = None
    exclude_lifted: list[str] = field(default_factory=list)  # nodes whose exclusion ended (jobs/node_exclusion.py)
    exclude_lifted_why: dict[str, str] = field(default_factory=dict)  # node -> why its exclusion ended
    exclude_blamed: list[str] = field(default_factory=list)  # of exclude_requested, those asked for on attributions
    exclude_deferred: list[str] = field(default_factory=list)  # blamed, not excluded now: one new node per decision
    exclude_scheduler: dict[str, str] = field(default_factory=dict)  # attempt node -> sinfo state keeping it idle
    scheduler_unread: str | None = None  # sinfo could not be read: drained nodes were not checked
    attempts_without_progress: int = 0
    fingerprint: str | None = None  # the failure as recurrences are counted (see ``fingerprint``)
    repeats_without_progress: int = 0  # this failure, counted back while no attempt advanced the checkpoint

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def message(self) -> str:
        text = f"{self.action}: {self.reason}"
        if self.exclude_requested:
            text += f"; exclusion requested for {','.join(self.exclude_requested)}"
            text += (f" (not applied: {self.exclude_not_applied})" if self.exclude_not_applied
                     else f" (ExcNodeList={','.join(self.exclude_applied)})")
        drained = {n: s for n, s in self.exclude_scheduler.items() if n in self.exclude_requested}
        if drained:
            text += "; the scheduler keeps " + ", ".join(f"{n} ({s})" for n, s in drained.items()) + " from work"
        if self.exclude_deferred:
            text += (f"; {','.join(self.exclude_deferred)} also blamed, not excluded now (one new node per "
                     "decision)")
        if self.exclude_lifted:
            why: dict[str, list[str]] = {}
            for node in self.exclude_lifted:
                why.setdefault(self.exclude_lifted_why.get(node, LIFTED_EXPIRED), []).append(node)
            text += "; " + "); ".join(f"exclusion of {','.join(nodes)} lifted ({reason}"
                                      for reason, nodes in why.items())
            text += f"; ExcNodeList={','.join(self.exclude_applied)})"
        if self.scheduler_unread:
            text += f"; {self.scheduler_unread}"
        if self.budget_left is not None:
            text += "; restarts left " + ", ".join(f"{m} {n}" for m, n in self.budget_left.items())
        return text


def _failures(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in history if (a.get("classification") or {}).get("mode") is not None]


# The same failure this many times in a row, no attempt between advancing the checkpoint: a loop, stopped under
# every policy whatever its budget (nvidia-resiliency-ext's restart agent counts recurrences the same way).
SAME_FAILURE_LIMIT = 3
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")


def fingerprint(cls: Classification) -> str:
    """What makes two failures "the same": error type, the node(s) or rank it points at, and its first evidence line
    with every number masked (time stamps, pids, step counts, addresses differ between recurrences)."""
    where = ",".join(sorted(cls.hosts)) or (f"rank {cls.fields['rank']}" if cls.fields.get("rank") else "-")
    line = (cls.evidence[0] if cls.evidence else cls.reason or "").strip()
    return f"{cls.error_type} @ {where}" + (f": {_NUMBER.sub('N', line)[:160]}" if line else "")


def _since_progress(history: list[dict[str, Any]], current: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The attempts of ``history`` after the last one (``current`` included) that advanced the checkpoint."""
    chain = history + ([current] if current is not None else [])
    last = max((i for i, a in enumerate(chain) if made_progress(a)), default=-1)
    return history[last + 1:]


def _spent(history: list[dict[str, Any]], mode: str, current: dict[str, Any] | None = None) -> int:
    """Restarts of ``mode`` spent since the run last advanced its checkpoint. A budget counts failures without
    progress: a weeks-long run meets hundreds of failures (Llama 3 405B: 466 in 54 days) and a fixed count would
    end it within days although every attempt trained; a loop that trains nothing still runs out."""
    return sum(1 for a in _since_progress(history, current) if (a.get("decision") or {}).get("spent") == mode)


def _repeats(history: list[dict[str, Any]], current: dict[str, Any], print_: str) -> int:
    """How many times in a row this failure has happened with no advance in between: the current attempt, plus
    each earlier one with the same fingerprint while the attempt after it did not advance the checkpoint (an
    attempt with no records to judge by shows no advance)."""
    count, later = 1, current
    for earlier in reversed(history):
        if made_progress(later) or _fingerprint_of(earlier) != print_:
            break
        count, later = count + 1, earlier
    return count


def _fingerprint_of(attempt: dict[str, Any]) -> str | None:
    """An earlier attempt's fingerprint: as its decision recorded it, else (a ledger written before fingerprints)
    from its classification; None for an attempt that was not a failure."""
    recorded = (attempt.get("decision") or {}).get("fingerprint")
    c = attempt.get("classification") or {}
    if recorded or c.get("mode") is None:
        return recorded
    return fingerprint(Classification.from_dict(c))


def made_progress(attempt: dict[str, Any]) -> bool | None:
    """Whether an attempt advanced the newest checkpoint beyond the one it resumed from (None: unknown)."""
    ckpt, resumed = attempt.get("checkpoint_step"), attempt.get("resumed_from")
    if ckpt is None and resumed is None and attempt.get("last_step") is None:
        return None  # no trainer records and no checkpoint tracker: nothing to judge by
    return ckpt is not None and ckpt > (resumed or 0)


def _without_progress(history: list[dict[str, Any]], current: dict[str, Any]) -> int:
    """Restarts in a row (not the chain's first attempt) that failed without advancing the checkpoint."""
    count = 0
    chain = history + [current]
    for index in range(len(chain) - 1, 0, -1):
        a = chain[index]
        if (a.get("classification") or {}).get("mode") is None or made_progress(a) is not False:
            break
        count += 1
    return count


def decide(cls: Classification, policy: Policy, history: list[dict[str, Any]], current: dict[str, Any],
           cluster: Cluster, *, finished_flag: bool | None = None,
           shared_blames: list[tuple[str, float | None]] = ()) -> Decision:
    """The policy's decision for the attempt ``current`` (its record so far) after ``history``.

    ``shared_blames``: (node, time) of hardware attributions by other runs that share a node-history folder
    (``jobs/shared_node_history.py``); they count towards ``exclude_nodes_after`` like this run's own.

    ``finished_flag``: under ft_launcher, whether the trainer touched the finished flag (None: not known). A
    step that exited 0 without it, and without a record of our trainer's, stopped before the end (a trainer
    that saved and exited on a signal): requeued like a preemption.
    """
    kind = cls.error_type
    nodes, end = current.get("nodes") or [], current.get("end")
    now = time.time() if end is None else end

    def free(decision: Decision) -> Decision:
        """A requeue that spends no budget still drops the attempt's drained nodes, a node its in-job cycles blamed
        often enough (a lemon), and lifts ended exclusions."""
        asked = wanted(policy, False, cls, history, current, cluster, now, shared_blames)
        _copy(decision, plan(asked, history, nodes, cluster, min_nodes=current.get("min_nodes"), now=now,
                             lookback_s=lookback_of(policy)))
        return decision

    if kind == "finished" and cls.source == "exit_code" and finished_flag is False:
        return free(Decision("requeue", "the job step exited 0 without touching the finished flag (stopped before "
                             "the end): requeued without spending a retry", budget_left=_left(policy, history)))
    if kind == "finished":
        return Decision("stop", "training finished", final=True, outcome="finished")
    if kind == "finished_but_alive":
        return Decision("scancel", "the trainer finished but the job's processes are still running", final=True,
                        outcome="finished")
    if kind == "user_cancel":
        return Decision("stop", "cancelled by a person (scancel): never retried", final=True, outcome="cancelled")
    if kind in ("preempted", "system_cancel"):
        return free(Decision("requeue", f"{kind}: requeued without spending a retry",
                             budget_left=_left(policy, history)))
    action, why = policy.action_for(kind, cls.subsystem, cls.signal, tuple(cls.monitors))
    mode = cls.mode or "crash"
    left = _left(policy, history, current)
    print_ = fingerprint(cls)
    repeats = _repeats(history, current, print_)
    basis = dict(fingerprint=print_, repeats_without_progress=repeats)
    if action == "stop":
        return Decision("stop", f"{kind} is not restarted: {why}", final=True, outcome="stopped", budget_left=left,
                        **basis)
    stuck = _without_progress(history, current)
    if repeats >= SAME_FAILURE_LIMIT:
        return Decision("stop", f"the same failure {repeats} times in a row without advancing the checkpoint: "
                        f"{print_}", final=True, outcome="no_progress", budget_left=left,
                        attempts_without_progress=stuck, **basis)
    if policy.max_attempts_without_progress and stuck >= policy.max_attempts_without_progress:
        return Decision("stop", f"{stuck} failed attempt(s) in a row did not advance the checkpoint "
                        f"(max_attempts_without_progress={policy.max_attempts_without_progress}): a restart loop "
                        f"without progress; last failure {print_}", final=True, outcome="no_progress",
                        budget_left=left, attempts_without_progress=stuck, **basis)
    if left[mode] <= 0:
        return Decision("stop", f"retry budget exhausted: {policy.max_restarts[mode]} of "
                        f"{policy.max_restarts[mode]} {mode} restart(s) used since the run last advanced its "
                        f"checkpoint ({kind}, policy {policy.name}); last failure {print_}",
                        final=True, outcome="budget_exhausted", budget_left=left, attempts_without_progress=stuck,
                        **basis)
    left[mode] -= 1
    decision = Decision("requeue", f"{kind}: {why}", spent=mode, budget_left=left, attempts_without_progress=stuck,
                        **basis)
    asked = wanted(policy, action == "requeue_excluding_nodes", cls, history, current, cluster, now, shared_blames)
    _copy(decision, plan(asked, history, nodes, cluster, min_nodes=current.get("min_nodes"), now=now,
                         lookback_s=lookback_of(policy)))
    return decision


def _copy(decision: Decision, exclusion: Exclusion) -> None:
    decision.exclude_requested, decision.exclude_applied = exclusion.requested, exclusion.applied
    decision.exclude_not_applied, decision.exclude_lifted = exclusion.not_applied, exclusion.lifted
    decision.exclude_blamed, decision.exclude_deferred = exclusion.blamed, exclusion.deferred
    decision.exclude_scheduler, decision.scheduler_unread = exclusion.scheduler, exclusion.scheduler_unread
    decision.exclude_lifted_why = exclusion.lifted_why


def _left(policy: Policy, history: list[dict[str, Any]], current: dict[str, Any] | None = None) -> dict[str, int]:
    return {m: max(0, policy.max_restarts[m] - _spent(history, m, current)) for m in taxonomy.MODES}


def decide_monitor_only(cls: Classification) -> Decision:
    """Monitor-only (``RestartPolicyPlugin(policy=None)``): classified and recorded, never requeued."""
    outcome = {"finished": "finished", "finished_but_alive": "finished", "user_cancel": "cancelled"}.get(
        cls.error_type, "monitor_only")
    return Decision("record", f"monitor-only: {cls.error_type} recorded, never requeued (no restart policy)",
                    final=True, outcome=outcome)


def decide_like_nemo_run(cls: Classification, history: list[dict[str, Any]], *, retries: int, ft: bool,
                         finished_flag: bool) -> Decision:
    """nemo_run's requeue rule (no policy), with preemptions, 'do not restart' and scancel honoured."""
    kind = cls.error_type
    if kind == "user_cancel":
        return Decision("stop", "cancelled by a person (scancel): never retried", final=True, outcome="cancelled")
    if kind == "do_not_restart":
        return Decision("stop", "ft_launcher decided the job must not be restarted", final=True, outcome="stopped")
    if kind == "rerun_failed_validation":
        return Decision("stop", "the result failed validation (exit 17): needs a person", final=True,
                        outcome="stopped")
    if finished_flag or (kind == "finished" and not ft):
        return Decision("stop", "training finished (finished flag)" if finished_flag else "training finished",
                        final=True, outcome="finished")
    if cls.mode is None:  # finished without the flag (FT template requeues it), preempted, system cancel
        return Decision("requeue", f"{kind}: not a failure, requeued without spending a retry")
    if ft:
        in_a_row = 1
        for a in reversed(history):
            if (a.get("classification") or {}).get("mode") is None:
                break
            in_a_row += 1
        if retries == 0 or in_a_row >= retries:
            return Decision("stop", f"job failures limit reached: {in_a_row} failed attempt(s) in a row, "
                            f"TORCHX_MAX_RETRIES={retries}", final=True, outcome="budget_exhausted")
        return Decision("requeue", f"{kind}: failure {in_a_row} in a row of {retries} allowed", spent="crash")
    used = len([a for a in _failures(history) if (a.get("decision") or {}).get("action") == "requeue"])
    if used >= retries:
        return Decision("stop", f"job failures limit reached: {used} failure requeue(s) of TORCHX_MAX_RETRIES="
                        f"{retries}", final=True, outcome="budget_exhausted")
    return Decision("requeue", f"{kind}: failure requeue {used + 1} of {retries}", spent="crash")
