"""Slurm ``--signal`` values read the way Slurm reads them, so two spellings of one request compare equal.

Format ``[{R|B}:]<sig>[@<time>]`` (``sbatch(1)``): ``<sig>`` is a number or a name with or without the
``SIG`` prefix, in any case (``TERM``, ``SIGTERM``, ``15``); ``<time>`` defaults to 60 seconds; ``B:``
signals only the batch shell and ``R:`` allows reservation overlap: both change the request, so they
take part in the comparison. Megatron-Bridge and NeMo-Framework-Launcher write ``TERM@60``, NeMo 2.0
``15@60``, this project ``SIGTERM@60``: the same request.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any

from megatron_resilience.config.validate import ConfigError

_FORM = re.compile(r"^(?:([RB]{1,2}):)?([A-Za-z0-9]+)(?:@(\d+))?$")
DEFAULT_TIME = 60


@dataclass(frozen=True)
class SlurmSignal:
    number: int
    seconds: int
    flags: frozenset[str]

    def __str__(self) -> str:
        prefix = "".join(sorted(self.flags))
        return f"{prefix + ':' if prefix else ''}{signal.Signals(self.number).name}@{self.seconds}"


def parse_slurm_signal(value: Any, key: str = "executor.signal") -> SlurmSignal:
    """The request a ``--signal`` value makes; ConfigError naming ``key`` for one Slurm would reject."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    match = _FORM.match(text)
    if match is None:
        raise ConfigError(f"{key}: must be a Slurm --signal value like 'SIGTERM@60', 'TERM@60', '15@60' or "
                          f"'B:USR1@120', got {value!r}")
    flags, sig, seconds = match.groups()
    if sig.isdigit():
        number = int(sig)
        if number not in {s.value for s in signal.Signals}:
            raise ConfigError(f"{key}: signal number {number} is not a signal of this system, got {value!r}")
    else:
        name = sig.upper() if sig.upper().startswith("SIG") else f"SIG{sig.upper()}"
        if name not in signal.Signals.__members__:
            raise ConfigError(f"{key}: unknown signal {sig!r} (names like TERM, SIGUSR1, or numbers), got {value!r}")
        number = signal.Signals[name].value
    return SlurmSignal(number=number, seconds=int(seconds) if seconds is not None else DEFAULT_TIME,
                       flags=frozenset(flags or ""))


def same_slurm_signal(a: Any, b: Any, key: str = "executor.signal") -> bool:
    """Whether two ``--signal`` values make the same request (number, time, ``B:``/``R:``)."""
    return parse_slurm_signal(a, key) == parse_slurm_signal(b, key)


__all__ = ["DEFAULT_TIME", "SlurmSignal", "parse_slurm_signal", "same_slurm_signal"]
