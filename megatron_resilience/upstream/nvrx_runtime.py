"""nvidia-resiliency-ext on the compute node: module paths and rank-monitor client internals per version."""

from __future__ import annotations

import importlib
from types import ModuleType

from megatron_resilience.upstream.versions import package_version


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


def ft_end_all_sections(client) -> list[str]:
    """Close every section ``client`` has open, on the client and at its rank monitor; returns their names.

    0.4.1: ``end_all_sections()`` sends CLOSE_ALL and clears the client's own bookkeeping. 0.7.0: it sends
    nothing - the client filters messages of sections without a configured timeout, and CLOSE_ALL names no
    section - and the client keeps its open sections, so the next ``start_section`` of one of them raises
    "Tried to open step that is already open". There each open section is closed by name.
    """
    open_now = list(getattr(getattr(client, "timeouts_calc", None), "open_sections", None) or {})
    filtered = getattr(client, "_should_monitor_section", None)
    if callable(filtered) and not filtered(None):
        for name in open_now:
            try:
                client.end_section(name)
            except Exception:  # noqa: BLE001 - the monitor may have closed it already; the client's record is gone
                pass
    else:
        client.end_all_sections()
    return open_now

