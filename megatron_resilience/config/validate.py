"""Small helpers for ``__post_init__`` validation.

Every error names the config key (``section.field``) and, for choices, the
allowed values, so a bad override fails at submit time with a message the user
can act on instead of hours into a job. The messages are the same whichever way
a value arrives: ``key=value`` on a command line (parsed by the field's type in
``overrides.py``) or set in Python on a recipe (checked here by ``check_types``).
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Iterable


class ConfigError(ValueError):
    """A config value is invalid. The message starts with the dotted key."""


def fail(key: str, message: str, value: Any) -> None:
    raise ConfigError(f"{key}: {message}, got {value!r}")


def check_keys(source: str, where: str, data: Any, allowed: Iterable[str], *, of: str = "", more: str = "") -> None:
    """A mapping read from a file has only ``allowed`` keys: the first unknown one is named by its path in the file
    (``<source>: <where>.<key>``), with every allowed key; ``of`` says what kind of file, ``more`` what else works.
    One wording for every file this package reads (policies, monitors, the foreign tool's files, chaos mixes)."""
    unknown = sorted(set(data) - set(allowed), key=str)
    if unknown:
        path = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(f"{source}: {path}: unknown key{of}; allowed keys: {list(allowed)}{more}")


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        fail(key, f"must be one of {allowed}", value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_finite(key: str, value: Any) -> None:
    """NaN passes every comparison (``nan <= 0`` is false), so numbers are checked for finiteness first."""
    if not _is_number(value):
        fail(key, "must be a number", value)
    if not math.isfinite(value):
        fail(key, "must be a finite number", value)


def check_positive(key: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check_finite(key, value)
    if value <= 0:
        fail(key, "must be a number > 0", value)


def check_non_negative(key: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check_finite(key, value)
    if value < 0:
        fail(key, "must be a number >= 0", value)


def check_int(key: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        fail(key, "must be an integer", value)
    if minimum is not None and value < minimum:
        fail(key, f"must be an integer >= {minimum}", value)


def check_fraction(key: str, value: Any) -> None:
    check_finite(key, value)
    if not 0.0 <= value <= 1.0:
        fail(key, "must be a number in [0, 1]", value)


def check_below_one(key: str, value: Any) -> None:
    """A probability or decay factor in [0, 1) (dropouts, Adam betas)."""
    check_finite(key, value)
    if not 0.0 <= value < 1.0:
        fail(key, "must be a number in [0, 1)", value)


# Signals a training process can catch and that Slurm's --signal accepts by name.
CATCHABLE_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGCONT")


def check_signal(key: str, value: Any) -> None:
    check_choice(key, value, CATCHABLE_SIGNALS)


# --- types from the annotations --------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints`` of a config dataclass, cached (the modules use postponed annotations)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def base_type(annotation: Any) -> tuple[Any, bool]:
    """``(type without None, None allowed)`` for ``int``, ``int | None``, ``list[str]``, ..."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return annotation, False


def type_name(annotation: Any) -> str:
    """How a key's type is shown in help: ``int``, ``float | None``, ``list[str]``."""
    kind, optional = base_type(annotation)
    name = "list[str]" if typing.get_origin(kind) is list or kind is list else getattr(kind, "__name__", str(kind))
    return f"{name} | None" if optional else name


def check_type(key: str, value: Any, annotation: Any) -> None:
    """The value has the field's type: the same message as a ``key=value`` that does not parse."""
    kind, optional = base_type(annotation)
    if value is None:
        if not optional:
            fail(key, "must not be None", value)
        return
    if kind is bool:
        if not isinstance(value, bool):
            fail(key, "must be true or false", value)
    elif kind is int:
        check_int(key, value)
    elif kind is float:
        check_finite(key, value)
    elif kind is str:
        if not isinstance(value, str):
            fail(key, "must be a string", value)
    elif typing.get_origin(kind) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            fail(key, "must be a list of strings", value)


def check_types(obj: Any, section: str) -> None:
    """Check every field of the dataclass ``obj`` against its annotation (keys ``<section>.<field>``)."""
    for name, annotation in field_types(type(obj)).items():
        check_type(f"{section}.{name}" if section else name, getattr(obj, name), annotation)
