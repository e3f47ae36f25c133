"""Restart policies: what to do with an attempt that ended, given why (its classification).

A policy file (YAML; the presets in ``presets/policies/`` are documented examples to copy)::

    name: my_policy
    description: why this policy
    monitors: megatron_production      # what to recognise (a preset or a file); the plugin may override
    max_restarts: {crash: 3, stall: 2, timeout: 1}   # job-level restarts per mode, over the whole chain
    max_attempts_without_progress: 3   # failed attempts in a row that did not advance the checkpoint
    exclude_nodes_after: 2             # a host named by hardware errors in this many attempts is excluded
    exclude_nodes_within_days: 14      # ... counting the attributions of this many days; an exclusion lasts as long
    exclude_error_types: [cuda_oom]    # never restarted, whatever the rules say
    default_action: stop               # for error types no rule matches: requeue | stop
    rules:                             # first match wins; every key given must match (lists are "any of")
      - match: {error_type: [nccl_timeout], subsystem: [communication], signal: [SIGABRT]}
        action: requeue                # requeue | requeue_excluding_nodes | stop
      - match: {mode: [stall]}         # also: monitor: [names of the monitors whose lines decided]
        action: requeue

Not failures, the same under every policy: a finished run stops, a person's ``scancel`` is never
retried, a run that stopped on a signal (preemption, time-limit warning) or was preempted by the
scheduler is requeued without spending a retry. Everything is validated when loaded (before
submission): unknown keys, unknown error types/subsystems/actions, negative numbers, a rule that can
never fire or a requeue rule without a budget (``policy_checks.py``), each error names the file and
the key. Error types and subsystems may be named in the log-monitoring tool's vocabulary too
(``foreign_vocabulary.py``), and that tool's per-mode restart files load as they are (``foreign_policy.py``).
"""

from __future__ import annotations

import os
import signal as _signal
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_resilience.config.validate import ConfigError, check_keys
from megatron_resilience.failures import foreign_vocabulary, taxonomy
from megatron_resilience.jobs import foreign_policy, policy_checks
from megatron_resilience.jobs.monitors import read_raw, read_yaml, resolve_path, say_once

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets", "policies")
FILE_KEYS = ("name", "description", "monitors", "max_restarts", "max_attempts_without_progress",
             "exclude_nodes_after", "exclude_nodes_within_days", "exclude_error_types", "default_action", "rules")
RULE_KEYS = ("match", "action")
MATCH_KEYS = ("error_type", "subsystem", "signal", "mode", "monitor")
ACTIONS = ("requeue", "requeue_excluding_nodes", "stop")
DEFAULT_ACTIONS = ("requeue", "stop")
SIGNAL_NAMES = tuple(sorted(s.name for s in _signal.Signals if not s.name.startswith("SIG_")))


@dataclass(frozen=True)
class Rule:
    action: str
    error_type: tuple[str, ...] = ()
    subsystem: tuple[str, ...] = ()
    signal: tuple[str, ...] = ()
    mode: tuple[str, ...] = ()
    monitor: tuple[str, ...] = ()

    def matches(self, error_type: str, subsystem: str, signal: str | None, monitors: tuple[str, ...] = ()) -> bool:
        return ((not self.error_type or error_type in self.error_type)
                and (not self.subsystem or subsystem in self.subsystem)
                and (not self.signal or signal in self.signal)
                and (not self.mode or taxonomy.mode_of(error_type) in self.mode)
                and (not self.monitor or bool(set(monitors) & set(self.monitor))))

    def to_dict(self) -> dict[str, Any]:
        match = {k: list(getattr(self, k)) for k in MATCH_KEYS if getattr(self, k)}
        return {"match": match, "action": self.action}


