"""The few Slurm commands the job-level room reads (scontrol, squeue, sacct, sinfo); all tolerate failure.

Reads only; commands that change anything (requeue, update, sbatch, scancel) go through
``Ledger.perform`` so the intent is on disk first.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

from megatron_resilience.jobs.attribution import expand_hostlist
from megatron_resilience.jobs.node_exclusion import Cluster

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
            "OUT_OF_MEMORY")
LIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING", "SUSPENDED",
        "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD")
UNUSABLE_NODE_STATES = ("down", "drain", "drained", "draining", "fail", "failing", "maint", "reboot", "unknown",
                        "not_responding", "future", "inval", "power_down", "powered_down")
# sinfo's state suffixes (man sinfo, NODE STATE CODES) and whether a node carrying one can take a job now
# (``usable_now``: a requeued attempt's node count) or ever (``usable_at_all``: may a node be excluded):
#   *  not responding: gets no new work, and becomes DOWN if it stays so          -> neither
#   $  in a reservation with the maintenance flag: not for this job               -> neither
#   ~  powered off (power saving): Slurm powers it up for the job that gets it   -> both (after a boot)
#   #  being powered up or configured                                            -> both
#   !  pending power down, %  being powered down: taken out of service           -> later (powers up again)
#   @  pending reboot, ^  reboot issued: back once rebooted                      -> later
#   -  planned by the backfill scheduler for a higher-priority job               -> later
NODE_FLAGS = "*~#!%$@^-"
NEVER_FLAGS = "*$"
NOT_NOW_FLAGS = "*$!%@^-"


def _run(cmd: list[str], timeout: float = 30.0) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol -o show job`` as a dict ({} once slurmctld forgot the job)."""
    out = _run(["scontrol", "-o", "show", "job", str(job_id)])
    if not out or "JobState=" not in out:
        return {}
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def expand_nodes(nodelist: str | None) -> list[str]:
    if not nodelist or nodelist in ("(null)", "None", "None assigned"):
        return []
    out = _run(["scontrol", "show", "hostnames", nodelist])
    return out.split() if out else expand_hostlist(nodelist)  # no scontrol (the watcher's host): expanded here


def parse_slurm_time(text: str | None) -> float | None:
    """``2026-11-25T07:31:48`` (sacct, local time) -> epoch seconds; None for Unknown/None/empty."""
    if not text or not text[:4].isdigit():
        return None
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def sacct_runs(job_id: str) -> list[dict[str, str]]:
    """Every run of the job (a requeue adds one), oldest first, from accounting."""
    fields = ["JobID", "State", "ExitCode", "Submit", "Start", "End", "NodeList", "Reason", "Partition", "JobName"]
    out = _run(["sacct", "-D", "-X", "-n", "-P", "-j", str(job_id), "-o", ",".join(fields)])
    if not out:
        return []
    return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]


def sacct_steps(job_id: str, job_name: str) -> list[dict[str, Any]]:
    """Every job step of every run of the job (``<id>.batch``, ``<id>.0``, ...; not ``extern``) with its start as
    epoch seconds (``start_time``), from accounting: Slurm's own verdict on each step (OUT_OF_MEMORY, NODE_FAIL, ...)
    while the job itself still reads RUNNING. [] unless the job under that id is named ``job_name`` (the same id
    on another cluster is another job)."""
    fields = ["JobID", "JobName", "State", "ExitCode", "Start", "End", "NodeList"]
    out = _run(["sacct", "-D", "-n", "-P", "-j", str(job_id), "-o", ",".join(fields)])
    rows = [dict(zip(fields, line.split("|"))) for line in (out or "").splitlines() if line.strip()]
    if not any(r["JobID"] == str(job_id) and r["JobName"] == job_name for r in rows):
        return []
    return [{**r, "start_time": parse_slurm_time(r["Start"])} for r in rows
            if r["JobID"].startswith(f"{job_id}.") and not r["JobID"].endswith(".extern")]


