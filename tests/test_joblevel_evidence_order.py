"""What a line means before it decides: an Xid by its code (failures/xid_codes.py), and evidence in time order
(jobs/time_order.py): a peer's symptom after another rank's own failure is its consequence."""

from __future__ import annotations

import pytest

# --- Xid codes (failures/xid_codes.py, from NVIDIA's Xid catalog) -----------------------------------------------------

@pytest.mark.parametrize("code, severity, points_at, host_role", [
    ("63", "info", "handled", "reporter"),  # row remapping recorded: the driver handled it
    ("64", "warning", "machine", "hardware"),  # a retirement that could not be recorded: the machine, not fatal
    ("31", "warning", "application", "reporter"),  # a page fault: usually the application's
    ("79", "fatal", "machine", "hardware"),  # fell off the bus
    ("95", "fatal", "machine", "hardware"),  # uncontained ECC error
    ("999", "fatal", "machine", "hardware"),  # not in the table: read as every Xid was before it
])
def test_an_xid_line_takes_its_codes_severity_and_blames_its_node_only_for_the_machine(code, severity, points_at,
                                                                                       host_role):
    from megatron_resilience.failures.xid_codes import xid_code
    from megatron_resilience.jobs.attribution import mentions
    from megatron_resilience.jobs.monitors import load_monitors, scan

    line = f"nid002: [  219.470994] NVRM: Xid (PCI:0000:07:00): {code}, pid=1896, an event"
    [signal] = [s for s in scan([("log", line)], load_monitors(["megatron_nccl"])) if s.monitor == "xid_kernel"]
    assert (signal.error_type, signal.severity, signal.fields["xid"], signal.fields["xid_points_at"]) == (
        "xid_error", severity, code, points_at)
    assert signal.fields["xid_meaning"] == xid_code(code).meaning
    assert [(m.node, m.role) for m in mentions([signal], ["nid001", "nid002"])] == [("nid002", host_role)]


# --- evidence in time order (jobs/time_order.py) ---------------------------------------------------------------------

@pytest.mark.parametrize("line, expected", [
    ("[rank0]:[E1128 10:02:11.123456 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught", (11, 28, 36131.123456)),
    ("[2026-11-28 10:02:11,880] [ERROR] [ft_launcher5120@nid001] failed (exitcode: 1)", (11, 28, 36131.88)),
    ("2026-11-28T10:02:11.5+00:00 NVRM: Xid (PCI:0000:38:00): 79", (11, 28, 36131.5)),
    ("Nov  8 10:02:11 worker4 kernel: [  219.470994] NVRM: Xid (PCI:0000:07:00): 48", (11, 8, 36131.0)),
    ("[rank9]: ValueError: bad batch shape (4, 2047)", None),
])
def test_time_stamps_of_each_format(line, expected):
    from megatron_resilience.jobs.time_order import stamp

    assert stamp(line) == (pytest.approx(expected) if expected else None)


def test_a_peer_symptom_after_another_ranks_failure_is_a_consequence_by_stamp_or_by_place():
    from megatron_resilience.jobs.monitors import load_monitors, scan
    from megatron_resilience.jobs.time_order import later_symptoms

    watchdog = ("[rank0]:[E1128 10:12:02.1 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=4411, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
                "600081 milliseconds before timing out.")
    bug = "[rank9]: ValueError: bad batch shape (4, 2047)"
    monitors = load_monitors(["megatron_production"])

    def symptoms(*sourced):
        signals = [s for s in scan(list(sourced), monitors) if s.severity in ("fatal", "error")]
        return [s.error_type for s in later_symptoms(signals)]

    assert symptoms(("log:a", bug), ("log:a", watchdog)) == ["nccl_timeout"]  # after it in one log
    assert symptoms(("log:a", watchdog), ("log:a", bug)) == []  # the mirror: the timeout came first
    assert symptoms(("log:a", bug), ("log:b", watchdog)) == []  # two files, one stamp: no order, the type decides
    xid = "Nov 28 10:02:11 nid002 kernel: NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus."
    assert symptoms(("log:a", watchdog), ("log:b", xid)) == ["nccl_timeout"]  # two files, both stamped: by time
    assert symptoms(("log:a", watchdog.replace("10:12", "09:12")), ("log:b", xid)) == []
    assert symptoms(("log:a", "[rank0]: ValueError: x"), ("log:a", watchdog)) == []  # the same rank's own
