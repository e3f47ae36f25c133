"""The ``nemo megatron_resilience pretrain`` command: NeMo-Run CLI entrypoint, recipe/executor/plugin factories.

NeMo-Run finds this module through the ``nemo_run.cli`` entry-point group
(``pyproject.toml``) and imports it when the first CLI word is
``megatron_resilience``. Importing registers:

- the entrypoint ``megatron_resilience pretrain`` (the task is a ``run.Partial`` of
  ``megatron_resilience.entry.pretrain``),
- recipe factories for ``--factory``: ``gpt_tiny``, ``gpt_126m``, ``gpt_350m``, ``gpt_1_3b``, ``gpt_7b``
  (arguments in parentheses: ``--factory "gpt_126m(num_nodes=4)"``),
- executor factories for ``run.executor=NAME``: ``local`` (torchrun), ``local_ft`` (ft_launcher), ``slurm``,
- plugin factories for ``run.plugins=NAME`` or ``run.plugins=[a,b]``: ``ft``, ``preemption``, ``resilience`` (both).

Task overrides (``train.max_steps=100``) are applied by :mod:`.overrides` (typed, only the
named fields change, unknown keys list the valid ones); ``--dryrun`` prints the final config
and, for Slurm, the sbatch script the job would use.
"""

import dataclasses
import os
import sys
from typing import Any, Callable, List, Literal, Optional

from megatron_resilience.config._validate import ConfigError
from megatron_resilience.config.overrides import config_to_overrides
from megatron_resilience.entry import pretrain
from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.recipes.gpt import RECIPES, validate
from megatron_resilience.recipes.overrides import apply_overrides, apply_plugin_overrides, unknown_executor_keys

run = import_nemo_run()
import fiddle as fdl  # noqa: E402
from nemo_run.cli.api import RunContext, RunContextError  # noqa: E402

NAMESPACE = "megatron_resilience"


