"""Slurm ``--time`` strings read the way Slurm reads them (``time_str2secs`` in Slurm's ``parse_time.c``).

Formats: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S`` (``D-`` alone is D days). ``0``,
``-1``, ``INFINITE`` and ``UNLIMITED`` (any case) mean no limit. The two-part form is minutes and
seconds, not hours and minutes: ``01:30`` is 90 s, a trap when ``HH:MM`` was meant, so
:func:`time_note` says so. Slurm keeps limits in whole minutes, rounding seconds up.
"""

from __future__ import annotations

import re
from typing import Any

from megatron_resilience.config.validate import ConfigError

_NO_LIMIT = ("-1", "infinite", "unlimited")
_WITH_DAYS = re.compile(r"(\d+)-(?:(\d+)(?::(\d+)(?::(\d+))?)?)?")
_WITHOUT_DAYS = re.compile(r"(\d+)(?::(\d+))?(?::(\d+))?")


def slurm_time_seconds(text: Any, key: str = "executor.time") -> int | None:
    """Seconds of a Slurm time limit; None for no limit (``0``, ``-1``, ``INFINITE``, ``UNLIMITED``) or not set.

    ``None`` (not set) renders no ``--time``: the partition's default applies, unknown here.
    Anything Slurm rejects (``""``, ``"soon"``, ``"1:2:3:4"``) raises ConfigError naming ``key``.
    """
    if text is None:
        return None
    raw = str(text).strip() if isinstance(text, (str, int)) and not isinstance(text, bool) else None
    if raw is None or not raw:
        raise ConfigError(f"{key}: must be a Slurm time like '01:30:00' or '1-00:00:00', got {text!r}")
    if raw.lower() in _NO_LIMIT:
        return None
    days = _WITH_DAYS.fullmatch(raw)
    if days:
        d, h, m, s = (int(x) if x else 0 for x in days.groups())
        seconds = d * 86400 + h * 3600 + m * 60 + s
    else:
        plain = _WITHOUT_DAYS.fullmatch(raw)
        if not plain:
            raise ConfigError(f"{key}: must be a Slurm time like '01:30:00' or '1-00:00:00', got {text!r}")
        a, b, c = plain.groups()
        if c is not None:
            seconds = int(a) * 3600 + int(b) * 60 + int(c)
        else:
            seconds = int(a) * 60 + int(b or 0)
    return seconds or None  # 0: "a time limit of zero requests that no time limit be imposed" (sbatch)


def describe_seconds(seconds: int) -> str:
    """``5400`` -> ``'1 h 30 min'``; ``90`` -> ``'1 min 30 s'``."""
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size} {unit}")
            seconds %= size
    return " ".join(parts)


def time_note(text: Any, key: str = "executor.time") -> str | None:
    """A warning for the ``MM:SS`` form (``'01:30'`` is 1 min 30 s to Slurm, not 1 h 30 min); else None."""
    raw = str(text).strip() if isinstance(text, (str, int)) else ""
    plain = _WITHOUT_DAYS.fullmatch(raw)
    if not plain or plain.group(2) is None or plain.group(3) is not None:
        return None
    seconds = slurm_time_seconds(raw, key)
    if seconds is None:
        return None
    minutes, secs = int(plain.group(1)), int(plain.group(2))
    return (f"{key}={raw!r} is {describe_seconds(seconds)} to Slurm (minutes:seconds); "
            f"for {minutes} h {secs} min write '{minutes:02d}:{secs:02d}:00'")
