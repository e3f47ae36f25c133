"""ft_launcher 0.7.0's job-step log cut into its restart cycles (``records/launcher_log.py``).

Under nvidia-resiliency-ext 0.7 the rendezvous' result comes through torch's elastic agent logger with its glog-style
prefix; before, the ``restart_count=N`` line stood alone. Seen first in the Megatron-LM chaos run
(``tests/megatron_lm/test_megatron_lm_chaos_on_slurm.py``): no cycle was cut, so an Xid that ft_launcher restarted in
the job was classified ``unknown``. The lines below have 0.7.0's shape (torch 2.13), with this test's times and pids.
"""

from __future__ import annotations

from megatron_resilience.jobs.classifier import AttemptEvidence, classify
from megatron_resilience.jobs.monitors import load_monitors, scan
from megatron_resilience.records.launcher_log import launcher_cycles

AGENT = "I1129 05:54:{s} 12131 .venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py:553]"
NVRX = "2026-11-29 05:54:{s} [INFO] [vm] [workload:?(?) infra:0(0)] "


def rendezvous(seconds: str, count: int) -> list[str]:
    event = f"profiling.py:93   - Cycle: {count} Event: rendezvous_completed Node: localhost_12131_0 Rank: None " \
            f"Time: 2026-11-29 05:54:{seconds} UTC"
    return [NVRX.format(s=seconds.replace(".", ",")) + event,
            AGENT.format(s=seconds + "000") + " [default] Rendezvous complete for workers. Result:",
            AGENT.format(s=seconds + "000") + f"   restart_count={count}",
            AGENT.format(s=seconds + "000") + "   master_addr=localhost"]


LOG = [
    *rendezvous("35.415", 0),
    "[default1]: [2026-11-29 05:54:49.304538] iteration      120/     250 | consumed samples:          480 |",
    "[default0]:mn1 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=12142, name=python, GPU has fallen off the bus.",
    "E1129 05:54:49.593000 12131 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:"
    "1002] failed (exitcode: -9) local_rank: 0 (pid: 12142) of binary: /work/main/.venv/bin/python",
    NVRX.format(s="49,594") + "launcher.py:636 [default] Worker group UNHEALTHY. 30/30 attempts left; will restart "
    "worker group",
    *rendezvous("51.830", 1),
    "[default1]: [2026-11-29 05:54:58.406624] iteration      121/     250 | consumed samples:          484 |",
]


def test_the_glog_prefixed_restart_count_cuts_the_cycles():
    cycles = launcher_cycles(LOG)
    assert [(c.count, len(c.lines)) for c in cycles] == [(0, 10), (1, 3)]  # a cycle begins at its mark
    first = cycles[0]
    assert round(first.started % 60, 3) == 35.415  # the rendezvous_completed line's stamp before the mark
    assert round(first.noticed % 60, 3) == 49.594  # "will restart worker group": the first stamped detection


def test_the_restarted_cycles_xid_is_classified_from_its_own_lines():
    first = launcher_cycles(LOG)[0]
    signals = scan([("log", line) for line in first.lines], load_monitors(["megatron_production"]))
    c = classify(AttemptEvidence(exit_code=None, signals=signals))
    assert (c.error_type, c.mode) == ("xid_error", "crash"), c
