"""The ``preempt_time`` a job asked Slurm for, read from its ``--signal`` value the way Slurm reads it.

The job-level config records it (``plugins/batch_decision.py``) so each preempted attempt's ledger record can say
how much of it was left (``margin_s``). ``--signal=TERM`` without ``@<time>`` is Slurm's 60 s (``sbatch(1)``);
before, it was recorded as unknown and no margin was measured for such a job.
"""

from __future__ import annotations

import pytest

from megatron_resilience.jobs.preemption_margin import measure, preempt_time_of


@pytest.mark.parametrize("value, expected", [
    ("SIGTERM@60", 60), ("TERM@120", 120), ("15@90", 90), ("B:SIGUSR1@90", 90), ("R:USR2@300", 300),
    ("TERM", 60), ("SIGTERM", 60), ("15", 60), ("B:USR1", 60),  # no @time: Slurm's default warning time
    (None, None), ("", None),  # not set
    ("TERM@soon", None), ("FOO@60", None), ("99@60", None),  # values Slurm rejects: nothing was asked for
])
def test_preempt_time_is_read_as_slurm_reads_the_signal(value, expected):
    assert preempt_time_of(value) == expected


def test_a_signal_without_time_gets_a_margin_measured_against_slurms_default():
    records = [{"kind": "signal", "first_received_time": 1000.0}]
    found = measure({"checkpoint_at_stop": "saved"}, records, exit_time=1045.0, preempt_time=preempt_time_of("TERM"))
    assert (found["preempt_time"], found["needed_s"], found["margin_s"]) == (60, 45.0, 15.0)
