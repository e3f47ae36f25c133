"""The one adapter for differences between upstream versions.

Clusters run newer releases than these machines install (FACTS.md): every
``if version ...`` about nemo_run, nvidia-resiliency-ext or megatron-core lives
here and nowhere else. Importing this module never imports torch or megatron.
"""

from __future__ import annotations

import importlib
import os
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

# Rendering happens on the login node, the job runs ft_launcher from the cluster's container, whose
# nvidia-resiliency-ext is usually newer than the one installed here. The plugins therefore render for
# one explicit version: the FaultTolerancePlugin's ``nvrx_version`` field, else the installed one, else
# NVRX_ASSUMED_VERSION (the newest behaviour we know).
#
# | nvidia-resiliency-ext | ft param flags                      | --ignore-missing-fault-tol-cfg | cfg path flag / env            |
# |-----------------------|-------------------------------------|--------------------------------|--------------------------------|
# | <= 0.3                | --ft-param-<snake>                  | yes                            | --fault-tol-cfg-path / PET_FAULT_TOL_CFG_PATH |
# | 0.4.x                 | --ft-<kebab>, --ft-<snake>, --ft-param-<snake> | yes                 | --ft-cfg-path / PET_FT_CFG_PATH |
# | >= 0.5                | --ft-<kebab>, --ft-<snake>          | removed                        | --ft-cfg-path / PET_FT_CFG_PATH |
#
# nemo_run (0.11) renders every run.FaultTolerance field as ``--ft-<snake> VALUE`` (fields equal to 0
# or None are dropped), ``max_restarts`` as ``--max-restarts N``, and all-None fields as
# ``--ignore-missing-fault-tol-cfg``.

NVRX_ASSUMED_VERSION = (0, 7)

# run.FaultTolerance fields that nemo_run turns into ft_launcher FT-param flags.
NEMO_RUN_FT_PARAM_FIELDS = (
    "workload_check_interval", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
    "rank_termination_signal", "log_level",
)


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.7"`` / ``"0.4.1"`` / ``"0.5.0rc1"`` -> int tuple; ValueError names the bad text."""
    parts: list[int] = []
    for piece in str(text).strip().split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if len(parts) < 2:
        raise ValueError(f"not a version like '0.7' or '0.4.1': {text!r}")
    return tuple(parts)


def nvrx_version_for_rendering(override: str | None) -> tuple[tuple[int, ...], str]:
    """The nvidia-resiliency-ext version the ft_launcher command is rendered for, and where it came from."""
    if override is not None:
        return parse_version(override), "FaultTolerancePlugin.nvrx_version"
    installed = package_version("nvidia-resiliency-ext")
    if installed is not None:
        return installed, "installed nvidia-resiliency-ext"
    return NVRX_ASSUMED_VERSION, "assumed (nvidia-resiliency-ext not installed here)"


def ft_param_flags(field: str, version: tuple[int, ...]) -> tuple[str, ...]:
    """Every spelling of the FT-param flag for ``field`` that ft_launcher ``version`` accepts."""
    kebab = field.replace("_", "-")
    if version < (0, 4):
        return (f"--ft-param-{field}",)
    if version < (0, 5):
        return (f"--ft-{kebab}", f"--ft-{field}", f"--ft-param-{field}")
    return (f"--ft-{kebab}", f"--ft-{field}")


def nemo_run_ft_param_flag(field: str) -> str:
    """The spelling nemo_run renders for a run.FaultTolerance field."""
    return f"--ft-{field}"


def ft_launcher_accepts_nemo_run_flags(version: tuple[int, ...]) -> bool:
    """Whether ft_launcher ``version`` parses the FT-param flags nemo_run renders."""
    return all(nemo_run_ft_param_flag(f) in ft_param_flags(f, version) for f in NEMO_RUN_FT_PARAM_FIELDS)


def ft_launcher_accepts_ignore_missing_cfg(version: tuple[int, ...]) -> bool:
    return version < (0, 5)


def ft_cfg_path_env(version: tuple[int, ...]) -> str:
    """Environment variable ft_launcher reads the FT YAML path from (torch-elastic ``PET_<dest>``)."""
    return "PET_FAULT_TOL_CFG_PATH" if version < (0, 4) else "PET_FT_CFG_PATH"


