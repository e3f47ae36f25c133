"""Why did an attempt end? One classification from everything known about it, in order of trust.

1. the trainer's own record: ``stop_reason.json`` (finished, stopped on a signal with a checkpoint,
   rerun exit 16/17) — a person's ``scancel`` is checked first of all but a finished run, and Slurm's
   NODE_FAIL before "stopped on a signal" (the signal was Slurm ending the job for the failed node);
2. nvidia-resiliency-ext: its "do not restart" exit code (93 by default) and log line (when its progress tracker
   gave up on this allocation, the failure its cycles show decides instead: ``_behind_no_progress``);
3. Slurm's record: the job state (NODE_FAIL, TIMEOUT, PREEMPTED, OUT_OF_MEMORY, CANCELLED);
4. log signals (monitors): ``fatal`` before ``error`` ones, then the likelier root cause first
   (``taxonomy.ERROR_TYPES`` order: an OOM on one rank explains NCCL timeouts on the others);
5. the exit code alone: 0 is finished, a signal is ``killed``, anything else ``unknown``.

``info``/``warning`` signals never decide; they supply details (the signal that killed a worker,
the node Megatron's rerun machine distrusted).
"""

from __future__ import annotations

import dataclasses
import signal as _signal
from dataclasses import dataclass, field
from typing import Any

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs import time_order
from megatron_resilience.jobs.monitors import Signal
from megatron_resilience.jobs.root_cause import FIRST_FAILURE_MONITOR, RootCause, first_failure, split_consequences

MAX_EVIDENCE_LINES = 4
# The reason ft_launcher's "do not restart" line gives when its progress tracker stopped it (nvidia-resiliency-ext
# 0.7 ``RDZV_SHUTDOWN_REASON_NO_PROGRESS``); the other reason, an attribution STOP, is "attribution_stop".
NO_PROGRESS = "no_progress"
# What a stop on a signal leaves in the log besides a rank's own failure: the signal itself, the kills that follow
# it, and the peers' symptoms of a rank that went away.
NOT_A_RANKS_OWN_FAILURE = ("preempted", "killed", "user_cancel", *taxonomy.PEER_SYMPTOMS)
# torchelastic's agent received a signal from outside (monitors/_slurm.yaml)
LAUNCHER_SIGNAL_MONITOR = "launcher_death_signal"


@dataclass
class AttemptEvidence:
    """What is known about one attempt (a Slurm job run, or one in-job cycle of it)."""

    exit_code: int | None = None  # the job step's (launcher's) exit code; None: unknown (watcher)
    stop_reason: dict[str, Any] | None = None  # the trainer's stop_reason.json of this attempt
    slurm_state: str | None = None  # scontrol/sacct JobState, e.g. RUNNING, CANCELLED, NODE_FAIL
    signals: list[Signal] = field(default_factory=list)  # from logs, metrics, cycle info (in order)
    no_restart_exit_code: int = taxonomy.NVRX_NO_RESTART_EXIT_CODE
    # The attempt's node list and training ranks per node, where known: they turn the launcher's local rank into
    # the global rank of ``[rankN]:`` lines on a multi-node attempt (jobs/root_cause.py).
    nodes: list[str] = field(default_factory=list)
    ranks_per_node: int | None = None


