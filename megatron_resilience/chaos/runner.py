"""The chaos loop: a seeded stream of faults at a given MTBF into one run's Slurm job, until a bound is reached.

Reproducible: the seed alone decides the sequence of (time to the next fault, cause, target seed), drawn
in that order whatever happens in between. The exponential inter-arrival times run on one of two clocks:

* ``training`` (default): the clock runs while the job trains (its trainer has logged a step since the
  previous poll), and a fault never lands while the previous one is still being recovered from, so runs of
  different speed or checkpoint interval meet the same stream;
* ``allocation``: the clock runs while the job holds its allocation (Slurm: RUNNING; queue wait does not
  count), faults land whenever they come due, during a restart or a startup too — the world's way, and the
  process Daly's optimum assumes (failures at rate 1/M over the allocated time, restarts included), so a run's
  goodput / E* measures the run, not a stream that spares its recoveries. A fault that comes due while its
  target does not exist (between attempts; a rank fault before the ranks started) lands when it does.

On either clock a fault Slurm gave no answer for (squeue timing out on a loaded controller) is tried again.

Bounded: at most ``max_count`` faults and ``max_time`` seconds; it stops when the run's chain of attempts ends.
Every fault (and every node it took down and gave back) is a line of ``<run_dir>/chaos_ledger.jsonl``; nodes
taken down are resumed after ``repair`` seconds and always before it exits.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from megatron_resilience.chaos import inject as actions
from megatron_resilience.chaos.faults import fault
from megatron_resilience.chaos.mix import Mix, load_mix
from megatron_resilience.records import megatron_log
from megatron_resilience.records.ledger import Ledger
from megatron_resilience.records.names import CHAOS_LEDGER_FILE, LEDGER_FILE, METRICS_FILE

CLOCKS = ("training", "allocation")


@dataclass(kw_only=True)
class ChaosConfig:
    run_dir: str
    mtbf: float  # seconds between faults, on average, on the clock below
    clock: str = "training"  # training | allocation (module docstring)
    mix: str = "llama3"
    seed: int = 0
    max_count: int = 10
    max_time: float = 3600.0
    repair: float = 60.0  # seconds a node taken down stays down
    job_id: str | None = None
    rank: int | None = None  # always this rank (default: drawn)
    poll: float = 0.5
    recover_timeout: float = 900.0  # longest wait for the job to train again after a fault
    # node -> weight of a node that fails more often than the others (a lemon): a fault that picks a node picks
    # it ``weight`` times as often as a node not named here (weight 1)
    lemons: dict[str, float] = field(default_factory=dict)
    # The partition's nodes, each a machine with failures of its own: a hardware fault (a GPU's Xid or ECC error, a
    # node lost) strikes one of them (a lemon ``weight`` times as often); one that strikes a node outside the job
    # costs the job nothing and is recorded so (not done, not tried again). Empty: it strikes one of the job's
    # nodes, whatever the job runs on (a one-node job then meets every hardware fault, the lemon's weight unused).
    pool: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("mtbf", "max_time", "repair", "poll", "recover_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value != value or value == float("inf"):
                raise ValueError(f"chaos --{name.replace('_', '-')}: must be a finite number > 0, got {value!r}")
        if isinstance(self.max_count, bool) or not isinstance(self.max_count, int) or self.max_count < 1:
            raise ValueError(f"chaos --max-count: must be an integer >= 1, got {self.max_count!r}")
        if self.clock not in CLOCKS:
            raise ValueError(f"chaos --clock: must be one of {list(CLOCKS)}, got {self.clock!r}")
        for node, weight in self.lemons.items():
            if not isinstance(node, str) or not node or isinstance(weight, bool) \
                    or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
                raise ValueError(f"chaos --lemon: must be NODE=WEIGHT with a node name and a finite weight > 0, "
                                 f"got {node!r}={weight!r}")
        if any(not isinstance(n, str) or not n for n in self.pool) or len(set(self.pool)) != len(self.pool):
            raise ValueError(f"chaos --pool: must be distinct node names, got {self.pool!r}")
        if not os.path.isdir(self.run_dir):
            raise ValueError(f"chaos RUN_DIR: no such run directory {self.run_dir!r}")


def strike(hardware: bool, nodes: list[str], seed: int, cfg: ChaosConfig) -> str:
    """The node a fault lands on: a hardware fault on one of the pool's machines when there is a pool (maybe one
    the job does not run on), anything else on one of the job's ``nodes``."""
    return pick_node(cfg.pool if hardware and cfg.pool else nodes, seed, cfg.lemons)


