"""A foreign trainer's own log (Megatron-LM's, Megatron-Bridge's) read as this package's trainer records.

The job-level room (the report, the optimum, the ledger's steps and checkpoints) reads what the trainer did from
``metrics.jsonl`` (``runtime/metrics.py``'s kinds). A run of Megatron-LM's ``pretrain_gpt.py`` or a Megatron-Bridge
recipe writes none: what it did is in its log (:mod:`.megatron_log_lines` says which lines). This module turns
that log into the same records, so the accounting (``goodput/accounting.py``), Daly's optimum
(``goodput/optimum.py``), the throughput table and the ledger's progress read a foreign run without a second
path through them:

- ``start``: one per process (a launch, or a restart of the worker group by ft_launcher/torchrun): its time is
  the training loop's start (Megatron-LM's ``before the start of training step``; Bridge's ``after dataloaders
  are built``), ``resumed_from`` the ``successfully loaded checkpoint ... at iteration N`` (0 without one), and
  the setup marks the accounting paints: launch and init -> ``startup``, the checkpoint load (its
  ``load-checkpoint`` timer, ending where the model was built) -> ``checkpoint_restore``, the data loaders ->
  ``data_loading``. Where the process began: the launcher's first stamped line (for the first process) or the
  ``after megatron is initialized`` stamp less ``time to initialize megatron``;
- ``train``: one per iteration line; ``step_time_s`` is its own steps' mean. Megatron-LM does not reset its
  interval timer after the first line of a process (``is_first_iteration``), so the second line's mean spans
  the first line's steps too: its own steps get the total less the first line's (measured: the second line after
  every (re)start averages the process's first two steps). Bridge resets at every line;
- ``checkpoint``: one per ``successfully saved`` line: ``blocking_s`` from the ``save-checkpoint`` timer (the
  slowest rank), else the ``saving`` -> ``saved`` stamps; ``start_time`` the ``saving`` stamp (Bridge: the
  step's line before it); ``reason``: ``interval`` at a multiple of ``--save-interval``, ``signal`` before a
  SIGTERM exit, ``final`` after ``after training is done``, ``non_persistent`` for a local save;
- ``signal`` and ``end``: ``exiting program after receiving SIGTERM.`` -> a signal (noticed where the save it
  asked for began: the log has no line for its arrival) and an end with exit code 0 (Megatron-LM returns from
  training and exits 0), ``after training is done`` -> ``finished``,
  ``exiting program at iteration N`` / ``after N minutes`` -> ``exit_interval`` / ``exit_duration``; a process
  the log shows no end of was killed or crashed (no ``end`` record, as for this package's trainer).

Every record says where it came from (``source: megatron_log``).
"""

from __future__ import annotations

import os
from typing import Any

from megatron_resilience.records import launcher_log
from megatron_resilience.records.megatron_log_lines import Event, events_by_line
from megatron_resilience.records.names import step_of_iter_dir

SOURCE = "megatron_log"
INITIALIZED = "after megatron is initialized"
MODEL_BUILT = "after model, optimizer, and learning rate scheduler are built"
DATA_BUILT = "after dataloaders are built"
LOOP_STARTS = "before the start of training step"
TRAINING_DONE = "after training is done"
SIGTERM_EXIT = "exiting program after receiving SIGTERM."
LOG_SUFFIXES = (".out", ".log", ".txt", ".err")


class _Process:
    """What one trainer process printed, from its setup to its last line."""

    def __init__(self, pending: dict[str, Any]) -> None:
        self.args: dict[str, str] = dict(pending.get("args") or {})
        self.world: tuple[int, int] | None = pending.get("world")
        self.init_s: float | None = pending.get("init")
        self.launcher: float | None = pending.get("launcher")
        self.marks: dict[str, float] = {}
        self.events: list[Event] = []
        self.loaded: int | None = None
        self.load_s: float | None = pending.get("load")
        self.bridge = False

    def arg_int(self, name: str) -> int | None:
        value = self.args.get(name, "")
        return int(value) if value.isdigit() else None


def _processes(lines: list[str]) -> list[_Process]:
    """The log cut where each process's setup says ``after megatron is initialized``; what a process prints
    before that (its arguments, world size, init time) and the launcher's stamp before it go with it."""
    processes: list[_Process] = []
    pending: dict[str, Any] = {}
    for line, events in events_by_line(lines):
        if not processes and "launcher" not in pending and not launcher_log.RANK_LINE.match(line):
            stamp = launcher_log.stamp_time(line)  # the launcher's first stamped line: where the run began
            if stamp is not None:
                pending["launcher"] = stamp
        for e in events:
            _take(e, processes, pending)
    return processes


