"""nvidia-resiliency-ext's in-process restart (``inprocess.Wrapper``) across 0.4.1 and 0.7.0.

| | 0.4.1 | 0.7.0 |
|---|---|---|
| health checks before a restart | the ``health_check`` given | that one plus GPU, NVLink and NIC checks (1) |
| ``rank_filter`` argument | deprecated | removed (we pass none) |
| logging | ``utils.Logging`` | ``shared_utils.log_manager`` ("nvrx" logger) |
| interruption message | ``Interruption.EXCEPTION on ranks={1}`` | ``Interruption.EXCEPTION affecting ranks ...`` |

(1) NVML-based, added by the wrapper itself whenever ``LOCAL_RANK`` is set: they fail where there is no NVML
(every CPU rank under torchrun or ft_launcher), so they are kept only where NVML answers.

Both: ``ThreadedFinalize`` insists on CUDA ("CUDA is not available"), so the trainer's finalize is a plain
``Finalize``; ``AbortTorchDistributed`` asks every group for its CUDA backend (harmless on gloo: the error stays
in its worker threads) and then destroys the process groups, which is what frees a gloo peer.

Imports torch and nvidia_resiliency_ext lazily.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

_INTERRUPTION = re.compile(r"Interruption\.(\w+)\D*([\d][\d, \-]*)?")


def import_inprocess() -> ModuleType:
    import nvidia_resiliency_ext.inprocess as inprocess

    return inprocess


def nvml_available() -> bool:
    """Whether NVML answers here (GPU nodes): 0.7's automatic hardware health checks need it."""
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any NVML failure means "no NVML"
        return False
    return True


def make_wrapper(*, hardware_health_checks: bool, **kwargs: Any):
    """``inprocess.Wrapper(**kwargs)``; without ``hardware_health_checks`` only the given ``health_check`` runs
    before a restart (0.7 adds NVML-based checks itself; on 0.4.1 there are none to remove)."""
    import os

    local_rank = None if hardware_health_checks else os.environ.pop("LOCAL_RANK", None)
    try:  # 0.7 builds its NVML checks in the constructor, when LOCAL_RANK is set (logging NVML errors without it)
        wrapper = import_inprocess().Wrapper(**kwargs)
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    if not hardware_health_checks and hasattr(wrapper, "restart_health_check"):
        wrapper.restart_health_check = kwargs.get("health_check")
    return wrapper


def describe_interruptions(message: str) -> str:
    """``"exception on rank 1, soft_timeout on rank 0"`` from the wrapper's interruption message (any version)."""
    parts = []
    for kind, ranks in _INTERRUPTION.findall(message or ""):
        ranks = ",".join(r.strip() for r in ranks.split(",") if r.strip()) if ranks else "?"
        parts.append(f"{kind.lower()} on rank{'s' if ',' in ranks or '-' in ranks else ''} {ranks}")
    return ", ".join(parts) or (message or "unknown")


def interruptions_of(store: Any, iteration: int) -> str | None:
    """The interruptions recorded in restart iteration ``iteration`` (``store``: a client of the wrapper's store),
    or None."""
    try:
        from nvidia_resiliency_ext.inprocess.attribution import format_interruption_records
        from nvidia_resiliency_ext.inprocess.store import PrefixStore

        records = PrefixStore(iteration, store).get_interruption_records()
    except Exception:  # noqa: BLE001 - attribution is best effort
        return None
    return describe_interruptions(format_interruption_records(records)) if records else None


_RETRY = re.compile(r"iteration=(\d+)\s+self\.max_iterations=(\d+)\s+state\.world_size=(\d+)\s+"
                    r"self\.min_world_size=(\d+)")


def why_restarts_ended(err: BaseException) -> str:
    """Why the wrapper stopped restarting (``RetryController``'s ``RestartAbort``, or a rank assignment that
    discarded this rank), in the words of our settings."""
    text = str(err)
    match = _RETRY.search(text)
    if match:
        iteration, limit, world, minimum = map(int, match.groups())
        if iteration >= limit:
            return f"in-process budget exhausted (inprocess.max_iterations={limit})"
        if world < minimum:
            return f"a rank was lost (world size {world} of {minimum}; a dead process is restarted by the launcher)"
    return f"{type(err).__name__}: {text.strip()}" if text.strip() else type(err).__name__

