"""A policy's rules that cannot do what they say: rejected when nothing of a rule can work, warned when a part can't.

Two mistakes pass every key check and go unnoticed until a real failure:

* a rule that can never fire: its error types are decided before any rule (a person's ``scancel`` is
  never retried, a finished run stops, a preemption or a system cancellation is requeued without
  spending a retry) or are in ``exclude_error_types`` (which always wins);
* a requeue without a budget: ``requeue`` for error types whose mode has ``max_restarts`` 0 stops at the
  first such failure ("retry budget exhausted"), the opposite of what the rule says.

When every type a rule names is affected, the file is rejected, naming the rule; when only some are,
the policy loads and a warning names the rule and those types (said in the log, at submit time).
"""

from __future__ import annotations

from typing import Any

from megatron_resilience.config.validate import ConfigError
from megatron_resilience.failures import taxonomy

WHY_NOT_A_RULE = {
    "user_cancel": "a person's scancel is never retried",
    "finished": "a finished run always stops",
    "finished_but_alive": "a finished run always stops",
    "preempted": "a preemption is always requeued without spending a retry",
    "system_cancel": "a system cancellation is always requeued without spending a retry",
}
FAILURES = tuple(t.name for t in taxonomy.ERROR_TYPES if t.mode is not None)


def check(policy: Any) -> list[str]:
    """Raise ConfigError for a rule that can do nothing it says; return warnings for rules that partly can't."""
    warnings = []
    for index, rule in enumerate(policy.rules):
        named = f"rules[{index}] (match {rule.to_dict()['match']}, action {rule.action})"  # warnings: logged per file
        where = f"{policy.source}: {named}"
        never = [t for t in rule.error_type if t in WHY_NOT_A_RULE]
        excluded = [t for t in rule.error_type if t in policy.exclude_error_types]
        live = [t for t in _candidates(rule) if t not in policy.exclude_error_types]
        if rule.error_type and not live:
            reasons = [f"{t}: {WHY_NOT_A_RULE[t]}" for t in never] + \
                      ([f"{', '.join(excluded)}: in exclude_error_types, which always wins"] if excluded else [])
            raise ConfigError(f"{where}: can never fire ({'; '.join(reasons)}); remove the rule")
        if never:
            warnings.append(f"{named}: {', '.join(never)} never reach a rule "
                            f"({'; '.join(WHY_NOT_A_RULE[t] for t in never)})")
        if excluded:
            warnings.append(f"{named}: {', '.join(excluded)} never reach it (exclude_error_types always wins)")
        if rule.action == "stop" or not live:
            continue
        modes = sorted({taxonomy.mode_of(t) for t in live})
        broke = [m for m in modes if policy.max_restarts[m] == 0]
        if broke == modes:
            raise ConfigError(f"{where}: requeues without a budget: {_by_mode(live, broke)} but "
                              f"{' and '.join(f'max_restarts.{m} is 0' for m in broke)}, so the first such failure "
                              f"stops the job; give max_restarts.{broke[0]} a number > 0, or make the rule stop")
        if broke and rule.error_type:
            warnings.append(f"{named}: {_by_mode(live, broke)} cannot be requeued: "
                            f"{' and '.join(f'max_restarts.{m} is 0' for m in broke)}")
    if policy.default_action == "requeue" and not any(policy.max_restarts.values()):
        raise ConfigError(f"{policy.source}: default_action: requeue, but every max_restarts is 0 (a requeue without "
                          "a budget stops at the first failure); give max_restarts a number > 0 for a mode")
    return warnings


def _candidates(rule: Any) -> list[str]:
    """The failure types the rule can match (by type, mode and the types' own subsystems)."""
    types = [t for t in (rule.error_type or FAILURES) if t in FAILURES]
    if rule.mode:
        types = [t for t in types if taxonomy.mode_of(t) in rule.mode]
    if rule.subsystem and rule.error_type:  # a monitor may set another subsystem: only filter named types
        types = [t for t in types if taxonomy.BY_NAME[t].subsystem in rule.subsystem] or types
    return types


def _by_mode(types: list[str], modes: list[str]) -> str:
    return "; ".join(f"{', '.join(t for t in types if taxonomy.mode_of(t) == m)} (mode {m})" for m in modes)
