"""M has one rule (``goodput/mtbf.choose``): the trainer choosing its checkpoint interval at a restart and the
report computing the optimum count the same interruptions and explain M in the same words."""

from __future__ import annotations

import pytest
from resilience_support.goodput_records import HANG_RUN, T0, save, start, steps

from megatron_resilience.goodput import history
from megatron_resilience.goodput.accounting import account
from megatron_resilience.goodput.buckets import AttemptWindow
from megatron_resilience.goodput.mtbf import MIN_FAILURES, Mtbf, choose
from megatron_resilience.goodput.optimum import measure


def test_the_rule_prefers_the_estimate_until_the_run_has_seen_enough_interruptions():
    assert MIN_FAILURES == 3
    assert choose(allocated_s=3600.0, interruptions=0, estimate_s=None) == Mtbf(
        seconds=None, interruptions=0, source="no interruption seen and no estimate")
    assert choose(allocated_s=3600.0, interruptions=2, estimate_s=None) == Mtbf(
        seconds=1800.0, interruptions=2, source="3600 s allocated / 2 interruption(s) (fewer than 3: a rough estimate)")
    assert choose(allocated_s=3600.0, interruptions=2, estimate_s=7200.0) == Mtbf(
        seconds=7200.0, interruptions=2,
        source="the user's estimate (checkpoint.expected_mtbf_hours; 2 interruption(s) seen)")
    assert choose(allocated_s=3600.0, interruptions=3, estimate_s=7200.0) == Mtbf(
        seconds=1200.0, interruptions=3, source="3600 s allocated / 3 interruption(s)")


def _killed_three_times() -> tuple[list[dict], dict[int, str]]:
    """Four cycles of 10 s in one 40 s allocation; the first three are killed after their third step."""
    records, endings = [], {}
    for cycle in range(4):
        t = 10.0 * cycle
        records += [start(t + 1, step=3 * cycle, resumed_from=3 * cycle or None, process_start=t + 0.5,
                          launcher_start=0.0, in_job=cycle), *steps(3 * cycle + 1, 3 * cycle + 3, at=t + 2, every=2,
                                                                    step_time=1.5),
                    save(3 * cycle + 3, t + 7.0, 0.5)]
        if cycle < 3:
            endings[cycle] = "killed"
    records.append({"kind": "end", "step": 12, "reason": "finished", "exit_code": 0, "time": T0 + 39.0})
    return records, endings


@pytest.mark.parametrize("estimate_s", [None, 600.0])
def test_the_trainer_and_the_report_count_the_same_interruptions_and_say_m_the_same_way(estimate_s):
    cases = [(HANG_RUN, {0: "hang"}, 60.0), (*_killed_three_times(), 40.0)]
    for records, endings, allocated in cases:
        if estimate_s is not None:
            records = [{"kind": "checkpoint_interval", "expected_mtbf_s": estimate_s, "time": T0}, *records]
        acc = account([AttemptWindow(index=0, start=T0, end=T0 + allocated, cycle_endings=endings)], records)
        trainer = history.mtbf(records, estimate_s=estimate_s)
        report = measure(acc, records)
        assert trainer.interruptions == report.failures == len(endings)
        # the report's allocation is Slurm's window; the trainer knows only its records (first launch -> last record)
        expected = choose(allocated_s=allocated, interruptions=len(endings), estimate_s=estimate_s)
        assert (report.m, report.m_source) == (expected.seconds, expected.source)
        last = records[-1]["time"] - T0
        assert trainer == choose(allocated_s=last, interruptions=len(endings), estimate_s=estimate_s)
        if estimate_s is not None and len(endings) < MIN_FAILURES:
            assert trainer.source == report.m_source == (
                "the user's estimate (checkpoint.expected_mtbf_hours; 1 interruption(s) seen)")