@dataclass
class Classification:
    error_type: str
    subsystem: str
    severity: str
    mode: str | None
    source: str  # what decided: stop_reason | slurm | nvrx | log | metrics | exit_code
    reason: str  # one line for people
    signal: str | None = None  # the signal that ended the attempt, when known (SIGKILL, SIGTERM, ...)
    evidence: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)  # the nodes the evidence blames (jobs/attribution.py)
    host_evidence: list[dict[str, Any]] = field(default_factory=list)  # every host read: role, line, source
    attribution: str = ""  # why those nodes (one line)
    monitors: list[str] = field(default_factory=list)  # the monitors whose lines decided (rules may match them)

    def to_dict(self) -> dict[str, Any]:
        return {"error_type": self.error_type, "subsystem": self.subsystem, "severity": self.severity,
                "mode": self.mode, "source": self.source, "reason": self.reason, "signal": self.signal,
                "evidence": list(self.evidence), "fields": dict(self.fields), "hosts": list(self.hosts),
                "host_evidence": list(self.host_evidence), "attribution": self.attribution,
                "monitors": list(self.monitors)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Classification:
        return cls(**{k: data.get(k) for k in ("error_type", "subsystem", "severity", "mode", "source", "reason")},
                   signal=data.get("signal"), evidence=list(data.get("evidence") or []),
                   fields=dict(data.get("fields") or {}), hosts=list(data.get("hosts") or []),
                   host_evidence=list(data.get("host_evidence") or []), attribution=data.get("attribution") or "",
                   monitors=list(data.get("monitors") or []))


def _make(error_type: str, source: str, reason: str, *, severity: str = "fatal", signals: list[Signal] = (),
          signal: str | None = None, fields: dict[str, str] | None = None) -> Classification:
    kind = taxonomy.BY_NAME[error_type]
    merged: dict[str, str] = {}
    for s in signals:
        for k, v in s.fields.items():
            merged.setdefault(k, v)
    merged.update(fields or {})
    hosts = []
    for s in signals:
        host = s.fields.get("host")
        if host and host not in hosts:
            hosts.append(host)
    subsystem = signals[0].subsystem if signals else kind.subsystem
    return Classification(error_type=error_type, subsystem=subsystem, severity=severity, mode=kind.mode,
                          source=source, reason=reason, signal=signal,
                          evidence=list(dict.fromkeys(s.line for s in signals))[:MAX_EVIDENCE_LINES], fields=merged,
                          hosts=hosts, monitors=list(dict.fromkeys(s.monitor for s in signals)))


def signal_name(number: int) -> str | None:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return None


def _signal_sent_after_a_failure(stop: dict[str, Any], signals: list[Signal]) -> bool:
    """Whether the trainer's stop on a signal was the launcher ending the worker group after a rank failed.

    ft_launcher and torchrun stop the other ranks of a group with SIGTERM once one failed; the trainer's handler
    cannot tell that signal from a preemption's and records "stopped on a signal" (found by the long chaos run: an
    ECC error in the cycle that used up ``--max-restarts`` read as a free preemption, its node's failure never
    counted). It was, when the log holds a rank's own failure and that failure, or the launcher's line that a
    worker failed, is stamped no later than the moment the trainer received the signal (``received_time`` in the
    record). A failure after the signal — a save cut short, a teardown exception — stays the preemption's
    consequence."""
    received = (stop.get("signal") or {}).get("received_time")
    own = [s for s in signals if s.severity in ("fatal", "error") and s.error_type not in NOT_A_RANKS_OWN_FAILURE]
    if received is None or not own:
        return False
    at = time_order.local_stamp(float(received))
    lines = own + [s for s in signals if s.monitor == FIRST_FAILURE_MONITOR]
    return any(t is not None and t <= at for t in (time_order.stamp(s.line) for s in lines))


def _stopped_from_outside(signals: list[Signal]) -> Signal | None:
    """The launcher's "Received SIGTERM death signal" line, when it is what ended the attempt: no rank's own failure
    and no launcher's worker-failed line can have come before it (each is certainly later: by time stamp, or by
    place in the same log).

    A preemption or time-limit warning that lands while the ranks are stuck in a C++ call (a rendezvous waiting for a
    stopped peer, found by the long chaos run: a rank hang injected during setup, then a preemption) never reaches
    their Python handler: they write no stop record, the launcher kills them after its shutdown timeout, and
    without this line the attempt read as ``killed``, which ``megatron_transient`` stops on. Slurm's own lines for
    a time limit, a preemption or a lost node are stamped before the launcher's and keep deciding."""
    received = [s for s in signals if s.monitor == LAUNCHER_SIGNAL_MONITOR]
    if not received:
        return None
    first = received[0]
    position = {id(s): i for i, s in enumerate(signals)}
    failed = [s for s in signals if (s.severity in ("fatal", "error") and s.error_type not in NOT_A_RANKS_OWN_FAILURE)
              or s.monitor == FIRST_FAILURE_MONITOR]
    if all(time_order.before(first, s, position) for s in failed):
        return first
    return None


def ending_signal(evidence: AttemptEvidence) -> str | None:
    """The signal that ended the attempt: a worker killed by one, or the launcher's exit code 128+N."""
    for s in reversed(evidence.signals):
        if s.fields.get("signal"):
            return s.fields["signal"]
        code = s.fields.get("exitcode")
        if code and code.startswith("-") and code[1:].isdigit():
            return signal_name(int(code[1:]))
    if evidence.exit_code is not None and evidence.exit_code > 128:
        return signal_name(evidence.exit_code - 128)
    return None


def _of(signals: list[Signal], error_type: str) -> list[Signal]:
    return [s for s in signals if s.error_type == error_type]


def classify(evidence: AttemptEvidence) -> Classification:
    sigs = evidence.signals
    code = evidence.exit_code
    stop = evidence.stop_reason or {}
    reason = str(stop.get("reason", "")) if stop else ""
    ended_by = ending_signal(evidence)

    if stop.get("finished") is True or reason == "finished":
        return _make("finished", "stop_reason", f"the trainer finished at step {stop.get('step')}", severity="info",
                     fields={"step": str(stop.get("step"))})
    # slurmstepd's "CANCELLED AT ... ***" line is the evidence while Slurm's record is not final (the trap sees
    # RUNNING); once Slurm recorded another ending (FAILED: the batch shell was killed), the record wins.
    # Only the job's own line (``*** JOB 43 ON host CANCELLED AT ...``) says a person cancelled the job: a line for
    # a job step alone (``STEP 43.1``) is also what slurmstepd prints when srun ends a step whose launcher exited
    # after forwarding a signal (torchrun, ft_launcher on one of several nodes), i.e. every preemption.
    # slurmstepd also prints the job's line when a signal reaches the batch step (``scancel --signal=TERM --full``,
    # measured on Slurm 22.05): with the batch shell signalled and Slurm's record still RUNNING, it is no cancel.
    cancel = [s for s in _of(sigs, "user_cancel") if "." not in str(s.fields.get("job", ""))]
    if any(s.monitor == "batch_shell_signal" for s in sigs) and evidence.slurm_state == "RUNNING":
        cancel = []
    if evidence.slurm_state == "CANCELLED" or (cancel and evidence.slurm_state in (None, "RUNNING", "COMPLETING")):
        return _make("user_cancel", "slurm", "the job was cancelled with scancel (Slurm state "
                     f"{evidence.slurm_state or 'from the log'}): a person's decision, never retried",
                     signals=cancel, signal=ended_by)
    if reason.startswith("rerun:") or code in (16, 17):
        rerun_code = int(reason.split(":", 1)[1]) if reason.startswith("rerun:") else code
        if rerun_code == 17:
            return _make("rerun_failed_validation", "stop_reason",
                         "Megatron's rerun state machine: the result failed validation (exit 17)",
                         fields={"step": str(stop.get("step"))})
        return _make("rerun_resume", "stop_reason",
                     "Megatron's rerun state machine asks to resume on different hardware (exit 16)",
                     signals=_of(sigs, "rerun_resume"), fields={"step": str(stop.get("step"))})
    state_type = taxonomy.SLURM_STATE_TYPES.get(evidence.slurm_state or "")
    if state_type == "node_fail":
        # Slurm ended the attempt for a failed node: a rank still running saved on Slurm's SIGTERM and wrote
        # "stopped on a signal" (exit 0), which is not a preemption.
        return _make(state_type, "slurm", f"Slurm job state {evidence.slurm_state}",
                     signals=_of(sigs, state_type), signal=ended_by)
    if stop and stop.get("exit_code") == 0 and not _signal_sent_after_a_failure(stop, sigs):
        return _make("preempted", "stop_reason", f"the trainer stopped with a checkpoint at step {stop.get('step')} "
                     f"({reason})", severity="info", signal=ended_by, fields={"reason": reason,
                                                                              "step": str(stop.get("step"))})
    nvrx = _of(sigs, "do_not_restart")
    if nvrx or (code is not None and code == evidence.no_restart_exit_code):
        verdict = _make("do_not_restart", "nvrx", f"ft_launcher decided the job must not be restarted "
                        f"(exit code {code})", signals=nvrx)
        return _behind_no_progress(evidence, verdict) if verdict.fields.get("reason") == NO_PROGRESS else verdict
    if state_type is not None:
        return _make(state_type, "slurm", f"Slurm job state {evidence.slurm_state}",
                     signals=_of(sigs, state_type), signal=ended_by)

    trainer_saw_it = any(s.severity == "fatal" for s in _of(sigs, "preempted"))  # its lines say more: the loop
    outside = None if trainer_saw_it else _stopped_from_outside(sigs)
    if outside is not None:
        signal = outside.fields.get("signal", "")
        signal = signal_name(int(signal)) if signal.isdigit() else signal
        return _make("preempted", "launcher", f"the launcher received {signal} from outside (preemption, time-limit "
                     "warning, scancel --signal) before any rank failed; the trainer wrote no stop of its own",
                     severity="info", signals=[outside], signal=signal)
    # the launcher's first failed rank: its peers' communication errors follow from it
    root = first_failure(sigs, evidence.nodes, evidence.ranks_per_node)
    # a cancel line was weighed above against Slurm's record; "killed" lines only name the signal
    failures = [s for s in sigs if s.severity in ("fatal", "error") and s.error_type not in ("killed", "user_cancel")]
    after_a_failure = [id(s) for s in time_order.later_symptoms(failures)]  # a peer's symptom of an earlier failure
    for severity in ("fatal", "error"):
        deciding = [s for s in failures if s.severity == severity and id(s) not in after_a_failure]
        deciding = split_consequences(deciding, root)
        if deciding:
            best = min(deciding, key=lambda s: taxonomy.rank(s.error_type))
            chosen = _of(deciding, best.error_type)
            source = "metrics" if chosen[0].source == "metrics" else "log"
            if best.error_type == "preempted":
                signal = chosen[0].fields.get("signal") or ended_by
                return _make("preempted", source, f"the trainer received {signal} and was stopping to checkpoint "
                             f"(after step {chosen[0].fields.get('step')}); the attempt ended before it finished",
                             severity=severity, signals=chosen, signal=signal)
            # the same type's other lines, but not the peers' symptoms of the root cause (they lost contact with it)
            extra = [s for s in _of(sigs, best.error_type) if root is None or s not in root.consequences]
            return _make(best.error_type, source, f"{taxonomy.BY_NAME[best.error_type].meaning} "
                         f"({len(chosen)} line(s), monitor {best.monitor})", severity=severity,
                         signals=chosen + [s for s in extra if s not in chosen], signal=ended_by)
    if root is not None and root.consequences:
        return _first_failure(root, ended_by)
    if code == 0:
        return _make("finished", "exit_code", "the job step exited 0", severity="info")
    if ended_by is not None or (code is not None and code > 128):
        return _make("killed", "exit_code", f"killed by {ended_by or 'a signal'} (exit code {code}); no log line "
                     "explains it", signals=_of(sigs, "killed"), signal=ended_by)
    return _make("unknown", "exit_code", f"exit code {code} and no evidence of why", severity="error")


def _behind_no_progress(evidence: AttemptEvidence, verdict: Classification) -> Classification:
    """ft_launcher's progress tracker stopped restarting inside this allocation: its cycles' own failure decides.

    The tracker's verdict (nvidia-resiliency-ext >= 0.6: ``max_no_progress_cycles`` cycles in a row without a newer
    checkpoint) is about *this allocation*: restarting on the same nodes does not help. A node that keeps failing
    (an Xid, an ECC error, a lost node) is exactly that case, and a new allocation without the node is the cure;
    stopping the job there would end a weeks-long run at the first lemon node. So the failure the cycles show is
    the classification (and the restart policy, its budget of failures without progress and the node exclusion
    decide, as for any attempt); the tracker's verdict stands only when the log shows no failure of its own
    (nothing known, or only a kill). An attribution service's STOP is never overridden.
    """
    rest = [s for s in evidence.signals if s.error_type != "do_not_restart"]
    behind = classify(dataclasses.replace(evidence, exit_code=None, signals=rest))
    if behind.mode is None or behind.error_type in ("unknown", "killed"):
        return verdict
    behind.fields["launcher_gave_up"] = NO_PROGRESS
    behind.reason += "; then ft_launcher stopped restarting in this allocation (no progress across its cycles)"
    behind.evidence = (behind.evidence + verdict.evidence)[:MAX_EVIDENCE_LINES]
    behind.monitors = list(dict.fromkeys(behind.monitors + verdict.monitors))
    return behind


def _first_failure(root: RootCause, ended_by: str | None) -> Classification:
    """The first rank failed without a line of its own; its peers only lost contact with it."""
    where = f" on {root.host}" if root.host else ""
    if root.killed_by is not None:
        signal = signal_name(root.killed_by) or f"signal {root.killed_by}"
        return _make("killed", "launcher", f"{root.label}{where} was killed by {signal} (the launcher's "
                     f"report, exit code {root.exit_code}); {root.peers_line()}",
                     signals=[root.signal, *root.consequences], signal=signal)
    return _make("unknown", "launcher", f"{root.label}{where} exited with code {root.exit_code} first (the "
                 f"launcher's report) and no line of its own explains it; {root.peers_line()}",
                 severity="error", signals=[root.signal, *root.consequences], signal=ended_by)
