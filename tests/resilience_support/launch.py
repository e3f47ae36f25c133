"""Launch the real trainer (``-m megatron_resilience``) under the real ft_launcher, 2 CPU ranks, and inspect it.

Each run gets its own directory: ``ft.yaml`` (the launcher's FT config, written from the timeouts asked
for), ``launcher.log`` (launcher + ranks, stdout and stderr), the trainer's ``metrics.jsonl``,
``stop_reason.json``, ``ckpt/`` and the finished flag file, and its own port block (``ports.py``): the
trainer's stores never share a port with another launch, and a port clash is a failure like any other.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from resilience_support.polling import poll
from resilience_support.ports import PortBlock, reserve

JOB_PORT_ENV = "MEGATRON_RESILIENCE_JOB_PORT"

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
FAKE_CUPTI = Path(__file__).resolve().parent / "fake_cupti"

# Generous except where a test injects a hang: 2 cores run several launches at once, and on a machine shared with
# other suites (load average 240 seen) setup took 110 s, steps 4 s and a process's first save over 60 s.
DEFAULT_TIMEOUTS = {"setup": 600.0, "step": 300.0, "checkpointing": 300.0, "out_of_section": 600.0}


@dataclass
class Run:
    run_dir: Path
    proc: subprocess.Popen
    started: float
    returncode: int | None = None
    wall: float | None = None
    extra: dict = field(default_factory=dict)
    ports: PortBlock | None = None

    @property
    def log_path(self) -> Path:
        return self.run_dir / "launcher.log"

    @property
    def flag(self) -> Path:
        return self.run_dir / "finished.flag"

    @property
    def ckpt(self) -> Path:
        return self.run_dir / "ckpt"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 600) -> int:
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher's own process group (start_new_session)
            self.proc.wait()
            raise AssertionError(f"ft_launcher did not finish within {timeout}s; log tail:\n{self.log()[-3000:]}")
        finally:
            if self.proc.poll() is not None and self.ports is not None:
                self.ports.release()
        self.wall = time.monotonic() - self.started
        return self.returncode

    def stop_reason(self) -> dict:
        return json.loads((self.run_dir / "stop_reason.json").read_text())

    def records(self) -> list[dict]:
        """Every record of metrics.jsonl, in file order."""
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()
                if line.strip()]

    def train_records(self, *, last_per_step: bool = True) -> list[dict]:
        train = [r for r in self.records() if r.get("kind") == "train"]
        if not last_per_step:
            return train
        by_step = {r["step"]: r for r in train}
        return [by_step[s] for s in sorted(by_step)]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.train_records()}

    def checkpoint_steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.ckpt.iterdir() if (m := re.fullmatch(r"iter_(\d+)", p.name)))

    def worker_pids(self) -> dict[int, tuple[int, int]]:
        """rank -> (pid, restart count) of the launcher's live worker processes (not its rank monitors)."""
        out = {}
        for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
            try:
                env = dict(kv.split("=", 1) for kv in
                           Path(f"/proc/{child}/environ").read_bytes().decode(errors="replace").split("\0")
                           if "=" in kv)
            except OSError:
                continue
            if "TORCHELASTIC_RESTART_COUNT" in env and "RANK" in env:
                out[int(env["RANK"])] = (int(child), int(env["TORCHELASTIC_RESTART_COUNT"]))
        return out


def write_ft_yaml(path: Path, timeouts: dict[str, float], *, safety_factor: float = 5.0,
                  check_interval: float = 1.0, heartbeats: tuple[float, float] | None = None) -> None:
    """Sections mode: section timeouts, heartbeat timeouts null. Heartbeats mode: the reverse (as the plugin does)."""
    t = {**DEFAULT_TIMEOUTS, **timeouts}
    if heartbeats is None:
        body = ("  initial_rank_heartbeat_timeout: null\n"
                "  rank_heartbeat_timeout: null\n"
                f"  rank_section_timeouts: {{setup: {t['setup']}, step: {t['step']}, "
                f"checkpointing: {t['checkpointing']}}}\n"
                f"  rank_out_of_section_timeout: {t['out_of_section']}\n")
    else:
        body = (f"  initial_rank_heartbeat_timeout: {heartbeats[0]}\n"
                f"  rank_heartbeat_timeout: {heartbeats[1]}\n"
                "  rank_section_timeouts: {}\n"
                "  rank_out_of_section_timeout: null\n")
    path.write_text("fault_tolerance:\n" + body + f"  workload_check_interval: {check_interval}\n"
                    f"  safety_factor: {safety_factor}\n  enable_nic_monitor: false\n")