def job_state(job_id: str) -> dict[str, Any]:
    """State, restarts, exit code, nodes, reason: scontrol while slurmctld knows the job, else sacct."""
    info = show_job(job_id)
    if info:
        return {"state": info.get("JobState", "").split()[0], "restarts": int(info.get("Restarts", "0") or 0),
                "exit_code": info.get("ExitCode"), "nodes": expand_nodes(info.get("NodeList")),
                "reason": info.get("Reason"), "exc_nodes": info.get("ExcNodeList"),
                "job_name": info.get("JobName"), "stdout": info.get("StdOut"), "partition": info.get("Partition")}
    runs = sacct_runs(job_id)
    if not runs:
        return {}
    last = runs[-1]
    return {"state": last["State"].split()[0], "restarts": len(runs) - 1, "exit_code": last["ExitCode"],
            "nodes": expand_nodes(last.get("NodeList")), "reason": last.get("Reason"),
            "partition": last.get("Partition"), "cancelled_by":
            last["State"].split(" by ")[-1] if " by " in last["State"] else None}


def node_details(nodes: list[str]) -> dict[str, dict[str, str]]:
    """``scontrol show node``: state, reason (a down node's, e.g. "Not responding") and address of each node."""
    if not nodes:
        return {}
    out = _run(["scontrol", "-o", "show", "node", ",".join(nodes)]) or ""
    found = {}
    for line in out.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        if not name:
            continue
        state = re.search(r"\bState=(\S+)", line)
        addr = re.search(r"\bNodeAddr=(\S+)", line)
        reason = re.search(r"\bReason=(.*?)(?= [A-Z][A-Za-z]*=|$)", line)  # the reason may hold spaces
        found[name.group(1)] = {"state": state.group(1) if state else "", "addr": addr.group(1) if addr else "",
                                "reason": reason.group(1) if reason else ""}
    return found


def split_state(state: str) -> tuple[str, str]:
    """sinfo's ``%T`` -> (state, suffix flags), lower case: ``"IDLE*"`` -> ``("idle", "*")``."""
    text = state.strip().lower()
    base = text.rstrip(NODE_FLAGS)
    return base, text[len(base):]


def usable_at_all(state: str) -> bool:
    """May a node in ``state`` (with its flags) ever run the job: not down, drained, failing or not responding."""
    base, flags = split_state(state)
    return base not in UNUSABLE_NODE_STATES and not set(flags) & set(NEVER_FLAGS)


def usable_now(state: str) -> bool:
    """Can a node in ``state`` take the job as soon as it is free: no flag that keeps it from new work now."""
    return usable_at_all(state) and not set(split_state(state)[1]) & set(NOT_NOW_FLAGS)


def cluster(partition: str | None) -> Cluster:
    """The partition's nodes, their states and which of them cannot run a job (sinfo; see ``usable_at_all``);
    ``unread`` says why when sinfo gave no answer."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N|%T"] + (["-p", partition] if partition else [])
    out = _run(cmd)
    if out is None:
        return Cluster(partition=partition or "", unread=f"{' '.join(cmd)} failed or timed out")
    nodes, unusable, states = [], [], {}
    for line in out.splitlines():
        if "|" not in line:
            continue
        name, state = line.split("|", 1)
        if name not in nodes:
            nodes.append(name)
            states[name] = state.strip().lower()
        if not usable_at_all(state) and name not in unusable:
            unusable.append(name)
            states[name] = state.strip().lower()
    return Cluster(nodes=nodes, unusable=unusable, partition=partition or "", states=states)


def partition_node_states(partition: str | None) -> dict[str, str]:
    """Node -> state of the partition's nodes (sinfo ``%T``, lower case, suffix flags kept: ``idle*`` is an idle
    node that does not respond, which ``usable_now`` rejects; {} when sinfo fails). A node in two states (e.g. idle
    and allocated CPUs) reads as the first sinfo lists."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N|%T"] + (["-p", partition] if partition else [])) or ""
    states: dict[str, str] = {}
    for line in out.splitlines():
        if "|" in line:
            name, state = line.split("|", 1)
            states.setdefault(name, state.strip().lower())
    return states


def live_jobs_named(name: str, *, stdout_dir: str | None = None) -> list[dict[str, str]]:
    """This user's live jobs with this name (and, if given, writing their output into ``stdout_dir``)."""
    out = _run(["squeue", "--me", "-h", "-n", name, "-o", "%i|%T|%Z"]) or ""
    jobs = []
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) < 2:
            continue
        job = {"job_id": parts[0], "state": parts[1]}
        if stdout_dir is not None:
            info = show_job(parts[0])
            if info and not (info.get("StdOut") or "").startswith(stdout_dir.rstrip("/") + "/"):
                continue
        jobs.append(job)
    return jobs
