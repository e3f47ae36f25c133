"""Small helpers for ``__post_init__`` validation.

Every error names the config key (``section.field``) and, for choices, the
allowed values, so a bad override fails at submit time with a message the user
can act on instead of hours into a job.
"""

from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A config value is invalid. The message starts with the dotted key."""


def fail(key: str, message: str, value: Any) -> None:
    raise ConfigError(f"{key}: {message}, got {value!r}")


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        fail(key, f"must be one of {allowed}", value)


def check_positive(key: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        fail(key, "must be a number > 0", value)


def check_non_negative(key: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        fail(key, "must be a number >= 0", value)


def check_int(key: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        fail(key, "must be an integer", value)
    if minimum is not None and value < minimum:
        fail(key, f"must be an integer >= {minimum}", value)


def check_fraction(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        fail(key, "must be a number in [0, 1]", value)


# Signals a training process can catch and that Slurm's --signal accepts by name.
CATCHABLE_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGCONT")


def check_signal(key: str, value: Any) -> None:
    check_choice(key, value, CATCHABLE_SIGNALS)
