"""The one submit-time check of a pretraining task and its executor. Never imports torch.

Every interface runs it before anything leaves the user's hands, so a mistake gets the same
message everywhere: ``preview()``, the plugins' ``setup`` (``run.run`` / ``Experiment``, dry run
or not), the ``nemo megatron_resilience pretrain`` CLI. The trainer's own command line runs
the same config checks (the dataclasses validate themselves) and the path checks before torch loads.

What it checks:

* the task's config: every section's own validation (types, finite numbers, ranges, choices) and
  the cross-section checks of ``PretrainConfig``. Tasks: ``run.Partial`` of
  ``megatron_resilience.entry.pretrain`` and ``run.Script`` running ``python -m megatron_resilience
  key=value ...`` (module form, or an inline script's trainer line); other tasks are left to the
  plugins, which name the supported forms;
* the job's size: TP x PP must divide nodes x ranks per node, the global batch must fit, the memory estimate
  per rank must fit (``config/memory.py``), and a Slurm job starts one rank per GPU it asks for
  (``job_shape.py``), checked with or without a config of ours;
* the executor: a Slurm account that is not empty and a time limit Slurm accepts (a ``MM:SS`` limit
  is logged, since ``01:30`` is 90 seconds to Slurm);
* paths, when this machine sees the job's filesystem (a ``LocalExecutor``, or Slurm through a
  ``LocalTunnel``): run and checkpoint folders writable, data prefixes present;
* given the job's plugins (``run.run``/``Experiment.add`` before they run, ``preview()`` and the CLI after):
  ``inprocess.enabled`` on a SlurmExecutor without a ``FaultTolerancePlugin`` is refused. Only that plugin
  makes srun keep the ranks the in-process wrapper keeps alive (nemo_run renders ``--kill-on-bad-exit=1``) and
  sets the wrapper's environment (``plugins/inprocess_restart.py``); without it every fault the wrapper would
  recover in seconds ends the job step, and nothing says why. A plugin's own ``setup`` does not know the
  other plugins of the job and passes none.
"""

from __future__ import annotations

import logging
import os
import shlex
from typing import Any

from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.config.overrides import config_from_overrides
from megatron_resilience.config.paths import check_paths
from megatron_resilience.config.slurm_time import slurm_time_seconds, time_note
from megatron_resilience.config.validate import fail
from megatron_resilience.plugins.job_plan import plan_of
from megatron_resilience.plugins.job_shape import check_ranks_per_node, world_size
from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.upstream.fsdp import check_data_parallel_strategy

log = logging.getLogger("megatron_resilience.plugins")

ENTRY = "megatron_resilience.entry.pretrain"
MODULE = "megatron_resilience"
_SHELL = ("$", "`")  # values the batch shell expands: unknown at submit time, not checked
_CONTROL = {"|", "||", "&&", ";", "&", ";;", "(", ")", "|&", ">", ">>", "<"}  # the trainer's arguments end there


def trainer_overrides(task: Any) -> list[str] | None:
    """The ``key=value`` arguments of a ``python -m megatron_resilience`` Script task; None for other tasks."""
    run = import_nemo_run()
    if not isinstance(task, run.Script):
        return None
    if not task.inline:
        if task.path == MODULE and task.m:
            return [str(a) for a in task.args]
        return None
    for line in reversed(task.inline.replace("\\\n", " ").split("\n")):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i in range(len(tokens) - 2):
            if os.path.basename(tokens[i]).startswith("python") and tokens[i + 1:i + 3] == ["-m", MODULE]:
                args = tokens[i + 3:]
                ends = [j for j, tok in enumerate(args) if tok in _CONTROL]
                return args[:ends[0]] if ends else args
    return None


def _partial_config(task: Any) -> PretrainConfig | None:
    run = import_nemo_run()
    import fiddle as fdl

    if not isinstance(task, run.Partial):
        return None
    fn = task.__fn_or_cls__
    if f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}" != ENTRY:
        return None
    try:
        kwargs = fdl.build(task).keywords
    except ConfigError as err:  # drop the "Fiddle context: ..." paragraph Fiddle appends: the key says where
        raise ConfigError(str(err).split("\n\nFiddle context:")[0]) from None
    if "run_dir" not in kwargs:
        raise ConfigError("run_dir: required, e.g. run.Partial(pretrain, run_dir='/path/to/run')")
    return PretrainConfig(**{name: value for name, value in kwargs.items() if value is not None})