@dataclass(frozen=True)
class Policy:
    name: str
    description: str = ""
    monitors: tuple[str, ...] = ("megatron_production",)
    max_restarts: dict[str, int] = field(default_factory=lambda: {"crash": 0, "stall": 0, "timeout": 0})
    max_attempts_without_progress: int = 3
    exclude_nodes_after: int = 0
    exclude_nodes_within_days: float = 14.0  # nvidia-resiliency-ext's node attribution lookback (14 days)
    exclude_error_types: tuple[str, ...] = ()
    default_action: str = "stop"
    rules: tuple[Rule, ...] = ()
    source: str = ""
    notes: tuple[str, ...] = field(default=(), compare=False)  # what a foreign key became
    warnings: tuple[str, ...] = field(default=(), compare=False)  # rules that partly cannot work

    def action_for(self, error_type: str, subsystem: str, signal: str | None,
                   monitors: tuple[str, ...] = ()) -> tuple[str, str]:
        """(action, why) for a failure; ``exclude_error_types`` always wins, then the first rule, then the default."""
        if error_type in self.exclude_error_types:
            return "stop", f"{error_type} is in exclude_error_types of policy {self.name}"
        for i, rule in enumerate(self.rules):
            if rule.matches(error_type, subsystem, signal, monitors):
                return rule.action, f"rule {i} of policy {self.name} ({rule.to_dict()['match']})"
        return self.default_action, f"default_action of policy {self.name}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "monitors": list(self.monitors),
                "max_restarts": dict(self.max_restarts),
                "max_attempts_without_progress": self.max_attempts_without_progress,
                "exclude_nodes_after": self.exclude_nodes_after,
                "exclude_nodes_within_days": self.exclude_nodes_within_days,
                "exclude_error_types": list(self.exclude_error_types), "default_action": self.default_action,
                "rules": [r.to_dict() for r in self.rules]}


    @property
    def exclude_nodes_within_s(self) -> float:
        return self.exclude_nodes_within_days * 86400.0


def preset_names() -> list[str]:
    return sorted(n[:-5] for n in os.listdir(PRESET_DIR) if n.endswith(".yaml"))


