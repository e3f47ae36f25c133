"""The part of a rank-level injection that runs on the node, inside the job's allocation.

    srun --jobid=JOB --overlap -N1 -n1 -w NODE python -m megatron_resilience.chaos.on_node --job JOB --kind K

Finds the job's rank processes on this node (``/proc/*/environ``: ``SLURM_JOB_ID`` is the job's,
``SLURMD_NODENAME`` this node, and ``RANK`` set by torchrun/ft_launcher or ``SLURM_PROCID`` for a rank
srun started; a forked child of a rank, e.g. an async checkpoint writer, is not a rank; a child of the
launcher is preferred, and of several with one rank the newest: the worker group may have restarted), picks one with
the seed (or ``--rank``), writes the fault's lines to its stderr (``/proc/PID/fd/2``: where the rank's
own output goes) and sends it the fault's signal. Prints one JSON line: what it did, to whom, when.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import time

from megatron_resilience.chaos.faults import fault

# Parents a rank process has: torchrun / ft_launcher (torchelastic agents), or slurmstepd for a rank srun started.
LAUNCHERS = ("ft_launcher", "torchrun", "torch.distributed.run", "slurmstepd")


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in data.split(b"\0") if b"=" in item)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _started(pid: int) -> int:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def rank_processes(job: str, node: str | None) -> list[dict[str, object]]:
    """The job's rank processes on this node: [{pid, rank}], by rank. Workers of a launcher (``RANK`` set) when
    there are any, else python processes srun started itself (``SLURM_PROCID``)."""
    mine = {os.getpid(), os.getppid()}
    workers: dict[int, dict[str, object]] = {}
    tasks: dict[int, dict[str, object]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        env = _environ(int(entry))
        if env.get("SLURM_JOB_ID") != str(job) or (node and env.get("SLURMD_NODENAME", node) != node):
            continue
        if env.get("MEGATRON_RESILIENCE_CHAOS_HELPER"):
            continue  # this helper's own step
        if env.get("RANK", "").isdigit():
            workers[int(entry)] = {"pid": int(entry), "rank": int(env["RANK"])}
        elif env.get("SLURM_PROCID", "").isdigit() and "python" in _cmdline(int(entry)):
            tasks[int(entry)] = {"pid": int(entry), "rank": int(env["SLURM_PROCID"])}
    found = workers or tasks
    for pid, p in found.items():
        p["parent"] = _cmdline(_parent(pid) or 0)[:80]
    ranks = [p for pid, p in found.items() if _parent(pid) not in found]  # not a forked child of a rank
    launched = [p for p in ranks if any(name in str(p["parent"]) for name in LAUNCHERS)]
    ranks = launched or ranks  # the launcher's (or slurmstepd's) own children: not a stray with a rank's env
    newest: dict[int, dict[str, object]] = {}
    for p in sorted(ranks, key=lambda p: _started(p["pid"])):
        newest[p["rank"]] = p  # one process per rank: the newest (the worker group restarted since)
    return sorted(newest.values(), key=lambda p: (p["rank"], p["pid"]))


def inject(job: str, kind: str, *, node: str | None, seed: int, rank: int | None = None) -> dict[str, object]:
    spec = fault(kind)
    if spec.where != "rank":
        raise ValueError(f"{kind} is not a rank-level fault")
    ranks = rank_processes(job, node)
    if rank is not None:
        ranks = [r for r in ranks if r["rank"] == rank]
    if not ranks:
        return {"ok": False, "why": f"no rank process of job {job} on {node or socket.gethostname()}"}
    target = random.Random(seed).choice(ranks)
    pid = int(target["pid"])
    host = node or socket.gethostname()
    lines = [line.format(host=host, pid=pid, rank=target["rank"]) for line in spec.lines]
    if lines:
        try:
            with open(f"/proc/{pid}/fd/2", "a", encoding="utf-8") as err:
                err.write("".join(line + "\n" for line in lines))
        except OSError as error:
            lines.append(f"(could not write to the rank's stderr: {error})")
    when = time.time()
    os.kill(pid, getattr(signal, spec.signal))
    return {"ok": True, "pid": pid, "rank": target["rank"], "node": host, "time": when, "signal": spec.signal,
            "lines": lines, "ranks_on_node": len(ranks), "parent": target.get("parent")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resilience.chaos.on_node")
    parser.add_argument("--job", required=True)
    parser.add_argument("--kind", required=True)
    parser.add_argument("--node", default=os.environ.get("SLURMD_NODENAME"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=None)
    args = parser.parse_args(argv)
    result = inject(args.job, args.kind, node=args.node, seed=args.seed, rank=args.rank)
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok") else 3


if __name__ == "__main__":
    sys.exit(main())
