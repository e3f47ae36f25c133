"""A restart file of the log-monitoring tool (per-mode ``policies``, ``SelectiveRestartPolicy``), translated.

That tool's documented schema, accepted as it is::

    policies:
      - mode: crash                          # crash | stall | timeout | success
        implementation:
          class_name: SelectiveRestartPolicy # or AlwaysRestartPolicy, NoRestartPolicy
          max_retries: 5
          default_action: stop               # restart | stop
          restart_on_error_types: [nccl, nccl_timeout]
          restart_on_subsystems: [distributed]
          restart_on_signals: [cuda_hang]    # names of log signals (monitors)
          exclude_error_types: [oom]         # never restarted, whatever else matches

Translated once, at load, into this package's policy (``policies.py``), each key said in the log with
what it became:

* ``max_retries`` of a mode -> ``max_restarts`` of that mode. This package's error types carry their own
  mode (``nccl_timeout`` is a stall): a policy that names types of a mode with no policy of its own lends
  them its budget (that tool counted them in the policy's mode);
* per mode, in this order: ``exclude_error_types`` -> a ``stop`` rule (exclusions win, as there),
  ``restart_on_signals`` -> a ``requeue`` rule on those monitors, ``restart_on_error_types`` and
  ``restart_on_subsystems`` -> ``requeue`` rules (names through ``foreign_vocabulary.py``), ``default_action``
  -> a rule on the mode (``restart``: requeue); ``AlwaysRestartPolicy`` -> requeue the mode,
  ``NoRestartPolicy`` -> stop it; a mode without a policy stops (that tool's ``NoRestartPolicy`` default);
* what every policy here does anyway is not a rule: a finished run stops (``success``), a preemption or
  a system cancellation (``cancelled``) is requeued without spending a retry, a person's ``scancel`` is
  never retried;
* ``restart_reason`` / ``stop_reason`` / ``reason`` / ``message``: not used (the ledger and the batch log
  give the decision's own reason).

An ``AlwaysRestartPolicy`` without ``max_retries`` (unbounded there) is rejected: a requeue needs a
budget.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_resilience.config.validate import ConfigError, check_keys
from megatron_resilience.failures import foreign_vocabulary, taxonomy

FILE_KEYS = ("policies",)
ENTRY_KEYS = ("mode", "implementation")
MODES = ("crash", "stall", "timeout", "success")
IMPLEMENTATIONS = {
    "SelectiveRestartPolicy": ("class_name", "max_retries", "default_action", "restart_on_error_types",
                               "restart_on_subsystems", "restart_on_signals", "exclude_error_types",
                               "restart_reason", "stop_reason"),
    "AlwaysRestartPolicy": ("class_name", "max_retries", "reason"),
    "NoRestartPolicy": ("class_name", "message"),
}
SELECTIVE_DEFAULT_RETRIES = 3  # SelectiveRestartPolicy's max_retries when the file gives none
NOT_USED = ("restart_reason", "stop_reason", "reason", "message")


def is_foreign(data: Any) -> bool:
    return isinstance(data, dict) and "policies" in data


def translate(data: dict[str, Any], *, source: str) -> tuple[dict[str, Any], list[str]]:
    """(this package's policy as data, notes on what each key became)."""
    check_keys(source, "", data, FILE_KEYS, of=" of a restart-policy file of the per-mode schema",
               more=" (or this package's keys, without 'policies')")
    entries = data.get("policies")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: policies: must be a list of {{mode: ..., implementation: ...}}, "
                          f"got {entries!r}")
    notes: list[str] = []
    budgets: dict[str, int] = {}
    named_modes: dict[str, set[str]] = {}  # mode of a policy -> modes of the types its rules name
    specific: list[dict[str, Any]] = []
    defaults: list[dict[str, Any]] = []
    for index, entry in enumerate(entries):
        where = f"policies[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{source}: {where}: must be a mapping with keys {list(ENTRY_KEYS)}, got {entry!r}")
        check_keys(source, where, entry, ENTRY_KEYS)
        mode = entry.get("mode")
        if mode not in MODES:
            raise ConfigError(f"{source}: {where}.mode: must be one of {list(MODES)}, got {mode!r}")
        impl = entry.get("implementation")
        kind = impl.get("class_name") if isinstance(impl, dict) else None
        if kind not in IMPLEMENTATIONS:
            raise ConfigError(f"{source}: {where}.implementation.class_name: must be one of "
                              f"{list(IMPLEMENTATIONS)}, got {kind!r}")
        where = f"{where} (mode {mode}, {kind})"
        check_keys(source, where, impl, IMPLEMENTATIONS[kind])
        for key in NOT_USED:
            if key in impl:
                notes.append(f"{where}.{key}: not used (the ledger and the batch log give each decision's reason)")
        if mode == "success":
            if kind != "NoRestartPolicy":
                raise ConfigError(f"{source}: {where}.class_name: a finished run always stops here; give "
                                  f"NoRestartPolicy for mode success (or leave the mode out), got {kind!r}")
            notes.append(f"{where}: a finished run always stops (no rule)")
            continue
        budgets[mode] = _retries(impl, kind, source=source, where=where, notes=notes)
        if kind == "NoRestartPolicy":
            defaults.append({"match": {"mode": [mode]}, "action": "stop"})
            notes.append(f"{where} -> rule: stop every {mode}")
            continue
        if kind == "AlwaysRestartPolicy":
            defaults.append({"match": {"mode": [mode]}, "action": "requeue"})
            notes.append(f"{where} -> rule: requeue every {mode}, max_restarts.{mode} = {budgets[mode]}")
            continue
        rules, modes = _selective(impl, source=source, where=where, notes=notes)
        specific += rules
        named_modes[mode] = modes
        action = impl.get("default_action", "stop")
        if action not in ("restart", "stop"):
            raise ConfigError(f"{source}: {where}.default_action: must be one of ['restart', 'stop'], got {action!r}")
        defaults.append({"match": {"mode": [mode]}, "action": "requeue" if action == "restart" else "stop"})
        notes.append(f"{where}.default_action: {action} -> rule: {'requeue' if action == 'restart' else 'stop'} "
                     f"the other {mode} error types, max_restarts.{mode} = {budgets[mode]}")
    for lender, modes in named_modes.items():
        for mode in sorted(modes - set(budgets)):
            budgets[mode] = budgets[lender]
            notes.append(f"max_restarts.{mode} = {budgets[lender]}: the {lender} policy names {mode}-mode types "
                         f"and this package counts restarts per mode")
    notes.append("policies[*].max_retries keeps its number and takes this package's meaning: failures of the mode "
                 "since the run last advanced its checkpoint (an attempt that saved a newer checkpoint refills it), "
                 "not failures over the whole run; the same failure 3 times in a row without progress always stops")
    name = os.path.splitext(os.path.basename(source))[0]
    return {"name": name, "description": f"translated from {source} (per-mode policies)",
            "max_restarts": {m: budgets.get(m, 0) for m in taxonomy.MODES}, "default_action": "stop",
            "rules": specific + defaults}, notes


