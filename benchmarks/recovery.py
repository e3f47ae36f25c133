"""What a fault, a preemption and a checkpoint cost in wall time, phase by phase.

    .venv/bin/python benchmarks/recovery.py [--device auto|cpu|cuda] [--shape ...] [--nproc N]
                                             [--faults rank_killed,rank_hung] [--saves 4] [--modes sync,async]
                                             [--variants persistent,local,inprocess]

The real trainer under the real ft_launcher (``--nproc`` ranks: 2 on CPU, 1 on one GPU), FT on:

1. Fault -> first completed step after the in-job restart, per ``--faults`` kind (simulated on the last rank
   at step 8, checkpoint at step 5; rank_hung detected by a 5 s step timeout, check interval 1 s). Split
   with the launcher's log and the ``setup`` timeline every ``start`` record carries
   (runtime/setup_timeline.py): detection (fault banner -> the launcher's failure / timeout line), process
   start (-> the new rank 0 process exists), imports (-> torch, megatron-core and our modules loaded),
   distributed init, model, optimizer, data, checkpoint load, first step (-> its ``train`` record).
2. Per checkpoint mode (sync, async): a run saving every ``--save-interval`` steps; after ``--saves`` saves
   the launcher gets SIGTERM, as Slurm's ``--signal`` would deliver it. Reported: every save's stall (time
   training was held up), size, and GB/s (bytes / time to durable), the first save of the process against
   the median of the others; and signal -> stop agreed -> checkpoint durable -> launcher exited.
   ``checkpoint`` records written by older trainers carry only ``seconds``: then stall = seconds, durable =
   the record's time, and the size is read from the checkpoint directory.

3. Recovery variants, side by side for the same fault (``--variants``): an exception on the last rank at step
   8, recovered by (a) a process restart from the persistent checkpoint (every 5 steps: today's path), (b) a
   process restart from a node-local checkpoint (every step), (c) an in-process restart from the in-memory copy
   of the newest local checkpoint. Fault -> first productive step (the first step past the last one trained
   before the fault), split into detection (fault -> the launcher's failure line, or the wrapper's detection),
   restart (-> the training function is entered again: a new process, or the wrapper's abort, finalize and
   barriers), the setup phases above, the first step, and the steps recomputed. Prints each variant's total
   against (a)'s.

Prints markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import common  # noqa: E402

FAULT_STEP, FAULT_CKPT_INTERVAL = 8, 5
# FT section timeouts: generous (a loaded machine must not turn a slow save into a "fault"), except the step
# timeout of the rank_hung run, which is what detects that fault.
TIMEOUTS = {"setup": 900.0, "step": 300.0, "checkpointing": 900.0, "out_of_section": 900.0}
HUNG_STEP_TIMEOUT = 5.0
PHASES = ["detection", "process start", "imports", "distributed init", "model", "optimizer", "data",
          "checkpoint load", "first step"]
VARIANT_PHASES = ["detection", "restart", "imports", "distributed init", "model", "optimizer", "data",
                  "checkpoint load", "first step", "recompute"]
VARIANTS = {  # name -> (what recovers, overrides)
    "persistent": ("process restart, persistent checkpoint", []),
    "local": ("process restart, local checkpoint", ["checkpoint.local_dir={run}/local", "checkpoint.local_interval=1"]),
    "inprocess": ("in-process restart, in-memory checkpoint",
                  ["checkpoint.local_dir={run}/local", "checkpoint.local_interval=1", "inprocess.enabled=true"]),
}


# --- launching ---------------------------------------------------------------------------------------------------


def ft_launcher() -> str:
    beside = Path(sys.executable).parent / "ft_launcher"
    found = str(beside) if beside.exists() else shutil.which("ft_launcher")
    if not found:
        sys.exit("ft_launcher not found next to the interpreter nor on PATH")
    return found


def launch(run_dir: Path, overrides: list[str], *, nproc: int, device: str, timeouts: dict[str, float],
           max_restarts: int) -> subprocess.Popen:
    from resilience_support.launch import write_ft_yaml
    from resilience_support.ports import reserve

    run_dir.mkdir(parents=True, exist_ok=True)
    write_ft_yaml(run_dir / "ft.yaml", timeouts)
    block = reserve()  # the trainer's stores on a port block no other launch on this machine holds
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="error", **block.env(),
               FAULT_TOL_FINISHED_FLAG_FILE=str(run_dir / "finished.flag"),
               PYTHONPATH=os.pathsep.join(p for p in [str(common.REPO), os.environ.get("PYTHONPATH", "")] if p))
    cmd = [ft_launcher(), "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.5", "--workers-stop-timeout=15", f"--ft-cfg-path={run_dir / 'ft.yaml'}",
           "-m", "megatron_resilience", f"run_dir={run_dir}", f"checkpoint.save={run_dir / 'ckpt'}",
           f"train.device={device}", "ft.enabled=true", *overrides]
    log = open(run_dir / "launcher.log", "ab")
    proc = subprocess.Popen(cmd, cwd=common.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.port_block = block  # released when this process ends
    return proc


def wait(proc: subprocess.Popen, timeout: float, run_dir: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"run in {run_dir} did not finish within {timeout}s; see {run_dir / 'launcher.log'}")
    finally:
        if proc.poll() is not None:
            proc.port_block.release()


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def log_time(line: str) -> float:
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[,.](\d{3})", line)
    if not m:
        raise ValueError(f"no timestamp in {line!r}")
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


# --- 1. fault -> first step --------------------------------------------------------------------------------------


def measure_fault(root: Path, kind: str, *, nproc: int, device: str, base: list[str]) -> dict:
    run_dir = root / kind
    overrides = [*base, f"train.max_steps={FAULT_STEP + 4}", f"checkpoint.save_interval={FAULT_CKPT_INTERVAL}",
                 "ft.simulate_fault=true", f"ft.simulated_fault_type={kind}", f"ft.simulated_fault_rank={nproc - 1}",
                 f"ft.simulated_fault_step={FAULT_STEP}"]
    proc = launch(run_dir, overrides,
                  nproc=nproc, device=device, max_restarts=1,
                  timeouts={**TIMEOUTS, "step": HUNG_STEP_TIMEOUT if kind == "rank_hung" else TIMEOUTS["step"]})
    rc = wait(proc, 1800, run_dir)
    if rc != 0:
        raise RuntimeError(f"{kind} run failed (rc={rc}); see {run_dir / 'launcher.log'}")
    lines = (run_dir / "launcher.log").read_text(errors="replace").splitlines()
    fault_i = next(i for i, line in enumerate(lines) if "SIMULATED FAULT at" in line)
    fault = log_time(lines[fault_i])
    marker = "has been open for" if kind == "rank_hung" else "failed (exitcode:"
    detected = log_time(next(line for line in lines[fault_i:] if marker in line))
    recs = records(run_dir)
    restart = [i for i, r in enumerate(recs) if r.get("kind") == "start"][-1]
    start = recs[restart]
    first = next(r for r in recs[restart:] if r.get("kind") == "train")
    marks, process_start = start["setup"]["marks"], start["setup"]["process_start"]
    points = [fault, detected, process_start, marks["imports"], marks["distributed"], marks["model"],
              marks["optimizer"], marks["data"], marks["checkpoint_load"], first["time"]]
    return {"phases_s": dict(zip(PHASES, [b - a for a, b in zip(points, points[1:])])),
            "total_s": first["time"] - fault, "interpreter_s": marks["entered"] - process_start,
            "resumed_from": start["step"], "first_step": first["step"], "log": str(run_dir / "launcher.log")}


# --- 3. recovery variants ---------------------------------------------------------------------------------------


def measure_variant(root: Path, variant: str, *, nproc: int, device: str, base: list[str]) -> dict:
    """One launch: the exception fault recovered by ``variant``; fault -> first productive step, phase by phase."""
    run_dir = root / f"variant_{variant}"
    overrides = [*base, f"train.max_steps={FAULT_STEP + 4}", f"checkpoint.save_interval={FAULT_CKPT_INTERVAL}",
                 *(o.format(run=run_dir) for o in VARIANTS[variant][1]), "ft.simulate_fault=true",
                 "ft.simulated_fault_type=exception", f"ft.simulated_fault_rank={nproc - 1}",
                 f"ft.simulated_fault_step={FAULT_STEP}"]
    proc = launch(run_dir, overrides, nproc=nproc, device=device, max_restarts=1, timeouts=TIMEOUTS)
    rc = wait(proc, 1800, run_dir)
    if rc != 0:
        raise RuntimeError(f"variant {variant} failed (rc={rc}); see {run_dir / 'launcher.log'}")
    lines = (run_dir / "launcher.log").read_text(errors="replace").splitlines()
    fault_i = next(i for i, line in enumerate(lines) if "SIMULATED FAULT at" in line)
    fault = log_time(lines[fault_i])
    recs = records(run_dir)
    restart = [i for i, r in enumerate(recs) if r.get("kind") == "start"][-1]
    start, marks = recs[restart], recs[restart]["setup"]["marks"]
    before = max(r["step"] for r in recs[:restart] if r.get("kind") == "train")
    after = [r for r in recs[restart:] if r.get("kind") == "train"]
    first, productive = after[0], next(r for r in after if r["step"] > before)
    inprocess = next((r for r in recs[restart - 1:restart] if r.get("kind") == "inprocess_restart"), None)
    if inprocess is not None:  # the first rank's wrapper began to abort; then finalize, barriers, re-entry
        detected, entered = inprocess["detected_time"], inprocess["began_time"]
    else:  # the launcher saw the rank exit; a new process started and entered the trainer
        detected = log_time(next(line for line in lines[fault_i:] if "failed (exitcode:" in line))
        entered = marks["entered"]
    points = [fault, detected, entered, marks["imports"], marks["distributed"], marks["model"], marks["optimizer"],
              marks["data"], marks["checkpoint_load"], first["time"], productive["time"]]
    return {"recovered_by": VARIANTS[variant][0], "phases_s": dict(zip(VARIANT_PHASES, [b - a for a, b in
                                                                                          zip(points, points[1:])])),
            "total_s": productive["time"] - fault, "resumed_from": start["step"],
            "resumed_tier": start.get("resumed_tier"), "attempt": start["attempt"], "last_step_before": before,
            "log": str(run_dir / "launcher.log")}


# --- 2. checkpoint stalls and preemption ------------------------------------------------------------------------


def _directory_bytes(path: Path) -> int | None:
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _save(rec: dict, ckpt: Path) -> dict:
    """One checkpoint record, whichever trainer wrote it (see the module docstring)."""
    stall = rec.get("blocking_s", rec.get("seconds"))
    durable = rec.get("durable_time", rec["time"])
    start = rec.get("start_time", durable - (stall or 0.0))
    size = rec.get("bytes") or _directory_bytes(ckpt / f"iter_{rec['step']:07d}")
    to_durable = durable - start
    return {"step": rec["step"], "reason": rec.get("reason"), "async": rec.get("async"), "stall_s": stall,
            "to_durable_s": to_durable, "durable_time": durable, "bytes": size,
            "gb_per_s": size / to_durable / 1e9 if size and to_durable > 0 else None,
            "first_in_process": rec.get("first_in_process")}


def measure_saves(root: Path, mode: str, *, nproc: int, device: str, base: list[str], saves: int,
                  interval: int) -> dict:
    run_dir = root / f"saves_{mode}"
    proc = launch(run_dir, [*base, "train.max_steps=100000", f"checkpoint.save_interval={interval}",
                            f"checkpoint.async_save={'true' if mode == 'async' else 'false'}",
                            "checkpoint.keep_last_n=3", "train.exit_signal_handler=true", "train.exit_signal=SIGTERM"],
                  nproc=nproc, device=device, timeouts=TIMEOUTS, max_restarts=0)
    deadline = time.monotonic() + 1800
    while sum(r.get("kind") == "checkpoint" for r in records(run_dir)) < saves:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{mode} run ended or stalled before {saves} saves; see {run_dir / 'launcher.log'}")
        time.sleep(0.2)
    signalled = time.time()
    os.kill(proc.pid, signal.SIGTERM)  # the launcher, as Slurm's --signal delivers it; it forwards to the ranks
    rc = wait(proc, 600, run_dir)
    exited = time.time()
    recs = records(run_dir)
    saved = [_save(r, run_dir / "ckpt") for r in recs if r.get("kind") == "checkpoint"]
    # The checkpoint the next attempt resumes from: the save at the signal, or the save the signal arrived during
    # ("already saved": the run stops right after it).
    stop = json.loads((run_dir / "stop_reason.json").read_text()) if (run_dir / "stop_reason.json").exists() else {}
    at_signal = next((s for s in reversed(saved) if s["step"] == stop.get("checkpoint_step")), None)
    received = next((r.get("received_time") for r in recs if r.get("kind") == "signal"), None)
    lines = (run_dir / "launcher.log").read_text(errors="replace").splitlines()
    stop_line = next((line for line in lines if "stopping at step" in line and "signal" in line), None)
    stopped = log_time(stop_line) if stop_line else None
    interval_saves = [s for s in saved if s["reason"] == "interval"]
    steady = [s["stall_s"] for s in interval_saves[1:]]
    return {
        "rc": rc, "saves": saved,
        "first_vs_steady_stall": (interval_saves[0]["stall_s"] / statistics.median(steady)
                                  if steady and interval_saves[0]["stall_s"] and statistics.median(steady) > 0
                                  else None),
        "preemption": {
            "signal_sent": signalled, "received": received, "stop_agreed": stopped,
            "checkpoint_durable": None if at_signal is None else at_signal["durable_time"],
            "launcher_exited": exited, "checkpoint_step": None if at_signal is None else at_signal["step"],
            "checkpoint_at_stop": stop.get("checkpoint_at_stop")},
        "log": str(run_dir / "launcher.log"),
    }


# --- report ------------------------------------------------------------------------------------------------------


def _s(value: float | None, fmt: str = ".2f") -> str | None:
    return None if value is None else format(value, fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--faults", default="rank_killed,rank_hung")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"recovery variants for the same fault (of {', '.join(VARIANTS)})")
    parser.add_argument("--saves", type=int, default=4, help="interval saves before the preemption signal")
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--work-dir", type=Path, default=None, help="run folders (default: a new temporary one)")
    parser.add_argument("--concurrent", action="store_true",
                        help="start all runs at once (CI-size form: quicker, timings not comparable)")
    args = parser.parse_args()
    device = common.resolve_device(args.device)
    shape = common.default_shape(device, args.shape)
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    nproc = args.nproc or (1 if device == "cuda" else 2)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="recovery_bench_"))
    base = [*common.SHAPES[shape].overrides(), f"model.precision={precision}", "train.log_interval=1"]
    info = common.machine(device)
    jobs = {("fault", kind): lambda kind=kind: measure_fault(root, kind, nproc=nproc, device=device, base=base)
            for kind in filter(None, args.faults.split(","))}
    jobs.update({("variant", v): lambda v=v: measure_variant(root, v, nproc=nproc, device=device, base=base)
                 for v in filter(None, args.variants.split(","))})
    jobs.update({("saves", mode): lambda mode=mode: measure_saves(
        root, mode, nproc=nproc, device=device, base=base, saves=args.saves, interval=args.save_interval)
        for mode in filter(None, args.modes.split(","))})
    try:
        if args.concurrent:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=len(jobs) or 1) as pool:
                futures = {key: pool.submit(job) for key, job in jobs.items()}
            results = {key: future.result() for key, future in futures.items()}
        else:
            results = {key: job() for key, job in jobs.items()}
    except RuntimeError as err:
        sys.exit(f"recovery: {err}")
    faults = {key[1]: value for key, value in results.items() if key[0] == "fault"}
    saves = {key[1]: value for key, value in results.items() if key[0] == "saves"}
    variants = {key[1]: value for key, value in results.items() if key[0] == "variant"}
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]

    print(f"\n{common.describe(info)}; load average after {info['load_average_after'][0]}")
    print(f"{nproc} {device} rank(s) under ft_launcher, shape {shape}, {precision}\n")
    if faults:
        print(f"Fault -> first completed step after the in-job restart (fault at step {FAULT_STEP} on rank "
              f"{nproc - 1}, checkpoint every {FAULT_CKPT_INTERVAL} steps; rank_hung: step timeout 5 s; check interval "
              "1 s), "
              "seconds:\n")
        print(common.table(["fault", *PHASES, "total", "resumed from"], [
            [kind, *(_s(r["phases_s"][p]) for p in PHASES), _s(r["total_s"]), f"step {r['resumed_from']}"]
            for kind, r in faults.items()]))
    if variants:
        print(f"\nThe same fault (an exception on rank {nproc - 1} at step {FAULT_STEP}; persistent checkpoint every "
              f"{FAULT_CKPT_INTERVAL} steps, local every step) recovered three ways: fault -> first productive step "
              "(past the last step trained before the fault), seconds:\n")
        ref = variants.get("persistent", {}).get("total_s")
        print(common.table(["recovered by", *VARIANT_PHASES, "total", "vs process restart (persistent)",
                            "resumed from"], [
            [r["recovered_by"], *(_s(r["phases_s"][p]) for p in VARIANT_PHASES), _s(r["total_s"]),
             None if not ref else f"{100 * r['total_s'] / ref:.0f} %",
             f"{r['resumed_tier']} step {r['resumed_from']}"] for r in variants.values()]))
        if ref and "inprocess" in variants:
            ratio = variants["inprocess"]["total_s"] / ref
            print(f"\nin-process / process restart (persistent): {ratio:.2f} (goal on a 2-core CPU machine: <= 0.25)")
    for mode, r in saves.items():
        print(f"\nCheckpoint saves, {mode} (every {args.save_interval} steps; the last one at the signal):\n")
        print(common.table(["step", "reason", "stall (s)", "to durable (s)", "size (MB)", "GB/s"], [
            [s["step"], s["reason"], _s(s["stall_s"], ".3f"), _s(s["to_durable_s"], ".3f"),
             _s(None if s["bytes"] is None else s["bytes"] / 1e6, ".1f"), _s(s["gb_per_s"], ".3f")]
            for s in r["saves"]]))
        print(f"\nfirst interval save's stall / median of the later ones: {_s(r['first_vs_steady_stall'])}")
    if saves:
        print("\nPreemption signal (SIGTERM to the launcher) -> stop agreed -> checkpoint durable -> launcher exited, "
              "seconds after the signal:\n")
        rows = []
        for mode, r in saves.items():
            p = r["preemption"]
            rel = [None if t is None else t - p["signal_sent"] for t in
                   (p["stop_agreed"], p["checkpoint_durable"], p["launcher_exited"])]
            rows.append([mode, *(_s(x) for x in rel), p["checkpoint_step"], p["checkpoint_at_stop"], r["rc"]])
        print(common.table(["mode", "stop agreed", "checkpoint durable", "launcher exited", "checkpoint step",
                            "checkpoint at stop", "launcher exit code"], rows))
    path = common.write_json("recovery", device, {
        "machine": info, "shape_name": shape, "shape": common.SHAPES[shape], "precision": precision, "nproc": nproc,
        "concurrent_runs": args.concurrent, "faults": faults, "saves": saves, "variants": variants}, args.json)
    print(f"\nJSON: {path}\nrun folders: {root}")


if __name__ == "__main__":
    main()
