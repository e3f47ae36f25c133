"""The watcher: what a job cannot see about itself, decided with the same classifier, policy and ledger.

    python -m megatron_resilience.watch RUN_DIR [--job-id ID] [--interval 30] [--once]
    nemo megatron_resilience watch RUN_DIR

Runs on the login node while the chain of attempts goes on. Each poll:

* an attempt that ended without its batch script's decision (NODE_FAIL, the batch host lost, the
  batch shell killed) is classified from Slurm's record and the logs and decided by the policy:
  Slurm already requeued it (``--requeue`` jobs after a node failure) -> only the node exclusion is
  applied; otherwise ``scontrol requeue``, and when Slurm refuses (the job is gone or cannot be
  requeued) a resubmission of the same sbatch script (``sbatch --exclude=...``), marked as the
  chain's next attempt (``MEGATRON_RESILIENCE_RESUBMISSION``);
* a decision to requeue that Slurm did not carry out (the job ended anyway) -> resubmission;
* the trainer reported finished but the job still runs after ``finished_grace_seconds`` -> scancel;
* no log or metrics progress for ``inactivity_threshold`` seconds while FT is off -> a stall, decided
  like any other failure (requeue or scancel);
* a job pending on an exclusion that can never be satisfied (``BadConstraints``) -> the exclusion is
  dropped and recorded.

Safe to kill at any moment and to start twice: one lock per run (a second watcher exits at once),
a write-ahead ledger record before every ``sbatch``/``scancel``/``scontrol``, and on start a
reconciliation of intents without outcome against Slurm by job name and output directory (a
submission that happened is adopted, one that did not is recorded as not done and decided again).
A person's ``scancel`` is never undone; a live job of the run is never submitted twice.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from typing import Any

from megatron_resilience.jobs import requeue_size, slurm
from megatron_resilience.jobs.attempt_end import Ending, attempt_start, end_attempt
from megatron_resilience.jobs.classifier import Classification
from megatron_resilience.jobs.jobconfig import JobLevelConfig
from megatron_resilience.records.ledger import Ledger

LOCK_FILE = ".job_level_watch.lock"
RESUBMISSION_ENV = "MEGATRON_RESILIENCE_RESUBMISSION"
IMPOSSIBLE_PENDING = ("BadConstraints", "PartitionNodeLimit", "PartitionConfig", "ReqNodeNotAvail, May be reserved "
                      "for other job")


class WatcherBusy(RuntimeError):
    pass


def log(message: str) -> None:
    print(f"megatron_resilience watch: {message}", flush=True)


class Watcher:
    def __init__(self, cfg: JobLevelConfig, *, job_id: str | None = None) -> None:
        self.cfg = cfg
        self.ledger = Ledger(cfg.ledger)
        self.job_id = job_id
        self.partition: str | None = None  # learned from Slurm's record of the job
        self._lock_fd: int | None = None

    # --- lock and reconciliation ---------------------------------------------------------------------------------
    def lock(self) -> None:
        path = os.path.join(os.path.dirname(os.path.abspath(self.cfg.ledger)), LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            raise WatcherBusy(f"another watcher ({other or 'pid unknown'}) holds {path}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {os.uname()[1]}".encode())
        self._lock_fd = fd  # released by the kernel when this process dies, however it dies

    def job_name(self) -> str | None:
        names = [r.get("job_name") for r in self.ledger.records("attempt_start") if r.get("job_name")]
        return names[-1] if names else None

    def current_job(self) -> str | None:
        return self.ledger.current_job(self.job_id)

    def live_jobs(self) -> list[dict[str, str]]:
        name = self.job_name()
        return slurm.live_jobs_named(name, stdout_dir=self.cfg.job_dir) if name else []

    def reconcile(self) -> None:
        """Intents a killed watcher (or trap) left without an outcome: find out from Slurm what happened."""
        for intent in self.ledger.pending_intents():
            action = intent.get("action")
            if action == "sbatch":
                live = self.live_jobs()
                if live:
                    new = live[-1]["job_id"]
                    self.ledger.append({"kind": "outcome", "intent": intent["id"], "action": "sbatch", "ok": True,
                                        "new_job_id": new, "output": f"adopted live job {new} on restart",
                                        "by": "watcher"})
                    log(f"reconciled: the interrupted submission did happen: adopted job {new}")
                else:
                    self.ledger.append({"kind": "outcome", "intent": intent["id"], "action": "sbatch", "ok": False,
                                        "output": "not submitted (the submitter stopped before sbatch); "
                                                  "decided again", "by": "watcher"})
                    log("reconciled: the interrupted submission never happened; deciding again")
            else:
                state = slurm.job_state(str(intent.get("job_id"))) if intent.get("job_id") else {}
                self.ledger.append({"kind": "outcome", "intent": intent["id"], "action": action, "ok": None,
                                    "output": f"outcome unknown (the writer stopped); job now {state.get('state')}",
                                    "by": "watcher"})

    # --- one poll --------------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One look at the chain; True when it has ended (final record)."""
        if self.ledger.final() is not None and not self.live_jobs():
            return True
        job = self.current_job()
        if job is None:
            log("no job of this run known yet (no attempt started; pass --job-id)")
            return False
        st = slurm.job_state(job)
        self.partition = st.get("partition") or self.partition
        if not st:
            return self._ended(job, restart=self._restarts_known(job), state="VANISHED", exit_code=None, nodes=None)
        self._catch_up_requeued(job, st)
        if st["state"] == "RUNNING":
            return self._check_running(job, st)
        if st["state"] in ("PENDING", "REQUEUED", "REQUEUE_HOLD"):
            self._check_pending(job, st)
            return False
        if st["state"] in slurm.TERMINAL:
            return self._terminal(job, st)
        return False

    def _restarts_known(self, job: str) -> int:
        known = [int(r.get("slurm_restart") or 0) for r in self.ledger.records("attempt_start")
                 if str(r.get("job_id")) == job]
        return max(known, default=0)

    def _recorded(self, job: str, restart: int) -> dict[str, Any] | None:
        found = [a for a in self.ledger.attempts() if str(a.get("job_id")) == job
                 and int(a.get("slurm_restart") or 0) == restart]
        return found[-1] if found else None

    def _catch_up_requeued(self, job: str, st: dict[str, Any]) -> None:
        """Slurm requeued the job itself (node failure) and the batch script recorded nothing: record it now."""
        runs = slurm.sacct_runs(job)
        for restart in range(min(int(st.get("restarts") or 0), len(runs))):
            run = runs[restart]
            state = run["State"].split()[0]
            if state in slurm.LIVE and not state.startswith("REQUEUE"):
                continue  # accounting does not show how this run ended yet (e.g. RUNNING): the next poll
            if self._recorded(job, restart) is None and attempt_start(self.ledger, job, restart) is not None:
                ending = self._end(job, restart, state, _exit_code(run["ExitCode"]),
                                   slurm.expand_nodes(run.get("NodeList")))
                self._carry_out(job, ending, already_requeued=True)

    def _terminal(self, job: str, st: dict[str, Any]) -> bool:
        restart = int(st.get("restarts") or 0)
        recorded = self._recorded(job, restart)
        if recorded is None:
            return self._ended(job, restart=restart, state=st["state"], exit_code=_exit_code(st.get("exit_code")),
                               nodes=st.get("nodes"))
        decision = recorded.get("decision") or {}
        if decision.get("action") == "requeue":  # decided, but Slurm did not requeue it (or it was purged)
            log(f"job {job} was to be requeued but is {st['state']}: resubmitting")
            self._resubmit(decision.get("exclude_applied") or [], recorded.get("node_count"))
            return False
        return self._finish_chain(recorded)

    def _ended(self, job: str, *, restart: int, state: str, exit_code: int | None, nodes: list[str] | None) -> bool:
        ending = self._end(job, restart, state, exit_code, nodes)
        return self._carry_out(job, ending, already_requeued=False)

    def _end(self, job: str, restart: int, state: str, exit_code: int | None, nodes: list[str] | None) -> Ending:
        ending = end_attempt(self.cfg, self.ledger, job_id=job, restart=restart, exit_code=exit_code,
                             slurm_state=None if state == "VANISHED" else state, by="watcher", nodes=nodes or None,
                             partition=self.partition)
        cls = ending.classification
        if state != "COMPLETED" and (cls.error_type in ("killed", "unknown")
                                     or (cls.error_type == "finished" and cls.source == "exit_code")):
            # The batch script's EXIT trap never recorded this attempt: its shell (or its host) died.
            lost = Classification(error_type="batch_lost", subsystem="node", severity="fatal", mode="crash",
                                  source="slurm", reason=f"the batch script ended without recording a decision "
                                  f"(Slurm state {state}, exit {exit_code})", signal=cls.signal,
                                  evidence=cls.evidence, fields=cls.fields, hosts=cls.hosts,
                                  host_evidence=cls.host_evidence, attribution=cls.attribution)
            ending = self._redecide(ending, lost)
        log(f"job {job} restart {restart} ended ({state}): {ending.classification.error_type}: "
            f"{ending.decision.message()}")
        return ending

    def _redecide(self, ending: Ending, cls: Classification) -> Ending:
        from megatron_resilience.jobs.attempt_end import chain_history, share, shared_blames
        from megatron_resilience.jobs.decision import decide, decide_monitor_only

        policy = self.cfg.load_policy()
        if self.cfg.monitor_only:
            decision = decide_monitor_only(cls)
            return Ending(cls, decision, {**ending.record, "classification": cls.to_dict(),
                                          "decision": decision.to_dict()})
        if policy is None:
            return ending
        record = {**ending.record, "classification": cls.to_dict()}
        cluster = slurm.cluster(self.partition)
        decision = decide(cls, policy, chain_history(self.ledger), record, cluster,
                          shared_blames=shared_blames(self.cfg, record))
        share(self.cfg, record, cluster)
        record["decision"] = decision.to_dict()
        record.pop("node_count", None)
        count = requeue_size.plan(self.cfg, record, decision, chain_history(self.ledger), partition=self.partition)
        if count is not None:
            record["node_count"] = count
        return Ending(cls, decision, record)

    def _carry_out(self, job: str, ending: Ending, *, already_requeued: bool) -> bool:
        self.ledger.append(ending.record)
        decision = ending.decision
        if decision.action == "record":  # monitor-only: recorded; Slurm's own requeue (if any) goes on
            return False if already_requeued else self._finish_chain(ending.record)
        if decision.action == "requeue":
            if not already_requeued:
                ok, out = self.ledger.perform("requeue", ["scontrol", "requeue", job], by="watcher", job_id=job)
                if not ok:
                    log(f"scontrol requeue {job} refused ({out}): resubmitting")
                    self._resubmit(decision.exclude_applied, ending.record.get("node_count"))
                    return False
            if decision.exclude_applied or decision.exclude_lifted:  # the whole list (empty: every one lifted)
                nodes = ",".join(decision.exclude_applied)
                self.ledger.perform("exclude_nodes", ["scontrol", "update", f"JobId={job}", f"ExcNodeList={nodes}"],
                                    by="watcher", job_id=job, nodes=decision.exclude_applied)
            resized = requeue_size.carry_out(self.ledger, ending.record, job, by="watcher")
            if resized:
                log(f"job {job}: {resized}")
            return False
        if decision.action == "scancel":
            self.ledger.perform("scancel", ["scancel", job], by="watcher", job_id=job)
        elif already_requeued:  # Slurm requeued an attempt the policy would not continue
            self.ledger.perform("scancel", ["scancel", job], by="watcher", job_id=job)
        return self._finish_chain(ending.record)

    def _finish_chain(self, record: dict[str, Any]) -> bool:
        if self.ledger.final() is None:
            decision = record.get("decision") or {}
            cls = record.get("classification") or {}
            n = int(record.get("attempt_index") or 0) + 1
            message = (f"training finished after {n} attempt(s)" if decision.get("outcome") == "finished" else
                       f"NOT restarted after {n} attempt(s): {decision.get('reason')} (last ending: "
                       f"{cls.get('error_type')})")
            self.ledger.append({"kind": "final", "outcome": decision.get("outcome"), "message": message,
                                "job_id": record.get("job_id"), "attempts": n, "by": "watcher"})
            log(message)
        return True

    def _check_running(self, job: str, st: dict[str, Any]) -> bool:
        if self.cfg.monitor_only:
            return False  # nothing to act on: finished-but-alive and stalls are this package's actions
        stop = self.cfg.stop_reason
        start = attempt_start(self.ledger, job, int(st.get("restarts") or 0)) or {}
        if stop and os.path.exists(stop) and os.path.getmtime(stop) >= float(start.get("time") or 0):
            with open(stop, encoding="utf-8") as f:
                finished = json.load(f).get("finished") is True
            age = time.time() - os.path.getmtime(stop)
            if finished and age > self.cfg.finished_grace_seconds:
                record = {"kind": "attempt", "by": "watcher", "job_id": job, "slurm_restart": st.get("restarts"),
                          "slurm_state": "RUNNING", "classification": {"error_type": "finished_but_alive",
                          "mode": None, "source": "stop_reason", "reason": f"finished {age:.0f} s ago, still running"},
                          "decision": {"action": "scancel", "outcome": "finished", "final": True,
                                       "reason": "the trainer finished but the job's processes did not exit"}}
                self.ledger.append(record)
                self.ledger.perform("scancel", ["scancel", job], by="watcher", job_id=job)
                return self._finish_chain(record)
        if self.cfg.inactivity_threshold and not self.cfg.ft:
            paths = [p for p in [self.cfg.metrics, self.cfg.stop_reason]
                     + _step_logs(self.cfg, job, int(st.get("restarts") or 0)) if p]
            seen = max([os.path.getmtime(p) for p in paths if os.path.exists(p)] + [float(start.get("time") or 0)])
            if seen and time.time() - seen > self.cfg.inactivity_threshold:
                log(f"job {job}: no log or metrics progress for {time.time() - seen:.0f} s: a stall")
                self._stall(job, st, time.time() - seen)
        return False

    def _stall(self, job: str, st: dict[str, Any], idle: float) -> None:
        cls = Classification(error_type="hang", subsystem="launcher", severity="fatal", mode="stall", source="slurm",
                             reason=f"no log or metrics progress for {idle:.0f} s (inactivity_threshold)")
        ending = end_attempt(self.cfg, self.ledger, job_id=job, restart=int(st.get("restarts") or 0), exit_code=None,
                             slurm_state="RUNNING", by="watcher", nodes=st.get("nodes"))
        ending = self._redecide(ending, cls)
        if ending.decision.action == "requeue":
            self._carry_out(job, ending, already_requeued=False)
        else:
            self.ledger.append(ending.record)
            self.ledger.perform("scancel", ["scancel", job], by="watcher", job_id=job)
            self._finish_chain(ending.record)

    def _check_pending(self, job: str, st: dict[str, Any]) -> None:
        reason = st.get("reason") or ""
        ours = any(a.get("decision", {}).get("exclude_applied") for a in self.ledger.attempts()
                   if str(a.get("job_id")) == job)
        if ours and any(reason.startswith(r) for r in IMPOSSIBLE_PENDING) and st.get("exc_nodes") not in (None, "",
                                                                                                     "(null)"):
            log(f"job {job} pends ({reason}) on our exclusion {st.get('exc_nodes')}: dropping it")
            self.ledger.perform("exclude_nodes", ["scontrol", "update", f"JobId={job}", "ExcNodeList="],
                                by="watcher", job_id=job, nodes=[],
                                why=f"pending {reason}: the exclusion cannot be met")

    # --- resubmission ----------------------------------------------------------------------------------------------
    def _resubmit(self, exclude: list[str], node_count: dict[str, Any] | None = None) -> None:
        live = self.live_jobs()
        if live:
            log(f"not resubmitting: job {live[-1]['job_id']} of this run is live")
            return
        script = self.cfg.sbatch_script
        if not script or not os.path.exists(script):
            log(f"cannot resubmit: the sbatch script {script!r} does not exist")
            return
        n = 1 + sum(1 for r in self.ledger.records("outcome") if r.get("action") == "sbatch" and r.get("ok"))
        command = ["sbatch", "--parsable", "--requeue", f"--export=ALL,{RESUBMISSION_ENV}={n}"]
        if self.job_name():
            command.append(f"--job-name={self.job_name()}")
        if exclude:
            command.append(f"--exclude={','.join(exclude)}")
        if node_count:  # FaultTolerancePlugin.min_nodes: the nodes the partition can give now (jobs/requeue_size.py)
            command.append(f"--nodes={node_count['nodes']}")
        command.append(script)
        intent = self.ledger.append({"kind": "intent", "id": os.urandom(6).hex(), "action": "sbatch",
                                     "command": command, "by": "watcher", "resubmission": n})
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=os.path.dirname(script))
            ok, out = proc.returncode == 0, (proc.stdout + proc.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            ok, out = False, str(err)
        new = out.split(";")[0].strip() if ok else None
        self.ledger.append({"kind": "outcome", "intent": intent["id"], "action": "sbatch", "ok": ok,
                            "new_job_id": new, "output": out[-2000:], "by": "watcher"})
        log(f"resubmitted as job {new}" if ok else f"sbatch failed: {out}")


def _exit_code(text: Any) -> int | None:
    """sacct/scontrol ``code:signal`` -> a shell-style exit code (128 + signal when killed by one)."""
    if text is None:
        return None
    code, _, sig = str(text).partition(":")
    if sig.isdigit() and int(sig):
        return 128 + int(sig)
    return int(code) if code.isdigit() else None


def _step_logs(cfg: JobLevelConfig, job: str, restart: int) -> list[str]:
    from megatron_resilience.jobs.evidence import step_logs

    return step_logs(cfg.job_dir, job, restart)


def watch(cfg: JobLevelConfig, *, job_id: str | None, interval: float, once: bool) -> int:
    if cfg.policy is None and not cfg.monitor_only:
        log("this run has no restart policy (RestartPolicyPlugin): its batch script follows nemo_run's rule and "
            "there is nothing for a watcher to decide; `python -m megatron_resilience.report RUN_DIR` shows the chain")
        return 2
    if cfg.monitor_only:
        log("monitor-only (no restart policy): attempts the job could not record are classified and recorded; "
            "nothing is requeued, resubmitted or cancelled")
    watcher = Watcher(cfg, job_id=job_id)
    try:
        watcher.lock()
    except WatcherBusy as err:
        log(str(err))
        return 3
    watcher.reconcile()
    while True:
        if watcher.step():
            final = watcher.ledger.final() or {}
            log(f"the chain ended: {final.get('message', final.get('outcome'))}")
            return 0
        if once:
            return 0
        time.sleep(interval)
