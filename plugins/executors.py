"""What each NeMo-Run executor can take from the plugins, decided by the executor alone (never by the task).

Every executor that nemo_run can run a task on starts the task under a launcher (torchrun or
ft_launcher), so every one gets the launcher, in-job restarts, timeouts and the trainer settings. The
rest differs per executor, and a setting that does not apply is logged, never silently dropped:

| executor                  | scheduler signal | job retries          | FT config file reaches ft_launcher  |
|---------------------------|------------------|----------------------|-------------------------------------|
| SlurmExecutor             | #SBATCH --signal | N + 1 (FT sbatch)    | written by the sbatch script        |
| LocalExecutor             | -                | -                    | a file under NEMORUN_HOME           |
| DockerExecutor            | -                | N (restart policy)   | that file, mounted read-only        |
| Skypilot(Jobs)Executor    | -                | -                    | that file, as a SkyPilot file mount |
| LeptonExecutor            | -                | -                    | written by pre_launch_commands      |
| DGXCloud/KubeflowExecutor | -                | -                    | no way to ship it (logged)          |

Only SlurmExecutor's job runs in a batch script of ours (``batch_script``: the restart policy's decision between
attempts, ft_launcher flags nemo_run cannot render), can shrink and grow between attempts (``node_range``), shares
its nodes' ports with other users' jobs (``port_block``: a port block from the job id) and starts ranks with srun
(``srun``: ``--kill-on-bad-exit``). The plugins ask the profile for the ability, never for the executor's class.

What each way of shipping the FT config does is ``ft_config_delivery.py`` (the plugin has no per-executor branch
for it). Subclasses get their base class's row. An executor nemo_run cannot run a task on (KubeRayExecutor hosts
Ray clusters; any class outside nemo_run's scheduler table) is an error that names the ones that work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_resilience.config import ConfigError
from megatron_resilience.upstream import import_nemo_run


@dataclass(frozen=True)
class ExecutorProfile:
    """The plugin-relevant abilities of one nemo_run executor class."""

    kind: str  # "slurm", "local", "docker", "skypilot", "lepton", "dgxcloud", "kubeflow"
    name: str  # the executor's class name, for log lines
    scheduler_signal: bool  # a signal before the time limit can be requested (Slurm's --signal)
    retries: str | None  # "slurm": N + 1; "count": N; None: nemo_run has no job-level retries there
    ft_config: str | None  # how the FT config file reaches ft_launcher (see the table above); None: it cannot
    max_restarts: bool  # nemo_run renders --max-restarts (DGX Cloud drops it)
    command_flags: bool  # ft_launcher flags nemo_run cannot render can be added (the sbatch script)
    batch_script: bool  # a batch script of ours runs around the job step and decides between attempts
    node_range: bool  # the job can be requeued on fewer or more nodes (an elastic node range)
    port_block: bool  # other jobs share the nodes: the job takes a port block of its own from its job id
    srun: bool  # the launcher is started by srun (whose --kill-on-bad-exit can end ranks a wrapper keeps)


def _profiles(run: Any) -> list[tuple[type, dict[str, Any]]]:
    rows = [(run.SlurmExecutor, dict(kind="slurm", scheduler_signal=True, retries="slurm", ft_config="sbatch",
                                     command_flags=True, batch_script=True, node_range=True, port_block=True,
                                     srun=True)),
            (run.LocalExecutor, dict(kind="local", ft_config="local_file")),
            (run.DockerExecutor, dict(kind="docker", retries="count", ft_config="docker_volume")),
            (run.SkypilotExecutor, dict(kind="skypilot", ft_config="skypilot_file_mount")),
            (run.SkypilotJobsExecutor, dict(kind="skypilot", ft_config="skypilot_file_mount")),
            (run.LeptonExecutor, dict(kind="lepton", ft_config="lepton_pre_launch")),
            (run.DGXCloudExecutor, dict(kind="dgxcloud", max_restarts=False)),
            (run.KubeflowExecutor, dict(kind="kubeflow"))]
    return rows


def runnable_executors() -> list[str]:
    return [f"run.{cls.__name__}" for cls, _ in _profiles(import_nemo_run())]


def executor_profile(executor: Any, plugin: str) -> ExecutorProfile:
    """The row for ``executor``'s class (or its nearest listed base class); ConfigError when none fits."""
    run = import_nemo_run()
    for cls, profile in _profiles(run):
        if isinstance(executor, cls):
            if profile["kind"] == "slurm" and executor.heterogeneous:
                raise ConfigError(f"{plugin}: heterogeneous SlurmExecutor jobs are not supported; use one "
                                  f"SlurmExecutor per job")
            defaults = dict(scheduler_signal=False, retries=None, ft_config=None, max_restarts=True,
                            command_flags=False, batch_script=False, node_range=False, port_block=False, srun=False)
            return ExecutorProfile(name=type(executor).__name__, **{**defaults, **profile})
    raise ConfigError(
        f"{plugin}: {type(executor).__name__} cannot run a task under a launcher (nemo_run has no scheduler that "
        f"starts run.Script or run.Partial tasks on it), so there is nothing to set up; use one of: "
        f"{', '.join(runnable_executors())}")


__all__ = ["ExecutorProfile", "executor_profile", "runnable_executors"]
