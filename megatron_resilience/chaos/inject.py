"""One injection into one running Slurm job: the commands, and what happened, for the chaos ledger.

Only the given job is touched: rank faults run as a step inside its own allocation (``srun --jobid
--overlap``), ``preempt`` signals its steps (``scancel --signal``), ``node_down`` takes a node of the job
out only when no other job runs there, ``nan`` writes a trigger file in the run's own directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from megatron_resilience.chaos.faults import FaultKind
from megatron_resilience.jobs import slurm
from megatron_resilience.records.names import METRICS_FILE

NAN_TRIGGER = "chaos_nan.json"  # in the run directory; read by the trainer with rerun.accept_chaos_nan=true
HELPER_ENV = "MEGATRON_RESILIENCE_CHAOS_HELPER"


def _run(command: list[str], timeout: float = 120.0) -> tuple[bool, str]:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"{type(err).__name__}: {err}"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def other_jobs_on(node: str, job: str) -> list[str]:
    ok, out = _run(["squeue", "-h", "-w", node, "-o", "%i"])
    return [j for j in out.split() if j != str(job)] if ok else ["(squeue failed)"]


def inject(spec: FaultKind, *, job: str, restart: int, nodes: list[str], node: str, seed: int, run_dir: str,
           rank: int | None = None, python: str = sys.executable) -> dict[str, Any]:
    """Inject ``spec`` into ``job``; returns the ledger fields (``ok``, ``time`` of the fault, target, output)."""
    out: dict[str, Any] = {"node": node}
    if spec.where == "rank":
        command = ["srun", f"--jobid={job}", "--overlap", "-N1", "-n1", f"--nodelist={node}", "--quiet",
                   f"--export=ALL,{HELPER_ENV}=1", python, "-m", "megatron_resilience.chaos.on_node",
                   f"--job={job}", f"--kind={spec.name}", f"--node={node}", f"--seed={seed}"]
        if rank is not None:
            command.append(f"--rank={rank}")
        ok, text = _run(command)
        result = {}
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                try:
                    result = json.loads(line)
                    break
                except ValueError:
                    continue
        out.update({k: v for k, v in result.items() if k != "ok"})
        out.update(ok=ok and bool(result.get("ok")), command=command, output=text[-1000:])
        out.setdefault("time", time.time())
    elif spec.where == "job":
        out["time"] = time.time()
        command = ["scancel", "--signal=TERM", str(job)]
        ok, text = _run(command)
        out.update(ok=ok, command=command, output=text[-1000:])
    elif spec.where == "node":
        others = other_jobs_on(node, job)
        if others:
            return {**out, "ok": False, "time": time.time(), "why": f"other jobs run on {node}: {others}; "
                    "a node is taken down only under the job it was given"}
        out["time"] = time.time()
        outputs = []
        for state in ("DRAIN", "DOWN"):  # drained first, so that it stays out until chaos resumes it
            command = ["scontrol", "update", f"NodeName={node}", f"State={state}", f"Reason=chaos-{spec.name}"]
            ok, text = _run(command)
            outputs.append(f"{' '.join(command)}: {'ok' if ok else text}")
            if not ok:
                break
        out.update(ok=ok, output="; ".join(outputs)[-1000:])
    elif spec.where == "trainer":
        trigger = {"job_id": str(job), "slurm_restart": int(restart), "in_job_restart": in_job_restart(run_dir),
                   "rank": 0 if rank is None else rank, "node": node, "time": time.time()}
        path = os.path.join(run_dir, NAN_TRIGGER)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(trigger, f)
        os.replace(path + ".tmp", path)
        out.update(ok=True, time=trigger["time"], rank=trigger["rank"], trigger=path)
    else:
        raise ValueError(f"fault {spec.name}: unknown place {spec.where!r}")
    return out


def in_job_restart(run_dir: str) -> int:
    """The launcher's restart count of the trainer running now (its newest ``start`` record)."""
    from megatron_resilience.jobs.evidence import read_metrics

    starts = [r for r in read_metrics(os.path.join(run_dir, METRICS_FILE)) if r.get("kind") == "start"]
    attempt = (starts[-1].get("attempt") or {}) if starts else {}
    return int(attempt.get("in_job_restart") or 0) if isinstance(attempt, dict) else 0


def resume_node(node: str) -> tuple[bool, str]:
    return _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def job_nodes(job: str) -> tuple[str | None, int, list[str]]:
    """(state, restart count, nodes) of the job now."""
    st = slurm.job_state(job)
    return st.get("state"), int(st.get("restarts") or 0), list(st.get("nodes") or [])
