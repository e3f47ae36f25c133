"""The shapes of Megatron-LM's and Megatron-Bridge's own log lines, each read into one small event.

Facts taken from their sources (format strings, not code): megatron-core 0.19.2's ``megatron/training`` (the
Megatron-LM training loop its wheel ships) and megatron-bridge 0.6.2's ``megatron/bridge/training``:

- the iteration line (``training_log``, printed by the last rank every ``--log-interval`` steps):
  ``[YYYY-mm-dd HH:MM:SS.ffffff] iteration N/ M | consumed samples: S | elapsed time per iteration (ms): E |
  ... global batch size: B | lm loss: L | ...`` (Bridge: the stamp without microseconds). ``E`` is the mean wall
  time per step since the previous line;
- ``[NAME] datetime: YYYY-mm-dd HH:MM:SS[.ffffff]`` (``print_datetime``, ``barrier_and_log``): setup phases
  (``after megatron is initialized``, ``after model, optimizer, and learning rate scheduler are built``,
  ``after dataloaders are built``, Megatron-LM's ``before the start of training step``), the ends of a run
  (``after training is done``, ``exiting program after receiving SIGTERM.``, ``exiting program at iteration N``,
  ``exiting program after N minutes``);
- ``[STAMP] saving checkpoint at iteration N to DIR in FORMAT format`` (Megatron-LM only),
  ``[STAMP] successfully saved checkpoint from iteration N to DIR [ t .., p .. ]`` (Bridge: no stamp),
  ``[STAMP] successfully saved local checkpoint from iteration N`` (``--non-persistent-ckpt-type local``),
  ``successfully loaded checkpoint from DIR [ t .., p .. ] at iteration N`` (no stamp; it names the ``--load``
  folder even when the node-local copy was loaded);
- the timers (``megatron.core.timers``, logged through Python logging): ``(min, max) time across ranks (ms):``
  then ``    save-checkpoint ......: (MIN, MAX)`` (or ``max time across ranks (ms):`` then ``    NAME ....: MAX``),
  for ``save-checkpoint``, ``save-checkpoint-non-persistent`` and ``load-checkpoint``;
- ``time to initialize megatron (seconds): X``; ``using world size: W, data-parallel size: D, ...``; the
  arguments block (``  save_interval ........ 4``); Bridge's ``Starting training loop at iteration N``.

A line may carry a launcher's prefix (``[default0]:``, ``0: ``, ``[rank0]:``) and, when two ranks print at
once, another print glued to its end: every shape is searched for, not matched from the line's start.
Stamps are local time, as the trainer printed them (like :mod:`.launcher_log`'s).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)"
ITERATION = re.compile(r"(?:\[" + _STAMP + r"\]\s*)?iteration\s+(\d+)/\s*(\d+) \|(.*?)(?=\[\d{4}-|$)")
MARK = re.compile(r"\[([^\[\]]+)\] datetime: " + _STAMP)
SAVING = re.compile(r"\[" + _STAMP + r"\] saving checkpoint at iteration\s+(\d+) to (\S+) in (\S+) format")
SAVED = re.compile(r"(?:\[" + _STAMP + r"\] )?successfully saved (local )?checkpoint from iteration\s+(\d+)"
                   r"(?: to (\S+))?")
LOADED = re.compile(r"successfully loaded checkpoint from (\S+) .*?at iteration (\d+)")
TIMER = re.compile(r"^\s+([\w/-]+) \.+: \(?([\d.]+)(?:, ([\d.]+)\))?\s*$")
INIT = re.compile(r"time to initialize megatron \(seconds\): ([\d.]+)")
WORLD = re.compile(r"using world size: (\d+), data-parallel size: (\d+)")
ARGUMENT = re.compile(r"^\s+(\w+) \.{3,} (\S.*?)\s*$")
BRIDGE_LOOP = re.compile(r"Starting training loop at iteration (\d+)")
PREFIX = re.compile(r"^(?:\d+: )?(?:\[(?:default|rank)\d+\]:)?")  # srun --label, torchrun/ft_launcher --tee
FIELD = re.compile(r"\s*([^|:]+?): ([^|]+?)\s*\|")
# the arguments a reader needs (Megatron-LM's ``print_args`` block)
WANTED_ARGS = ("save_interval", "non_persistent_save_interval", "seq_length", "global_batch_size", "world_size",
               "data_parallel_size", "train_iters", "log_interval", "save", "load")
TIMERS = ("save-checkpoint", "save-checkpoint-non-persistent", "load-checkpoint")


def parse_stamp(text: str | None) -> float | None:
    """Epoch seconds of ``2026-11-29 01:20:06.873669`` (local time; fraction optional)."""
    if not text:
        return None
    whole, _, frac = text.partition(".")
    try:
        base = time.mktime(time.strptime(whole, "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return None
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


@dataclass
class Event:
    """One fact a line said: ``kind`` is one of iteration, mark, saving, saved, loaded, timer, init, world,
    argument, bridge_loop; ``time`` when the line carried a stamp."""

    kind: str
    time: float | None = None
    step: int | None = None
    name: str = ""
    value: Any = None
    fields: dict[str, str] = field(default_factory=dict)


def iteration_fields(rest: str) -> dict[str, str]:
    """``{name: value}`` of an iteration line's ``| name: value |`` fields after the step."""
    return {m.group(1).strip(): m.group(2).strip() for m in FIELD.finditer("|" + rest)}