def pick_node(nodes: list[str], seed: int, lemons: dict[str, float]) -> str:
    """The node a fault lands on: drawn from the job's nodes by the fault's seed, a lemon ``weight`` times as often
    (without a lemon among ``nodes``, the same draw as without lemons, so a seed keeps its stream)."""
    rng = random.Random(seed)
    if not any(n in lemons for n in nodes):
        return nodes[rng.randrange(len(nodes))]
    return rng.choices(nodes, weights=[float(lemons.get(n, 1.0)) for n in nodes])[0]


@dataclass
class Planned:
    index: int
    delay: float  # seconds after the previous fault, on the stream's clock
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


def _tail(path: str, chunk: int) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chunk))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return None


def _last_foreign_record_time(run_dir: str, kind: str, chunk: int) -> float | None:
    """A run whose trainer writes no metrics.jsonl (Megatron-LM's, Megatron-Bridge's ``pretrain``; RUN_DIR is then
    the job folder): the tail of its newest trainer log, read as the same records (``records/megatron_log``)."""
    logs = megatron_log.log_files(run_dir)
    if not logs:
        return None
    tail = _tail(max(logs, key=os.path.getmtime), chunk) or []
    found = [r for r in megatron_log.records_from_lines(tail) if r.get("kind") == kind and r.get("time")]
    return float(found[-1]["time"]) if found else None


def last_record_time(run_dir: str, kind: str = "train", chunk: int = 1 << 16) -> float | None:
    """The time of the newest ``kind`` record of the run's metrics.jsonl (read from the end); for a trainer that
    writes none, of its own log's lines."""
    tail = _tail(os.path.join(run_dir, METRICS_FILE), chunk)
    if tail is None:
        return _last_foreign_record_time(run_dir, kind, chunk)
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == kind:
            return float(rec.get("time") or 0)
    return None


def last_train_time(run_dir: str) -> float | None:
    return last_record_time(run_dir, "train")


