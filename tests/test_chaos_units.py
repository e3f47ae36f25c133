"""Chaos without a cluster: the seeded stream, the mixes and their checks, and a rank-level injection into a real
process that looks like a job's rank (its environment names the job, the node and the rank). The same code
against a real Slurm job is in tests/slurm/test_chaos_on_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_resilience.chaos import on_node
from megatron_resilience.chaos.cli import duration, main
from megatron_resilience.chaos.faults import FAULTS
from megatron_resilience.chaos.mix import load_mix
from megatron_resilience.chaos.runner import ChaosConfig, plan
from megatron_resilience.config.validate import ConfigError


def test_llama3_mix_is_the_papers_table_with_its_source():
    mix = load_mix("llama3")
    assert sum(c.count for c in mix.causes) == 419 and len(mix.causes) == 18
    assert (mix.causes[0].cause, mix.causes[0].count, mix.causes[0].percent, mix.causes[0].fault) == \
        ("Faulty GPU", 148, 30.1, "gpu_xid")
    assert "arXiv:2407.21783" in mix.source and "Table 5" in mix.source
    weights = mix.weights_by_fault()
    assert weights["python_bug"] == pytest.approx(56 / 419)
    assert weights["gpu_xid"] + weights["gpu_ecc"] + weights["nan"] == pytest.approx((148 + 17 + 6 + 72 + 19 + 6) / 419)
    recoverable = load_mix("llama3_recoverable")
    assert recoverable.excluded == ("python_bug",) and sum(c.count for c in recoverable.causes) == 363
    assert "python_bug" not in recoverable.weights_by_fault() and recoverable.source == mix.source
    assert set(recoverable.weights_by_fault()) == set(FAULTS) - {"python_bug"}
    local = load_mix("llama3_local_cluster")  # the acceptance run's on the one-machine cluster: no SDC either
    assert local.excluded == ("python_bug", "nan") and sum(c.count for c in local.causes) == 357
    assert set(local.weights_by_fault()) == {"gpu_xid", "gpu_ecc", "rank_hang", "preempt", "node_down"}


def test_the_seed_alone_decides_the_stream():
    mix = load_mix("llama3")
    a, b = plan(mix, seed=7, mtbf=120, count=50), plan(mix, seed=7, mtbf=120, count=50)
    assert a == b and plan(mix, seed=8, mtbf=120, count=50) != a
    assert plan(mix, seed=7, mtbf=120, count=5) == a[:5]  # a longer run meets the same first faults
    mean = sum(p.delay for p in plan(mix, seed=1, mtbf=120, count=4000)) / 4000
    assert mean == pytest.approx(120, rel=0.05)  # exponential inter-arrival times at the MTBF


def test_bad_mixes_and_arguments_name_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsource: s\ncauses:\n  - {cause: c, count: 0, fault: gpu_xid}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: causes\[0\].count: must be an integer >= 1, got 0"):
        load_mix(str(bad))
    bad.write_text("name: x\nsource: s\ncauses:\n  - {cause: c, count: 3, fault: cosmic_ray}\n")
    with pytest.raises(ConfigError, match=r"causes\[0\].fault: must be one of \['gpu_ecc', 'gpu_xid', 'nan', "):
        load_mix(str(bad))
    bad.write_text("name: x\ncauses:\n  - {cause: c, count: 3, fault: nan}\n")
    with pytest.raises(ConfigError, match="source: must say where the numbers come from"):
        load_mix(str(bad))
    with pytest.raises(ConfigError, match="is neither a preset"):
        load_mix("llama4")
    assert (duration("120s"), duration("2m"), duration("1.5h"), duration("30")) == (120, 120, 5400, 30)
    with pytest.raises(ValueError, match="chaos --mtbf: must be a finite number > 0"):
        ChaosConfig(run_dir=str(tmp_path), mtbf=0)
    assert main([str(tmp_path / "missing"), "--mtbf", "60s"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main([str(tmp_path), "--mtbf", "60s", "--seed", "7", "--max-count", "3", "--plan"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [p["fault"] for p in lines] == [p.fault for p in plan(load_mix("llama3"), seed=7, mtbf=60, count=3)]
    assert all(p["expected"] == list(FAULTS[p["fault"]].expected) for p in lines)
    assert not os.path.exists(tmp_path / "chaos_ledger.jsonl")  # --plan touches nothing


def _fake_rank(tmp_path, *, job: str, node: str, rank: int):
    """A python process with a rank's environment; its stderr goes to a file, as a job step's does."""
    err = open(tmp_path / f"rank{rank}.err", "w")
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURMD_NODENAME": node, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, stderr=err)
    return proc, tmp_path / f"rank{rank}.err"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_rank_fault_finds_the_jobs_rank_on_the_node_logs_the_line_and_kills_it(tmp_path):
    job, other_job = f"{os.getpid()}42", f"{os.getpid()}43"  # no other test's process has these
    ranks = [_fake_rank(tmp_path, job=job, node="mn3", rank=r) for r in (0, 1)]
    other = _fake_rank(tmp_path, job=other_job, node="mn3", rank=0)  # another job's rank: never touched
    try:
        deadline = time.monotonic() + 30
        while len(on_node.rank_processes(job, "mn3")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = on_node.rank_processes(job, "mn3")
        assert [(p["rank"], p["pid"]) for p in found] == [(0, ranks[0][0].pid), (1, ranks[1][0].pid)]
        assert "pytest" in found[0]["parent"] or "python" in found[0]["parent"]  # no launcher here: this test
        assert on_node.rank_processes(job, "mn1") == []  # another node's processes are not this node's
        result = on_node.inject(job, "gpu_xid", node="mn3", seed=0, rank=1)
        assert result["ok"] and (result["rank"], result["pid"], result["signal"]) == (1, ranks[1][0].pid, "SIGKILL")
        assert ranks[1][0].wait(timeout=30) == -signal.SIGKILL
        text = ranks[1][1].read_text()
        assert text == (f"mn3 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid={ranks[1][0].pid}, name=python, GPU has "
                        "fallen off the bus.\n")
        hang = on_node.inject(job, "rank_hang", node="mn3", seed=0)
        assert hang["ok"] and hang["rank"] == 0 and hang["lines"] == []
        deadline = time.monotonic() + 30
        while _state(ranks[0][0].pid) != "T" and time.monotonic() < deadline:  # the signal takes a moment
            time.sleep(0.05)
        assert _state(ranks[0][0].pid) == "T"  # stopped
        assert ranks[0][0].poll() is None and other[0].poll() is None
        assert not on_node.inject(job, "gpu_ecc", node="mn9", seed=0)["ok"]
    finally:
        for proc, _ in ranks + [other]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_nemo_megatron_resilience_chaos_is_the_same_command(tmp_path):
    """``nemo megatron_resilience chaos RUN key=value ...`` through NeMo-Run's CLI: the seeded plan, nothing touched."""
    import contextlib
    import io

    from nemo_run.cli.api import create_cli

    import megatron_resilience.recipes.cli  # noqa: F401  (registers the namespace's commands)

    argv = ["nemo", "megatron_resilience", "chaos", str(tmp_path), "mtbf=60s", "seed=7", "max_count=3", "plan=true"]
    out = io.StringIO()
    saved, sys.argv = sys.argv, argv
    try:
        with contextlib.redirect_stdout(out):
            code = create_cli()(args=argv[1:], standalone_mode=False)
    finally:
        sys.argv = saved
    assert not code
    faults = [json.loads(line)["fault"] for line in out.getvalue().splitlines() if line.startswith("{")]
    assert faults == [p.fault for p in plan(load_mix("llama3"), seed=7, mtbf=60, count=3)]