def read_line(line: str, *, timer_block: bool = False) -> list[Event]:
    """The events in one log line. ``timer_block``: the previous line opened a timers block (only then is an
    indented ``name ....: value`` a timer, not an argument)."""
    out: list[Event] = []
    line = PREFIX.sub("", line.rstrip("\n"))
    for m in ITERATION.finditer(line):
        fields = iteration_fields(m.group(4))
        out.append(Event("iteration", parse_stamp(m.group(1)), int(m.group(2)), value=int(m.group(3)),
                         fields=fields))
    if out:
        return out
    for m in MARK.finditer(line):
        out.append(Event("mark", parse_stamp(m.group(2)), name=m.group(1).strip()))
    found = SAVING.search(line)
    if found:
        out.append(Event("saving", parse_stamp(found.group(1)), int(found.group(2)), value=found.group(3)))
    found = SAVED.search(line)
    if found:
        out.append(Event("saved", parse_stamp(found.group(1)), int(found.group(3)), name="local" if found.group(2)
                         else "global", value=found.group(4)))
    found = LOADED.search(line)
    if found:
        out.append(Event("loaded", None, int(found.group(2)), value=found.group(1)))
    if timer_block:
        found = TIMER.match(line)
        if found and found.group(1) in TIMERS:
            ms = float(found.group(3) or found.group(2))  # the slowest rank's: the one everyone waited for
            out.append(Event("timer", name=found.group(1), value=ms / 1000.0))
            return out
    for pattern, kind in ((INIT, "init"), (BRIDGE_LOOP, "bridge_loop")):
        found = pattern.search(line)
        if found:
            out.append(Event(kind, value=float(found.group(1))))
    found = WORLD.search(line)
    if found:
        out.append(Event("world", value=(int(found.group(1)), int(found.group(2)))))
    found = ARGUMENT.match(line) if not out else None
    if found and found.group(1) in WANTED_ARGS:
        out.append(Event("argument", name=found.group(1), value=found.group(2)))
    return out


def events_by_line(lines: list[str]) -> Iterator[tuple[str, list[Event]]]:
    """Each line with its events. A timers block is followed per launcher prefix (``[default1]:``): another rank's
    line printed between a block's header and its timer lines does not end it."""
    open_blocks: set[str] = set()
    for line in lines:
        prefix = PREFIX.match(line).group(0)
        events = read_line(line, timer_block=prefix in open_blocks)
        if "time across ranks (ms):" in line:
            open_blocks.add(prefix)
        elif not (events and events[-1].kind == "timer"):
            open_blocks.discard(prefix)
        yield line, events


def read_lines(lines: list[str]) -> list[Event]:
    """The events of a whole log, in order."""
    return [e for _, events in events_by_line(lines) for e in events]