def past_setup(run_dir: str) -> bool:
    """The trainer running now has trained since its (re)start: its ranks talk to ft_launcher's rank monitor."""
    trained, started = last_record_time(run_dir, "train"), last_record_time(run_dir, "start")
    return trained is not None and (started is None or trained > started)


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
        return self.run_ledger.current_job(self.cfg.job_id)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        stream = plan(self.mix, seed=cfg.seed, mtbf=cfg.mtbf, count=cfg.max_count)
        deadline = time.monotonic() + cfg.max_time
        self.ledger.append({"kind": "chaos_start", "seed": cfg.seed, "mtbf_s": cfg.mtbf, "config": asdict(cfg),
                            "mix": self.mix.to_dict(), "plan": [asdict(p) for p in stream]})
        reason = "max_count"
        try:
            allocation = cfg.clock == "allocation"
            for item in stream:
                waited = self._allocated_for(item.delay, deadline) if allocation else \
                    self._train_for(item.delay, deadline)
                if not waited or not self._inject_when_possible(item, deadline):
                    reason = "chain ended" if self.chain_ended() else "max_time"
                    break
                if not allocation and not self._recovered(deadline):
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

    def _allocated_for(self, seconds: float, deadline: float) -> bool:
        """Wait until the job has held its allocation ``seconds`` more (Slurm's RUNNING; pending time is not)."""
        held, last = 0.0, time.monotonic()
        while held < seconds:
            if time.monotonic() > deadline or self.chain_ended():
                return False
            time.sleep(self.cfg.poll)
            self._tick()
            now = time.monotonic()
            job = self.job()
            if job and actions.job_nodes(job)[0] == "RUNNING":
                held += now - last
            last = now
        return True

    def _inject_when_possible(self, item: Planned, deadline: float) -> bool:
        """Inject ``item`` now, or as soon as its target exists (on the ``allocation`` clock it may come due between
        attempts) and Slurm answers (a query that times out on a loaded controller is asked again, on either clock);
        False: the chain ended or a bound was reached first."""
        due = time.time()
        limit = min(deadline, time.monotonic() + self.cfg.recover_timeout)
        # A rank stopped before it first talks to ft_launcher's rank monitor is seen by no timeout (the monitor's
        # timers start at the rank's first message; alone in its job, nothing else waits for it): a hang lands
        # once the ranks are past setup.
        hang = fault(item.fault).signal == "SIGSTOP"
        tries: list[str] = []  # why each earlier try of this item was not done
        while True:
            if hang and not past_setup(self.cfg.run_dir) and time.monotonic() < limit:
                if self.chain_ended():
                    return False
                time.sleep(self.cfg.poll)
                self._tick()
                continue
            record = self._try(item)
            if record.get("ok") or time.monotonic() >= limit or not _retryable(record):
                record["retries"] = len(tries)
                if tries:
                    record["retry_reasons"] = sorted(set(tries))[:5]
                if record.get("ok") and record.get("time"):
                    record["late_s"] = round(float(record["time"]) - due, 3)
                self._commit(item, record)
                return True
            # tried again below: counted on the injection's own record (chaos_ledger.jsonl), never silent
            tries.append(str(record.get("why") or record.get("output") or "")[:200])
            if self.chain_ended():
                return False
            time.sleep(self.cfg.poll)
            self._tick()

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
    def _try(self, item: Planned) -> dict[str, Any]:
        """Try ``item`` once; the caller decides whether to keep the outcome (``_commit``) or try again."""
        spec = fault(item.fault)
        job = self.job()
        state, restart, nodes = actions.job_nodes(job) if job else (None, 0, [])
        record: dict[str, Any] = {"kind": "injection", "index": item.index, "fault": spec.name, "cause": item.cause,
                                  "category": item.category, "expected": list(spec.expected),
                                  "hardware": spec.hardware, "job_id": job, "slurm_restart": restart,
                                  "seed": item.seed}
        if state != "RUNNING" or not nodes:
            record.update(ok=False, time=time.time(), why=f"job {job} is {state}, not running")
        elif (node := strike(spec.hardware, nodes, item.seed, self.cfg)) not in nodes:
            record.update(ok=False, time=time.time(), node=node, outside_job=True,
                          why=f"struck {node}, a node outside job {job}: its hardware fault costs the job nothing")
        else:
            record.update(actions.inject(spec, job=job, restart=restart, nodes=nodes, node=node, seed=item.seed,
                                         run_dir=self.cfg.run_dir, rank=self.cfg.rank))
            if spec.where == "node" and record.get("ok"):
                self.down[node] = time.time() + self.cfg.repair
        return record

    def _commit(self, item: Planned, record: dict[str, Any]) -> None:
        spec = fault(item.fault)
        self.ledger.append(record)
        self.injected.append(record)
        what = f"rank {record.get('rank')} on {record.get('node')}" if spec.where == "rank" else record.get("node")
        late = f" ({record['late_s']:.1f} s after it came due)" if record.get("late_s") else ""
        late += f" after {record['retries']} tries not done ({'; '.join(record['retry_reasons'])[:160]})" \
            if record.get("retries") else ""
        outcome = "done" + late if record.get("ok") else f"NOT done: {record.get('why') or record.get('output')}"
        self.log(f"chaos: {item.index}: {spec.name} ({item.cause}) -> job {record.get('job_id')} {what}: {outcome}")

    def _resume(self, node: str) -> None:
        ok, text = actions.resume_node(node)
        self.down.pop(node, None)
        self.ledger.append({"kind": "node_resumed", "node": node, "ok": ok, "output": text[-500:]})
        self.log(f"chaos: node {node} resumed{'' if ok else ': ' + text}")


# What slurmctld's clients print when it did not answer in time (MessageTimeout) or could not be reached.
SLURM_UNANSWERED = ("(squeue failed)", "Socket timed out", "Unable to contact slurm controller",
                    "Zero Bytes were transmitted", "TimeoutExpired")


def _retryable(record: dict[str, Any]) -> bool:
    """A target that does not exist yet (between attempts; no rank process yet) or a Slurm that did not answer,
    not a refusal (another job's node) or a command that failed for its own reason."""
    said = f"{record.get('why') or ''} {record.get('output') or ''}"
    return "not running" in said or "no rank process" in said or any(s in said for s in SLURM_UNANSWERED)


__all__ = ["CLOCKS", "Chaos", "ChaosConfig", "plan"]
