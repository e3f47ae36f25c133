"""The chaos loop: a seeded stream of faults at a given MTBF into one run's Slurm job, until a bound is reached.

Reproducible: the seed alone decides the sequence of (time to the next fault, cause, target seed), drawn
in that order whatever happens in between. The clock of the stream runs while the job trains (its
trainer has logged a step since the previous fault): the exponential inter-arrival times are in training
time, so runs of different speed or checkpoint interval meet the same stream, and a fault never lands
while the previous one is still being recovered from. Bounded: at most ``max_count`` faults and
``max_time`` seconds; it stops when the run's chain of attempts ends. Every fault (and every node it took
down and gave back) is a line of ``<run_dir>/chaos_ledger.jsonl``; nodes taken down are resumed after
``repair`` seconds and always before it exits.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from megatron_resilience.chaos import inject as actions
from megatron_resilience.chaos.faults import fault
from megatron_resilience.chaos.mix import Mix, load_mix
from megatron_resilience.jobs.ledger import LEDGER_FILE, Ledger
from megatron_resilience.jobs.report_inputs import CHAOS_LEDGER_FILE
from megatron_resilience.jobs.watcher import current_job


@dataclass(kw_only=True)
class ChaosConfig:
    run_dir: str
    mtbf: float  # seconds of training between faults, on average
    mix: str = "llama3"
    seed: int = 0
    max_count: int = 10
    max_time: float = 3600.0
    repair: float = 60.0  # seconds a node taken down stays down
    job_id: str | None = None
    rank: int | None = None  # always this rank (default: drawn)
    poll: float = 0.5
    recover_timeout: float = 900.0  # longest wait for the job to train again after a fault

    def __post_init__(self) -> None:
        for name in ("mtbf", "max_time", "repair", "poll", "recover_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value != value or value == float("inf"):
                raise ValueError(f"chaos --{name.replace('_', '-')}: must be a finite number > 0, got {value!r}")
        if isinstance(self.max_count, bool) or not isinstance(self.max_count, int) or self.max_count < 1:
            raise ValueError(f"chaos --max-count: must be an integer >= 1, got {self.max_count!r}")
        if not os.path.isdir(self.run_dir):
            raise ValueError(f"chaos RUN_DIR: no such run directory {self.run_dir!r}")


@dataclass
class Planned:
    index: int
    delay: float  # training seconds after the previous fault
    cause: str
    category: str
    fault: str
    seed: int


def plan(mix: Mix, *, seed: int, mtbf: float, count: int) -> list[Planned]:
    """The stream the seed decides: the same for the same (mix, seed, mtbf)."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        delay = rng.expovariate(1.0 / mtbf)
        cause = mix.draw(rng)
        out.append(Planned(k, delay, cause.cause, cause.category, cause.fault, rng.randrange(2 ** 31)))
    return out


