"""Monitors: what to recognise in an attempt's log. A monitor is a regex that, on a matching line, emits a signal.

A monitor file (YAML; the presets in ``presets/monitors/`` are examples to copy) looks like::

    name: my_monitors
    description: what this set recognises
    include: [megatron_basic]          # presets or files whose monitors come first
    monitors:
      - name: cuda_oom                 # unique in the set
        error_type: cuda_oom           # one of taxonomy.NAMES
        severity: fatal                # info | warning | error | fatal
        pattern: 'OutOfMemoryError: CUDA out of memory\\.(?: Tried to allocate (?P<alloc>\\S+ [KMGT]iB))?'
        unless: 'retrying'             # optional: a line that also matches this emits nothing
        subsystem: memory              # optional: defaults to the error type's
        extract_groups: {size: alloc}  # optional: more field names for groups ("match": the whole match)

Named groups become the signal's fields; a group named ``host`` names the machine the line points
at (candidates for node exclusion), ``rank`` the rank. Only ``error`` and ``fatal`` signals can
classify an attempt; ``info``/``warning`` ones are kept as context. The Slurm monitors
(``presets/monitors/_slurm.yaml``: slurmstepd's cancellation lines, the trainer's own stop lines)
are always on. Every file is checked when loaded, before submission: an unknown key, a regex
that does not compile, an unknown error type or severity is an error naming the file and the key.
Error types and subsystems may be named in the log-monitoring tool's vocabulary too (``foreign_vocabulary.py``),
and that tool's own ``SlurmLogMonitor`` files load as they are (``foreign_monitors.py``).
"""

from __future__ import annotations

import copy
import functools
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_resilience.config.validate import ConfigError, check_keys
from megatron_resilience.failures import foreign_vocabulary, taxonomy, xid_codes
from megatron_resilience.jobs import foreign_monitors

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets", "monitors")
ALWAYS_ON = "_slurm"
FILE_KEYS = ("name", "description", "include", "monitors")
MONITOR_KEYS = ("name", "error_type", "severity", "pattern", "unless", "subsystem", "extract_groups")
REQUIRED_MONITOR_KEYS = ("name", "error_type", "severity", "pattern")


@dataclass(frozen=True)
class Monitor:
    name: str
    error_type: str
    severity: str
    pattern: str
    unless: str | None = None
    subsystem: str | None = None
    extract_groups: tuple[tuple[str, str], ...] = ()  # (field, group) pairs; group "match": the whole match
    source: str = ""
    _compiled: Any = field(default=None, compare=False, repr=False)
    _unless: Any = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "error_type": self.error_type, "severity": self.severity, "pattern": self.pattern}
        if self.unless:
            out["unless"] = self.unless
        if self.subsystem:
            out["subsystem"] = self.subsystem
        if self.extract_groups:
            out["extract_groups"] = dict(self.extract_groups)
        out["from"] = self.origin
        return out

    @property
    def origin(self) -> str:
        """The monitor set it was defined in (file name without .yaml)."""
        return os.path.splitext(os.path.basename(self.source))[0]

    @property
    def reads_batch_log(self) -> bool:
        """Slurm's own monitors also read the batch script's log (which echoes the script itself)."""
        return self.origin == ALWAYS_ON

    def match(self, line: str) -> dict[str, str] | None:
        found = self._compiled.search(line)
        if found is None or (self._unless is not None and self._unless.search(line)):
            return None
        fields = {k: v for k, v in found.groupdict().items() if v is not None}
        for name, group in self.extract_groups:
            value = found.group(0) if group == "match" else fields.get(group)
            if value is not None:
                fields[name] = value
        return fields


@dataclass(frozen=True)
class Signal:
    """One thing a monitor (or Slurm, or the trainer) saw about an attempt."""

    monitor: str
    error_type: str
    subsystem: str
    severity: str
    line: str
    # "log:<file>" (one file's signals come in line order), "slurm", "stop_reason", "exit_code", "metrics", "cycle_info"
    source: str
    fields: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "error_type": self.error_type, "subsystem": self.subsystem,
                "severity": self.severity, "line": self.line, "source": self.source, "fields": dict(self.fields)}


def _where(source: str, key: str) -> str:
    return f"{source}: {key}"


