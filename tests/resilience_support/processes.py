"""The ft_launcher process of a launch started here, found among the processes below it.

Why shared: the tests that drive NeMo-Run's local launches (tests/test_plugins_local_launches.py) and Megatron-LM's
own script (tests/megatron_lm/test_megatron_lm_local.py) signal ft_launcher itself, as a scheduler would; both find
it by its command line (``ft_launcher`` as the program, or as the script that python runs).
"""

from __future__ import annotations

import os
from typing import Iterable

import psutil


def ft_launcher_among(processes: Iterable[psutil.Process]) -> psutil.Process | None:
    """The first of ``processes`` that is ft_launcher; None while there is none (a process that ended is skipped)."""
    for child in processes:
        try:
            if any(os.path.basename(part) == "ft_launcher" for part in child.cmdline()[:2]):
                return child
        except psutil.NoSuchProcess:
            continue
    return None
