"""How close the run came to the best it could have done: C, R, M and tau measured from the run, Daly's E*.

- C: the median blocking time of the run's periodic saves (``checkpoint`` records, ``reason=interval``;
  any save when there is none);
- R: the mean allocated time from an interruption to the first training step of the next cycle (detection,
  restart, startup, checkpoint load; queue wait is not allocated and not counted): the mean, not the median,
  because restart costs add up and on a loaded machine a few slow restarts are a real part of them;
- M: by the rule the trainer chose its interval with (:func:`megatron_resilience.goodput.mtbf.choose`), from the
  allocation Slurm gave the run and the accounting's interruptions; the user's estimate comes from the trainer's
  ``checkpoint_interval`` records. Every interruption counts, failures and preemptions alike: a scheduler's
  preemption or maintenance is as unplanned for the job as a failure (Llama 3 counts host maintenance among its
  unexpected interruptions), and it costs a restart too (a planned stop at a time limit counts as well: it cannot be
  told apart);
- tau: the median compute time between two periodic saves of one cycle (the wall time between their
  requests minus the earlier one's stall), and the steps between them (so seconds per step); when no
  cycle lived through two periodic saves (an interval longer than the time between faults), the spacing
  of the periodic saves' steps x the median wall time per step.

E* is Daly's expected efficiency at his optimum interval for (C, R, M); the report prints the run's
goodput / E*, the regret of the interval used (E* - E(tau)), and the ``checkpoint.save_interval`` in
steps that the optimum corresponds to at the measured seconds per step.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from megatron_resilience.goodput import daly
from megatron_resilience.goodput.buckets import Accounting
from megatron_resilience.goodput.history import (
    between_saves,
    periodic_save_seconds,
    save_spacing,
    wall_seconds_per_step,
)
from megatron_resilience.goodput.mtbf import choose


@dataclass
class Optimum:
    c: float | None = None
    r: float | None = None
    m: float | None = None
    m_source: str = ""
    tau: float | None = None
    seconds_per_step: float | None = None
    interval_steps: int | None = None  # the interval used (steps between the periodic saves measured)
    failures: int = 0  # interruptions seen (failures and preemptions)
    tau_young: float | None = None
    tau_daly: float | None = None
    e_star: float | None = None
    e_used: float | None = None  # Daly's expected efficiency of the interval used
    ratio: float | None = None  # goodput / E*
    regret: float | None = None  # E* - E(tau)
    recommended_steps: int | None = None
    missing: str = ""  # why E* could not be computed
    trainer: str = ""  # a foreign trainer read from its log (megatron_lm, megatron_bridge): its own flag is named

    @property
    def interval_setting(self) -> str:
        """The setting a user changes to apply the recommendation, in the trainer's own words."""
        return {"megatron_lm": "--save-interval", "megatron_bridge": "checkpoint.save_interval"}.get(
            self.trainer, "checkpoint.save_interval")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _user_mtbf(records: list[dict[str, Any]]) -> float | None:
    """The user's estimate as the trainer recorded it (``checkpoint_interval`` records), in seconds."""
    found = [r.get("expected_mtbf_s") for r in records if r.get("kind") == "checkpoint_interval"]
    found = [float(v) for v in found if isinstance(v, (int, float)) and v > 0]
    return found[-1] if found else None


def measure(acc: Accounting, records: list[dict[str, Any]]) -> Optimum:
    out = Optimum(trainer=next((str(r["trainer"]) for r in records if r.get("kind") == "start" and r.get("trainer")),
                               ""))
    saves = periodic_save_seconds(records)
    if saves:
        out.c = statistics.median(saves)
    out.failures = len(acc.interruptions)
    restarts = [i.restart_seconds for i in acc.interruptions if i.restart_seconds is not None]
    if restarts:
        out.r = statistics.fmean(restarts)
    m = choose(allocated_s=acc.allocated, interruptions=out.failures, estimate_s=_user_mtbf(records))
    out.m = m.seconds
    out.m_source = m.source if m.seconds is not None else ""
    between = between_saves(records)
    if between:
        out.tau = statistics.median(s for s, _ in between)
        out.seconds_per_step = statistics.median(s / n for s, n in between)
        out.interval_steps = int(statistics.median(n for _, n in between))
    else:  # no cycle lived through two periodic saves (a long interval): their spacing x the wall time per step
        spacing, per_step = save_spacing(records), wall_seconds_per_step(records)
        if per_step:
            out.seconds_per_step = per_step
            if spacing:
                out.interval_steps, out.tau = spacing, spacing * per_step
    missing = [name for name, value in (("C (no checkpoint records)", out.c),
                                        ("M (no interruption and no estimate)", out.m)) if value is None]
    if missing:
        out.missing = "cannot compute E*: " + ", ".join(missing)
        return out
    r = out.r if out.r is not None else 0.0
    if out.r is None:
        out.missing = "R not measured (no restart seen): E* assumes R = 0"
    best = daly.optimum(max(out.c, 1e-6), r, out.m)
    out.tau_young, out.tau_daly, out.e_star = best.tau_young, best.tau_daly, best.e_star
    out.ratio = acc.goodput / best.e_star if best.e_star > 0 else None
    if out.tau is not None:
        out.e_used = best.efficiency(out.tau)
        out.regret = best.regret(out.tau)
    if out.seconds_per_step:
        out.recommended_steps = max(1, round(best.tau_daly / out.seconds_per_step))
    return out


def format_optimum(o: Optimum, goodput: float) -> list[str]:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s" if v < 60 else f"{v / 60:.1f}min"

    lines = [f"measured: C {s(o.c)} (median blocking save), R {s(o.r)} (mean: interruption -> first step of the "
             f"next cycle), "
             f"M {s(o.m)}" + (f" ({o.m_source})" if o.m_source else "") +
             (f", tau {s(o.tau)} ({o.interval_steps} steps, {o.seconds_per_step:.3f}s/step)" if o.tau else "")]
    if o.e_star is None:
        lines.append(o.missing)
        return lines
    lines.append(f"optimum: Young {s(o.tau_young)}, Daly {s(o.tau_daly)}; E* {100 * o.e_star:.1f}% expected "
                 f"goodput at the optimum; this run {100 * goodput:.1f}% = {o.ratio:.3f} x E*")
    if o.regret is not None:
        lines.append(f"interval used: tau {s(o.tau)} expects {100 * o.e_used:.1f}% (regret "
                     f"{100 * o.regret:.1f} points of goodput vs the optimum)")
    if o.recommended_steps is not None:
        ours = "" if o.trainer else ", or checkpoint.interval_policy=young_daly"
        lines.append(f"recommended: {o.interval_setting}={o.recommended_steps} (Daly's {s(o.tau_daly)} at "
                     f"{o.seconds_per_step:.3f}s/step){ours}")
    if o.missing:
        lines.append(o.missing)
    return lines