def _take(e: Event, processes: list[_Process], pending: dict[str, Any]) -> None:
    if e.kind == "mark" and e.name == INITIALIZED:
        processes.append(_Process(pending))
        processes[-1].marks[INITIALIZED] = e.time
        pending.clear()
        return
    current = processes[-1] if processes else None
    if e.kind == "argument":
        pending.setdefault("args", {}).setdefault(e.name, e.value)
    elif e.kind == "world":
        pending["world"] = e.value
    elif e.kind == "init":
        pending["init"] = e.value
    elif e.kind == "timer" and e.name == "load-checkpoint" and current is None:
        pending["load"] = e.value  # the last rank's line came before rank 0's mark
    elif current is None:
        return
    elif e.kind == "mark":
        current.marks.setdefault(e.name, e.time)
        current.events.append(e)
    elif e.kind == "loaded":
        current.loaded = e.step
    elif e.kind == "timer" and e.name == "load-checkpoint":
        if current.load_s is None and not any(x.kind == "iteration" for x in current.events):
            current.load_s = e.value
        else:  # the next process's (its last rank's line came before rank 0's mark)
            pending["load"] = e.value
    elif e.kind == "bridge_loop":
        current.bridge = True
    elif e.kind in ("iteration", "saving", "saved", "timer"):
        current.events.append(e)


def _start_record(p: _Process) -> dict[str, Any] | None:
    begin = p.marks.get(LOOP_STARTS) or p.marks.get(DATA_BUILT)
    first = next((e for e in p.events if e.kind == "iteration" and e.time is not None), None)
    if begin is None:
        begin = first.time if first else None
    if begin is None:
        return None
    initialized = p.marks[INITIALIZED]
    process_start = initialized - p.init_s if p.init_s is not None else initialized
    marks = {"distributed": initialized}
    built = p.marks.get(MODEL_BUILT)
    if built is not None:
        if p.load_s:
            marks["model"] = max(initialized, built - p.load_s)
            marks["checkpoint_load"] = built
        else:
            marks["model"] = built
    if p.marks.get(DATA_BUILT) is not None:
        marks["data"] = p.marks[DATA_BUILT]
    setup: dict[str, Any] = {"process_start": process_start, "marks": marks}
    if p.launcher is not None:
        setup["launcher_start"] = min(p.launcher, process_start)
    world, dp = p.world or (p.arg_int("world_size"), p.arg_int("data_parallel_size"))
    return {"kind": "start", "source": SOURCE, "time": begin, "step": p.loaded or 0, "resumed_from": p.loaded or 0,
            "world_size": world, "dp": dp, "setup": setup,
            "trainer": "megatron_bridge" if p.bridge else "megatron_lm"}


