"""Hang detection with nvidia-resiliency-ext's ``RankMonitorClient`` (the rank side of ft_launcher).

Sections mode (default): ``setup`` spans init and the checkpoint load, ``step``
every train iteration after the first one of a process (the first pays for lazy
init and would inflate the learned timeout), ``checkpointing`` every save.
Everything else (eval passes, logging, the first step) is "out of section" and
bounded by ``rank_out_of_section_timeout``. Heartbeats mode sends one heartbeat
at the end of setup, of every step, eval pass and save.

Learned timeouts (``ft.calc_ft_timeouts``): after a checkpoint save and at the
end of the run, every section with enough observations gets
``safety_factor x max observed`` (max over ranks; merged with earlier values by
the client's EMA). Rank 0 writes them atomically to ``<checkpoint.save>/ft_state.json``;
after a restart they are loaded before the rank connects, so the monitor uses them
from the first second. The setup timeout is learned only from runs that loaded a
checkpoint, the out-of-section one only at the end of a run that resumed from a checkpoint, saved one and has
a learned step timeout (so every kind of interval was observed at least once).
Every learned value (and every calculated one loaded from ft_state.json) is raised to at least
``ft.min_learned_timeout`` before the monitor gets it: ``safety_factor x max`` of fast steps is below 1 s,
and a GC pause, a slow filesystem or a busier node would get healthy ranks killed as hung.

Not under ft_launcher (no ``FT_RANK_MONITOR_IPC_SOCKET``): one log line, and
every call is a no-op.

With in-process restart (``keep_connection``) the process keeps one connection to its rank monitor for its
whole life: a restarted training function takes it over with every section closed, instead of connecting
again (the monitor takes a second connection of the same process for a restart of the worker group, and a
lost connection during one as an abort: section messages then fail). Each message to the monitor is then sent
inside the wrapper's ``atomic()`` block, so the restart's asynchronous interrupt never lands between a message
and its reply (which would leave the connection out of step for the next call). A section an exception leaves
is then not closed on the way out: the wrapper's monitor thread holds the ``atomic()`` lock from its first
interrupt until the soft timeout, and then interrupts again and again, so a message sent while unwinding would
wait for it and be interrupted (and could interrupt the wrapper's own handling after it); the next call closes
what was left open (``start``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator

from megatron_resilience import upstream
from megatron_resilience.config.resilience import FaultToleranceConfig
from megatron_resilience.resilience.log import get_logger

FT_STATE_FILE = "ft_state.json"
RANK_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
WARMUP_STEPS = 1  # per process: the first step is out of section
MIN_STEPS_FOR_STEP_TIMEOUT = 16  # observed step sections before the step timeout is learned


_KEPT: dict[str, object] = {}  # "client": the connection kept across in-process restarts


class FaultTolerance:
    def __init__(self, cfg: FaultToleranceConfig, *, rank: int, save_dir: str | None, load_dir: str | None,
                 async_save: bool, keep_connection: bool = False) -> None:
        self.keep_connection = keep_connection
        self.atomic: Callable[[], ContextManager] = contextlib.nullcontext  # in-process restart: CallWrapper.atomic
        self.cfg = cfg
        self.rank = rank
        self.save_dir = save_dir
        self.load_dir = load_dir
        self.async_save = async_save
        self.log = get_logger("ft", rank)
        self.client = None
        self.sections: set[str] = set()
        self.steps_seen = 0
        self.step_sections_seen = 0
        self.checkpoints_seen = 0
        self.loaded_checkpoint = False
        self.setup_open = False

    # --- lifecycle ------------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.client is not None

    def start(self) -> None:
        """Connect to this rank's monitor and open ``setup``. Before torch.distributed is initialised."""
        if not os.environ.get(RANK_MONITOR_SOCKET_ENV):
            if self.rank == 0:  # one line per job, not per rank
                self.log.warning("ft.enabled=true but this process was not started by ft_launcher "
                                 f"({RANK_MONITOR_SOCKET_ENV} is not set): hang detection is off for this run")
            return
        client = _KEPT.get("client") if self.keep_connection else None
        if client is not None:
            with self.atomic():  # a fault may have left setup (or another section) open
                closed = upstream.ft_end_all_sections(client)
            if closed:
                self.log.info(f"FT: closed section(s) {closed} left open by the interrupted training function")
        else:
            ft = upstream.import_fault_tolerance()
            client = ft.RankMonitorClient()
            state = self._read_state()
            if state is not None:
                client.load_state_dict(state)
            client.init_workload_monitoring()
            if self.keep_connection:
                _KEPT["client"] = client
        self.client = client
        self.sections = upstream.ft_section_names(client.cfg)
        cfg = client.cfg
        if self.cfg.mode == "sections":
            if cfg.initial_rank_heartbeat_timeout is not None or cfg.rank_heartbeat_timeout is not None:
                self.log.warning(
                    "ft.mode=sections sends no heartbeats, but ft_launcher has heartbeat timeouts "
                    f"(initial={cfg.initial_rank_heartbeat_timeout}, subsequent={cfg.rank_heartbeat_timeout}): "
                    "the ranks will be killed when they elapse; set them to null in the FT config")
            missing = {"setup", "step", "checkpointing"} - self.sections
            if missing:
                self.log.warning(f"ft_launcher config has no timeout for sections {sorted(missing)}: "
                                 "they are not monitored")
        # `setup` first, at once: a restarted worker whose connection ends before its first section message leaves
        # nvidia-resiliency-ext's rank monitor ABORTED for the rest of the job (docs/versions.md); the line below
        # says the rank is monitored, not only connected.
        self._open("setup")
        self.setup_open = True
        if self.rank == 0:
            self.log.info(f"FT: connected to the rank monitor (mode={self.cfg.mode}); {self.describe_timeouts()}")

    def end_setup(self, *, loaded_checkpoint: bool) -> None:
        self.loaded_checkpoint = loaded_checkpoint
        if self.setup_open:
            self._close("setup")
            self.setup_open = False
        self._heartbeat()

    def shutdown(self, *, update_timeouts: bool) -> None:
        """End of training on this rank. ``update_timeouts`` only when every rank gets here (it is collective)."""
        if not self.active:
            return
        if update_timeouts:
            self._maybe_update_timeouts(closing=True)
        self.client.shutdown_workload_monitoring()
        _KEPT.pop("client", None)
        self.client = None

    # --- sections -------------------------------------------------------------------------------------------

    @contextmanager
    def step(self) -> Iterator[None]:
        monitored = self.steps_seen >= WARMUP_STEPS
        if monitored:
            self._open("step")
        try:
            yield
        except BaseException:
            if not self.keep_connection:
                self._end_step(monitored)
            raise
        self._end_step(monitored)

    def _end_step(self, monitored: bool) -> None:
        if monitored:
            self._close("step")
            self.step_sections_seen += 1
        self.steps_seen += 1
        self._heartbeat()

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        self._open("checkpointing")
        try:
            yield
        except BaseException:
            if not self.keep_connection:
                self._close("checkpointing")
            raise
        self._close("checkpointing")
        self.checkpoints_seen += 1
        self._heartbeat()
        self._maybe_update_timeouts(closing=False)

    def after_eval(self) -> None:
        self._heartbeat()

    # --- learned timeouts -----------------------------------------------------------------------------------

    def _maybe_update_timeouts(self, *, closing: bool) -> None:
        """Collective: every rank calls it at the same point (after a save, at the end of the run)."""
        if not (self.active and self.cfg.calc_ft_timeouts):
            return
        if self.cfg.mode == "heartbeats":
            self._calculate_and_set(heartbeats=True)
            return
        selected = []
        if self.loaded_checkpoint:
            selected.append("setup")
        if self.step_sections_seen >= MIN_STEPS_FOR_STEP_TIMEOUT:
            selected.append("step")
        if self.checkpoints_seen > 0 and not self.async_save:
            selected.append("checkpointing")
        selected = [name for name in selected if name in self.sections]
        learned_before = set(self.client.section_timeouts.calculated_sections)
        out_of_section = (closing and "setup" in selected and self.checkpoints_seen > 0
                          and ("step" in selected or "step" in learned_before))
        if not selected and not out_of_section:
            return
        self._calculate_and_set(heartbeats=False, selected_sections=selected, calc_out_of_section=out_of_section)

    def _calculate_and_set(self, **kwargs) -> None:
        """Learn (collective), raise to the floor, send to the monitor, persist."""
        raised: list[tuple[str, float]] = []

        def floor(timeouts):
            floored, raised[:] = floor_learned_timeouts(timeouts, self.cfg.min_learned_timeout)
            return floored

        updated, before_send = upstream.ft_calculate_and_set_timeouts(self.client, adjust=floor, **kwargs)
        if not updated:
            return
        if self.rank == 0:
            for name, value in raised:
                self.log.info(f"FT: learned {name} timeout {value:.2f} s raised to the floor "
                              f"ft.min_learned_timeout={self.cfg.min_learned_timeout:g} s")
            if raised and not before_send:
                self.log.warning("FT: this nvidia-resiliency-ext cannot take adjusted learned timeouts: the rank "
                                 "monitor uses the unraised ones until the next restart (ft_state.json has the "
                                 "raised ones)")
        self._write_state()

    def _state_path(self, directory: str | None) -> str | None:
        return os.path.join(directory, FT_STATE_FILE) if directory else None

    def _read_state(self) -> dict | None:
        candidates = [self._state_path(d) for d in (self.load_dir, self.save_dir) if d]
        path = next((p for p in candidates if os.path.exists(p)), None)
        if path is None:
            return None
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError) as err:
            self.log.warning(f"FT: ignoring unreadable {path}: {err}")
            return None
        if self.rank == 0:
            self.log.info(f"FT: loaded learned timeouts from {path}")
        current = state.get("current_timeouts") if isinstance(state, dict) else None
        for kind in ("section", "heartbeat"):
            if isinstance(current, dict) and isinstance(current.get(kind), dict):
                for name, value in floor_timeouts_dict(current[kind], self.cfg.min_learned_timeout):
                    if self.rank == 0:
                        self.log.info(f"FT: loaded {name} timeout {value:.2f} s raised to the floor "
                                      f"ft.min_learned_timeout={self.cfg.min_learned_timeout:g} s")
        return state

    def _write_state(self) -> None:
        if self.rank == 0:
            path = self._state_path(self.save_dir)
            if path is not None:
                os.makedirs(self.save_dir, exist_ok=True)
                tmp = f"{path}.tmp.{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(self.client.state_dict(), f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                self.log.info(f"FT: learned timeouts saved to {path}; {self.describe_timeouts()}")

    def describe_timeouts(self) -> str:
        if not self.active:
            return "FT inactive"
        if self.cfg.mode == "heartbeats":
            hb = self.client.hb_timeouts
            return f"heartbeat timeouts: initial={_fmt(hb.initial)} subsequent={_fmt(hb.subsequent)}"
        st = self.client.section_timeouts
        parts = [f"{name}={_fmt(value)}" for name, value in sorted(st.section.items())]
        parts.append(f"out_of_section={_fmt(st.out_of_section)}")
        learned = sorted(st.calculated_sections) + (["out_of_section"] if st.is_out_of_section_calculated else [])
        return f"section timeouts: {' '.join(parts)} (learned: {', '.join(learned) or 'none'})"

    # --- plumbing -------------------------------------------------------------------------------------------

    def _open(self, name: str) -> None:
        if self._monitored(name):
            with self.atomic():
                self.client.start_section(name)

    def _close(self, name: str) -> None:
        if self._monitored(name):
            with self.atomic():
                self.client.end_section(name)

    def _monitored(self, name: str) -> bool:
        if not self.active or self.cfg.mode != "sections":
            return False
        if name in self.sections:
            return True
        return False

    def _heartbeat(self) -> None:
        if self.active and self.cfg.mode == "heartbeats":
            with self.atomic():
                self.client.send_heartbeat()


