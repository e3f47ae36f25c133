"""The report's injected-vs-classified summary (``report/injected.py``), from hand-made interruptions.

What each injected fault of a kind was classified as and where, the absorbed ones apart, the ones matched to no
interruption, not carried out, or striking a node outside the job; the accounting that produces the interruptions
is tested in ``test_goodput_accounting.py``.
"""

from __future__ import annotations

from resilience_support.goodput_records import T0


def test_the_injected_summary_says_what_each_fault_of_a_kind_was_classified_as_and_where():
    """Issue 34 §5: per fault kind, the faults classified as expected (by type); each one classified as another type,
    with the cycle whose ending named it (the place to read); the absorbed ones apart, with the ending that absorbed
    them; and the ones matched to no interruption (when) or not carried out (why)."""
    import time

    from megatron_resilience.goodput.buckets import Accounting, Interruption
    from megatron_resilience.report.injected import format_injected, summarize

    def inj(t, fault, *expected, **more):
        return {"time": T0 + t, "fault": fault, "expected": list(expected), **more}

    def ended(index, attempt, cycle, cause, injection, absorbed=()):
        t = injection["time"]
        return Interruption(index, attempt, cycle, "process", cause, t, "injected", t, t + 1, injection=injection,
                            absorbed=list(absorbed))

    ecc = [inj(10, "gpu_ecc", "ecc_error"), inj(20, "gpu_ecc", "ecc_error"), inj(31, "gpu_ecc", "ecc_error"),
           inj(90, "gpu_ecc", "ecc_error"), inj(95, "gpu_ecc", "ecc_error", ok=False, why="no rank process of job 7")]
    xid = [inj(30, "gpu_xid", "xid_error"), inj(40, "gpu_xid", "xid_error")]
    preempt = [inj(50, "preempt", "preempted", "system_cancel"), inj(60, "preempt", "preempted", "system_cancel")]
    acc = Accounting(interruptions=[
        ended(0, 0, 1, "ecc_error", ecc[0]), ended(1, 0, 8, "xid_error", ecc[1]),
        ended(2, 1, 0, "xid_error", xid[0], absorbed=[ecc[2]]), ended(3, 1, 3, "ecc_error", xid[1]),
        ended(4, 1, 4, "preempted", preempt[0]), ended(5, 2, 0, "system_cancel", preempt[1])])
    summary = summarize(acc, ecc + xid + preempt, [])
    at_90 = time.strftime("%H:%M:%S", time.localtime(T0 + 90))
    assert format_injected(summary) == [
        "injected faults: 9 (NOT all classified as injected: 4 classified as injected, 2 as another type, 1 absorbed "
        "by a fault that landed before they were noticed (counted apart), 1 matched to no interruption, 1 not done)",
        "  gpu_ecc: injected 5, classified as expected 1 (ecc_error); as xid_error 1 (attempt 0 cycle 8); absorbed 1 "
        f"(by the gpu_xid that ended attempt 1 cycle 0); matched to no interruption 1 (injected at {at_90}); not "
        "done 1 (no rank process of job 7)",
        "  gpu_xid: injected 2, classified as expected 1 (xid_error); as ecc_error 1 (attempt 1 cycle 3)",
        "  preempt: injected 2, classified as expected 2 (preempted 1, system_cancel 1)",
        "  nodes excluded by the job-level decision: none"]
    assert summary["by_fault"]["gpu_ecc"] == {
        "injected": 5, "classified_as_expected": 1, "as_expected": {"ecc_error": 1},
        "as_another": {"xid_error": ["attempt 0 cycle 8"]}, "absorbed": ["by the gpu_xid that ended attempt 1 cycle 0"],
        "no_interruption": [T0 + 90], "not_done": ["no rank process of job 7"], "outside_job": {}}

def test_hardware_faults_that_struck_a_node_outside_the_job_are_counted_per_node_and_misread_nothing():
    """``chaos --pool``: a fault that strikes an idle node costs the job nothing; the long chaos run listed 23 such
    faults one reason each. They are counted per node, apart from faults chaos could not carry out."""
    from megatron_resilience.goodput.buckets import Accounting, Interruption
    from megatron_resilience.report.injected import format_injected, summarize

    xid = {"time": T0 + 30, "fault": "gpu_xid", "expected": ["xid_error"]}
    idle = [{"time": T0 + t, "fault": "gpu_xid", "expected": ["xid_error"], "ok": False, "outside_job": True,
             "node": node, "why": f"struck {node}, a node outside job 7: its hardware fault costs the job nothing"}
            for t, node in ((40, "mn2"), (50, "mn3"), (60, "mn2"))]
    acc = Accounting(interruptions=[Interruption(0, 0, 0, "process", "xid_error", T0 + 30, "injected", T0 + 30,
                                                 T0 + 31, injection=xid)])
    summary = summarize(acc, [xid, *idle], [])
    assert (summary["all_classified"], summary["none_misread"], summary["outside_job"], summary["not_done"]) == \
        (False, True, 3, 0)
    assert format_injected(summary)[:2] == [
        "injected faults: 4 (none misread: 1 classified as injected, 3 struck a node outside the job)",
        "  gpu_xid: injected 4, classified as expected 1 (xid_error); struck a node outside the job 3 (mn2 2, mn3 1)"]
    broken = summarize(acc, [xid, {**idle[0], "outside_job": False}], [])  # not done for another reason: unexplained
    assert not broken["none_misread"] and broken["not_done"] == 1