def unaccepted_ft_launcher_flags(args: list[str], version: tuple[int, ...]) -> list[str]:
    """FT flags in a rendered ft_launcher argument list that ft_launcher ``version`` would reject."""
    known = {flag for field in NEMO_RUN_FT_PARAM_FIELDS for flag in ft_param_flags(field, (0, 4))}
    known |= {"--ft-param-" + f for f in NEMO_RUN_FT_PARAM_FIELDS}
    accepted = {flag for field in NEMO_RUN_FT_PARAM_FIELDS for flag in ft_param_flags(field, version)}
    bad = [a for a in args if a.split("=")[0] in known and a.split("=")[0] not in accepted]
    if "--ignore-missing-fault-tol-cfg" in args and not ft_launcher_accepts_ignore_missing_cfg(version):
        bad.append("--ignore-missing-fault-tol-cfg")
    return bad


# Signals a launcher catches and forwards to its workers (then SIGKILL after a grace period). Any other
# signal Slurm sends to the launcher kills the launcher itself, and the trainer never sees it.
# ft_launcher 0.4.1 installs handlers for exactly these; torchrun's default is the same (recent torch,
# e.g. 2.13 here, can add more with --signals-to-handle; older torch on clusters cannot).
LAUNCHER_FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Grace period before torchrun SIGKILLs workers it forwarded a signal to: 30 s unless this env var is
# set (read by recent torch, e.g. 2.13 here; older torch ignores it). ft_launcher 0.4.1 waits
# --term-timeout (default 1800 s).
TORCHRUN_SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def ft_launcher_args_parser():
    """The installed ft_launcher's own argparse parser (imports torch: tests and compute nodes only)."""
    from nvidia_resiliency_ext.fault_tolerance import launcher

    return launcher.get_args_parser()



# --- nvidia-resiliency-ext / megatron-core: runtime imports (owned by the resilience runtime) -----------------


def import_fault_tolerance() -> ModuleType:
    """``nvidia_resiliency_ext.fault_tolerance`` (same path in every release we support)."""
    return importlib.import_module("nvidia_resiliency_ext.fault_tolerance")


def straggler_module_name() -> str:
    """The straggler ``Detector`` moved to ``attribution.straggler`` in nvidia-resiliency-ext 0.5."""
    version = package_version("nvidia-resiliency-ext")
    if version is not None and version >= (0, 5):
        return "nvidia_resiliency_ext.attribution.straggler"
    return "nvidia_resiliency_ext.straggler"


def import_straggler() -> ModuleType:
    """The module holding ``Detector`` and ``Report`` for the installed nvidia-resiliency-ext."""
    return importlib.import_module(straggler_module_name())


def ft_section_names(client_cfg) -> set[str]:
    """Sections the rank monitor knows. 0.4.x raises on an unknown section; >=0.5 skips it: we skip it always."""
    return set(getattr(client_cfg, "rank_section_timeouts", None) or {})


