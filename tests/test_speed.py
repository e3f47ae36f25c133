"""Speed proofs that spawn processes, started together (one module fixture) to keep the suite short.

- The CI-size form of each benchmark (benchmarks/): it runs, prints its table, writes its JSON, and the values
  are sane. Never timing thresholds (this machine is shared and loaded): structure, counts, causality, and
  figures that must follow from each other (tokens/s from step time, MFU from the FLOP count, phase sums).
  The overhead and recovery forms use 1 rank, the single-GPU layout.
- What a (re)start pays before its first step: one real 2-step trainer run under ``python -X importtime``
  (its import log lists every module the whole run imported) and the setup timeline its start record carries.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, read_metrics

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402

ARGS = {
    "throughput": ["--shape", "gpt_tiny", "--rounds", "2", "--steps", "1", "--warmup", "1", "--peak-tflops", "0.1"],
    "resilience_overhead": ["--nproc", "1", "--blocks", "2", "--block-steps", "1", "--isolated-chunks", "2",
                            "--isolated-steps", "3"],
    "recovery": ["--nproc", "1", "--faults", "rank_killed", "--modes", "sync", "--saves", "2", "--save-interval", "3",
                 "--variants", "inprocess", "--concurrent"],
}
MARKS = ["entered", "imports", "distributed", "model", "optimizer", "data", "checkpoint_load"]


def _start(args: list[str], out_path) -> subprocess.Popen:
    with open(out_path, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchmarks")
    setup_dir = root / "setup_cost"
    procs = {"setup_cost": _start([sys.executable, "-X", "importtime", "-m", "megatron_resilience",
                                   f"run_dir={setup_dir}", "train.max_steps=2"], root / "setup_cost.out")}
    for name, extra in ARGS.items():
        procs[name] = _start([sys.executable, str(BENCH / f"{name}.py"), "--device", "cpu", "--json",
                              str(root / f"{name}.json"),
                              *(["--work-dir", str(root / f"{name}_runs")] if name != "throughput" else []), *extra],
                             root / f"{name}.out")
    done = {}
    try:
        for name, proc in procs.items():
            rc = proc.wait(timeout=1500)
            text = (root / f"{name}.out").read_text(errors="replace")
            assert rc == 0, f"{name} exited {rc}:\n{text[-4000:]}"
            if name == "setup_cost":
                imported = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", text, flags=re.M))
                done[name] = (setup_dir, text, imported)
            else:
                done[name] = (json.loads((root / f"{name}.json").read_text()), text)
    finally:  # a failure or timeout leaves no launcher or rank behind
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return done


def _table_rows(text: str, header: str) -> list[list[str]]:
    lines = text.splitlines()
    i = lines.index(header)
    assert set(lines[i + 1]) <= set("|-")
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_throughput_compares_our_trainer_with_plain_pytorch(results):
    data, text = results["throughput"]
    assert data["benchmark"] == "throughput" and data["machine"]["device"] == "cpu"
    assert data["shape"] == {"layers": 2, "hidden": 64, "heads": 4, "vocab": 1024, "seq": 64, "micro_batch": 4,
                             "ffn": None}
    assert data["tokens_per_step"] == 256 and data["errors"] == {}
    variants = data["variants"]
    assert list(variants) == ["ours:sdpa", "ours:unfused", "plain:eager", "plain:compiled"]
    for name, v in variants.items():
        assert len(v["step_time_s"]) == 2 and all(t > 0 for t in v["step_time_s"]), name
        assert v["tokens_per_s"] == pytest.approx(256 / v["median_step_time_s"])
        flops = common.SHAPES["gpt_tiny"].flops_per_token()
        assert v["mfu"] == pytest.approx(flops * v["tokens_per_s"] / 0.1e12)
    assert variants["plain:eager"]["ratio_to_plain_eager"] == 1.0
    assert all(0 < v["ratio_to_plain_eager"] < 100 for v in variants.values())
    header = ("| variant | step time ms (median [IQR]) | tokens/s | tokens/s vs plain eager (per-round median) "
              "| MFU |")
    assert [row[0] for row in _table_rows(text, header)] == list(variants)
    # 6 x (2 layers x (4 x 64^2 + 2 x 64 x 256) + 64 x 1024) + 12 x 2 x 64 x 64
    assert flops == 6 * (2 * (4 * 64 * 64 + 2 * 64 * 256) + 64 * 1024) + 12 * 2 * 64 * 64


@pytest.mark.slow
def test_resilience_overhead_reports_every_mode(results):
    data, text = results["resilience_overhead"]
    assert (data["nproc"], data["straggler_cupti"], data["blocks"]) == (1, "stand-in (no CUDA)", 2)
    modes = data["modes"]
    assert list(modes) == ["off", "ft", "straggler", "rerun", "all"]
    for name, m in modes.items():
        assert len(m["step_wall_s"]) == len(m["step_cpu_s"]) == 2 and all(t > 0 for t in m["step_wall_s"]), name
    assert modes["off"]["ratio_to_off"] == [1.0, 1.0, 1.0] and modes["off"]["added_wall_us"] == [0.0, 0.0, 0.0]
    assert list(data["isolated_us"]) == ["ft sections (2 IPC round trips)", "straggler section + report check",
                                         "stop agreement all-reduce (signal, straggler)", "all hooks"]
    assert all(v > 0 for v in data["isolated_us"].values())
    header = "| mode | step wall time (ms) | ratio to off (wall) | added wall per step (µs) | added CPU per step (µs) |"
    assert [row[0] for row in _table_rows(text, header)] == list(modes)


@pytest.mark.slow
def test_recovery_splits_the_restart_and_times_saves_and_preemption(results):
    data, text = results["recovery"]
    fault = data["faults"]["rank_killed"]
    phases = fault["phases_s"]
    assert list(phases) == ["detection", "process start", "imports", "distributed init", "model", "optimizer",
                            "data", "checkpoint load", "first step"]
    assert sum(phases.values()) == pytest.approx(fault["total_s"])
    # Causality: each phase ends after it starts (process start: /proc's 10 ms clock ticks against log times).
    assert phases["process start"] > -0.05 and all(v >= 0 for k, v in phases.items() if k != "process start")
    assert (fault["resumed_from"], fault["first_step"]) == (5, 6)

    # The in-process variant (issue 24; the side-by-side figures are the benchmark's, docs/fast-recovery.md): the
    # same exception recovered without a new process, from the in-memory copy of the newest local checkpoint.
    inprocess = data["variants"]["inprocess"]
    assert list(inprocess["phases_s"]) == ["detection", "restart", "imports", "distributed init", "model",
                                           "optimizer", "data", "checkpoint load", "first step", "recompute"]
    assert sum(inprocess["phases_s"].values()) == pytest.approx(inprocess["total_s"])
    assert all(v >= 0 for v in inprocess["phases_s"].values()), inprocess["phases_s"]
    assert (inprocess["resumed_tier"], inprocess["resumed_from"], inprocess["last_step_before"]) == ("memory", 7, 7)
    assert (inprocess["attempt"]["inprocess_restart"], inprocess["attempt"]["in_job_restart"]) == (1, 0)
    row = next(r for r in _table_rows(text, "| recovered by | detection | restart | imports | distributed init | model "
                                            "| optimizer | data | checkpoint load | first step | recompute | total "
                                            "| vs process restart (persistent) | resumed from |"))
    assert (row[0], row[-1]) == ("in-process restart, in-memory checkpoint", "memory step 7")

    sync = data["saves"]["sync"]
    assert sync["rc"] == 0
    interval = [s for s in sync["saves"] if s["reason"] == "interval"]
    assert [s["step"] for s in interval][:2] == [3, 6]
    assert all(s["stall_s"] > 0 and s["bytes"] > 100_000 and s["gb_per_s"] > 0 for s in sync["saves"])
    assert math.isfinite(sync["first_vs_steady_stall"] or 1.0)
    p = sync["preemption"]
    assert p["checkpoint_step"] == sync["saves"][-1]["step"]
    if p["checkpoint_at_stop"] == "saved":  # the save at the signal, after the stop was agreed
        assert sync["saves"][-1]["reason"] == "signal"
        assert p["signal_sent"] <= p["stop_agreed"] <= p["checkpoint_durable"] <= p["launcher_exited"]
    else:  # the signal came during an interval save: that save is the stop's checkpoint
        assert p["checkpoint_at_stop"] == "already saved" and sync["saves"][-1]["reason"] == "interval", p
        assert p["signal_sent"] <= p["checkpoint_durable"] and p["stop_agreed"] <= p["launcher_exited"]
    rows = _table_rows(text, "| mode | stop agreed | checkpoint durable | launcher exited | checkpoint step "
                             "| checkpoint at stop | launcher exit code |")
    assert rows[0][0] == "sync" and rows[0][-1] == "0"
    assert "| rank_killed |" in text


@pytest.mark.slow
def test_run_imports_no_compiler_backend_and_no_login_node_packages(results):
    _, _, imported = results["setup_cost"]
    assert "megatron.core.models.gpt.gpt_model" in imported and "megatron.core.optimizer" in imported  # it is the log
    # megatron-core decorates its fusions with torch.compile at import; upstream/mcore.py defers that to the
    # first call, which a run without bias fusions never makes: inductor's compiler is not loaded.
    assert "torch._inductor.compile_fx" not in imported
    # Fault tolerance and stragglers are off here: nvidia-resiliency-ext stays unimported, as do the
    # login-node packages.
    assert not {m for m in imported if m.split(".")[0] in ("nvidia_resiliency_ext", "nemo_run", "fiddle")}


@pytest.mark.slow
def test_start_record_carries_the_setup_timeline_in_order(results):
    run_dir, log, _ = results["setup_cost"]
    start = read_metrics(run_dir, kind="start")[0]
    setup = start["setup"]
    assert list(setup["marks"]) == MARKS
    times = [setup["process_start"], *setup["marks"].values(), start["time"], read_metrics(run_dir)[0]["time"]]
    assert times == sorted(times), json.dumps(setup)
    assert start["time"] - setup["process_start"] < 900  # the process start is this process's, not the boot
    assert "data: MockGPTDataset (null tokenizer), 256 train samples (the run reads 8)" in log
