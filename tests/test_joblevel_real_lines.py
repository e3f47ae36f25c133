"""The monitors against real messages, not our own: quoted lines (tests/joblevel_corpus/real_lines.yaml, each with
its public source) and lines captured here from real runs of the software that prints them.

Captured in this file: a host OOM (PyTorch's CPU allocator, uncaught in a gloo rank), a rank's lost peer (gloo's
``Connection closed by peer`` after another rank was SIGKILLed) and torchrun's first-failure report of that
kill, both from a real ``torchrun --nproc-per-node=2``. Slurm's own lines (slurmstepd, srun) are captured from
real jobs in tests/slurm/. No GPU here: the CUDA OOM and the NCCL watchdog lines are quoted (a lent GPU machine
would capture them; none was lent when this was written).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.classifier import AttemptEvidence, classify
from megatron_resilience.jobs.monitors import load_monitors, scan

CORPUS = os.path.join(os.path.dirname(__file__), "joblevel_corpus")
with open(os.path.join(CORPUS, "real_lines.yaml"), encoding="utf-8") as _f:
    REAL = yaml.safe_load(_f)
MONITORS = load_monitors(["megatron_production"])  # + the always-on Slurm monitors
RANK_PREFIX = "[rank0]: "  # torch.distributed's uncaught-exception hook (captured below from a real rank)


def deciding(lines: list[str]):
    """The signal that can decide (fatal before error, then the likelier root cause), else None."""
    signals = scan([("log", line) for line in lines], MONITORS)
    for severity in ("fatal", "error"):
        found = [s for s in signals if s.severity == severity]
        if found:
            return min(found, key=lambda s: taxonomy.rank(s.error_type))
    return None


def strongest(lines: list[str]):
    """The deciding signal, else the first context (info/warning) signal: srun's task lines name where ranks died."""
    return deciding(lines) or next(iter(scan([("log", line) for line in lines], MONITORS)), None)


def test_every_quoted_line_names_its_source():
    assert len(REAL) >= 30
    for item in REAL:
        assert item.get("composed", False) in (True, False), item
        # a verbatim quote cites a public report; a composed line, the upstream source whose format it follows
        allowed = ("https://github.com/", "nvidia-resiliency-ext ") if item.get("composed") else ("https://",)
        assert item["source"].startswith(allowed), item
        assert item["line"] and item["what"], item
    assert sum(1 for item in REAL if item.get("composed")) == 9


@pytest.mark.parametrize("item", REAL, ids=[f"{i:02d}-{r['what'][:40]}" for i, r in enumerate(REAL)])
def test_quoted_real_line(item):
    line = (RANK_PREFIX + item["line"]) if item.get("in_rank") else item["line"]
    found = deciding([line])
    if item["expect"] == "none":
        assert found is None, (found, line)
        return
    expect = item["expect"]
    found = strongest([line])
    assert found is not None, f"no monitor matches: {line}"
    assert (found.monitor, found.error_type) == (expect["monitor"], expect["error_type"]), (found, line)
    assert found.severity == expect.get("severity", found.severity), (found, line)  # Xids: by code
    for key, value in (expect.get("fields") or {}).items():
        assert found.fields.get(key) == value, (key, found.fields, line)


# --- captured from real runs here -------------------------------------------------------------------------------

HOST_OOM = textwrap.dedent("""
    import os, socket, torch, torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: PyTorch's CPU allocator refuses it at once
""")

PEER_KILLED = textwrap.dedent("""
    import os, signal, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 of rank 1
    dist.all_reduce(t)  # rank 0: its peer is gone
""")


@pytest.mark.slow
def test_captured_host_oom_is_cpu_oom():
    proc = subprocess.run([sys.executable, "-c", HOST_OOM], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert any(line.startswith(RANK_PREFIX + "Traceback") for line in lines), proc.stderr[-2000:]
    found = deciding(lines)
    assert (found.monitor, found.error_type, found.fields["rank"], found.fields["bytes"]) == \
        ("host_oom_allocator", "cpu_oom", "0", str(1 << 50)), proc.stderr[-2000:]


@pytest.fixture(scope="module")
def peer_killed(tmp_path_factory):
    """``torchrun --nproc-per-node=2``: rank 1 SIGKILLs itself after a collective; rank 0's next one fails."""
    folder = tmp_path_factory.mktemp("peer_killed")
    script = folder / "peer.py"
    script.write_text(PEER_KILLED)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # a monitor interval longer than rank 0 needs to raise: its traceback is printed before the agent stops it
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", "--monitor-interval=3", str(script)],
                          capture_output=True, text=True, timeout=600, cwd=folder,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc


@pytest.mark.slow
def test_captured_gloo_peer_loss_is_a_communication_error(peer_killed):
    lines = (peer_killed.stdout + peer_killed.stderr).splitlines()
    gloo = [line for line in lines if "Connection closed by peer" in line or "Connection reset by peer" in line]
    assert gloo and gloo[0].startswith("[rank0]: "), "\n".join(lines[-60:])
    found = deciding(gloo[:1])
    assert (found.monitor, found.error_type, found.fields["rank"]) == ("socket_error", "communication_error", "0")


@pytest.mark.slow
def test_captured_killed_rank_is_the_root_cause_not_its_peers_symptom(peer_killed):
    """Issue 23 section 4: the launcher's first failure (rank 1, exit -9) decides; rank 0's gloo error follows."""
    lines = (peer_killed.stdout + peer_killed.stderr).splitlines()
    assert peer_killed.returncode == 1, "\n".join(lines[-60:])
    # torchrun names the first failure by the second it was seen in: rank 1's kill, or rank 0's exit 1 when both
    # ended within one poll; its summary lists both either way
    assert any(re.search(r"exitcode +: -9 \(pid: \d+\)", line) for line in lines), "\n".join(lines[-60:])
    cls = classify(AttemptEvidence(exit_code=1, signals=scan([("log", line) for line in lines], MONITORS)))
    assert (cls.error_type, cls.source, cls.signal) == ("killed", "launcher", "SIGKILL"), cls
    assert re.fullmatch(r"rank 1( on localhost)? was killed by SIGKILL \(the launcher's report, exit code -9\); "
                        r"rank\(s\) 0 lost contact with another rank \(communication_error: a consequence, "
                        r"1 line\(s\)\)", cls.reason), cls.reason
    assert "by peer" in cls.evidence[-1], cls.evidence
