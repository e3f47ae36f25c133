"""The goodput report of a real Megatron-LM run, read from the trainer's own log (no ``metrics.jsonl``).

Two runs, launched as a Megatron-LM user launches them: ``run.run(run.Script(kill_rank_at_step.py, <Megatron-LM
flags>), LocalExecutor(2 ranks, launcher="ft"), plugins=[FaultTolerancePlugin, PreemptionPlugin,
RestartPolicyPlugin])`` (the driver of ``test_megatron_lm_local.py``), the trainer being megatron-core 0.19.2's
``megatron.training.pretrain`` through ``pretrain_gpt.py``; rank 1 is killed (SIGKILL) inside step 13 of the
first worker group; ft_launcher restarts the group, which resumes from the step-10 checkpoint and finishes 20 steps
(saves every 5). In the other, rank 0 gets SIGTERM during step 13: Megatron-LM's exit-signal handler (any rank's
signal stops all) saves after step 13 and every rank exits 0. (A SIGTERM to ft_launcher, which forwards it, broke
that save here: the save's helper process got it too and the rank died with ``BrokenPipeError``; the plugins'
lane, ``test_megatron_lm_local.py``, is where that path is tested.) Then ``python -m megatron_resilience.report``
reads the job folder nemo_run wrote (``kill_rank_at_step.py`` beside this file sends the signals).

Every expected value is read from the captured log here with patterns of this test's own (not the package's
reader): the steps of each process, the saves, the load, the ``save-checkpoint``/``load-checkpoint`` timers, the
launcher's stamps. Exact where the accounting places a logged duration whole (saves, loads, the allocation, the
fault and its detection, steps and their counts); bounded where Megatron-LM's first step of a process may not fit
between the training loop's start mark and its line (its timer starts before that mark is printed), which the
accounting clips. Nothing is mocked but the GPU (the CPU layer). Run with ``make test-megatron-lm``.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import statistics
import subprocess
import time

import local_driver
import pytest
from megatron_lm_run import HERE, NEWEST, tiny_gpt_args

from megatron_resilience.goodput import daly
from megatron_resilience.jobs import evidence as ev
from megatron_resilience.records import megatron_log
from megatron_resilience.report import run_report
from megatron_resilience.report.cli import main as report_main

pytestmark = pytest.mark.slow

TRAIN_ITERS, SAVE_INTERVAL, KILL_AT = 20, 5, 13
STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})"
ITER = re.compile(r"\[" + STAMP + r"\] iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+\d+ \| "
                  r"elapsed time per iteration \(ms\): ([\d.]+) \|")
SAVING = re.compile(r"\[" + STAMP + r"\] saving checkpoint at iteration\s+(\d+) to ")
SAVED = re.compile(r"\[" + STAMP + r"\] successfully saved checkpoint from iteration\s+(\d+) ")
LOADED = re.compile(r"successfully loaded checkpoint from (\S+) .* at iteration (\d+)$")
TIMER = re.compile(r"    (save|load)-checkpoint \.+: \(([\d.]+), ([\d.]+)\)$")
MARK = re.compile(r"\[([^\]]+)\] datetime: " + STAMP)
LAUNCHER = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \[")


def epoch(text: str) -> float:
    whole, _, micro = text.partition(".")
    return time.mktime(time.strptime(whole, "%Y-%m-%d %H:%M:%S")) + int(micro or 0) / 1e6


def launch(root, name: str, env: dict[str, str]) -> tuple[subprocess.Popen, object, str]:
    """``run.run`` of the tiny GPT (20 steps, saves every 5) in a driver process of its own."""
    ckpt = str(root / f"{name}_ckpt")
    proc, home = local_driver.start(root, name, os.path.join(HERE, "kill_rank_at_step.py"),
                                    tiny_gpt_args(train_iters=TRAIN_ITERS, save=ckpt, save_interval=SAVE_INTERVAL),
                                    env=env)
    return proc, home, ckpt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not os.path.isdir(os.path.join(NEWEST, "megatron", "training")):
        pytest.fail(f"{NEWEST} has no megatron.training: run scripts/newest/install.sh .venv-newest (make does)")
    root = tmp_path_factory.mktemp("megatron_lm_report")
    started = time.monotonic()
    launched = {  # both at once: most of their time is imports and first saves
        "killed": launch(root, "killed", {"KILL_RANK_AT_STEP": str(KILL_AT), "KILL_RANK": "1"}),
        "sigterm": launch(root, "sigterm", {"KILL_RANK_AT_STEP": str(KILL_AT), "KILL_RANK": "0",
                                            "KILL_SIGNAL": "SIGTERM"}),
    }
    out = {}
    for name, (proc, home, ckpt) in launched.items():
        code = proc.wait(timeout=1200)
        job_dirs = glob.glob(str(home / "experiments" / name / "*" / name))
        driver_log = (root / f"{name}.driver.log").read_text(errors="replace")
        assert code == 0 and job_dirs, driver_log[-4000:]
        (log_path,) = glob.glob(os.path.join(job_dirs[0], "**", "combined.log"), recursive=True)
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
        out[name] = {"dir": job_dirs[0], "lines": lines, "report": run_report.build(job_dirs[0], slurm_lookup=False),
                     "ckpt": ckpt}
    print(f"both runs {time.monotonic() - started:.0f} s")
    return out


@pytest.fixture(scope="module")
def killed(runs):
    return runs["killed"]


def log_facts(lines: list[str], processes: int = 2) -> dict:
    """What the captured log says, read line by line with this test's own patterns."""
    starts = [k for k, line in enumerate(lines) if MARK.search(line) and "after megatron is initialized" in line]
    assert len(starts) == processes, starts  # killed: the first worker group, and the one ft_launcher restarted
    starts.append(len(lines))
    steps: list[list[tuple[int, float, float]]] = [[] for _ in range(processes)]  # per process: (step, stamp, ms)
    timers: dict[str, list[float]] = {"save": [], "load": []}
    saves, loads, stamps, savings, exits = [], [], [], {}, []
    for k, line in enumerate(lines):
        process = 0 if k < starts[1] else 1
        for m in ITER.finditer(line):
            steps[process].append((int(m.group(2)), epoch(m.group(1)), float(m.group(3))))
            stamps.append(epoch(m.group(1)))
        if (m := SAVED.search(line)) is not None:
            saves.append((process, int(m.group(2)), epoch(m.group(1))))
            stamps.append(epoch(m.group(1)))
        if (m := LOADED.search(line)) is not None:
            loads.append(int(m.group(2)))
        if (m := TIMER.search(line)) is not None:
            timers[m.group(1)].append(float(m.group(3)) / 1000.0)  # the slowest rank's
        if (m := MARK.search(line)) is not None:
            stamps.append(epoch(m.group(2)))
            if m.group(1) == "exiting program after receiving SIGTERM.":
                exits.append(epoch(m.group(2)))
        if (m := SAVING.search(line)) is not None:
            savings[int(m.group(2))] = epoch(m.group(1))
    launcher = [epoch(f"{m.group(1)}.{m.group(2)}000") for line in lines if (m := LAUNCHER.match(line))]
    noticed = [epoch(f"{m.group(1)}.{m.group(2)}000") for line in lines
               if "will restart worker group" in line and (m := LAUNCHER.match(line))]
    return {"steps": steps, "saves": saves, "loads": loads, "timers": timers, "begin": min(launcher),
            "end": max(stamps), "noticed": noticed, "savings": savings, "exits": exits}


