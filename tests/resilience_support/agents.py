"""Two ft_launcher agents on one machine: the launchers of a two-node job, rendezvousing over c10d.

Each agent is started as Slurm starts one per node (``--nnodes=2 --rdzv-backend=c10d
--rdzv-endpoint=HOST:PORT``), with its own log file; the ranks share one run directory, as ranks on two
nodes share a filesystem. Agent 0 hosts the c10d store (``is_host=1`` in ``PET_RDZV_CONF``; on a cluster
the head node does, found by its hostname, which both agents share here). The rest of ``PET_RDZV_CONF``
is what ``FaultTolerancePlugin`` renders for a multi-node job (``join_timeout=...``).

A node is lost when every process of its agent dies at once (the agent, its rank monitors and its
ranks, which run in sessions of their own): ``lose_node`` stops the whole process tree, then kills it.
A node that stops answering without closing its connections (power or network loss) is ``freeze_node``:
the tree is stopped (SIGSTOP) and stays so until the test ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from resilience_support.launch import REPO, VENV_BIN, write_ft_yaml
from resilience_support.ports import PortBlock, reserve

from megatron_resilience.runtime.metrics import read_metrics


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (children of every thread), parents first."""
    out = [pid]
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            out += process_tree(int(child))
    return out


def free_port() -> int:
    """A port free now (released again: for what a test hands to nemo_run, not for the trainer's stores)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Agent:
    index: int
    proc: subprocess.Popen
    log_path: Path
    returncode: int | None = None
    ended: float | None = None  # time.time() when wait() saw it exit

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal_tree(self, signum: int) -> list[int]:
        pids = process_tree(self.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return pids


@dataclass
class TwoAgentRun:
    run_dir: Path
    agents: list[Agent]
    lost: dict = field(default_factory=dict)  # what lose_node/freeze_node did: node index, wall time, pids
    extra: dict = field(default_factory=dict)
    ports: PortBlock | None = None

    @property
    def flag(self) -> Path:
        return self.run_dir / "finished.flag"

    def log(self) -> str:
        return "".join(f"\n==> agent {a.index} <==\n" + a.log() for a in self.agents)

    def train_steps(self) -> int:
        if not (self.run_dir / "metrics.jsonl").exists():
            return 0
        return len(read_metrics(str(self.run_dir), "train"))

    def records(self, kind: str | None = None) -> list[dict]:
        return [r for r in read_metrics(str(self.run_dir), None) if kind is None or r.get("kind") == kind]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(str(self.run_dir), "train")}

    def checkpoint_steps(self) -> list[int]:
        folder = self.run_dir / "ckpt"
        names = os.listdir(folder) if folder.is_dir() else []
        return sorted(int(n[5:]) for n in names if n.startswith("iter_") and n[5:].isdigit())

    def lose_node(self, index: int) -> None:
        """Node ``index`` dies: every process of its agent stops at once, then is killed."""
        agent = self.agents[index]
        pids = agent.signal_tree(signal.SIGSTOP)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.lost = {"node": index, "at": time.time(), "pids": pids, "how": "killed"}

    def freeze_node(self, index: int) -> None:
        """Node ``index`` stops answering: its processes are stopped, their connections stay open."""
        pids = self.agents[index].signal_tree(signal.SIGSTOP)
        self.lost = {"node": index, "at": time.time(), "pids": pids, "how": "frozen"}

    def wait(self, timeout: float, *, agents: list[int] | None = None) -> None:
        """Wait for the given agents (default: all); kill everything and fail with the logs after ``timeout``."""
        deadline = time.monotonic() + timeout
        for agent in (self.agents[i] for i in (agents if agents is not None else range(len(self.agents)))):
            try:
                agent.returncode = agent.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                agent.ended = time.time()
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"agent {agent.index} did not finish within {timeout}s:\n{self.log()[-6000:]}")
        if self.ports is not None and all(a.proc.poll() is not None for a in self.agents):
            self.ports.release()

    def kill(self) -> None:
        """Kill every process both agents started (incl. stopped ones); leaves nothing behind."""
        for agent in self.agents:
            for pid in agent.signal_tree(signal.SIGKILL) + self.lost.get("pids", []):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if agent.proc.poll() is None:
                agent.proc.wait()


def launch_two_agents(run_dir: Path, overrides: list[str], *, join_timeout: int, max_restarts: int = 1,
                      timeouts: dict | None = None, nnodes: str = "2", rdzv_conf: str = "",
                      flags: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> TwoAgentRun:
    """Start two ft_launcher agents (one rank each) for ``-m megatron_resilience run_dir=... <overrides>``.

    ``nnodes="1:2"`` is an elastic node range (what ``FaultTolerancePlugin(min_nodes=1)`` renders); ``rdzv_conf``
    adds rendezvous settings to ``PET_RDZV_CONF`` (e.g. ``last_call_timeout=5``); ``flags`` go to ft_launcher too.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "ft.yaml"
    write_ft_yaml(cfg, timeouts or {})
    block = None if "MEGATRON_RESILIENCE_JOB_PORT" in (extra_env or {}) else reserve()
    # Both "nodes" are this host: nvidia-resiliency-ext 0.7's rendezvous refuses two launchers on one host unless
    # told that it is meant (0.4.1 does not check).
    extra_env = {**(block.env() if block else {}), "TORCH_CPP_LOG_LEVEL": "error",
                 "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1", **(extra_env or {})}
    # The agents' rendezvous on the block's rendezvous port (base + 0), as the plugin renders it for Slurm jobs.
    endpoint = f"127.0.0.1:{int(extra_env['MEGATRON_RESILIENCE_JOB_PORT'])}"
    agents = []
    for index in range(2):
        conf = [f"join_timeout={join_timeout}", f"is_host={int(index == 0)}"] + ([rdzv_conf] if rdzv_conf else [])
        env = dict(os.environ, FAULT_TOL_FINISHED_FLAG_FILE=str(run_dir / "finished.flag"), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", PET_RDZV_CONF=",".join(conf), **(extra_env or {}))
        cmd = [str(VENV_BIN / "ft_launcher"), f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_dir.name}", f"--max-restarts={max_restarts}",
               "--monitor-interval=0.5", "--workers-stop-timeout=15", f"--ft-cfg-path={cfg}", *flags,
               "-m", "megatron_resilience", f"run_dir={run_dir}", f"checkpoint.save={run_dir / 'ckpt'}",
               "ft.enabled=true", *overrides]
        log_path = run_dir / f"agent{index}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        agents.append(Agent(index=index, proc=proc, log_path=log_path))
    return TwoAgentRun(run_dir=run_dir, agents=agents, ports=block)