def _error_types(source: str, key: str, value: Any, notes: list[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{source}: {key}: must be a non-empty list of error types "
                          f"({foreign_vocabulary.both_vocabularies()}), got {value!r}")
    types, said = foreign_vocabulary.error_types(value, source=source, key=key, foreign=False)
    notes += said
    return types


def _names(source: str, key: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{source}: {key}: must be a non-empty list of {list(allowed)}, got {value!r}")
    for item in value:
        if item not in allowed:
            raise ConfigError(f"{source}: {key}: must be one of {list(allowed)}, got {item!r}")
    return tuple(value)


def _count(source: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source}: {key}: must be an integer >= 0, got {value!r}")
    return value


def _days(source: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{source}: {key}: must be a number of days > 0 (e.g. 14, or 0.5 for 12 hours), "
                          f"got {value!r}")
    return float(value)


def policy_from_dict(data: dict[str, Any], *, source: str, notes: tuple[str, ...] = ()) -> Policy:
    """A validated Policy; every error names ``source`` (the file) and the key. ``notes``: a translation's."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a mapping with keys {list(FILE_KEYS)}, got {data!r}")
    check_keys(source, "", data, FILE_KEYS)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: name: must be a non-empty string, got {name!r}")
    monitors = data.get("monitors", "megatron_production")
    monitors = (monitors,) if isinstance(monitors, str) else monitors
    if not isinstance(monitors, (list, tuple)) or not monitors or not all(isinstance(m, str) for m in monitors):
        raise ConfigError(f"{source}: monitors: must be a monitor preset name, a file or a list of them, "
                          f"got {data.get('monitors')!r}")
    restarts = data.get("max_restarts", {})
    if not isinstance(restarts, dict):
        raise ConfigError(f"{source}: max_restarts: must be a mapping of {list(taxonomy.MODES)} to integers >= 0, "
                          f"got {restarts!r}")
    for mode in restarts:
        if mode not in taxonomy.MODES:
            raise ConfigError(f"{source}: max_restarts.{mode}: unknown mode; allowed: {list(taxonomy.MODES)}")
    max_restarts = {m: _count(source, f"max_restarts.{m}", restarts.get(m, 0)) for m in taxonomy.MODES}
    default_action = data.get("default_action", "stop")
    if default_action not in DEFAULT_ACTIONS:
        raise ConfigError(f"{source}: default_action: must be one of {list(DEFAULT_ACTIONS)}, got {default_action!r}")
    said = list(notes)
    excluded = data.get("exclude_error_types") or []
    excluded = _error_types(source, "exclude_error_types", excluded, said) if excluded else ()
    rules_raw = data.get("rules") or []
    if not isinstance(rules_raw, list):
        raise ConfigError(f"{source}: rules: must be a list of {{match: ..., action: ...}}, got {rules_raw!r}")
    rules = tuple(_rule(source, i, raw, said) for i, raw in enumerate(rules_raw))
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{source}: description: must be a string, got {description!r}")
    policy = Policy(
        name=name, description=description.strip(), monitors=tuple(monitors), max_restarts=max_restarts,
        max_attempts_without_progress=_count(source, "max_attempts_without_progress",
                                             data.get("max_attempts_without_progress", 3)),
        exclude_nodes_after=_count(source, "exclude_nodes_after", data.get("exclude_nodes_after", 0)),
        exclude_nodes_within_days=_days(source, "exclude_nodes_within_days",
                                        data.get("exclude_nodes_within_days", 14.0)),
        exclude_error_types=excluded, default_action=default_action, rules=rules, source=source)
    warnings = policy_checks.check(policy)  # raises on a rule that can never fire or requeue; warns on a part
    return replace(policy, notes=tuple(dict.fromkeys(said)), warnings=tuple(warnings))


def _rule(source: str, index: int, raw: Any, notes: list[str]) -> Rule:
    where = f"rules[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where}: must be a mapping with keys {list(RULE_KEYS)}, got {raw!r}")
    check_keys(source, where, raw, RULE_KEYS)
    action = raw.get("action")
    if action not in ACTIONS:
        raise ConfigError(f"{source}: {where}.action: must be one of {list(ACTIONS)}, got {action!r}")
    match = raw.get("match")
    if not isinstance(match, dict) or not match:
        raise ConfigError(f"{source}: {where}.match: must be a mapping with one or more of {list(MATCH_KEYS)}, "
                          f"got {match!r}")
    check_keys(source, f"{where}.match", match, MATCH_KEYS)
    values: dict[str, tuple[str, ...]] = {}
    for key, value in match.items():
        at = f"{where}.match.{key}"
        if key == "error_type":
            values[key] = _error_types(source, at, value, notes)
        elif key == "subsystem":
            listed = [value] if isinstance(value, str) else value
            if not isinstance(listed, list) or not listed:
                raise ConfigError(f"{source}: {at}: must be a non-empty list of subsystems, got {value!r}")
            values[key], said = foreign_vocabulary.subsystems(listed, source=source, key=at, foreign=False)
            notes += said
        elif key == "monitor":
            listed = [value] if isinstance(value, str) else value
            if not isinstance(listed, list) or not listed or not all(isinstance(v, str) and v for v in listed):
                raise ConfigError(f"{source}: {at}: must be a non-empty list of monitor names, got {value!r}")
            values[key] = tuple(listed)
        else:
            values[key] = _names(source, at, value, SIGNAL_NAMES if key == "signal" else taxonomy.MODES)
    return Rule(action=action, **values)


def load_policy(spec: str) -> Policy:
    """A preset name (``megatron_transient``) or a YAML file path -> a validated Policy.

    That tool's per-mode restart files are translated first; what each key became is logged once.
    """
    path = resolve_path(spec, "policy", PRESET_DIR, preset_names())
    raw = read_raw(path)
    if foreign_policy.is_foreign(raw):
        data, notes = foreign_policy.translate(raw, source=path)
        policy = policy_from_dict(data, source=path, notes=tuple(notes))
    else:
        policy = policy_from_dict(read_yaml(path, FILE_KEYS), source=path)
    say_once(path, list(policy.notes))
    say_once(path, list(policy.warnings), warning=True)
    return policy
