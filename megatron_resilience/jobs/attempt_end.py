"""One Slurm attempt ended: classify it, decide, and build its ledger record (shared by the trap and the watcher).

Acting on the decision (``scontrol requeue`` from inside the job, ``sbatch`` from the watcher) is
the caller's job; this module only reads files and Slurm, and returns what to record.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs import (
    attribution,
    finished,
    preemption_margin,
    requeue_size,
    shared_node_history,
    slurm,
)
from megatron_resilience.jobs import evidence as ev
from megatron_resilience.jobs.classifier import AttemptEvidence, Classification, classify
from megatron_resilience.jobs.decision import Cluster, Decision, decide, decide_like_nemo_run, decide_monitor_only
from megatron_resilience.jobs.jobconfig import JobLevelConfig
from megatron_resilience.jobs.node_exclusion import lookback_of
from megatron_resilience.records import megatron_log
from megatron_resilience.records.ledger import Ledger


@dataclass
class Ending:
    classification: Classification
    decision: Decision
    record: dict[str, Any]


def attempt_start(ledger: Ledger, job_id: str, restart: int) -> dict[str, Any] | None:
    starts = [r for r in ledger.records("attempt_start")
              if str(r.get("job_id")) == str(job_id) and int(r.get("slurm_restart") or 0) == int(restart)]
    return starts[-1] if starts else None


def chain_history(ledger: Ledger) -> list[dict[str, Any]]:
    """The attempt records of the current chain (a finished chain's successor starts after its final record)."""
    history: list[dict[str, Any]] = []
    for rec in ledger.records():
        if rec.get("kind") == "attempt":
            history.append(rec)
        elif rec.get("kind") == "final" and rec.get("outcome") != "resumed":
            history = []
    return history


def _step_states(job_id: str, exit_code: int | None, start: dict[str, Any]) -> list:
    """Slurm's verdict on the attempt's failed job steps (none asked for when the step exited 0, or when the attempt
    has no job name on record to tell this job from another with its id)."""
    if exit_code == 0 or not start.get("job_name"):
        return []
    return ev.step_state_signals(slurm.sacct_steps(job_id, str(start["job_name"])), since=start.get("time"))


def _stop_record(path: str, start: dict[str, Any], files: ev.AttemptFiles, by: str) -> dict[str, Any] | None:
    """The trainer's ``stop_reason.json`` when this attempt's last in-job cycle wrote it, else None.

    The file outlives the process that wrote it. A rank of an earlier cycle that got the launcher's teardown SIGTERM
    recorded "stopped on a signal"; when the last cycle's ranks died before writing one of their own (an Xid in
    setup), that stale record read as the attempt's ending, a free preemption, and the node's failure went
    uncounted (found twice by the long chaos run). The watcher also drops an earlier attempt's file."""
    record = ev.read_json(path)
    if record is None:
        return None
    written = os.path.getmtime(path)
    if by == "watcher" and start.get("time") and written < float(start["time"]):
        return None  # an earlier attempt's
    last_cycle = files.launcher[-1].started if len(files.launcher) > 1 else None
    if last_cycle is not None and written < last_cycle:
        return None  # an earlier in-job cycle's
    return record


def end_attempt(cfg: JobLevelConfig, ledger: Ledger, *, job_id: str, restart: int, exit_code: int | None,
                slurm_state: str | None, by: str, nodes: list[str] | None = None, partition: str | None = None,
                retries: int = 0, end_time: float | None = None, cluster_info: Cluster | None = None,
                node_info: dict[str, dict[str, str]] | None = None, batch_signal: str | None = None) -> Ending:
    """Classify the attempt (job_id, restart), decide with the config's policy, and build its ledger record.

    ``node_info``: ``scontrol show node`` of the attempt's nodes (None: asked of Slurm when the attempt failed).
    ``batch_signal``: the signal the batch shell received while the step ran (``TERM``: the scheduler stopped the
    whole job — preemption, ``scancel --signal=TERM --full``), a preemption whatever the step's exit code says.
    """
    start = attempt_start(ledger, job_id, restart) or {}
    nodes = nodes if nodes is not None else [n for n in str(start.get("nodes") or "").split(",") if n]
    monitors = cfg.load_monitors()
    files = ev.scan_attempt(job_dir=cfg.job_dir, job_id=job_id, restart=restart, monitors=monitors,
                            batch_offset=int(start.get("batch_log_offset") or 0), cycle_info_dir=cfg.cycle_info_dir,
                            max_log_bytes=cfg.max_log_bytes)
    records = ev.read_metrics(cfg.metrics) or foreign_records(ledger, files.files)
    mine = ev.attempt_records(records, job_id=job_id, restart=restart, since=start.get("time"), until=end_time)
    progress = ev.progress(records, mine, cfg.checkpoint_dir)
    stop_reason = _stop_record(cfg.stop_reason, start, files, by)
    evidence = AttemptEvidence(exit_code=exit_code, stop_reason=stop_reason, slurm_state=slurm_state,
                               signals=files.last_cycle_signals() + ev.metrics_signals(mine)
                               + ev.batch_signal(batch_signal) + _step_states(job_id, exit_code, start),
                               no_restart_exit_code=cfg.no_restart_exit_code)
    cls = _finished_by_evidence(cfg, job_id, restart, exit_code) or classify(evidence)
    if cls.mode is not None or by == "watcher":  # a failure, or one the job could not record (host lost?)
        info = node_info if node_info is not None else slurm.node_details(nodes)
        attribute(cls, evidence.signals + attribution.node_state_signals(info), nodes, info)
    cycles = _cycles(files, progress, cfg, mine, nodes)
    history = chain_history(ledger)
    record: dict[str, Any] = {
        "kind": "attempt", "by": by, "attempt_index": len(history), "job_id": str(job_id), "slurm_restart": restart,
        "resubmission": int(start.get("resubmission") or 0), "nodes": nodes, "start": start.get("time"),
        "end": end_time or time.time(), "slurm_state": slurm_state, "exit_code": exit_code,
        "last_step": progress["last_step"], "resumed_from": progress["resumed_from"],
        "checkpoint_step": progress["checkpoint_step"], "recomputed_steps": progress["recomputed_steps"],
        "cycles": cycles, "log_files": files.files, "classification": cls.to_dict(),
        **requeue_size.attempt_sizes(mine),  # world size and DP of the attempt (and of each in-job cycle)
        **({"batch_signal": f"SIG{batch_signal}"} if batch_signal else {}),
    }
    if cfg.min_nodes is not None:
        record["min_nodes"] = cfg.min_nodes
    if cls.error_type == "preempted":
        record["preemption"] = preemption_margin.measure(stop_reason, mine, exit_time=record["end"],
                                                         preempt_time=cfg.preempt_time)
    policy = cfg.load_policy()
    if cfg.monitor_only:
        decision = decide_monitor_only(cls)
    elif policy is None:
        decision = decide_like_nemo_run(cls, history, retries=retries, ft=cfg.ft,
                                        finished_flag=os.path.exists(cfg.finished_flag))
    else:
        # sinfo for every decision: a requeue excludes the attempt's nodes the scheduler drained and lifts those it
        # shows usable again (node_exclusion.py)
        cluster = cluster_info or slurm.cluster(partition)
        decision = decide(cls, policy, history, record, cluster,
                          finished_flag=os.path.exists(cfg.finished_flag) if cfg.ft else None,
                          shared_blames=shared_blames(cfg, record))
        share(cfg, record, cluster)
    record["decision"] = decision.to_dict()
    record["policy"] = policy.name if policy else ("monitor_only" if cfg.monitor_only else "nemo_run")
    count = requeue_size.plan(cfg, record, decision, history, partition=partition)
    if count is not None:
        record["node_count"] = count
    return Ending(cls, decision, record)


def foreign_records(ledger: Ledger, files: list[str]) -> list[dict[str, Any]]:
    """A trainer that writes no ``metrics.jsonl`` (Megatron-LM, Megatron-Bridge): its records read from its own
    log lines (``records/megatron_log.py``), over the chain's step logs so far (earlier attempts' steps tell which
    of this one's were recomputed). [] for a log that is no such trainer's."""
    named = [p for a in ledger.attempts() for p in a.get("log_files") or []] + list(files)
    return megatron_log.records_from_logs([p for p in dict.fromkeys(named) if os.path.basename(p).startswith("log")
                                           and os.path.exists(p)])


def attribute(cls: Classification, signals: list, nodes: list[str], info: dict[str, dict[str, str]]) -> None:
    """Record on ``cls`` every host the evidence names and the node(s) it blames (jobs/attribution.py)."""
    found = attribution.mentions(signals, nodes, {n: i.get("addr", "") for n, i in info.items()})
    cls.hosts, cls.attribution = attribution.suspects(found, nodes)
    cls.host_evidence = [m.to_dict() for m in found]


def _finished_by_evidence(cfg: JobLevelConfig, job_id: str, restart: int, exit_code: int | None) \
        -> Classification | None:
    """A run that finished without touching the finished flag (Megatron-LM, Bridge, NeMo without its FT callback):
    the flag is touched for it (so nemo_run's template, the fallback and the watcher agree) and the attempt is
    classified finished from its checkpoint or its end-of-training line (``jobs/finished.py``)."""
    if os.path.exists(cfg.finished_flag) or (ev.read_json(cfg.stop_reason) or {}).get("finished") is True:
        return None  # the trainer said so itself: the classifier and the decisions read its own record
    done = finished.detect_for_attempt(checkpoint_dir=cfg.checkpoint_dir, train_iters=cfg.train_iters,
                                       exit_code=exit_code, job_dir=cfg.job_dir, job_id=str(job_id), restart=restart,
                                       max_log_bytes=cfg.max_log_bytes)
    if done is None:
        return None
    touched = finished.mark_finished(cfg.finished_flag)
    kind = taxonomy.BY_NAME["finished"]
    return Classification(error_type="finished", subsystem=kind.subsystem, severity="info", mode=None,
                          source=done.source, reason=done.reason + ("" if touched else
                                                                    f" (could not touch {cfg.finished_flag})"),
                          evidence=[done.evidence] if done.evidence else [],
                          fields={"step": str(done.step)} if done.step is not None else {})


def shared_blames(cfg: JobLevelConfig, record: dict[str, Any]) -> list[tuple[str, float | None]]:
    """Other runs' hardware attributions from the shared node-history folder (none without one)."""
    if not cfg.node_history_dir:
        return []
    return shared_node_history.others(cfg.node_history_dir, cfg.ledger, record.get("end") or time.time(),
                                      lookback_s=lookback_of(cfg.load_policy()))


def share(cfg: JobLevelConfig, record: dict[str, Any], cluster: Cluster) -> None:
    """Publish this attempt's hardware attributions to the shared folder; the record says when that failed."""
    if cfg.node_history_dir:
        trouble = shared_node_history.publish(cfg.node_history_dir, cfg.ledger, record, cluster)
        if trouble:
            record["node_history_not_shared"] = trouble


def _cycle_ends(mine: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The trainer's own ``end`` record of each cycle (None for a cycle that never wrote one: killed, hung)."""
    out: list[dict[str, Any] | None] = []
    for rec in mine:
        if rec.get("kind") == "start":
            out.append(None)
        elif rec.get("kind") == "end" and out:
            out[-1] = {"reason": rec.get("reason"), "exit_code": rec.get("exit_code"), "step": rec.get("step")}
    return out


def _cycles(files: ev.AttemptFiles, progress: dict[str, Any], cfg: JobLevelConfig,
            mine: list[dict[str, Any]] = (), nodes: list[str] = ()) -> list[dict[str, Any]]:
    """One entry per in-job cycle: when it started, how it ended (earlier cycles) and where it resumed.

    A cycle is a (re)start of the training function: the launcher's (ft_launcher/torchrun restarting the worker
    group: a new ``restart_count`` in its log) and, with in-process restart, the wrapper's (a new call in the same
    processes: the trainer's ``start`` record says which, ``attempt.inprocess_restart``; the launcher's log knows
    nothing of it). A launcher cycle whose workers died before the trainer's ``start`` record (a fault during their
    setup) is a cycle too (``trainer_started: false``, started when the launcher's rendezvous did). An earlier
    cycle's ending is classified from its own launcher cycle's lines and, when the trainer wrote one, its ``end``
    record (e.g. ``rerun:16``: Megatron's rerun state machine asked to resume elsewhere, and ft_launcher restarted
    it), with the time the launcher noticed it (``ended.time``); one an in-process restart ended says so
    (``ended.inprocess``) and leaves the cause to that restart's own record. A failure names the node(s) its lines
    blame (``hosts``), by the attempt's rules: the report's per-node table counts it, though no job-level decision
    followed it."""
    ends = _cycle_ends(list(mine))
    trainer = progress["cycles"]
    pairs = _pairs(trainer, files.launcher, len(files.cycle_info))
    out = []
    for k, (t, at) in enumerate(pairs):
        entry: dict[str, Any] = {"cycle": k}
        launcher = files.launcher[at] if at is not None and at < len(files.launcher) else None
        if t is not None:
            entry.update(trainer[t])
        elif launcher is not None:
            entry.update({"start_time": launcher.started, "in_job_restart": launcher.count})
            if trainer:  # the trainer writes start records, but its workers died before this one's
                entry["trainer_started"] = False
        if at is not None and at < len(files.cycle_info):
            info = files.cycle_info[at]
            entry.update({"cycle_info": {key: info.get(key) for key in (
                "cycle_number", "cycle_start_time", "cycle_end_time", "active_nodes", "cycle_log_file")}})
        if at is not None and k + 1 < len(pairs) and pairs[k + 1][1] == at:
            entry["ended"] = {"inprocess": True, "reason": "in-process restart (its cause: the inprocess_restart "
                                                             "record)", "evidence": []}
        elif at is not None and at < len(files.cycles) - 1:  # an earlier launcher cycle ended in a restart: why?
            sigs = files.cycles[at]
            end = ends[t] if t is not None and t < len(ends) else None
            c = classify(AttemptEvidence(exit_code=None, signals=sigs, no_restart_exit_code=cfg.no_restart_exit_code,
                                         stop_reason=end if end and str(end.get("reason", "")).startswith("rerun:")
                                         else None))
            entry["ended"] = {"error_type": c.error_type, "reason": c.reason, "evidence": c.evidence[:2],
                              "time": launcher.noticed if launcher is not None else None}
            if c.mode is not None:
                attribute(c, sigs, list(nodes), {})
                entry["ended"]["hosts"] = c.hosts
        out.append(entry)
    return out


def _pairs(trainer: list[dict[str, Any]], launcher: list[ev.LauncherCycle], infos: int = 0) \
        -> list[tuple[int | None, int | None]]:
    """(trainer cycle, launcher cycle) of each in-job cycle, in order (None: there is none).

    The trainer's ``start`` records name their launcher cycle (``in_job_restart``: the workers'
    ``TORCHELASTIC_RESTART_COUNT``, the count the launcher printed); a launcher cycle no record names died in its
    setup, and one with several records had in-process restarts. Pairing by position instead gave every cycle after
    such a one the evidence of the cycle before it. Cycles before the log's first mark (a log cut at
    ``max_log_bytes``) have no launcher lines. Records without the count (another trainer) or with counts the log
    does not show pair by position, as before, over the launcher's cycles or the ``infos`` cycle-info files."""
    counts = [c.get("in_job_restart") for c in trainer]
    where = {c.count: j for j, c in enumerate(launcher)}
    if trainer and all(isinstance(n, int) for n in counts) and counts == sorted(counts):
        cut = [n for n in counts if launcher and n < launcher[0].count]  # cycles before the log's first mark
        if all(n in where for n in counts[len(cut):]):
            out: list[tuple[int | None, int | None]] = [(t, None) for t in range(len(cut))]
            for j, cycle in enumerate(launcher):
                out += [(t, j) for t, n in enumerate(counts) if n == cycle.count] or [(None, j)]
            return out
    known = max(len(launcher), infos)
    return [(k if k < len(trainer) else None, k if k < known else None) for k in range(max(known, len(trainer), 1))]
