"""The causal order of a detected hang in one launch's log: the fault, the monitor's detection, the restart, the resume.

Why a module of its own: tests/test_resilience_faults.py checks three hangs (in a step, in heartbeats mode, inside
a checkpoint save) against this one order, and the module holding those tests stays under the size limit.
"""

from __future__ import annotations

import re

from resilience_support.launch import Run, log_time


def assert_hang_detected_in_order(run: Run, *, fault_line: str, detected_line: str, timeout: float,
                                  resumed_step: int | None) -> list[str]:
    """The causal order, with bounds that catch a kill before the fault and a detection that never comes:
    the fault, then (>= timeout later) the monitor's line, then the restart, then the resume.

    Nothing is detected or restarted before the fault. The lower bound is the monitor's own statement (open/waited
    longer than the timeout) and the log clocks; the upper bound is what the monitor says it waited (a learned
    timeout may be longer than the configured one) plus generous slack (2 cores shared by many launches).
    """
    log = run.log().splitlines()
    faults = [i for i, line in enumerate(log) if "SIMULATED FAULT at" in line]
    assert faults, "the fault never fired:\n" + "\n".join(log)[-6000:]
    fault = faults[0]
    assert fault_line in log[fault], log[fault]
    detected = [i for i, line in enumerate(log) if detected_line in line]
    restarts = [i for i, line in enumerate(log) if "will restart worker group" in line]
    assert detected and min(detected) > fault, "detected before the fault (a healthy rank killed)"
    assert not [i for i in restarts if i < fault], "restarted before the fault"
    first = log[min(detected)]
    waited = float(re.search(r"(?:open for|Waited) ([\d.]+) seconds", first).group(1))
    assert waited >= timeout, first
    assert timeout - 1.0 <= log_time(first) - log_time(log[fault]) <= waited + 180.0, (log[fault], first)
    if resumed_step is not None:
        restart = next(i for i in restarts if i > min(detected))
        resumed = next(i for i, line in enumerate(log) if f"setup: resumed at step {resumed_step}" in line)
        assert restart < resumed, (restart, resumed)
    return log