def own_seconds(lines: list[tuple[int, float, float]]) -> dict[int, float]:
    """Each step's own seconds: the second line of a process averages its first two steps (Megatron-LM does not
    reset its interval timer after the first line; training.py ``is_first_iteration``)."""
    out = {}
    for k, (step, _, ms) in enumerate(lines):
        out[step] = (2 * ms - lines[0][2] if k == 1 else ms) / 1000.0
    return out


def test_each_process_its_steps_and_the_steps_the_kill_lost(killed):
    facts = log_facts(killed["lines"])
    first, second = ([s for s, _, _ in p] for p in facts["steps"])
    assert first == list(range(1, KILL_AT)) and second == list(range(SAVE_INTERVAL * 2 + 1, TRAIN_ITERS + 1))
    assert facts["loads"] == [2 * SAVE_INTERVAL]
    rows = [(r.cycle, r.steps, r.resumed_from, r.recomputed, r.world_size) for r in killed["report"].rows]
    assert rows == [(0, "1-12", 0, 0, 2), (1, "11-20", 10, 2, 2)]
    assert killed["report"].rows[1].ended == "finished"
    # the ledger's progress (what the EXIT trap records for an attempt) from the same records
    records = megatron_log.records_from_logs(megatron_log.log_files(killed["dir"]))
    progress = ev.progress(records, records, killed["ckpt"])
    assert (progress["last_step"], progress["checkpoint_step"], progress["recomputed_steps"]) == (20, 20, 2)
    assert [(c["resumed_from"], c["last_step"]) for c in progress["cycles"]] == [(0, 12), (10, 20)]


