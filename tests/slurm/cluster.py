"""The repo's local Slurm clusters, for tests and the example notebook.

``start_cluster()`` runs ``scripts/slurm/start.sh`` (installs Debian's Slurm, munge, slurmdbd and a
private MariaDB when missing; reuses a running healthy cluster in well under a second) and returns
a ``SlurmCluster`` with what a NeMo-Run ``SlurmExecutor`` needs to submit to it through a
``LocalTunnel``, and its node names. The ``slurm_cluster`` fixture does the same once per session for
the default cluster (``MR_SLURM_INSTANCE`` in the environment picks another, e.g. ``multinode``); other
test modules get it with ``from slurm.cluster import slurm_cluster  # noqa: F401`` (``tests/`` is on
sys.path). ``multinode_cluster`` is the default cluster when it has two or more nodes, else the private
multi-node instance (``scripts/slurm/multinode.env``) started beside it.

Helpers here read Slurm's own records (``scontrol``, ``sacct``): tests count attempts and states
from the scheduler, not from our logs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts", "slurm")
ACCOUNT = "megatron_resilience_tests"  # no AccountingStorageEnforce: any account name is accepted
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
            "OUT_OF_MEMORY"}


@dataclass(frozen=True)
class SlurmCluster:
    """Connection details of the local cluster: submit with a LocalTunnel and these settings."""

    cluster: str
    partition: str
    state_dir: str
    slurm_conf: str  # client tools find the cluster through SLURM_CONF=slurm_conf (in ``env``)
    nodes: tuple[str, ...] = ("localhost",)  # the default partition's nodes
    # Nodes only ``fault_partition`` reaches (it spans every node): no job of the default partition runs there,
    # so a test may take one DOWN. Empty (and fault_partition None) on a cluster without reserved nodes.
    fault_partition: str | None = None
    fault_nodes: tuple[str, ...] = ()
    account: str = ACCOUNT
    # Environment for submitting: the venv's bin first on PATH, so the job's srun/torchrun/ft_launcher/python
    # are this checkout's (sbatch exports the submitter's environment to the job).
    env: dict[str, str] = field(default_factory=dict)

    def executor(self, *, time: str = "00:05:00", nodes: int = 1, ntasks_per_node: int = 1, launcher: Any = None,
                 job_dir: str = "", env_vars: dict[str, str] | None = None, **kwargs: Any) -> Any:
        """A ``run.SlurmExecutor`` for this cluster (``run.Packager()``: jobs import this checkout).

        ``job_dir`` must be ``$NEMORUN_HOME/experiments`` or empty (nemo_run's LocalTunnel appends the
        experiment path to it in one place and not in another). ``OMP_NUM_THREADS=1`` by default: many
        ranks share 2 cores, and runs compared step by step must use the same thread count.
        """
        from megatron_resilience.upstream import import_nemo_run

        run = import_nemo_run()
        return run.SlurmExecutor(
            account=self.account, partition=self.partition, nodes=nodes, ntasks_per_node=ntasks_per_node, time=time,
            launcher=launcher, tunnel=run.LocalTunnel(job_dir=job_dir), packager=run.Packager(),
            env_vars={"OMP_NUM_THREADS": "1", **(env_vars or {})}, **kwargs)


def venv_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    bin_dir = os.path.dirname(sys.executable)
    if env.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def start_cluster(instance: str | None = None) -> SlurmCluster:
    """Install (if needed) and start (if not running) a cluster; raise with the scripts' output on failure.

    ``instance``: a preset in ``scripts/slurm/`` (``"multinode"``); None: ``MR_SLURM_INSTANCE`` of the
    environment, else the default cluster.
    """
    env = dict(os.environ)
    if instance is not None:
        env = {k: v for k, v in env.items() if not k.startswith("MR_SLURM_")}  # the preset's values, not ours
        env["MR_SLURM_INSTANCE"] = instance
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "start.sh")], capture_output=True, text=True, timeout=900,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/slurm/start.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    info = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)

    def names(key: str) -> tuple[str, ...]:
        return tuple(n for n in info.get(key, "").split(",") if n)

    return SlurmCluster(cluster=info["cluster"], partition=info["partition"], state_dir=info["state_dir"],
                        slurm_conf=info["slurm_conf"], nodes=names("nodes"),
                        fault_partition=info.get("fault_partition"), fault_nodes=names("fault_nodes"),
                        env={**venv_env(), "SLURM_CONF": info["slurm_conf"]})


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The running local cluster (started once per session; left running for the next session: stop it with
    ``scripts/slurm/stop.sh``). The process PATH gets the venv's bin first, so jobs submitted from this
    process run this checkout's python, torchrun and ft_launcher; SLURM_CONF points sbatch, sacct and
    scontrol (also nemo_run's calls) at this cluster."""
    cluster = start_cluster()
    os.environ["PATH"] = cluster.env["PATH"]
    os.environ["SLURM_CONF"] = cluster.slurm_conf
    return cluster