def floor_timeouts_dict(timeouts: dict, floor: float) -> list[tuple[str, float]]:
    """Raise, in place, every calculated value of a section/heartbeat timeouts dict (``state_dict()`` form) to
    ``floor``. Configured values are the user's and stay as they are. Returns ``[(name, old value)]`` raised."""
    raised = []

    def up(name: str, value):
        if value is not None and value < floor:
            raised.append((name, float(value)))
            return float(floor)
        return value

    if "calculated_sections" in timeouts:
        section = dict(timeouts.get("section") or {})
        for name in sorted(timeouts["calculated_sections"]):
            section[name] = up(name, section.get(name))
        timeouts["section"] = section
        if timeouts.get("is_out_of_section_calculated"):
            timeouts["out_of_section"] = up("out_of_section", timeouts.get("out_of_section"))
    elif timeouts.get("were_calculated"):
        for key in ("initial", "subsequent"):
            timeouts[key] = up(f"heartbeat {key}", timeouts.get(key))
    return raised


def floor_learned_timeouts(timeouts, floor: float):
    """``floor_timeouts_dict`` for nvidia-resiliency-ext's ``SectionTimeouts``/``HeartbeatTimeouts``: a new
    object (same type) and the raised ``[(name, old value)]``."""
    values = {field.name: getattr(timeouts, field.name) for field in dataclasses.fields(timeouts)}
    raised = floor_timeouts_dict(values, floor)
    return type(timeouts)(**values), raised


def _fmt(value: float | None) -> str:
    return "none" if value is None else f"{value:.2f}s"