def build_monitor(raw: Any, *, source: str, index: int) -> Monitor:
    """A validated Monitor from one YAML mapping; errors name the file, the monitor and the key."""
    where = f"monitors[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where}: must be a mapping with keys {list(MONITOR_KEYS)}, got {raw!r}")
    if isinstance(raw.get("name"), str):
        where = f"monitors[{index}] ({raw['name']})"
    check_keys(source, where, raw, MONITOR_KEYS)
    for key in REQUIRED_MONITOR_KEYS:
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ConfigError(f"{source}: {where}.{key}: must be a non-empty string, got {raw.get(key)!r}")
    error_type = foreign_vocabulary.monitor_error_type(raw["error_type"], subsystem=raw.get("subsystem"), source=source,
                                               key=f"{where}.error_type", foreign=False)
    if raw["severity"] not in taxonomy.SEVERITIES:
        raise ConfigError(f"{source}: {where}.severity: must be one of {list(taxonomy.SEVERITIES)}, "
                          f"got {raw['severity']!r}")
    subsystem = raw.get("subsystem")
    if subsystem is not None:
        names, _ = foreign_vocabulary.subsystems([subsystem], source=source, key=f"{where}.subsystem", foreign=False)
        own = taxonomy.BY_NAME[error_type].subsystem
        subsystem = own if own in names else names[0]
    groups = raw.get("extract_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in groups.items()):
        raise ConfigError(f"{source}: {where}.extract_groups: must map field names to capture group names, "
                          f"got {groups!r}")
    compiled = {}
    for key in ("pattern", "unless"):
        text = raw.get(key)
        if text is None:
            continue
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{source}: {where}.{key}: must be a non-empty regular expression, got {text!r}")
        try:
            compiled[key] = re.compile(text)
        except re.error as err:
            raise ConfigError(f"{source}: {where}.{key}: not a valid regular expression ({err}), got {text!r}") \
                from None
    missing = sorted(g for g in groups.values() if g != "match" and g not in compiled["pattern"].groupindex)
    if missing:
        raise ConfigError(f"{source}: {where}.extract_groups: the pattern has no group named {missing[0]!r}; its "
                          f"groups: {sorted(compiled['pattern'].groupindex)} (or 'match')")
    return Monitor(name=raw["name"], error_type=error_type, severity=raw["severity"], pattern=raw["pattern"],
                   unless=raw.get("unless"), subsystem=subsystem, extract_groups=tuple(groups.items()),
                   source=source, _compiled=compiled["pattern"], _unless=compiled.get("unless"))


def preset_names() -> list[str]:
    return sorted(n[:-5] for n in os.listdir(PRESET_DIR) if n.endswith(".yaml") and not n.startswith("_"))


def resolve_path(spec: str, kind: str, preset_dir: str, names: list[str]) -> str:
    """A preset name or a path to a YAML file -> the file's path (error lists the presets)."""
    if os.sep in spec or spec.endswith((".yaml", ".yml")):
        if not os.path.isfile(spec):
            raise ConfigError(f"{kind}: no such file {spec!r} (give a preset name {names} or a YAML file path)")
        return os.path.abspath(spec)
    path = os.path.join(preset_dir, f"{spec}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"{kind}: must be a preset name {names} or a YAML file path, got {spec!r}")
    return path


@functools.lru_cache(maxsize=64)
def _parse_yaml(path: str, stamp: tuple[float, int]) -> Any:
    """Parsed once per file version (presets are read for every attempt and every policy)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it: ~20x faster
    with open(path, encoding="utf-8") as f:
        try:
            return yaml.load(f, Loader=loader)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None


def read_raw(path: str) -> Any:
    """The file's YAML as data (a copy: callers may change it)."""
    info = os.stat(path)
    return copy.deepcopy(_parse_yaml(path, (info.st_mtime, info.st_size)))


def read_yaml(path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    data = read_raw(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a YAML mapping with keys {list(allowed)}, got {type(data).__name__}")
    check_keys(path, "", data, allowed)
    return data


def load_monitors(specs: str | list[str] | tuple[str, ...], *, _seen: tuple[str, ...] = ()) -> list[Monitor]:
    """Monitors of the given presets/files (their includes first), plus the always-on Slurm monitors."""
    if isinstance(specs, str):
        specs = [specs]
    out: list[Monitor] = []
    if not _seen:
        out += _load_file(os.path.join(PRESET_DIR, f"{ALWAYS_ON}.yaml"), _seen=(ALWAYS_ON,))
    for spec in specs:
        path = resolve_path(spec, "monitors", PRESET_DIR, preset_names())
        if path in _seen:
            continue
        out += _load_file(path, _seen=_seen + (path,))
    unique: dict[str, Monitor] = {}
    for monitor in out:
        unique.setdefault(monitor.name, monitor)  # an included set's monitor is loaded once
    return list(unique.values())


def load_file_data(path: str) -> dict[str, Any]:
    """A monitor file as this package's schema: that tool's SlurmLogMonitor files translated (said in the log)."""
    raw = read_raw(path)
    if foreign_monitors.is_foreign(raw):
        data, notes, _ = foreign_monitors.translate(raw, source=path)
        say_once(path, notes)
        return data
    return read_yaml(path, FILE_KEYS)


def foreign_settings(specs: list[str]) -> dict[str, Any]:
    """Settings a foreign monitoring file carries for the watcher (``inactivity_threshold``), by spec order."""
    out: dict[str, Any] = {}
    for spec in specs:
        path = resolve_path(spec, "monitors", PRESET_DIR, preset_names())
        raw = read_raw(path)
        if foreign_monitors.is_foreign(raw):
            out = {**foreign_monitors.translate(raw, source=path)[2], **out}
    return out


_SAID: set[tuple[str, str]] = set()


def say_once(source: str, notes: list[str], *, warning: bool = False) -> None:
    """Log what each key of a translated file became (or a warning about it), once per file and process."""
    import logging

    logger = logging.getLogger("megatron_resilience.jobs")
    for note in notes:
        if (source, note) not in _SAID:
            _SAID.add((source, note))
            logger.log(logging.WARNING if warning else logging.INFO, "%s: %s", source, note)


def _load_file(path: str, *, _seen: tuple[str, ...]) -> list[Monitor]:
    data = load_file_data(path)
    includes = data.get("include") or []
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: include: must be a list of preset names or files, got {includes!r}")
    monitors = data.get("monitors") or []
    if not isinstance(monitors, list):
        raise ConfigError(f"{path}: monitors: must be a list of monitors, got {monitors!r}")
    out: list[Monitor] = []
    for inc in includes:
        out += load_monitors([inc], _seen=_seen)
    names: set[str] = set()
    for i, raw in enumerate(monitors):
        monitor = build_monitor(raw, source=path, index=i)
        if monitor.name in names:
            raise ConfigError(f"{path}: monitors[{i}].name: {monitor.name!r} is used twice in this file")
        names.add(monitor.name)
        out.append(monitor)
    return out


def monitors_from_dicts(items: list[dict[str, Any]], *, source: str = "job-level config") -> list[Monitor]:
    """Monitors rendered into the job's config (already validated at submit time; checked again)."""
    out = []
    for i, raw in enumerate(items):
        raw = dict(raw)
        origin = raw.pop("from", None)
        monitor = build_monitor(raw, source=source, index=i)
        out.append(replace(monitor, source=f"{origin}.yaml") if origin else monitor)
    return out


def scan(lines: list[tuple[str, str]], monitors: list[Monitor]) -> list[Signal]:
    """Signals from (source, line) pairs, in order. Lines are complete lines (no trailing newline)."""
    signals: list[Signal] = []
    for source, line in lines:
        for monitor in monitors:
            fields = monitor.match(line)
            if fields is None:
                continue
            kind = taxonomy.BY_NAME[monitor.error_type]
            severity = monitor.severity
            if fields.get("xid"):  # an Xid code: its own severity, and whether it points at the machine
                code = xid_codes.xid_code(fields["xid"])
                severity = code.severity
                fields = {**fields, "xid_meaning": code.meaning, "xid_points_at": code.points_at}
            signals.append(Signal(monitor=monitor.name, error_type=monitor.error_type,
                                  subsystem=monitor.subsystem or kind.subsystem, severity=severity,
                                  line=line.strip()[:500], source=source, fields=fields))
    return signals