# --- the loop, with the cluster's commands replaced (tests/slurm/test_chaos_on_slurm.py runs it for real) --------

class FakeJob:
    """What the loop asks Slurm and the injector, scripted: the job's state per poll, each injection's outcome."""

    def __init__(self, states: list[str], outcomes: list[dict]):
        self.states, self.outcomes, self.calls = list(states), list(outcomes), []

    def job_nodes(self, job):
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return state, 0, ["n1"] if state == "RUNNING" else []

    def inject(self, spec, **kw):
        self.calls.append(spec.name)
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        return {"node": kw["node"], "time": time.time(), **outcome}


def run_chaos(monkeypatch, tmp_path, fake: FakeJob, **changes):
    from megatron_resilience.chaos import runner

    monkeypatch.setattr(runner.actions, "job_nodes", fake.job_nodes)
    monkeypatch.setattr(runner.actions, "inject", fake.inject)
    cfg = ChaosConfig(**{"run_dir": str(tmp_path), "mtbf": 0.02, "clock": "allocation", "seed": 3, "max_count": 3,
                         "max_time": 30.0, "poll": 0.01, "job_id": "42", "recover_timeout": 30.0, **changes})
    summary = runner.Chaos(cfg, log=lambda m: None).run()
    with open(tmp_path / "chaos_ledger.jsonl") as f:
        return summary, [json.loads(line) for line in f]


