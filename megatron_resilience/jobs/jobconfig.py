"""The job-level config: everything the batch script's EXIT trap and the watcher need, as one JSON file.

The plugins render it at submit time (validated there) into the sbatch script, which writes it to
``<job dir>/<job name>_job_level.json`` at the start of every attempt. Policy and monitors are
inlined, already resolved from their presets/files: the decision in the job uses exactly what was
checked on the login node, and does not need the user's files on the compute node.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_resilience.config.validate import ConfigError
from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.monitors import Monitor, load_monitors, monitors_from_dicts, preset_names
from megatron_resilience.jobs.policies import Policy, load_policy, policy_from_dict
from megatron_resilience.records.ledger import LEDGER_FILE

CONFIG_SUFFIX = "_job_level.json"
STOP_MARKER_SUFFIX = "_job_level_stopped"
NODE_RANGE_FIELDS = ("min_nodes", "nodes", "ntasks_per_node")
# The monitors used without a RestartPolicyPlugin (the ledger and report still say why attempts ended).
DEFAULT_MONITORS = "megatron_production"


@dataclass(kw_only=True)
class JobLevelConfig:
    job_name: str  # the job's file prefix in job_dir (nemo_run's executor.job_name)
    job_dir: str  # the job's directory on the cluster (sbatch/srun logs, finished flag)
    ledger: str
    finished_flag: str
    run_dir: str | None = None
    stop_reason: str | None = None
    metrics: str | None = None
    checkpoint_dir: str | None = None
    train_iters: int | None = None  # the run's last step, when the plugins could read it (jobs/finished.py)
    ft: bool = False
    no_restart_exit_code: int = taxonomy.NVRX_NO_RESTART_EXIT_CODE
    cycle_info_dir: str | None = None
    cycle_log_prefix: str | None = None
    sbatch_script: str | None = None
    policy: dict[str, Any] | None = None  # None: nemo_run's requeue rule (no RestartPolicyPlugin), or monitor-only
    # RestartPolicyPlugin(policy=None): monitors classify and the ledger records every attempt; nothing is requeued
    monitor_only: bool = False
    # Monitor presets by name, and the monitors of a user's own files inlined (validated at submit time).
    monitors: list[str | dict[str, Any]] = field(default_factory=lambda: [DEFAULT_MONITORS])
    max_log_bytes: int = 8 << 20
    finished_grace_seconds: float = 300.0  # watcher: finished but still running after this -> scancel
    inactivity_threshold: float | None = None  # watcher: no log/metrics progress for this long (FT off) -> stall
    preempt_time: int | None = None  # seconds between Slurm's preemption signal and its kill (--signal=SIG@N)
    # FaultTolerancePlugin.min_nodes: a requeued attempt asks for the nodes the partition can give, from min_nodes
    # up to nodes (the job's full size); ntasks_per_node: srun tasks per node (NumTasks follows NumNodes).
    min_nodes: int | None = None
    nodes: int | None = None
    ntasks_per_node: int = 1
    # RestartPolicyPlugin.node_history_dir: a folder the runs of a team share; hardware attributions of all of them
    # count towards a node's exclusion (jobs/shared_node_history.py). None: this run's own ledger only.
    node_history_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("job_name", "job_dir", "ledger", "finished_flag"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"job_level.{name}: must be a non-empty path, got {getattr(self, name)!r}")
        if self.monitor_only and self.policy is not None:
            raise ConfigError("job_level.monitor_only: a monitor-only job has no policy, got one")
        if isinstance(self.no_restart_exit_code, bool) or not isinstance(self.no_restart_exit_code, int) \
                or not 1 <= self.no_restart_exit_code <= 255:
            raise ConfigError(f"job_level.no_restart_exit_code: must be an integer in [1, 255], "
                              f"got {self.no_restart_exit_code!r}")
        if self.train_iters is not None and (isinstance(self.train_iters, bool) or not isinstance(self.train_iters, int)
                                             or self.train_iters < 1):
            raise ConfigError(f"job_level.train_iters: must be a positive integer or null, got {self.train_iters!r}")
        if self.node_history_dir is not None and (not isinstance(self.node_history_dir, str)
                                                  or not os.path.isabs(self.node_history_dir)):
            raise ConfigError(f"job_level.node_history_dir: must be an absolute path or null, "
                              f"got {self.node_history_dir!r}")

    @property
    def stop_marker(self) -> str:
        return os.path.join(self.job_dir, f"{self.job_name}{STOP_MARKER_SUFFIX}")

    @property
    def nemo_run_results(self) -> str:
        """nemo_run's FT template's record of attempts (``JOB_ID RESTART S|F`` lines), kept in job_dir."""
        return os.path.join(self.job_dir, f"{self.job_name}_job_results")

    @property
    def path(self) -> str:
        return os.path.join(self.job_dir, f"{self.job_name}{CONFIG_SUFFIX}")

    def load_policy(self) -> Policy | None:
        return None if self.policy is None else policy_from_dict(self.policy, source=f"{self.path} (policy)")

    def load_monitors(self) -> list[Monitor]:
        names = [m for m in self.monitors if isinstance(m, str)]
        inline = [m for m in self.monitors if isinstance(m, dict)]
        out = load_monitors(names)
        seen = {m.name for m in out}
        out += [m for m in monitors_from_dicts(inline, source=f"{self.path} (monitors)") if m.name not in seen]
        return out

    def to_json(self) -> str:
        data = asdict(self)
        if self.min_nodes is None:  # no node range: the job's JSON (and sbatch script) as without the feature
            for key in NODE_RANGE_FIELDS:
                data.pop(key)
        if self.node_history_dir is None:  # no shared folder: as without the feature
            data.pop("node_history_dir")
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobLevelConfig:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def read(cls, path: str) -> JobLevelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def resolve(policy: str | None, monitors: str | list[str] | None) -> tuple[dict | None, list[str | dict]]:
    """(policy as data or None, monitor specs) from preset names / files; every error names file and key.

    Presets stay names (they ship with the package on the compute node too); a user's own file is
    inlined, so the job does not need it and runs exactly what was checked here.
    """
    loaded = load_policy(policy) if policy is not None else None
    specs = monitor_specs(loaded, monitors)
    out: list[str | dict] = []
    for spec in specs:
        found = load_monitors([spec])  # validates (raises naming the file and key)
        if spec in preset_names():
            out.append(spec)
        else:
            out += [m.to_dict() for m in found if not m.reads_batch_log]
    return (loaded.to_dict() if loaded else None), out


def monitor_specs(policy: Policy | None, monitors: str | list[str] | None) -> list[str]:
    """The monitor presets/files in use: the ones given, else the policy's, else the default set."""
    specs = monitors if monitors is not None else (list(policy.monitors) if policy else [DEFAULT_MONITORS])
    return [specs] if isinstance(specs, str) else list(specs)


def watcher_settings(policy: str | None, monitors: str | list[str] | None) -> dict[str, Any]:
    """What a foreign monitoring file says for the watcher (``inactivity_threshold``), else {}."""
    from megatron_resilience.jobs.monitors import foreign_settings

    return foreign_settings(monitor_specs(load_policy(policy) if policy is not None else None, monitors))


def ledger_path(run_dir: str | None, job_dir: str) -> str:
    return os.path.join(run_dir or job_dir, LEDGER_FILE)
