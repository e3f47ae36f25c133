"""The batch script's EXIT trap: classify this attempt, decide, record, act; print the script's exit code.

    python -m megatron_resilience.jobs.batch_exit --config JOB_LEVEL_JSON --exit-code N [--nemo-run-retries R]
        [--batch-signal TERM]

Runs inside the job (no torch; imports in well under a second). The sbatch block (see
``megatron_resilience.plugins.batch_decision``) reads the last line, ``megatron_resilience: batch
exit code N``, and ends the script with it; when this program fails or prints no such line, the
block falls back to nemo_run's own decision and says so. SIGTERM is ignored while it runs: our own
``scontrol requeue`` makes Slurm signal the job at once, and the record and the node exclusion
must still be written (Slurm's SIGKILL follows only after ``KillWait``). An attempt Slurm already
requeued itself (a node failure) is left to the watcher, which records it from Slurm's record.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from megatron_resilience.jobs import requeue_size, slurm
from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.jobconfig import JobLevelConfig
from megatron_resilience.records.ledger import Ledger

PREFIX = "megatron_resilience:"


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m megatron_resilience.jobs.batch_exit")
    parser.add_argument("--config", required=True)
    parser.add_argument("--exit-code", type=int, required=True, help="the job step's exit code")
    parser.add_argument("--nemo-run-retries", type=int, default=0, help="TORCHX_MAX_RETRIES as nemo_run set it")
    parser.add_argument("--batch-signal", default="", help="a signal the batch shell received (TERM, ...), if any")
    args = parser.parse_args(argv)

    cfg = JobLevelConfig.read(args.config)
    ledger = Ledger(cfg.ledger)
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    info = slurm.show_job(job_id)
    state = (info.get("JobState") or "").split()[0] or None
    now = info.get("Restarts", "")
    if now.isdigit() and int(now) > restart:
        # Slurm requeued the job itself while this shell ran (a node of it failed: NODE_FAIL), or someone else
        # did: the decision is taken, and Slurm may SIGKILL this shell any moment (KillWait). The watcher records
        # the attempt from Slurm's record, once (as when the batch host itself is lost).
        print(f"{PREFIX} job {job_id} was requeued by Slurm or the watcher (now {state}, restart {now}) while "
              f"restart {restart} ended: not recorded here; the watcher records it from Slurm's record", flush=True)
        return _finish(args.exit_code)
    ending = end_attempt(cfg, ledger, job_id=job_id, restart=restart, exit_code=args.exit_code, slurm_state=state,
                         by="batch", partition=os.environ.get("SLURM_JOB_PARTITION") or info.get("Partition"),
                         retries=args.nemo_run_retries, batch_signal=args.batch_signal or None)
    cls, decision = ending.classification, ending.decision
    ledger.append(ending.record)
    print(f"{PREFIX} attempt {ending.record['attempt_index']} (job {job_id}, restart {restart}) ended: "
          f"{cls.error_type} [{cls.source}] {cls.reason}", flush=True)
    for line in cls.evidence[:3]:
        print(f"{PREFIX}   evidence: {line[:300]}", flush=True)
    print(f"{PREFIX} decision ({ending.record['policy']}): {decision.message()}", flush=True)

    code = args.exit_code
    if decision.action == "requeue" and cls.error_type == "preempted" and cfg.ft:
        _preemption_is_not_a_failure(cfg, job_id, restart)
    if decision.action == "requeue":
        ok, output = ledger.perform("requeue", ["scontrol", "requeue", job_id], by="batch", job_id=job_id)
        if not ok:
            message = (f"scontrol requeue {job_id} failed ({output}); the chain is not continued by this job "
                       f"(a running watcher resubmits it)")
            print(f"{PREFIX} {message}", flush=True)
            return _finish(code or 1)
        if decision.exclude_applied or decision.exclude_lifted:  # the job's whole list (empty: every one lifted)
            nodes = ",".join(decision.exclude_applied)
            command = ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={nodes}"]
            ok, output = ledger.perform("exclude_nodes", command, by="batch", job_id=job_id,
                                        nodes=decision.exclude_applied)
            print(f"{PREFIX} ExcNodeList={','.join(decision.exclude_applied)}: "
                  f"{'set' if ok else 'NOT set: ' + output}", flush=True)
        resized = requeue_size.carry_out(ledger, ending.record, job_id, by="batch")
        if resized:
            print(f"{PREFIX} {resized}", flush=True)
        return _finish(code)
    if decision.action == "record":  # monitor-only: recorded; the job ends as it ended, nothing requeues it
        message = (f"monitor-only: attempt {ending.record['attempt_index']} ended {cls.error_type} ({cls.reason}); "
                   "recorded, not requeued (no restart policy)")
        ledger.append({"kind": "final", "outcome": decision.outcome, "message": message, "job_id": job_id,
                       "attempts": ending.record["attempt_index"] + 1, "by": "batch"})
        print(f"{PREFIX} {message}", flush=True)
        return _finish(code)
    if decision.action == "stop":
        message = _final_message(cls, decision, ending.record)
        ledger.append({"kind": "final", "outcome": decision.outcome, "message": message, "job_id": job_id,
                       "attempts": ending.record["attempt_index"] + 1, "by": "batch"})
        with open(cfg.stop_marker, "w", encoding="utf-8") as f:
            f.write(message + "\n")
        print(f"{PREFIX} {message}", flush=True)
        if decision.outcome in ("finished", "cancelled"):
            return _finish(0 if decision.outcome == "finished" else code)
        return _finish(code or 1)
    return _finish(code)


def _preemption_is_not_a_failure(cfg: JobLevelConfig, job_id: str, restart: int) -> None:
    """nemo_run's FT template marked a preempted attempt F when the launcher exited non-zero (a rank the signal
    reached before its handler, torchrun after forwarding it): mark it S, so that nemo_run's own failure count
    (the fallback's rule) never spends a retry on a preemption either."""
    try:
        with open(cfg.nemo_run_results, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return
    failed = f"{job_id} {restart} F"
    if failed not in lines:
        return
    fixed = "".join(f"{job_id} {restart} S\n" if line == failed else f"{line}\n" for line in lines)
    tmp = f"{cfg.nemo_run_results}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(fixed)
    os.replace(tmp, cfg.nemo_run_results)
    print(f"{PREFIX} {os.path.basename(cfg.nemo_run_results)}: restart {restart} recorded as S, not F "
          f"(a preemption is not a failure)", flush=True)


def _final_message(cls, decision, record) -> str:
    n = record["attempt_index"] + 1
    if decision.outcome == "finished":
        return f"training finished after {n} attempt(s)"
    return (f"NOT restarted after {n} attempt(s): {decision.reason} (last ending: {cls.error_type}, "
            f"last step {record.get('last_step')}, newest checkpoint {record.get('checkpoint_step')})")


def _finish(code: int) -> int:
    code = code if 0 <= code <= 255 else 1
    print(f"{PREFIX} batch exit code {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