def test_on_the_allocation_clock_a_fault_waits_for_its_target_and_lands_late(monkeypatch, tmp_path):
    """The clock runs only while the job is RUNNING; a rank fault that comes due before the ranks exist is tried
    again until it lands (its lateness on record); the run ends at max_count."""
    no_rank = {"ok": False, "why": "no rank process of job 42 on n1"}
    fake = FakeJob(["PENDING"] * 5 + ["RUNNING"], [no_rank, no_rank, {"ok": True, "rank": 1}])
    summary, ledger = run_chaos(monkeypatch, tmp_path, fake)
    assert (summary["reason"], summary["injected"], summary["failed_injections"]) == ("max_count", 3, 0)
    injections = [r for r in ledger if r["kind"] == "injection"]
    assert [r["index"] for r in injections] == [0, 1, 2] and all(r["ok"] for r in injections)
    assert len(fake.calls) == 5  # the first fault tried three times, then one try each
    assert injections[0]["late_s"] >= 0 and "late_s" in injections[1]
    assert ledger[0]["kind"] == "chaos_start" and ledger[0]["config"]["clock"] == "allocation"


def test_the_allocation_clock_stands_still_while_the_job_waits_in_the_queue(monkeypatch, tmp_path):
    summary, ledger = run_chaos(monkeypatch, tmp_path, FakeJob(["PENDING"], [{"ok": True}]), max_time=0.5)
    assert (summary["reason"], summary["injected"]) == ("max_time", 0)


def test_a_refused_fault_is_not_retried(monkeypatch, tmp_path):
    refused = {"ok": False, "why": "other jobs run on n1: ['7']; a node is taken down only under the job it was given"}
    fake = FakeJob(["RUNNING"], [refused])
    summary, ledger = run_chaos(monkeypatch, tmp_path, fake, max_count=2)
    assert (summary["reason"], summary["injected"], summary["failed_injections"]) == ("max_count", 2, 2)
    assert len(fake.calls) == 2


def test_a_clock_that_does_not_exist_names_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match=r"^chaos --clock: must be one of \['training', 'allocation'\], got 'wall'$"):
        ChaosConfig(run_dir=str(tmp_path), mtbf=60, clock="wall")


def test_on_the_allocation_clock_a_hang_lands_once_the_ranks_are_past_setup(monkeypatch, tmp_path):
    """A rank stopped before it first talks to ft_launcher's rank monitor is seen by no timeout: the hang that comes
    due while the trainer is starting waits for its first step."""
    import threading

    mix = tmp_path / "hangs.yaml"
    mix.write_text("name: hangs\nsource: a test\ncauses:\n  - {cause: a dead link, count: 1, fault: rank_hang}\n")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "start", "time": time.time()}) + "\n")
    trained_at = {}

    def first_step():
        time.sleep(0.5)
        trained_at["t"] = time.time()
        with open(metrics, "a") as f:
            f.write(json.dumps({"kind": "train", "time": trained_at["t"], "step": 1}) + "\n")

    threading.Thread(target=first_step, daemon=True).start()
    fake = FakeJob(["RUNNING"], [{"ok": True, "rank": 0}])
    summary, ledger = run_chaos(monkeypatch, tmp_path, fake, mix=str(mix), max_count=1)
    [injection] = [r for r in ledger if r["kind"] == "injection"]
    assert summary["injected"] == 1 and injection["fault"] == "rank_hang"
    assert injection["time"] >= trained_at["t"] and injection["late_s"] > 0


def test_on_the_training_clock_a_fault_slurm_did_not_answer_for_is_asked_again(monkeypatch, tmp_path):
    """A loaded slurmctld can let squeue time out (MessageTimeout): a node fault whose check of the node's other jobs
    got no answer is tried again, on the training clock too, and lands; one that came back "not done" is no fault."""
    import threading

    mix = tmp_path / "down.yaml"
    mix.write_text("name: down\nsource: a test\ncauses:\n  - {cause: a power supply, count: 1, fault: node_down}\n")
    metrics = tmp_path / "metrics.jsonl"
    stop = threading.Event()

    def train():  # a trainer logging a step every 10 ms until the test is done
        step = 0
        while not stop.is_set():
            step += 1
            with open(metrics, "a") as f:
                f.write(json.dumps({"kind": "train", "time": time.time(), "step": step}) + "\n")
            time.sleep(0.01)

    threading.Thread(target=train, daemon=True).start()
    unanswered = {"ok": False, "why": "other jobs run on n1: ['(squeue failed)']; a node is taken down only under "
                                      "the job it was given"}
    fake = FakeJob(["RUNNING"], [unanswered, unanswered, {"ok": True}])
    try:
        summary, ledger = run_chaos(monkeypatch, tmp_path, fake, mix=str(mix), clock="training", max_count=1)
    finally:
        stop.set()
    [injection] = [r for r in ledger if r["kind"] == "injection"]
    assert (summary["reason"], summary["injected"], summary["failed_injections"]) == ("max_count", 1, 0)
    assert fake.calls == ["node_down"] * 3 and injection["ok"] is True and injection["late_s"] >= 0