def ft_calculate_and_set_timeouts(client, *, heartbeats: bool, selected_sections=None,
                                  calc_out_of_section: bool = False, adjust=None) -> tuple[bool, bool]:
    """``RankMonitorClient.calculate_and_set_{hb,section}_timeouts`` with ``adjust`` applied before sending.

    Why: the public calls compute the timeouts and send them to the rank monitor in one go, so a floor on
    learned values (``ft.min_learned_timeout``) could only be applied after the monitor already uses the
    unfloored ones. 0.4.x splits the work into the client's ``timeouts_calc`` (``maybe_bump_oos_time``,
    ``synchronize_all`` (collective), ``can_get_*``/``get_*`` with EMA merging against ``current``) and the
    private ``_set_calculated_timeouts``; we do the same steps with ``adjust(timeouts) -> timeouts`` between.

    Returns ``(updated, adjusted_before_send)``. On a version without these internals it calls the public
    method (same collectives) and applies ``adjust`` to the client's copy only, so ``state_dict()`` (and
    ft_state.json, hence the next restart) gets the adjusted values: ``adjusted_before_send`` is then False.
    """
    calc = getattr(client, "timeouts_calc", None)
    send = getattr(client, "_set_calculated_timeouts", None)
    needed = (("can_get_hb_timeouts", "get_hb_timeouts") if heartbeats else
              ("maybe_bump_oos_time", "can_get_section_timeouts", "get_section_timeouts"))
    internals = (calc is not None and callable(send) and hasattr(calc, "synchronize_all")
                 and all(hasattr(calc, name) for name in needed) and hasattr(client, "_ensure_is_ready"))
    adjust = adjust or (lambda timeouts: timeouts)
    attr = "hb_timeouts" if heartbeats else "section_timeouts"
    if not internals:
        if heartbeats:
            updated = client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        else:
            updated = client.calculate_and_set_section_timeouts(
                selected_sections=selected_sections, calc_out_of_section=calc_out_of_section, skip_if_not_ready=True)
        if updated:
            setattr(client, attr, adjust(getattr(client, attr)))
        return bool(updated), False
    client._ensure_is_ready()
    if heartbeats:
        calc.synchronize_all()
        if not calc.can_get_hb_timeouts():
            return False, True
        send(new_hb_timeouts=adjust(calc.get_hb_timeouts(current=client.hb_timeouts)), new_section_timeouts=None)
        return True, True
    calc.maybe_bump_oos_time()  # the last out-of-section chunk counts too (as the public call does)
    calc.synchronize_all()
    if not calc.can_get_section_timeouts(selected_sections=selected_sections, calc_out_of_section=calc_out_of_section):
        return False, True
    timeouts = calc.get_section_timeouts(selected_sections=selected_sections, calc_out_of_section=calc_out_of_section,
                                         current=client.section_timeouts)
    send(new_hb_timeouts=None, new_section_timeouts=adjust(timeouts))
    return True, True


# --- megatron-core dist_checkpointing (owned by checkpointing) -----------------------------------------------


def prewarm_checkpoint_writer() -> None:
    """Start dist_checkpointing's write-results queue now instead of inside the first save.

    megatron-core (0.13-0.16 at least) lazily starts a *spawned* multiprocessing
    Manager for the results of every torch_dist save (sync or async), in the
    private ``filesystem_async._get_write_results_queue``; the Manager's server
    process then imports torch when it unpickles the first results. Together
    that made the first save of a process take ~3 s (later saves ~0.1 s) for the
    tiny model. Passing a torch.distributed.checkpoint object through the queue
    here pays both costs up front. Versions without the helper need nothing.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    getter = getattr(filesystem_async, "_get_write_results_queue", None)
    if getter is None:
        return
    from torch.distributed.checkpoint.storage import WriteResult

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = _start_signal_proof_results_queue()
    queue = getter()
    queue.put(WriteResult)  # pickled by name: the server process imports torch.distributed.checkpoint
    queue.get()


_RESULTS_MANAGER = None  # keeps the Manager (and its server process) alive for the life of the rank


def _start_signal_proof_results_queue():
    """The write-results queue of dist_checkpointing, served by a Manager that survives a preemption signal.

    torchrun and ft_launcher forward SIGTERM with ``os.killpg`` to each rank's
    process group, which also holds the spawned Manager process megatron-core
    starts for the queue. With default signal handling the Manager died on the
    preemption signal and the checkpoint the signal asked for failed
    (``ConnectionRefusedError`` in ``write_preloaded_data_multiproc``). Our server
    ignores SIGTERM/SIGINT and exits by itself once its rank is gone.
    """
    global _RESULTS_MANAGER
    from multiprocessing.managers import SyncManager

    from torch import multiprocessing as mp

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_results_server_init, initargs=(os.getpid(),))
    _RESULTS_MANAGER = manager
    return manager.Queue()


def _results_server_init(rank_pid: int) -> None:
    """Runs in the Manager's server process: ignore termination signals, leave when the rank process is gone."""
    import signal
    import threading
    import time

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)

    def leave_with_the_rank() -> None:
        while os.getppid() == rank_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=leave_with_the_rank, name="leave-with-rank", daemon=True).start()