def _retries(impl: dict[str, Any], kind: str, *, source: str, where: str, notes: list[str]) -> int:
    if kind == "NoRestartPolicy":
        return 0
    value = impl.get("max_retries", SELECTIVE_DEFAULT_RETRIES if kind == "SelectiveRestartPolicy" else None)
    if value is None:
        raise ConfigError(f"{source}: {where}.max_retries: not given, so restarts would be unbounded; a requeue "
                          "needs a budget: give an integer >= 0")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source}: {where}.max_retries: must be an integer >= 0, got {value!r}")
    if "max_retries" not in impl:
        notes.append(f"{where}.max_retries: not given -> {value} (SelectiveRestartPolicy's default)")
    return value


def _selective(impl: dict[str, Any], *, source: str, where: str,
               notes: list[str]) -> tuple[list[dict[str, Any]], set[str]]:
    """Rules of one SelectiveRestartPolicy, in its order of precedence, and the modes of the types they name."""
    rules: list[dict[str, Any]] = []
    modes: set[str] = set()

    def names(key: str) -> list[str]:
        value = impl.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: {where}.{key}: must be a list of names, got {value!r}")
        return value

    for key, action in (("exclude_error_types", "stop"), ("restart_on_error_types", "requeue")):
        types, said = foreign_vocabulary.error_types(names(key), source=source, key=f"{where}.{key}", foreign=True)
        notes += said
        always = [t for t in types if t in taxonomy.NOT_FAILURES]
        if always:
            notes.append(f"{where}.{key}: {', '.join(always)}: not a rule here (a preemption or system cancellation "
                         "is requeued without spending a retry, a person's scancel never retried, a finished run "
                         "stops)")
        types = tuple(t for t in types if t not in taxonomy.NOT_FAILURES)
        if types:
            rules.append({"match": {"error_type": list(types)}, "action": action})
            modes |= {taxonomy.mode_of(t) for t in types if action == "requeue"}
        if key == "exclude_error_types" and names("restart_on_signals"):
            rules.append({"match": {"monitor": names("restart_on_signals")}, "action": "requeue"})
            notes.append(f"{where}.restart_on_signals: {names('restart_on_signals')} -> rule: requeue when those "
                         "monitors decided")
    subsystems, said = foreign_vocabulary.subsystems(names("restart_on_subsystems"), source=source,
                                             key=f"{where}.restart_on_subsystems", foreign=True)
    notes += said
    if subsystems:
        rules.append({"match": {"subsystem": list(subsystems)}, "action": "requeue"})
    return rules, modes
