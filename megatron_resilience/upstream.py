"""The one adapter for differences between upstream versions.

Clusters run newer releases than these machines install (FACTS.md): every
``if version ...`` about nemo_run, nvidia-resiliency-ext or megatron-core lives
here and nowhere else. Importing this module never imports torch or megatron.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from types import ModuleType


def package_version(name: str) -> tuple[int, ...] | None:
    """Installed version of a distribution as an int tuple, or None when absent."""
    try:
        raw = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts: list[int] = []
    for piece in raw.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


# --- nemo_run -------------------------------------------------------------------------------------------------


def import_nemo_run() -> ModuleType:
    """``import nemo_run`` without importing torch.

    nemo_run's YAML serializer does ``try: import torch`` at import time only to
    register a representer for ``torch.dtype`` (a ~1.5 s import, and the login-node
    rule forbids it). Our configs are plain data and never hold a dtype, so while
    nemo_run imports we make ``import torch`` fail the way it does where torch is
    not installed; a later ``import torch`` works as usual.
    """
    if "nemo_run" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("nemo_run")
    sys.modules["torch"] = None  # type: ignore[assignment]  # ModuleNotFoundError for `import torch`
    try:
        return importlib.import_module("nemo_run")
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


# --- nvidia-resiliency-ext: ft_launcher flags (owned by the plugins) -----------------------------------------


# --- nvidia-resiliency-ext / megatron-core: runtime imports (owned by the resilience runtime) -----------------