def launch(run_dir: Path, overrides: list[str], *, max_restarts: int = 1, timeouts: dict | None = None,
           safety_factor: float = 5.0, fake_cupti: bool = False, heartbeats: tuple[float, float] | None = None,
           module: str = "megatron_resilience", env: dict[str, str] | None = None, host: str | None = None) -> Run:
    """Start ``ft_launcher --nproc-per-node=2 ... -m megatron_resilience run_dir=... <overrides>`` (not waiting).

    ``host``: run it under that host name (a UTS namespace; needs root, as CI runs): what a requeue onto another
    node looks like to Megatron-Core's rerun state machine, which tells hardware apart by host name."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "ft.yaml"
    write_ft_yaml(cfg, timeouts or {}, safety_factor=safety_factor, heartbeats=heartbeats)
    block = None if JOB_PORT_ENV in (env or {}) else reserve()
    env = {**os.environ, "FAULT_TOL_FINISHED_FLAG_FILE": str(run_dir / "finished.flag"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "error", **(block.env() if block else {}), **(env or {})}
    if fake_cupti:
        env["PYTHONPATH"] = os.pathsep.join([str(FAKE_CUPTI), env.get("PYTHONPATH", "")])
    cmd = [str(VENV_BIN / "ft_launcher"), "--standalone", "--nproc-per-node=2", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.5", "--workers-stop-timeout=15", f"--ft-cfg-path={cfg}", "-m", module,
           f"run_dir={run_dir}", f"checkpoint.save={run_dir / 'ckpt'}", "ft.enabled=true", *overrides]
    if host is not None:  # exec: the process stays the launcher (its pid, its children, its process group)
        cmd = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd]
    log = open(run_dir / "launcher.log", "ab")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Run(run_dir=run_dir, proc=proc, started=time.monotonic(), ports=block)


def run_to_end(run_dir: Path, overrides: list[str], *, timeout: float, **kwargs) -> Run:
    """``launch`` and wait, for a run nothing interacts with."""
    run = launch(run_dir, overrides, **kwargs)
    run.wait(timeout)
    return run


def wait_for(predicate, *, timeout: float, interval: float = 0.2, what: str = "condition"):
    """``predicate()``'s first truthy value; AssertionError after ``timeout`` s (``resilience_support.polling``)."""
    return poll(predicate, timeout=timeout, interval=interval, what=what)


def sigterm_ranks_after(run: Run, steps: int, *, timeout: float) -> None:
    """Once ``run`` has trained ``steps`` steps, SIGTERM both of its ranks (as a scheduler's signal reaches them) and
    wait up to ``timeout`` s for the launch to end.

    Why shared: every preemption test that needs the signal while the run trains (tests/test_resilience_faults.py,
    tests/test_torch_fsdp2.py) stops it this way; the step is theirs to choose (between two periodic saves)."""
    wait_for(lambda: (run.run_dir / "metrics.jsonl").exists() and len(run.train_records()) >= steps,
             timeout=timeout, what=f"step {steps}")
    workers = run.worker_pids()
    assert sorted(workers) == [0, 1], workers
    for pid, _ in workers.values():
        os.kill(pid, signal.SIGTERM)
    run.wait(timeout)


def log_time(line: str) -> float:
    """Seconds since the epoch of a ``[YYYY-mm-dd HH:MM:SS,mmm]`` (launcher) or ``at YYYY-.. HH:MM:SS.mmm`` line."""
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[,.](\d{3})", line)
    assert m, line
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