def task_config(task: Any) -> tuple[PretrainConfig | None, set[str]]:
    """(the validated config of ``task`` or None when it is not a megatron_resilience task, keys not checked).

    Keys whose value the batch shell expands (``run_dir=$RUN``) are left out of the check.
    """
    overrides = trainer_overrides(task)
    if overrides is None:
        return _partial_config(task), set()
    known = [o for o in overrides if not any(c in o.partition("=")[2] for c in _SHELL)]
    unchecked = {o.partition("=")[0].strip().removeprefix("--") for o in overrides if o not in known}
    if "run_dir" in unchecked:
        known.append("run_dir=/unresolved")  # the batch shell's value; required, but not known here
    return config_from_overrides(known), unchecked


def sees_job_filesystem(executor: Any) -> bool:
    """True when paths on this machine are the job's paths: a LocalExecutor, or Slurm through a LocalTunnel."""
    run = import_nemo_run()
    if isinstance(executor, run.LocalExecutor):
        return True
    return isinstance(executor, run.SlurmExecutor) and isinstance(executor.tunnel, run.LocalTunnel)


def check_executor(executor: Any) -> None:
    """Slurm settings nemo_run renders as they are: an empty account, a time limit Slurm rejects."""
    run = import_nemo_run()
    if not isinstance(executor, run.SlurmExecutor):
        return
    if not isinstance(executor.account, str) or not executor.account.strip():
        fail("executor.account", "must be a Slurm account name", executor.account)
    slurm_time_seconds(executor.time)
    note = time_note(executor.time)
    if note and not plan_of(executor).time_noted:
        plan_of(executor).time_noted = True  # once per job, however many plugins run the check
        log.warning("%s", note)


# The plugin classes that set in-process restart up on the executor: ``plugins/fault_tolerance.py`` adds
# FaultTolerancePlugin when it is imported (a plugin in a job's list was imported), so this module, which the plugin
# imports, never imports it back.
INPROCESS_SETUP_PLUGINS: list[type] = []


def check_inprocess_setup(config: PretrainConfig, executor: Any, plugins: list[Any]) -> None:
    """In-process restart on Slurm needs ``FaultTolerancePlugin`` among the job's ``plugins`` (why: module doc).
    Any FaultTolerancePlugin sets it up for a task with ``inprocess.enabled`` (its ``inprocess_restart=True``
    sets that key itself). Refused rather than warned: as submitted, it cannot work."""
    if not config.inprocess.enabled or not isinstance(executor, import_nemo_run().SlurmExecutor):
        return
    if any(isinstance(p, tuple(INPROCESS_SETUP_PLUGINS)) for p in plugins):
        return
    raise ConfigError("inprocess.enabled: true on a SlurmExecutor needs FaultTolerancePlugin(inprocess_restart=True) "
                      "among the job's plugins (without it srun keeps nemo_run's --kill-on-bad-exit=1, which kills the "
                      "ranks the in-process wrapper keeps alive, and the wrapper's environment is not set), got "
                      f"plugins {[type(p).__name__ for p in plugins]}")


def check_task(task: Any, executor: Any = None, *, plugins: list[Any] | None = None) -> PretrainConfig | None:
    """Validate ``task`` (and, given one, ``executor``) before submission; ConfigError names the key.

    ``plugins``: the job's plugins, before or after they ran (None: not known here, as in a plugin's ``setup``).
    Returns the task's config, or None for a task that does not run megatron_resilience's trainer.
    """
    config, unchecked = task_config(task)
    if executor is not None:
        check_executor(executor)
        if isinstance(executor, import_nemo_run().SlurmExecutor):
            check_ranks_per_node(executor, config)
    if config is None:
        return None
    if executor is not None:
        config.validate_world_size(world_size(executor))
        check_data_parallel_strategy(config, world_size(executor))
        if sees_job_filesystem(executor):
            check_paths(config, skip=unchecked)
        if plugins is not None:
            check_inprocess_setup(config, executor, plugins)
    return config
