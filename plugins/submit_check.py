"""What ``run.run`` / ``Experiment.add`` check for our tasks, plugins or not, and the Python misuse they answer in
one line.

nemo_run applies plugins only when they are given; without them nothing of ours ran at submit time, so
``run.run(task, executor=run.LocalExecutor(ntasks_per_node=2))`` with TP=8 or ``max_steps=-5`` started a
job that failed with a traceback while ``run.run`` returned normally. Every task nemo_run adds to an
experiment (``run.run`` makes a one-job experiment) passes through ``Experiment._add_single_job(task,
executor, name, plugins, ...)``, which checks the task (``_validate_task``: the serializer round trip),
clones task and executor and runs the plugins. :func:`install` puts :func:`check_submission` in front of it
(``upstream/nemorun.py`` wraps it), so the same submit-time check as the plugins' runs first, for every job,
and a mistake in how the job is put together is one ``ConfigError`` line:

* ``plugins="ft"`` (the CLI's name, not the object), a plugin class instead of an instance, anything that is
  not a ``run.Plugin``; ``plugins=None`` means no plugins, as in ``run.run``;
* a ``run.Partial`` of a function nemo_run cannot serialize by name (``run.Partial(print)``: a built-in, a
  lambda, a function defined inside another), which Fiddle otherwise reports after the plugins logged;
* the task's config and job size (:func:`~megatron_resilience.plugins.task_check.check_task`).

Installed when the plugins or recipes are imported, and by ``megatron_resilience.entry`` in either import order:
at once when nemo_run is already imported, else right after ``import nemo_run`` finishes (a meta-path hook that
fires once; ``entry`` then imports this module only at the first submission).
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Iterable

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins.task_check import check_task
from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.upstream.nemorun import before_experiment_add

EXAMPLE = "e.g. plugins=[FaultTolerancePlugin(), PreemptionPlugin()]"


def check_plugins(plugins: Any) -> list[Any]:
    """The plugins as a list (None -> [], one plugin -> [it]); ConfigError for anything that is not a plugin."""
    run = import_nemo_run()
    if plugins is None:
        return []
    if isinstance(plugins, run.Plugin):
        return [plugins]
    if isinstance(plugins, str) or inspect.isclass(plugins) or not isinstance(plugins, Iterable):
        plugins = [plugins]
    out = list(plugins)
    for plugin in out:
        if isinstance(plugin, str):
            raise ConfigError(f"plugins: expected run.Plugin objects ({EXAMPLE}), got {plugin!r}, a string (plugin "
                              f"names like 'ft' are for the CLI's run.plugins=...)")
        if inspect.isclass(plugin) and issubclass(plugin, run.Plugin):
            raise ConfigError(f"plugins: expected plugin objects, got the class {plugin.__name__}; "
                              f"write {plugin.__name__}() ({EXAMPLE})")
        if not isinstance(plugin, run.Plugin):
            raise ConfigError(f"plugins: expected run.Plugin objects ({EXAMPLE}), got {plugin!r} "
                              f"({type(plugin).__name__})")
    return out


def check_callable(task: Any) -> None:
    """A ``run.Partial``/``run.Config`` whose function nemo_run cannot serialize by name: one line saying so."""
    fn = getattr(task, "__fn_or_cls__", None)
    if fn is None:
        return
    name = getattr(fn, "__qualname__", repr(fn))
    if isinstance(fn, (type, types.FunctionType, types.MethodType)) and "<" not in name:
        return
    what = ("a built-in" if isinstance(fn, types.BuiltinFunctionType) else
            "a lambda or a function defined inside another" if "<" in name else type(fn).__name__)
    raise ConfigError(f"task: run.Partial needs a function importable by name (defined at module level), got "
                      f"{name} ({what}); for this package: run.Partial(megatron_resilience.entry.pretrain, "
                      f"run_dir=...) or a recipe such as megatron_resilience.recipes.gpt_tiny(...)")


def check_submission(task: Any, executor: Any, plugins: Any = None) -> list[Any]:
    """Everything checkable before nemo_run clones and submits: plugins, the task's callable, config, job size."""
    plugins = check_plugins(plugins)
    check_callable(task)
    check_task(task, executor, plugins=plugins)
    return plugins


_INSTALLED = False


def install() -> None:
    """Check every job nemo_run adds to an experiment in this process (once)."""
    global _INSTALLED
    if not _INSTALLED:
        before_experiment_add(check_submission)
        _INSTALLED = True
