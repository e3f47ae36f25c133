"""A monitoring file of the log-monitoring tool (``class_name: SlurmLogMonitor``), translated into monitors.

That tool's documented schema, accepted as it is::

    class_name: SlurmLogMonitor
    poll_interval_seconds: 180          # how often it reads the logs
    check_interval_seconds: 120         # how often it checks for inactivity
    inactivity_threshold_seconds: 1200  # no log update for this long: a stall
    log_signals:                        # (``log_events`` in later versions)
      - name: cuda_oom
        pattern: 'CUDA out of memory.*Tried to allocate (?P<size>[\\d.]+\\s*[KMGT]iB)'
        pattern_type: regex             # or inactivity (the threshold above)
        state: {class_name: CrashState} # or the older ``action: error`` + ``mode: crash``
        actions: [{class_name: ErrorNoteAction, note: error}]
        metadata: {error_type: oom, subsystem: cuda, severity: critical}
        extract_groups: {allocation_size: size}

Translated once, at load, into this package's monitors (``monitors.py``); each foreign key is said
once in the log with what it became. What a signal means comes from its state (or mode/action):
a crash, stall or timeout signal can decide an attempt (severity from ``metadata.severity``:
critical -> fatal, error, warning); a success signal (``SuccessState``, ``run_finished``) is kept as
context (a finished run is known from the trainer's ``stop_reason.json`` and the exit code); progress
and checkpoint signals are dropped (progress comes from the trainer's metrics and the checkpoint
tracker). ``actions`` are not run: this package records every attempt in the ledger and acts only by
its policy. Unknown keys and names fail naming the file, the key and the allowed values.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_resilience.config.validate import ConfigError, check_keys
from megatron_resilience.failures import foreign_vocabulary, taxonomy

FILE_KEYS = ("class_name", "poll_interval_seconds", "check_interval_seconds", "inactivity_threshold_seconds",
             "log_signals", "log_events", "defaults", "termination_string", "termination_command",
             "log_path_template", "output_paths", "start_condition_cmd", "start_condition_interval_seconds")
SIGNAL_KEYS = ("name", "pattern", "pattern_type", "state", "action", "mode", "actions", "metadata",
               "extract_groups")
MONITOR_CLASSES = ("SlurmLogMonitor", "NullMonitor")
STATES = {"CrashState": "crash", "StalledState": "stall", "TimeoutState": "timeout", "SuccessState": "success",
          "StartedState": "started", "PendingState": "pending"}
MODES = ("crash", "stall", "timeout", "success")
SIGNAL_ACTIONS = ("error", "warning", "progress_update", "new_checkpoint", "run_finished")
NOT_USED = {
    "poll_interval_seconds": "not needed: the batch script decides when each attempt ends; the watcher polls every "
                             "--interval seconds",
    "check_interval_seconds": "not needed: the watcher checks inactivity at every poll",
    "termination_string": "not used: a finished run is known from the trainer's stop_reason.json and exit code",
    "termination_command": "not used: the policy decides; nothing runs on a match",
    "log_path_template": "not needed: nemo_run's job directory names each attempt's logs",
    "output_paths": "not needed: nemo_run's job directory names each attempt's logs",
    "start_condition_cmd": "not used: the job starts when Slurm starts it",
    "start_condition_interval_seconds": "not used: the job starts when Slurm starts it",
}


def is_foreign(data: Any) -> bool:
    return isinstance(data, dict) and (data.get("class_name") in MONITOR_CLASSES or "log_signals" in data
                                       or "log_events" in data)


def translate(data: dict[str, Any], *, source: str) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """(this package's monitor file as data, notes on what each key became, settings for the watcher)."""
    check_keys(source, "", data, FILE_KEYS, of=" of a SlurmLogMonitor file")
    kind = data.get("class_name", "SlurmLogMonitor")
    if kind not in MONITOR_CLASSES:
        raise ConfigError(f"{source}: class_name: must be one of {list(MONITOR_CLASSES)}, got {kind!r}")
    notes = [f"class_name: {kind} -> this package's monitors (file {os.path.basename(source)})"]
    settings: dict[str, Any] = {}
    for key, why in NOT_USED.items():
        if data.get(key) not in (None, [], ""):
            notes.append(f"{key}: {why}")
    threshold = data.get("inactivity_threshold_seconds")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
            raise ConfigError(f"{source}: inactivity_threshold_seconds: must be a number of seconds > 0, "
                              f"got {threshold!r}")
        settings["inactivity_threshold"] = float(threshold)
        notes.append(f"inactivity_threshold_seconds: {threshold:g} -> RestartPolicyPlugin.inactivity_threshold "
                     "(the watcher's stall detection, used while FT is off)")
    include = []
    for entry in data.get("defaults") or []:
        name = entry if isinstance(entry, str) else None
        if name is None or name == "_self_":
            continue
        local = os.path.join(os.path.dirname(source), f"{name}.yaml")
        include.append(local if os.path.isfile(local) else name)
        notes.append(f"defaults: {name} -> include {include[-1]}")
    monitors = []
    raw = (data.get("log_signals") or []) + (data.get("log_events") or []) if kind == "SlurmLogMonitor" else []
    if not isinstance(raw, list):
        raise ConfigError(f"{source}: log_signals: must be a list of signals, got {raw!r}")
    for index, item in enumerate(raw):
        monitor, note = _signal(item, source=source, index=index, settings=settings)
        notes.append(note)
        if monitor is not None:
            monitors.append(monitor)
    name = os.path.splitext(os.path.basename(source))[0]
    return {"name": name, "description": f"translated from {source}", "include": include,
            "monitors": monitors}, notes, settings


def _signal(item: Any, *, source: str, index: int, settings: dict[str, Any]) -> tuple[dict | None, str]:
    where = f"log_signals[{index}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{source}: {where}: must be a mapping with keys {list(SIGNAL_KEYS)}, got {item!r}")
    if isinstance(item.get("name"), str):
        where = f"{where} ({item['name']})"
    check_keys(source, where, item, SIGNAL_KEYS)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: {where}.name: must be a non-empty string, got {name!r}")
    meta = item.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ConfigError(f"{source}: {where}.metadata: must be a mapping, got {meta!r}")
    kind = _kind(item, source=source, where=where)
    if item.get("pattern_type", "regex") == "inactivity":
        return None, f"{where}: pattern_type inactivity -> the watcher's inactivity threshold (no log pattern)"
    if item.get("pattern_type", "regex") != "regex":
        raise ConfigError(f"{source}: {where}.pattern_type: must be one of ['regex', 'inactivity'], "
                          f"got {item.get('pattern_type')!r}")
    if kind in ("progress", "started", "pending"):
        return None, f"{where}: {kind} signal -> dropped (progress comes from the trainer's metrics and checkpoints)"
    foreign_sub = meta.get("subsystem")
    error_name = meta.get("error_type")
    if kind == "success":
        error_type, severity = "finished", "info"
    else:
        default = {"stall": "hang", "timeout": "time_limit"}.get(kind, "unknown")
        error_type = foreign_vocabulary.monitor_error_type(error_name, subsystem=foreign_sub, source=source,
                                                   key=f"{where}.metadata.error_type", foreign=True) \
            if error_name is not None else default
        severity = meta.get("severity", "warning" if kind == "warning" else "error")
        if severity not in foreign_vocabulary.SEVERITIES:
            raise ConfigError(f"{source}: {where}.metadata.severity: must be one of "
                              f"{list(foreign_vocabulary.SEVERITIES)}, got {severity!r}")
        severity = "warning" if kind == "warning" else foreign_vocabulary.SEVERITIES[severity]
    groups = item.get("extract_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in groups.items()):
        raise ConfigError(f"{source}: {where}.extract_groups: must map field names to capture group names, "
                          f"got {groups!r}")
    monitor = {"name": name, "error_type": error_type, "severity": severity, "pattern": item.get("pattern")}
    if groups:
        monitor["extract_groups"] = dict(groups)
    mode = taxonomy.mode_of(error_type)
    note = (f"{where}: {kind} signal, error_type {error_name or '-'} -> monitor {name} ({error_type}, {severity}"
            f"{', mode ' + mode if mode else ''}")
    if item.get("actions"):
        classes = [a.get("class_name") for a in item["actions"] if isinstance(a, dict)]
        note += f"; actions {classes} not run: the policy decides"
    return monitor, note + ")"


def _kind(item: dict[str, Any], *, source: str, where: str) -> str:
    """crash | stall | timeout | success | warning | progress | started | pending, from state, mode or action."""
    state = item.get("state")
    if state is not None:
        name = state.get("class_name") if isinstance(state, dict) else None
        if name not in STATES:
            raise ConfigError(f"{source}: {where}.state.class_name: must be one of {list(STATES)}, got {name!r}")
        return STATES[name]
    mode, action = item.get("mode"), item.get("action")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"{source}: {where}.mode: must be one of {list(MODES)} (or null), got {mode!r}")
    if action is not None and action not in SIGNAL_ACTIONS:
        raise ConfigError(f"{source}: {where}.action: must be one of {list(SIGNAL_ACTIONS)}, got {action!r}")
    if mode is not None:
        return mode
    if action == "run_finished":
        return "success"
    if action in ("progress_update", "new_checkpoint"):
        return "progress"
    if action == "warning":
        return "warning"
    return "crash" if action == "error" else "warning"
