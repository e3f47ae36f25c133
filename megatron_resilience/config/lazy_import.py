"""Build an object whose class imports only where the job runs (a NeMo callback on the compute node).

``run.Config(build, target="pkg.module.Class", **kwargs)`` serializes as a reference to this function,
which the login node can import without the target's dependencies (Lightning, NeMo); the job's Python
imports the target when nemo_run builds the task there.
"""

from __future__ import annotations

import importlib
from typing import Any


def build(target: str, **kwargs: Any) -> Any:
    """``pkg.module.Class(**kwargs)``, imported now."""
    module, _, name = target.rpartition(".")
    if not module:
        raise ValueError(f"lazy_import.build: target must be 'package.module.Name', got {target!r}")
    return getattr(importlib.import_module(module), name)(**kwargs)


__all__ = ["build"]
