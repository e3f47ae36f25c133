"""The optimum checkpoint interval: Daly's model against his published examples, and C, R, M and tau measured from a
run's own records (synthetic, with known seconds per phase: ``resilience_support/goodput_records.py``)."""

from __future__ import annotations

import math

import pytest
from resilience_support.goodput_records import HANG_RUN, T0, save, start, steps

from megatron_resilience.goodput import daly
from megatron_resilience.goodput.accounting import account
from megatron_resilience.goodput.buckets import AttemptWindow


def test_daly_reproduces_his_published_examples():
    """Daly 2006, figs. 3-5: C = 5 min, R = 10 min; M = 24 h -> 117 min, 6 h -> 57 min, 15 min -> 9.1 min (his
    figures give whole minutes; his eq. 37 gives 116.7, 56.7 and 9.14, which is what is checked within 0.1 min)."""
    for m_min, published, precise in ((24 * 60, 117, 116.7), (6 * 60, 57, 56.7), (15, 9.1, 9.14)):
        tau = daly.daly_interval(5 * 60, m_min * 60) / 60
        assert tau == pytest.approx(precise, abs=0.1)
        assert round(tau, 0 if published >= 10 else 1) == published
    assert daly.young_interval(5 * 60, 24 * 3600) / 60 == pytest.approx(120.0)
    # the interval is the optimum of the model's efficiency: no other interval does better
    best = daly.optimum(300, 600, 6 * 3600)
    for factor in (0.8, 0.95, 1.05, 1.25):
        assert best.efficiency(best.tau_daly * factor) <= best.e_star + 1e-12
    # efficiency of Daly's model by hand: tau / (M e^(R/M) (e^((tau + C)/M) - 1))
    assert daly.expected_efficiency(3600, 300, 600, 86400) == pytest.approx(
        3600 / (86400 * math.exp(600 / 86400) * (math.exp(3900 / 86400) - 1)))
    assert best.regret(best.tau_daly) == 0 and best.regret(best.tau_daly * 10) > 0.1


def test_daly_rejects_what_it_cannot_use():
    for c, m in ((0, 60), (5, 0), (float("nan"), 60), (5, float("inf"))):
        with pytest.raises(ValueError, match="must be a finite number > 0"):
            daly.daly_interval(c, m)
    assert daly.daly_interval(100, 40) == 40  # C >= 2M: checkpoint every M


def test_the_optimum_from_the_runs_own_c_r_m_and_tau():
    """C: median periodic save; R: mean restart (fault -> first step of the next cycle); M: the user's estimate
    until 3 interruptions; tau and s/step from consecutive periodic saves; E*, goodput / E*, regret, the interval."""
    from megatron_resilience.goodput.optimum import format_optimum, measure

    records = HANG_RUN[:1] + steps(1, 4, at=19, every=2, step_time=1.5) + [save(4, 25.0, 0.4)] + \
        steps(5, 6, at=27, every=2, step_time=1.5) + [save(6, 29.2, 0.6), {"kind": "checkpoint_interval",
                                                                            "expected_mtbf_s": 600.0,
                                                                            "time": T0 + 29.8}] + HANG_RUN[9:]
    acc = account([AttemptWindow(index=0, start=T0, end=T0 + 60, cycle_endings={0: "hang"},
                                 detections=[T0 + 36.0])], records, [{"time": T0 + 31.0, "fault": "rank_hang"}])
    o = measure(acc, records)
    assert (o.c, o.failures, o.m, o.m_source) == (0.5, 1, 600.0, "the user's estimate (checkpoint.expected_mtbf_hours; "
                                                               "1 interruption(s) seen)")
    assert o.r == pytest.approx(15.5)  # the fault (31) -> step 5's re-run (46.5)
    # between the saves at steps 4 and 6: 29.2 - 25.0 - 0.4 = 3.8 s of compute for 2 steps
    assert (o.tau, o.interval_steps, o.seconds_per_step) == (pytest.approx(3.8), 2, pytest.approx(1.9))
    best = daly.optimum(0.5, 15.5, 600.0)
    assert (o.tau_daly, o.e_star) == (pytest.approx(best.tau_daly), pytest.approx(best.e_star))
    assert o.ratio == pytest.approx(acc.goodput / best.e_star)
    assert o.regret == pytest.approx(best.e_star - best.efficiency(3.8))
    assert o.recommended_steps == round(best.tau_daly / 1.9) == 13  # Daly: 24.16 s at 1.9 s/step
    lines = format_optimum(o, acc.goodput)
    assert lines[2] == (f"interval used: tau 3.80s expects {100 * best.efficiency(3.8):.1f}% (regret "
                        f"{100 * o.regret:.1f} points of goodput vs the optimum)")
    assert lines[3].startswith("recommended: checkpoint.save_interval=13 (Daly's 24.16s at 1.900s/step)")


def test_tau_of_an_interval_longer_than_the_time_between_faults():
    """No cycle saw two periodic saves: tau is the saves' step spacing x the median wall time per step."""
    from megatron_resilience.goodput.optimum import measure

    records = [start(0), *steps(1, 5, at=2, every=2.0, step_time=1.5), save(4, 9.0, 0.4),
               start(20, step=4, resumed_from=4, in_job=1), *steps(5, 9, at=22, every=2.0, step_time=1.5),
               save(8, 29.5, 0.4)]
    o = measure(account([AttemptWindow(index=0, start=T0, end=T0 + 40, cycle_endings={0: "hang"})], records),
                records)
    assert (o.interval_steps, o.seconds_per_step, o.tau) == (4, 2.0, 8.0)
