"""The optimum checkpoint interval and the efficiency it buys: Young (1974) and Daly (2006).

Symbols (seconds), as in J. T. Daly, "A higher order estimate of the optimum checkpoint interval
for restart dumps", Future Generation Computer Systems 22 (2006) 303-312:

- ``C`` (Daly's delta): the time one checkpoint holds up training (the save's blocking time);
- ``R``: the restart time: from a failure to the first training step of the next cycle
  (detection, restart, startup, checkpoint load), not counting the work to redo;
- ``M``: the mean time between (unplanned) interruptions;
- ``tau``: the compute time between two checkpoints (the interval).

Daly's model of the expected wall time of a job whose failure-free solve time is ``T_s``::

    T_w(tau) = M * exp(R / M) * (exp((tau + C) / M) - 1) * T_s / tau

so the expected efficiency (the goodput an ideal run can expect) is ``T_s / T_w``. Its optimum
is Daly's higher-order interval; Young's first-order ``sqrt(2 C M)`` is the classic estimate. The
work lost to each failure (on average about half an interval) is inside this model, which is why a
run can be compared with ``E*`` as a whole: goodput / E* says how close it came to the best it
could have done with its own C, R and M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def young_interval(c: float, m: float) -> float:
    """Young's first-order optimum: sqrt(2 C M)."""
    _check(c=c, m=m)
    return math.sqrt(2.0 * c * m)


def daly_interval(c: float, m: float) -> float:
    """Daly's higher-order optimum (his eq. 37): for C < 2M,
    ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C``; else M."""
    _check(c=c, m=m)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def expected_efficiency(tau: float, c: float, r: float, m: float) -> float:
    """T_s / T_w of Daly's model for checkpoints every ``tau`` seconds of compute (in (0, 1])."""
    _check(c=c, m=m)
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau: must be a finite number > 0, got {tau!r}")
    if not (math.isfinite(r) and r >= 0):
        raise ValueError(f"R: must be a finite number >= 0, got {r!r}")
    exponent = (tau + c) / m
    if exponent > 700 or r / m > 700:  # exp overflows: the job essentially never finishes
        return 0.0
    return tau / (m * math.exp(r / m) * math.expm1(exponent))


@dataclass(frozen=True)
class Optimum:
    """The best interval for (C, R, M) and what it and an interval actually used can expect."""

    c: float
    r: float
    m: float
    tau_young: float
    tau_daly: float
    e_star: float  # expected efficiency at Daly's interval

    def efficiency(self, tau: float) -> float:
        return expected_efficiency(tau, self.c, self.r, self.m)

    def regret(self, tau: float) -> float:
        """E* - E(tau): the fraction of the allocation an interval of ``tau`` is expected to lose to the optimum."""
        return max(0.0, self.e_star - self.efficiency(tau))


def optimum(c: float, r: float, m: float) -> Optimum:
    tau = daly_interval(c, m)
    return Optimum(c=c, r=r, m=m, tau_young=young_interval(c, m), tau_daly=tau,
                   e_star=expected_efficiency(tau, c, r, m))


def _check(*, c: float, m: float) -> None:
    for name, value in (("C", c), ("M", m)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: must be a finite number > 0 (seconds), got {value!r}")