def _train_records(p: _Process, resumed: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    seq = p.arg_int("seq_length")
    previous, first_seconds = resumed, None
    for e in p.events:
        if e.kind != "iteration" or e.time is None:
            continue
        try:
            mean = float(e.fields.get("elapsed time per iteration (ms)", "")) / 1000.0
        except ValueError:
            continue
        steps = max(1, e.step - previous)
        seconds = mean * steps
        if len(out) == 1 and not p.bridge and first_seconds is not None:
            # Megatron-LM's second line after a (re)start: its mean spans the first line's steps too
            seconds = max(0.0, mean * (e.step - resumed) - first_seconds)
        if not out:
            first_seconds = seconds
        per_step = seconds / steps
        rec: dict[str, Any] = {"kind": "train", "source": SOURCE, "time": e.time, "step": e.step,
                               "step_time_s": per_step, "train_iters": e.value}
        batch = e.fields.get("global batch size", "").strip()
        if batch.isdigit():
            rec["global_batch_size"] = int(batch)
            if seq and per_step > 0:
                rec["tokens_per_s"] = int(batch) * seq / per_step
        for key in ("lm loss", "consumed samples"):
            if key in e.fields:
                rec[key.replace(" ", "_")] = e.fields[key]
        out.append(rec)
        previous = e.step
    return out


def _checkpoint_records(p: _Process, ending: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    interval = p.arg_int("save_interval")
    local_interval = p.arg_int("non_persistent_save_interval")
    saving: dict[int, float] = {}
    timers: dict[str, list[float]] = {}
    last_step_time = None
    done = False
    for e in p.events:
        if e.kind == "iteration":
            last_step_time = e.time
        elif e.kind == "mark" and e.name == TRAINING_DONE:
            done = True
        elif e.kind == "saving" and e.time is not None:
            saving[e.step] = e.time
        elif e.kind == "timer" and e.name.startswith("save-checkpoint"):
            timers.setdefault(e.name, []).append(e.value)
        elif e.kind == "saved":
            begin = saving.pop(e.step, None)
            rec = {"kind": "checkpoint", "source": SOURCE, "step": e.step, "dir": e.value, "time": e.time,
                   "start_time": begin if begin is not None else last_step_time}
            if e.name == "local":
                rec["reason"] = "non_persistent" if not local_interval or e.step % local_interval == 0 else "local"
            elif done:
                rec["reason"] = "final"
            elif interval and e.step % interval == 0:
                rec["reason"] = "interval"
            else:
                rec["reason"] = "signal" if ending == "signal" else "other"
            out.append(rec)
    # The timer is the last rank's line, the save lines rank 0's: in a log of both their order is not kept, but
    # each rank's is. The k-th timer of a kind belongs to the k-th save of that kind (the slowest rank's time).
    for kind, values in (("save-checkpoint", [r for r in out if r["reason"] not in ("non_persistent", "local")]),
                         ("save-checkpoint-non-persistent", [r for r in out if r["reason"] in ("non_persistent",
                                                                                               "local")])):
        for rec, seconds in zip(values, timers.get(kind, [])):
            rec["blocking_s"] = seconds
    for rec in out:
        if "blocking_s" not in rec and rec["start_time"] is not None and rec["time"] is not None:
            rec["blocking_s"] = rec["time"] - rec["start_time"]  # no timer printed: the stamps
        if rec["time"] is None and rec["start_time"] is not None:
            rec["time"] = rec["start_time"] + float(rec.get("blocking_s") or 0.0)  # Bridge: no stamp on the line
    return [r for r in out if r["time"] is not None]


def _ending(p: _Process) -> tuple[str, float] | None:
    for e in p.events:
        if e.kind != "mark":
            continue
        if e.name == SIGTERM_EXIT:
            return "signal", e.time
        if e.name.startswith("exiting program at iteration"):
            return "exit_interval", e.time
        if e.name.startswith("exiting program after"):
            return "exit_duration", e.time
        if e.name == TRAINING_DONE:
            return "finished", e.time
    return None


def records_from_lines(lines: list[str]) -> list[dict[str, Any]]:
    """This package's trainer records (``start``, ``train``, ``checkpoint``, ``signal``, ``end``) of every
    process a Megatron-LM or Megatron-Bridge log shows, in time order."""
    out: list[dict[str, Any]] = []
    for p in _processes(lines):
        start = _start_record(p)
        if start is None:
            continue
        ending = _ending(p)
        mine = [start] + _train_records(p, start["resumed_from"])
        mine += _checkpoint_records(p, ending[0] if ending else None)
        last = max(float(r.get("time") or 0.0) for r in mine)
        steps = [r["step"] for r in mine if r["kind"] == "train"]
        if ending is not None:
            reason, _ = ending
            if reason == "signal":  # noticed where its save began (Megatron-LM checks for it after each step)
                noticed = [r["start_time"] for r in mine if r["kind"] == "checkpoint" and r["reason"] == "signal"]
                mine.append({"kind": "signal", "source": SOURCE, "signal": "SIGTERM", "time": ending[1],
                             "received_time": (noticed or [ending[1]])[-1],
                             "step": max(steps, default=start["resumed_from"])})
            mine.append({"kind": "end", "source": SOURCE, "reason": reason, "exit_code": 0,
                         "step": max(steps, default=start["resumed_from"]), "time": max(last, ending[1] or last)})
        out += sorted(mine, key=lambda r: float(r.get("time") or 0.0))
    return out


def is_trainer_log(lines: list[str]) -> bool:
    """Does this log hold a Megatron-LM / Megatron-Bridge process's setup mark?"""
    return any(INITIALIZED in line and "datetime:" in line for line in lines)


def log_files(path: str, *, depth: int = 4) -> list[str]:
    """The trainer logs of a run: ``path`` itself when it is such a file, else the log-like files (``*.out``,
    ``*.log``, ``*.txt``, ``*.err``) at most ``depth`` folders down that hold a Megatron setup mark, by name. nemo_run's
    local executor writes ``<job dir>/nemo_run/<id>/<task>/0/combined.log`` (4 down: the job folder is a run, the
    experiment folder above it holding several is not); torchelastic's per-rank copies lie deeper; checkpoint
    folders are not searched."""
    if os.path.isfile(path):
        return [path] if is_trainer_log(head(path)) else []
    found, base = [], os.path.abspath(path).rstrip(os.sep)
    for root, dirs, files in os.walk(base):
        if root[len(base):].count(os.sep) >= depth:
            dirs[:] = []
        dirs[:] = [d for d in dirs if step_of_iter_dir(d) is None]
        for name in files:
            full = os.path.join(root, name)
            if name.endswith(LOG_SUFFIXES) and is_trainer_log(head(full)):
                found.append(full)
    return sorted(found)


def head(path: str, max_bytes: int = 4 << 20) -> list[str]:
    """The first lines of a file (a trainer prints its setup marks early; a large log is not read whole)."""
    try:
        with open(path, "rb") as f:
            return f.read(max_bytes).decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []


def _read(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def records_from_logs(paths: list[str]) -> list[dict[str, Any]]:
    """The records of every trainer log in ``paths``, in time order. A run's output is often in several files
    at once (nemo_run's ``combined.log`` and ``stdout.log``, torchelastic's per-rank files): a record another file
    already gave (same kind, step and stamp) is kept once, from the file that gave the most records."""
    per_file = [records_from_lines(_read(p)) for p in paths if is_trainer_log(head(p))]
    seen: set[tuple] = set()
    out: list[dict[str, Any]] = []
    for recs in sorted(per_file, key=len, reverse=True):
        for rec in recs:
            key = (rec["kind"], rec.get("step"), round(float(rec.get("time") or 0.0), 6))
            if key not in seen:
                seen.add(key)
                out.append(rec)
    return sorted(out, key=lambda r: float(r.get("time") or 0.0))
