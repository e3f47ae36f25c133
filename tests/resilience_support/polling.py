"""Waiting for something a launched job will do: the one polling loop of the local launches and the Slurm jobs.

Why shared: ``resilience_support.launch.wait_for`` (runs under ft_launcher here) and ``slurm.jobs.wait_until``
(jobs on the local cluster) poll the same way; each keeps its own defaults and the exception its callers expect.
No test asserts how long anything took: the timeout only bounds a wait that would otherwise never end.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def poll(predicate: Callable[[], Any], *, timeout: float, interval: float, what: str,
         error: type[Exception] = AssertionError) -> Any:
    """``predicate()``'s first truthy value, asked every ``interval`` s; ``error`` naming ``what`` once ``timeout``
    s have passed without one."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise error(f"timed out after {timeout:.0f} s waiting for {what}")
