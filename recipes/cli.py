"""The ``nemo megatron_resilience pretrain`` command: NeMo-Run CLI entrypoint, recipe/executor/plugin factories.

NeMo-Run finds this module through the ``nemo_run.cli`` entry-point group
(``pyproject.toml``) and imports it when the first CLI word is
``megatron_resilience``. Importing registers:

- the entrypoint ``megatron_resilience pretrain`` (the task is a ``run.Partial`` of
  ``megatron_resilience.entry.pretrain``),
- recipe factories for ``--factory``: ``gpt_tiny``, ``gpt_126m``, ``gpt_350m``, ``gpt_1_3b``, ``gpt_7b``
  (arguments in parentheses: ``--factory "gpt_126m(num_nodes=4)"``),
- executor factories for ``run.executor=NAME``: ``local`` (torchrun), ``local_ft`` (ft_launcher), ``slurm``,
- plugin factories for ``run.plugins=NAME`` or ``run.plugins=[a,b]``: ``ft``, ``preemption``, ``resilience`` (both),
  ``restart_policy`` (``run.plugins[i].policy=FILE``: this package's or the log-monitoring tool's schema).

Task overrides (``train.max_steps=100``) are applied by :mod:`.overrides` (typed, only the
named fields change, unknown keys list the valid ones); ``--dryrun`` prints the final config
and, for Slurm, the sbatch script the job would use.
"""

import dataclasses
import os
import sys
from typing import Any, Callable, List, Literal, Optional

from megatron_resilience.config.keys import key_listing
from megatron_resilience.config.overrides import config_to_overrides, reject_repeated_keys
from megatron_resilience.config.validate import ConfigError
from megatron_resilience.entry import pretrain
from megatron_resilience.plugins.executors import executor_profile
from megatron_resilience.plugins.job_shape import world_size
from megatron_resilience.plugins.task_check import check_task
from megatron_resilience.recipes.gpt import RECIPES, to_config
from megatron_resilience.recipes.overrides import (
    apply_overrides,
    apply_plugin_overrides,
    plugin_list,
    recipe_call,
    split_executor_overrides,
)
from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.upstream.harmless_warnings import PYTHONWARNINGS
from megatron_resilience.upstream.nemorun import cli_classes, quiet_cli_parser, run_cli

run = import_nemo_run()
import fiddle as fdl  # noqa: E402

RunContext, RunContextError, Entrypoint = cli_classes()

NAMESPACE = "megatron_resilience"