@pytest.fixture(scope="session")
def multinode_cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """A cluster with two or more nodes: the default one if it has them, else the private ``multinode``
    instance (its own config, state, ports and daemons, beside the default cluster; left running).

    A module that submits to it must point SLURM_CONF there while it runs (``use_cluster``): nemo_run's
    sbatch and sacct calls and the helpers below read the process environment.
    """
    if len(slurm_cluster.nodes) >= 2:
        return slurm_cluster
    cluster = start_cluster("multinode")
    cancel_leftover_jobs(cluster)
    resume_nodes_left_down(cluster)
    return cluster


def cancel_leftover_jobs(cluster: SlurmCluster, timeout: float = 120.0) -> list[str]:
    """Cancel what an earlier session left queued or running on the private multi-node instance, and wait until it
    is gone: its tests take nodes down and hold whole nodes, and a job left by an interrupted benchmark or test
    (slurmctld keeps its state across restarts and runs it again) holds the nodes they need. A benchmark and the
    suite cannot share the instance at once; the warning names what was cancelled."""
    env = {**os.environ, "SLURM_CONF": cluster.slurm_conf}
    listed = subprocess.run(["squeue", "-h", "-o", "%i %j %T %N"], env=env, capture_output=True, text=True,
                            timeout=60).stdout.splitlines()
    jobs = [line.split()[0] for line in listed if line.strip()]
    if not jobs:
        return []
    warnings.warn(f"the multi-node instance had jobs left by an earlier run; cancelled: {listed}", stacklevel=2)
    subprocess.run(["scancel", *jobs], env=env, capture_output=True, timeout=60)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True,
                              timeout=60).stdout.split():
            return jobs
        time.sleep(1)
    raise RuntimeError(f"jobs left on the multi-node instance did not go within {timeout:.0f} s: {jobs}")


# The reasons this repo's tests and chaos set when they take a node down (tests/slurm, megatron_resilience.chaos).
OUR_DOWN_REASONS = ("mr-test", "chaos-")


def resume_nodes_left_down(cluster: SlurmCluster) -> list[str]:
    """Resume the nodes an interrupted test or chaos run took down and never gave back (their reason is ours): a CI
    run killed while the node-down test held ``mn3`` DOWN left the next run's jobs without the node they must start
    on. Nodes down for any other reason are left as they are. Returns the nodes resumed, with a warning."""
    env = {**os.environ, "SLURM_CONF": cluster.slurm_conf}
    rows = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], env=env, capture_output=True, text=True,
                          timeout=60).stdout.splitlines()
    down = sorted({node for node, state, reason in (row.split("|", 2) for row in rows if row.count("|") == 2)
                   if reason.startswith(OUR_DOWN_REASONS) and state.rstrip("*~#!%$@^-").lower() != "idle"})
    if down:
        warnings.warn(f"nodes an earlier run took down and never resumed: {down}; resumed", stacklevel=2)
        subprocess.run(["scontrol", "update", f"NodeName={','.join(down)}", "State=RESUME"], env=env,
                       capture_output=True, timeout=60)
    return down


@contextlib.contextmanager
def use_cluster(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """Point this process's Slurm client calls (and jobs submitted from it) at ``cluster`` inside the block."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", cluster.slurm_conf)
        patch.setenv("PATH", cluster.env["PATH"])
        yield cluster


# --- Slurm's records ------------------------------------------------------------------------------------------


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...).

    slurmctld forgets a job ``MinJobAge`` (300 s) after it ended; then JobState, ExitCode and Restarts
    come from the accounting records (one per run).
    """
    proc = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 and "JobState=" in proc.stdout:
        return dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)
    runs = attempts(job_id)
    if not runs:
        return {}
    return {"JobId": str(job_id), "JobState": runs[-1]["State"].split()[0], "ExitCode": runs[-1]["ExitCode"],
            "Restarts": str(len(runs) - 1)}


def attempts(job_id: str) -> list[dict[str, str]]:
    """Every run of the job from Slurm's accounting, oldest first (a requeue adds a record)."""
    fields = ["JobID", "State", "ExitCode", "Start", "End", "Elapsed"]
    out = _run("sacct", "-D", "-X", "-n", "-P", "-j", str(job_id), "-o", ",".join(fields))
    return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]


def wait_for_job(job_id: str, timeout: float, poll: float = 1.0) -> dict[str, str]:
    """Wait until the job is in a terminal state (through any requeues); return its ``scontrol`` record."""
    deadline = time.monotonic() + timeout
    seen_terminal = 0
    while time.monotonic() < deadline:
        info = job_info(job_id)
        state = info.get("JobState", "")
        seen_terminal = seen_terminal + 1 if state in TERMINAL else 0
        if seen_terminal >= 2:  # stable: not a requeue in progress
            return info
        time.sleep(poll)
    raise TimeoutError(f"Slurm job {job_id} not finished after {timeout:.0f} s: {job_info(job_id)}")


def wait_for_state(job_id: str, states: set[str], timeout: float, poll: float = 0.5) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(poll)
    raise TimeoutError(f"Slurm job {job_id} not in {states} after {timeout:.0f} s: {job_info(job_id)}")
