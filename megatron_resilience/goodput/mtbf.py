"""M, the mean time between interruptions: one rule for every moment that needs it (stdlib only).

Two moments ask for M: the trainer, choosing the checkpoint interval at each restart
(``checkpoint.interval_policy=young_daly``, from its records and the job ledger as they stand), and the report,
computing the optimum after the run (from the accounting of the allocation Slurm gave it). Each passes what it
knows (allocated seconds, interruptions seen, the user's estimate); the rule and its wording are this module's,
so the interval a run chose and the optimum its report prints are explained by the same sentence.

Why a threshold: with one or two interruptions, allocated time / interruptions swings by a factor of two or more
with the next fault (Daly's interval goes with sqrt(M)); the user's estimate (``checkpoint.expected_mtbf_hours``)
is the steadier guess until the run has seen ``MIN_FAILURES`` of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_FAILURES = 3  # interruptions seen before a run's own M replaces the user's estimate


@dataclass(frozen=True, kw_only=True)
class Mtbf:
    seconds: float | None  # None: no interruption seen and no estimate
    source: str  # where ``seconds`` came from, in words a report prints
    interruptions: int  # interruptions seen


def choose(*, allocated_s: float, interruptions: int, estimate_s: float | None) -> Mtbf:
    """The run's own M (allocated / interruptions) once it has seen ``MIN_FAILURES`` interruptions, or fewer when
    there is no estimate (a rough one, said so); the user's estimate before that; None with neither."""
    if interruptions >= MIN_FAILURES or (interruptions and estimate_s is None):
        note = "" if interruptions >= MIN_FAILURES else f" (fewer than {MIN_FAILURES}: a rough estimate)"
        return Mtbf(seconds=allocated_s / interruptions, interruptions=interruptions,
                    source=f"{allocated_s:.0f} s allocated / {interruptions} interruption(s){note}")
    if estimate_s is not None:
        return Mtbf(seconds=estimate_s, interruptions=interruptions,
                    source=f"the user's estimate (checkpoint.expected_mtbf_hours; {interruptions} interruption(s) "
                           "seen)")
    return Mtbf(seconds=None, interruptions=interruptions, source="no interruption seen and no estimate")