def _local_env() -> dict:
    """One thread per CPU rank (2 cores for 2 ranks here), torchrun/ft_launcher from this Python's
    environment (the local scheduler looks them up on PATH, which lacks a venv that is not activated), and
    the harmless torch warning that processes print before the trainer can filter it, silenced."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": PYTHONWARNINGS}
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


@run.cli.factory(target=run.Plugin)
def restart_policy() -> run.Config[run.Plugin]:
    """``RestartPolicyPlugin`` (override: ``run.plugins.policy=/path/policy.yaml``, ``=null``: monitor-only)."""
    from megatron_resilience.plugins import RestartPolicyPlugin

    return run.Config(RestartPolicyPlugin)


PLUGINS = {"ft": lambda: fdl.build(ft()), "preemption": lambda: fdl.build(preemption()),
           "resilience": lambda: [fdl.build(p) for p in resilience()],
           "restart_policy": lambda: fdl.build(restart_policy())}


# --- recipes -----------------------------------------------------------------------------------------------

for _name, _recipe in RECIPES.items():
    run.cli.factory(target=pretrain, name=_name)(_recipe)


# --- the command -------------------------------------------------------------------------------------------


USAGE = f"""\
Overrides: section.field=value (typed; null, true/false, a,b for lists). Recipes (--factory): {", ".join(RECIPES)}
(arguments: --factory "gpt_126m(num_nodes=2,dir=/lustre/runs)"). Executors: run.executor=local|local_ft|slurm,
fields with run.executor.FIELD=value. Plugins: run.plugins=ft|preemption|resilience|restart_policy|[ft,preemption],
fields with run.plugins.FIELD=value or run.plugins[i].FIELD=value (restart_policy: run.plugins[i].policy=FILE).
--dryrun prints the final config (and the sbatch script).
"""

# run.* options that are the run context's own (run.name=..., run.detach=true, ...).
_CONTEXT_OPTIONS = ("name", "direct", "dryrun", "factory", "load", "repl", "detach", "skip_confirmation",
                    "tail_logs", "yaml")


def _option_value(argv: List[str], *names: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(f"{name}="):
                return arg.split("=", 1)[1]
    return None


def help_text(argv: List[str]) -> str:
    """What ``--help`` adds after the options: usage and every key (with the recipe's values given --factory)."""
    spec = _option_value(argv, "--factory", "-f")
    recipe, note = None, ""
    if spec:
        try:
            call = recipe_call(spec, RECIPES)
            recipe = to_config(call[0](**call[1])) if call else None
        except ConfigError as err:
            note = f"(--factory {spec}: {err})\n"
    name = spec.split("(")[0] if recipe is not None else None
    return f"{USAGE}\n{note}{key_listing(recipe, name)}"


class PretrainEntrypoint(Entrypoint):
    """``--help`` prints every config key with its type, default, meaning (and the recipe's value), instead of
    nemo_run's table of ``pretrain``'s arguments."""

    def help(self, console: Any = None, with_docs: bool = True) -> None:
        print(help_text(sys.argv))


@dataclasses.dataclass(kw_only=True)
class PretrainRunContext(RunContext):
    """NeMo-Run's run context with our parsing of recipes, plugins and overrides, one validation, one-line errors."""

    def cli_execute(self, fn: Callable, args: List[str],
                    entrypoint_type: Literal["task", "experiment"] = "task") -> None:
        # NeMo-Run treats every argument that starts with "run" as a run option and rejects
        # `run_dir=...`; split on the exact "run." prefix instead.
        run_args = [a[len("run."):] for a in args if a.startswith("run.")]
        task_args = [a for a in args if not a.startswith("run.")]
        try:
            reject_repeated_keys(task_args)
            reject_repeated_keys([f"run.{a}" for a in run_args])
            self.parse_args(run_args)
            self._execute_task(fn, task_args)
        except ConfigError as err:  # a user's mistake: one line, never nemo_run's "Unexpected error"
            raise RunContextError(str(err)) from None

    def parse_args(self, args: List[str], lazy: bool = False) -> List[str]:
        """``executor=NAME`` and ``executor.X=...`` through nemo_run (values checked first); plugins are ours."""
        plugin_spec = [a.split("=", 1)[1] for a in args if a.startswith("plugins=")]
        plugin_args = [a for a in args if a.startswith(("plugins.", "plugins["))]
        executor_args = [a for a in args if a.startswith("executor.")]
        rest = [a for a in args if a.startswith("executor=") or a.split("=")[0] in _CONTEXT_OPTIONS]
        unknown = [a for a in args if a not in rest + plugin_args + executor_args and not a.startswith("plugins=")]
        if unknown:
            from megatron_resilience.config.overrides import closest_keys, did_you_mean

            key = "run." + unknown[0].split("=")[0]
            options = ["run.executor", "run.plugins", *(f"run.{o}" for o in _CONTEXT_OPTIONS)]
            raise ConfigError(f"{key}: unknown run option; {did_you_mean(closest_keys(key, options))}"
                              f"run options: {', '.join(options)}")
        names = [a.split("=", 1)[1] for a in rest if a.startswith("executor=")]
        if executor_args and not names:
            raise ConfigError(f"run.{executor_args[0].split('=')[0]}: set run.executor=local|local_ft|slurm first")
        if names:
            try:
                executor_cls = fdl.get_callable(self.parse_executor(names[-1]))
            except ValueError:
                raise ConfigError(f"run.executor={names[-1]}: unknown executor; ours: local, local_ft, slurm") \
                    from None
            typed, executor_args = split_executor_overrides(executor_cls, executor_args)
        try:
            with quiet_cli_parser():
                left = super().parse_args(rest + executor_args, lazy)
        except Exception as err:  # nemo_run's own parse errors, nested several levels deep
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"run options {' '.join(rest + executor_args)}: {first}") from None
        if names:
            for name, value in typed.items():
                setattr(self.executor, name, value)
        self.plugins = plugin_list(plugin_spec[-1], PLUGINS) if plugin_spec else []
        if plugin_args:
            self.plugins = apply_plugin_overrides(self.plugins, plugin_args)
        return left

    def parse_fn(self, fn: Callable, args: List[str], **default_kwargs: Any):
        call = recipe_call(self.factory, RECIPES) if self.factory else None
        if call is not None:
            recipe, kwargs = call
            task = recipe(**kwargs)
        else:
            try:
                with quiet_cli_parser():
                    task = super().parse_fn(fn, [], **default_kwargs)  # another factory, or a bare Partial
            except Exception as err:  # nemo_run's resolution errors, nested several levels deep
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise ConfigError(f"--factory {self.factory}: {first}") from None
        return apply_overrides(task, args)

    def _execute_task(self, fn: Callable, task_args: List[str]) -> None:
        task = self.parse_fn(fn, task_args)
        if not getattr(task, "run_dir", None):
            raise ConfigError("run_dir: required: use --factory RECIPE or set run_dir=/path/to/run")
        executor = self.executor
        config = check_task(task, executor) if executor is not None else to_config(task)
        plugins = list(self.plugins or [])
        added_ft = False
        if executor is not None and uses_ft_launcher(executor):
            from megatron_resilience.plugins import FaultTolerancePlugin

            if not any(isinstance(p, FaultTolerancePlugin) for p in plugins):
                plugins.append(FaultTolerancePlugin())
                added_ft = True
        # Every check (the plugins' too) before anything is printed or submitted.
        script = None
        if executor is not None and executor_profile(executor, "run.executor").batch_script:  # a script to show
            from megatron_resilience.plugins import preview

            script = preview(task, executor, plugins, name=self.name)
        elif executor is not None:
            from megatron_resilience.plugins.preview import check_job

            check_job(task, executor, plugins, name=self.name)
        print(f"# {self.name}: final config ({'no executor' if executor is None else type(executor).__name__}, "
              f"world size {world_size(executor) if executor is not None else 1})")
        print("\n".join(config_to_overrides(config)))
        if added_ft:
            print("# the executor uses ft_launcher: added FaultTolerancePlugin() to run.plugins")
        if self.dryrun:
            if script is not None:
                print("# sbatch script")
                print(script)
            return
        if not self._should_continue(self.skip_confirmation):
            return
        run.run(task, name=self.name, executor=executor, plugins=plugins,
                direct=self.direct or executor is None, detach=self.detach)


from megatron_resilience.recipes import cli_report_watch_chaos  # noqa: E402,F401  (nemo megatron_resilience report|watch)

run.cli.entrypoint(namespace=NAMESPACE, run_ctx_cls=PretrainRunContext, entrypoint_cls=PretrainEntrypoint,
                   help="Megatron-Core GPT pretraining with fault tolerance, preemption, "
                        "straggler detection and the rerun state machine.")(pretrain)


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m megatron_resilience.recipes.cli pretrain ...``: the same command without the ``nemo`` script
    (and without torch: the ``nemo`` script imports nemo_run, and so torch, before any of our code runs)."""
    run_cli([NAMESPACE, *(sys.argv[1:] if argv is None else argv)], standalone_mode=True)


if __name__ == "__main__":
    main()