def last_train_time(run_dir: str, chunk: int = 1 << 16) -> float | None:
    """The time of the newest ``train`` record of the run's metrics.jsonl (read from the end)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chunk))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "train":
            return float(rec.get("time") or 0)
    return None


class Chaos:
    def __init__(self, cfg: ChaosConfig, *, log: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.mix = load_mix(cfg.mix)
        self.ledger = Ledger(os.path.join(cfg.run_dir, CHAOS_LEDGER_FILE))
        self.run_ledger = Ledger(os.path.join(cfg.run_dir, LEDGER_FILE))
        self.log = log
        self.down: dict[str, float] = {}  # node -> when to resume it
        self.injected: list[dict[str, Any]] = []

    def chain_ended(self) -> bool:
        return self.run_ledger.final() is not None

    def job(self) -> str | None:
        return current_job(self.run_ledger, self.cfg.job_id)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        stream = plan(self.mix, seed=cfg.seed, mtbf=cfg.mtbf, count=cfg.max_count)
        deadline = time.monotonic() + cfg.max_time
        self.ledger.append({"kind": "chaos_start", "seed": cfg.seed, "mtbf_s": cfg.mtbf, "config": asdict(cfg),
                            "mix": self.mix.to_dict(), "plan": [asdict(p) for p in stream]})
        reason = "max_count"
        try:
            for item in stream:
                if not self._train_for(item.delay, deadline):
                    reason = "chain ended" if self.chain_ended() else "max_time"
                    break
                self._inject(item)
                if not self._recovered(deadline):
                    reason = "chain ended" if self.chain_ended() else "max_time"
                    break
        except KeyboardInterrupt:
            reason = "interrupted"
        finally:
            for node in list(self.down):
                self._resume(node)
            summary = {"kind": "chaos_end", "reason": reason, "injected": len(self.injected),
                       "failed_injections": sum(1 for i in self.injected if not i.get("ok"))}
            self.ledger.append(summary)
            self.log(f"chaos: ended ({reason}) after {len(self.injected)} injection(s)")
        return summary

    # --- waiting ----------------------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.time()
        for node, when in list(self.down.items()):
            if now >= when:
                self._resume(node)

    def _train_for(self, seconds: float, deadline: float) -> bool:
        """Wait until the job has trained ``seconds`` more (training time: a step logged in the last poll)."""
        trained, seen = 0.0, last_train_time(self.cfg.run_dir)
        while trained < seconds:
            if time.monotonic() > deadline or self.chain_ended():
                return False
            time.sleep(self.cfg.poll)
            self._tick()
            newest = last_train_time(self.cfg.run_dir)
            if newest is not None and (seen is None or newest > seen):
                trained += self.cfg.poll
                seen = newest
        return True

    def _recovered(self, deadline: float) -> bool:
        """Wait until the job trains again after the last fault (a train record newer than it)."""
        since = self.injected[-1]["time"] if self.injected else time.time()
        limit = min(deadline, time.monotonic() + self.cfg.recover_timeout)
        while time.monotonic() < limit:
            if self.chain_ended():
                return False
            newest = last_train_time(self.cfg.run_dir)
            if newest is not None and newest > since:
                return True
            time.sleep(self.cfg.poll)
            self._tick()
        return time.monotonic() < deadline

    # --- acting -------------------------------------------------------------------------------------------------
    def _inject(self, item: Planned) -> None:
        spec = fault(item.fault)
        job = self.job()
        state, restart, nodes = actions.job_nodes(job) if job else (None, 0, [])
        record: dict[str, Any] = {"kind": "injection", "index": item.index, "fault": spec.name, "cause": item.cause,
                                  "category": item.category, "expected": list(spec.expected),
                                  "hardware": spec.hardware, "job_id": job, "slurm_restart": restart,
                                  "seed": item.seed}
        if state != "RUNNING" or not nodes:
            record.update(ok=False, time=time.time(), why=f"job {job} is {state}, not running")
        else:
            node = nodes[random.Random(item.seed).randrange(len(nodes))]
            record.update(actions.inject(spec, job=job, restart=restart, nodes=nodes, node=node, seed=item.seed,
                                         run_dir=self.cfg.run_dir, rank=self.cfg.rank))
            if spec.where == "node" and record.get("ok"):
                self.down[node] = time.time() + self.cfg.repair
        self.ledger.append(record)
        self.injected.append(record)
        what = f"rank {record.get('rank')} on {record.get('node')}" if spec.where == "rank" else record.get("node")
        self.log(f"chaos: {item.index}: {spec.name} ({item.cause}) -> job {job} {what}: "
                 f"{'done' if record.get('ok') else 'NOT done: ' + str(record.get('why') or record.get('output'))}")

    def _resume(self, node: str) -> None:
        ok, text = actions.resume_node(node)
        self.down.pop(node, None)
        self.ledger.append({"kind": "node_resumed", "node": node, "ok": ok, "output": text[-500:]})
        self.log(f"chaos: node {node} resumed{'' if ok else ': ' + text}")


__all__ = ["Chaos", "ChaosConfig", "plan"]
