"""The run's ledger: one JSON line per event of the chain of attempts, appended atomically next to the run.

``<run_dir>/job_ledger.jsonl`` is written by the batch script (at the start of each attempt, and its
EXIT trap's decision at the end) and by the watcher (what the job could not see about itself). Kinds:

- ``attempt_start``: job id, Slurm restart count, resubmission number, nodes, time, sbatch log offset;
- ``attempt``: how one Slurm attempt ended — exit code, Slurm state, the classification with its
  evidence lines, the decision with the budget left, last step, checkpoint resumed from and reached,
  steps recomputed, the in-job restart cycles (from ft_launcher's cycle-info files or the trainer's
  ``start`` records), the attempt's log files; for a preemption, whether the save at the signal finished
  and the margin left before Slurm's kill (``preemption``, see ``preemption_margin.py``);
- ``intent`` / ``outcome``: the write-ahead pair around every ``sbatch``/``scancel``/``scontrol``: the
  intent is on disk before the command runs, so a watcher killed in between finds it on restart
  and reconciles with Slurm instead of acting twice;
- ``final``: the chain ended (finished, stopped, budget exhausted, cancelled) and why, in one line;
- ``slurm``: the scheduler's record of an attempt, filled in later by the watcher (``sacct``).

Each record is one ``write()`` of one line to a file opened with ``O_APPEND`` (never interleaved),
under an advisory lock when the filesystem offers one. Readers skip a torn last line and keep
records and fields they do not know.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
import uuid
from typing import Any

from megatron_resilience.records.jsonl import read_jsonl
from megatron_resilience.records.names import CHAOS_LEDGER_FILE, LEDGER_FILE  # noqa: F401 (read from here too)

VERSION = 1


class Ledger:
    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def in_run_dir(cls, run_dir: str) -> Ledger:
        return cls(os.path.join(run_dir, LEDGER_FILE))

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        record = {"v": VERSION, **record}
        record.setdefault("time", time.time())
        data = (json.dumps(record, default=str) + "\n").encode()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # no locks on this filesystem: O_APPEND alone keeps lines whole
                pass
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return record

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_jsonl(self.path, kind)  # a torn line (writer killed mid-write) is skipped

    def current_job(self, default: str | None = None) -> str | None:
        """The run's current Slurm job: the newest attempt's, or the watcher's newest resubmission."""
        job = default
        for rec in self.records():
            if rec.get("kind") == "attempt_start":
                job = str(rec.get("job_id"))
            elif rec.get("kind") == "outcome" and rec.get("action") == "sbatch" and rec.get("new_job_id"):
                job = str(rec["new_job_id"])
        return job

    def attempts(self) -> list[dict[str, Any]]:
        return self.records("attempt")

    def final(self) -> dict[str, Any] | None:
        finals = self.records("final")
        return finals[-1] if finals else None

    def pending_intents(self) -> list[dict[str, Any]]:
        """Intents whose command's outcome was never recorded (the writer died in between)."""
        done = {r.get("intent") for r in self.records("outcome")}
        return [r for r in self.records("intent") if r.get("id") not in done]

    def perform(self, action: str, command: list[str], *, by: str, timeout: float = 60.0,
                **details: Any) -> tuple[bool, str]:
        """Write-ahead: record the intent, run ``command``, record the outcome. Returns (ok, output)."""
        intent = self.append({"kind": "intent", "id": uuid.uuid4().hex[:12], "action": action,
                              "command": command, "by": by, **details})
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            ok, output = proc.returncode == 0, (proc.stdout + proc.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            ok, output = False, f"{type(err).__name__}: {err}"
        self.append({"kind": "outcome", "intent": intent["id"], "action": action, "ok": ok, "output": output[-2000:],
                     "by": by})
        return ok, output