def test_every_bucket_against_the_log(killed):
    facts, acc = log_facts(killed["lines"]), killed["report"].accounting
    assert [s for _, s, _ in facts["saves"]] == [5, 10, 15, 20]
    assert acc.allocated == pytest.approx(facts["end"] - facts["begin"], abs=1e-6)
    assert acc.productive + sum(acc.badput.values()) == pytest.approx(acc.allocated, abs=1e-6)
    assert acc.badput["checkpoint_save"] == pytest.approx(sum(facts["timers"]["save"]), abs=1e-6)
    assert acc.badput["checkpoint_restore"] == pytest.approx(sum(facts["timers"]["load"]), abs=1e-6)
    assert len(facts["timers"]["save"]) == 4 and len(facts["timers"]["load"]) == 2
    first, second = (own_seconds(p) for p in facts["steps"])
    # steps 11 and 12 ran twice: their second run is wasted; every step's first run is productive
    rerun = second[11] + second[12]
    firsts = sum(first.values()) + sum(v for s, v in second.items() if s > 12)
    clip = first[1] + second[11]  # a process's first step may not fit before its line (see the docstring)
    assert rerun - second[11] <= acc.badput["wasted_progress"] <= rerun + 1e-6
    assert firsts - clip <= acc.productive <= firsts + 1e-6
    assert acc.badput["restart_inprocess"] == acc.badput["restart_job"] == acc.badput["eval"] == 0.0
    assert acc.badput["restart_process"] > 0 and acc.badput["startup"] > 0 and acc.badput["data_loading"] > 0


def test_the_interruption_its_detection_and_the_optimum(killed):
    facts, report = log_facts(killed["lines"]), killed["report"]
    (i,) = report.accounting.interruptions
    last_alive = max([t for _, t, _ in facts["steps"][0]] + [t for p, _, t in facts["saves"] if p == 0])
    assert (i.kind, i.fault_source) == ("process", "last sign of life")
    assert i.fault_time == pytest.approx(last_alive, abs=1e-6)
    assert i.detected == pytest.approx(facts["noticed"][0], abs=1e-6)  # ft_launcher's "will restart worker group"
    o = report.optimum
    assert o.c == pytest.approx(statistics.median(facts["timers"]["save"]), abs=1e-9)
    assert o.failures == 1 and o.m == pytest.approx(report.accounting.allocated)
    assert o.r == pytest.approx(i.restart_seconds)
    best = daly.optimum(o.c, o.r, o.m)
    assert o.e_star == pytest.approx(best.e_star) and o.recommended_steps == max(1, round(best.tau_daly /
                                                                                        o.seconds_per_step))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert report_main([killed["dir"], "--png", "none"]) == 0
    text = out.getvalue()
    assert f"recommended: --save-interval={o.recommended_steps} (Daly's" in text
    assert "final: trainer ended: finished at step 20" in text
    # per-attempt throughput: each process's steps, tokens/s from the global batch and seq_length (4 x 32)
    assert "| 2     | 2  | 1-12 (12)  |" in text and "| 2     | 2  | 11-20 (10) |" in text, text


def test_a_sigterm_is_a_preemption_whose_save_keeps_every_step(runs):
    """Rank 0 gets SIGTERM during step 13; Megatron-LM's exit-signal handler saves after that step and every rank
    exits 0: one process, a preemption, nothing lost."""
    run = runs["sigterm"]
    facts, report = log_facts(run["lines"], processes=1), run["report"]
    steps = [s for s, _, _ in facts["steps"][0]]
    stopped = steps[-1]
    assert steps == list(range(1, KILL_AT + 1)), steps  # the handler checks after each step: it stops after 13
    assert [s for _, s, _ in facts["saves"]] == [5, 10, stopped] and len(facts["exits"]) == 1
    assert [(r.cycle, r.steps, r.resumed_from, r.recomputed, r.ended) for r in report.rows] == \
        [(0, f"1-{stopped}", 0, 0, "signal")]
    acc = report.accounting
    assert report.windows[0].ending == "preempted" and not report.windows[0].failure
    (i,) = acc.interruptions
    assert (i.kind, i.cause, i.fault_source) == ("preemption", "preempted", "signal")
    assert i.fault_time == pytest.approx(facts["savings"][stopped], abs=1e-6)  # noticed: its save began
    assert acc.allocated == pytest.approx(facts["end"] - facts["begin"], abs=1e-6)
    assert acc.productive + sum(acc.badput.values()) == pytest.approx(acc.allocated, abs=1e-6)
    assert acc.badput["checkpoint_save"] == pytest.approx(sum(facts["timers"]["save"]), abs=1e-6)
    assert acc.badput["checkpoint_restore"] == pytest.approx(sum(facts["timers"]["load"]), abs=1e-6)
    assert acc.badput["wasted_progress"] == 0.0
    (own,) = (own_seconds(p) for p in facts["steps"])
    assert sum(own.values()) - own[1] <= acc.productive <= sum(own.values()) + 1e-6
    assert [r["reason"] for r in megatron_log.records_from_logs(megatron_log.log_files(run["dir"]))
            if r["kind"] == "checkpoint"] == ["interval", "interval", "signal"]
    assert report.optimum.failures == 1 and report.final == f"trainer ended: signal at step {stopped}"