def _local_env() -> dict:
    """One thread per CPU rank (2 cores for 2 ranks here), and torchrun/ft_launcher from this Python's
    environment: the local scheduler looks them up on PATH, which lacks a venv that is not activated."""
    env = {"OMP_NUM_THREADS": "1"}
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        env["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir
    return env


# --- executors ---------------------------------------------------------------------------------------------


@run.cli.factory
def local(ntasks_per_node: int = 2) -> run.Config[run.LocalExecutor]:
    """This machine, ``ntasks_per_node`` ranks under torchrun (CPU ranks when there is no GPU)."""
    return run.Config(run.LocalExecutor, ntasks_per_node=ntasks_per_node, launcher="torchrun", env_vars=_local_env())


@run.cli.factory
def local_ft(ntasks_per_node: int = 2) -> run.Config[run.LocalExecutor]:
    """This machine under nvidia-resiliency-ext's ft_launcher: a failed or hung rank restarts the worker group.

    The launcher is nemo_run's ``"ft"``; ``FaultTolerancePlugin`` fills in every ft_launcher
    setting (restarts, section timeouts through its FT config file). nemo_run alone would
    render ``--ignore-missing-fault-tol-cfg``, which newer ft_launchers reject, so the
    ``nemo`` command adds ``FaultTolerancePlugin()`` when ``run.plugins`` has none.
    """
    return run.Config(run.LocalExecutor, ntasks_per_node=ntasks_per_node, launcher="ft", env_vars=_local_env())


def uses_ft_launcher(executor: Any) -> bool:
    launcher = getattr(executor, "launcher", None)
    return launcher == "ft" or isinstance(launcher, run.FaultTolerance)


@run.cli.factory
def slurm(account: str = "", partition: Optional[str] = None, nodes: int = 1, time: str = "04:00:00",
          gpus_per_node: Optional[int] = 8, ntasks_per_node: Optional[int] = None, host: Optional[str] = None,
          user: Optional[str] = None, job_dir: str = "") -> run.Config[run.SlurmExecutor]:
    """A Slurm cluster: submitted from its login node (LocalTunnel) or over SSH when ``host`` is given.

    One torchrun per node with ``ntasks_per_node`` ranks (default: ``gpus_per_node``; on CPU-only
    partitions set ``gpus_per_node=None`` and ``ntasks_per_node``). ``run.Packager()``: the job imports the
    installed ``megatron_resilience``; no git archive of the submit directory is shipped.
    """
    if host:
        tunnel = run.Config(run.SSHTunnel, host=host, user=user or "", job_dir=job_dir)
    else:
        tunnel = run.Config(run.LocalTunnel, job_dir=job_dir)
    return run.Config(
        run.SlurmExecutor, account=account, partition=partition, nodes=nodes, time=time,
        ntasks_per_node=ntasks_per_node or gpus_per_node or 1, gpus_per_node=gpus_per_node, launcher="torchrun",
        tunnel=tunnel, packager=run.Config(run.Packager),
    )


# --- plugins -----------------------------------------------------------------------------------------------


@run.cli.factory(target=run.Plugin)
def ft() -> run.Config[run.Plugin]:
    """``FaultTolerancePlugin`` with its defaults (override: ``run.plugins.num_in_job_restarts=5``)."""
    from megatron_resilience.plugins import FaultTolerancePlugin

    return run.Config(FaultTolerancePlugin)


@run.cli.factory(target=run.Plugin)
def preemption() -> run.Config[run.Plugin]:
    """``PreemptionPlugin`` with its defaults (override: ``run.plugins.preempt_time=120``)."""
    from megatron_resilience.plugins import PreemptionPlugin

    return run.Config(PreemptionPlugin)


@run.cli.factory(target=run.Plugin)
def resilience() -> List[run.Config[run.Plugin]]:
    """Both: ``[FaultTolerancePlugin(), PreemptionPlugin()]`` (override: ``run.plugins[1].preempt_time=120``)."""
    return [ft(), preemption()]


# --- recipes -----------------------------------------------------------------------------------------------

for _name, _recipe in RECIPES.items():
    run.cli.factory(target=pretrain, name=_name)(_recipe)


# --- the command -------------------------------------------------------------------------------------------


def world_size(executor: Any) -> int:
    """Ranks the executor starts: nodes x processes per node (torchrun/ft_launcher or srun tasks)."""
    return executor.nnodes() * executor.nproc_per_node()


def is_slurm(executor: Any) -> bool:
    return isinstance(executor, run.SlurmExecutor)


@dataclasses.dataclass(kw_only=True)
class PretrainRunContext(RunContext):
    """NeMo-Run's run context with our override parsing, validation and dry-run output."""

    def cli_execute(self, fn: Callable, args: List[str],
                    entrypoint_type: Literal["task", "experiment"] = "task") -> None:
        # NeMo-Run treats every argument that starts with "run" as a run option and rejects
        # `run_dir=...`; split on the exact "run." prefix instead.
        run_args = [a[len("run."):] for a in args if a.startswith("run.")]
        task_args = [a for a in args if not a.startswith("run.")]
        self.parse_args(run_args)
        self._execute_task(fn, task_args)

    def parse_args(self, args: List[str], lazy: bool = False) -> List[str]:
        # Plugin overrides are ours (typed, validated); executor overrides stay NeMo-Run's, with a short
        # "valid keys" error instead of its dump of the whole executor config.
        plugin_args = [a for a in args if a.startswith(("plugins.", "plugins["))]
        rest = [a for a in args if a not in plugin_args]
        try:
            left = super().parse_args(rest, lazy)
        except Exception as err:  # NeMo-Run raises ValueError/AttributeError/its own parse errors
            raise RunContextError(self._explain(rest) or f"run options {rest}: {err}") from None
        if plugin_args:
            try:
                self.plugins = apply_plugin_overrides(list(self.plugins or []), plugin_args)
            except ConfigError as err:
                raise RunContextError(str(err)) from None
        return left

    def _explain(self, args: List[str]) -> Optional[str]:
        names = [a.split("=", 1)[1] for a in args if a.startswith("executor=")]
        if not names:
            return None
        try:
            executor_cls = fdl.get_callable(self.parse_executor(names[-1]))
        except ValueError:
            return f"run.executor={names[-1]}: unknown executor; ours: local, local_ft, slurm"
        return unknown_executor_keys(executor_cls, args)

    def parse_fn(self, fn: Callable, args: List[str], **default_kwargs: Any):
        task = super().parse_fn(fn, [], **default_kwargs)  # the --factory recipe (or a bare Partial)
        try:
            return apply_overrides(task, args)
        except ConfigError as err:
            raise RunContextError(str(err)) from None

    def _execute_task(self, fn: Callable, task_args: List[str]) -> None:
        task = self.parse_fn(fn, task_args)
        if not getattr(task, "run_dir", None):
            raise RunContextError("run_dir: required: use --factory RECIPE or set run_dir=/path/to/run")
        executor = self.executor
        try:
            config = validate(task, num_nodes=executor.nnodes(), num_gpus_per_node=executor.nproc_per_node()) \
                if executor is not None else validate(task, num_nodes=1, num_gpus_per_node=1)
        except ConfigError as err:
            raise RunContextError(str(err)) from None
        print(f"# {self.name}: final config ({'no executor' if executor is None else type(executor).__name__}, "
              f"world size {world_size(executor) if executor is not None else 1})")
        print("\n".join(config_to_overrides(config)))
        plugins = list(self.plugins or [])
        if executor is not None and uses_ft_launcher(executor):
            from megatron_resilience.plugins import FaultTolerancePlugin

            if not any(isinstance(p, FaultTolerancePlugin) for p in plugins):
                plugins.append(FaultTolerancePlugin())
                print("# the executor uses ft_launcher: added FaultTolerancePlugin() to run.plugins")
        if self.dryrun:
            if executor is not None and is_slurm(executor):
                from megatron_resilience.plugins import preview

                print("# sbatch script")
                print(preview(task, executor, plugins, name=self.name))
            return
        if not self._should_continue(self.skip_confirmation):
            return
        run.run(task, name=self.name, executor=executor, plugins=plugins,
                direct=self.direct or executor is None, detach=self.detach)


run.cli.entrypoint(namespace=NAMESPACE, run_ctx_cls=PretrainRunContext,
                   help="Megatron-Core GPT pretraining with fault tolerance, preemption, "
                        "straggler detection and the rerun state machine.")(pretrain)


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m megatron_resilience.recipes.cli pretrain ...``: the same command without the ``nemo`` script."""
    from nemo_run.cli.api import create_cli

    sys.argv = ["nemo", NAMESPACE, *(sys.argv[1:] if argv is None else argv)]
    create_cli()(standalone_mode=True)


if __name__ == "__main__":
    main()
