"""nemo_run: import it on a login node without importing torch, and the CLI internals our command builds on.

The ``nemo megatron_resilience pretrain`` command (``recipes/cli.py``) extends nemo_run's CLI
through parts that are not its documented API (checked against nemo-run 0.11): the
``RunContext`` class an entrypoint runs in (``cli_execute``, ``parse_args``, ``parse_fn``,
``parse_executor``, ``_should_continue`` and its option attributes), the ``Entrypoint`` class
whose ``help`` the command's ``--help`` calls (and whose ``_execute_simple`` the report/watch
commands replace), the logger its argument parser reports errors on, ``create_cli``,
``Experiment._add_single_job`` (where every job is checked, plugins or not) and the serializer
a reloaded experiment keeps its tasks in. They are reached only through this module.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
from types import ModuleType
from typing import Any, Iterator


def import_nemo_run() -> ModuleType:
    """``import nemo_run`` without importing torch.

    nemo_run's YAML serializer does ``try: import torch`` at import time only to
    register a representer for ``torch.dtype`` (a ~1.5 s import, and the login-node
    rule forbids it). Our configs are plain data and never hold a dtype, so while
    nemo_run imports we make ``import torch`` fail the way it does where torch is
    not installed; a later ``import torch`` works as usual.
    """
    if "nemo_run" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("nemo_run")
    sys.modules["torch"] = None  # type: ignore[assignment]  # ModuleNotFoundError for `import torch`
    try:
        return importlib.import_module("nemo_run")
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def cli_classes() -> tuple[type, type, type]:
    """``(RunContext, RunContextError, Entrypoint)`` of nemo_run's CLI, to subclass."""
    import_nemo_run()
    from nemo_run.cli.api import Entrypoint, RunContext, RunContextError

    return RunContext, RunContextError, Entrypoint


@contextlib.contextmanager
def quiet_cli_parser() -> Iterator[None]:
    """nemo_run's argument parser logs every error it raises (at ERROR, to stderr) before raising it again;
    our command reports the error itself, in one line, so the parser's own lines are held back."""
    logger = logging.getLogger("nemo_run.cli.cli_parser")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def before_experiment_add(check: Any) -> None:
    """Call ``check(task, executor, plugins)`` before nemo_run adds a job to an experiment (``run.run`` and
    ``Experiment.add``); it may raise, and returns the plugins to use (a normalized list).

    Wraps ``Experiment._add_single_job(self, task, executor, name="", plugins=None, ...)`` (nemo-run 0.11), the
    step that validates, clones and runs the plugins of every single-task job."""
    import_nemo_run()
    from nemo_run.run.experiment import Experiment

    original = Experiment._add_single_job
    if getattr(original, "_megatron_resilience_check", False):
        return
    signature = inspect.signature(original)

    def _add_single_job(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["plugins"] = check(bound.arguments["task"], bound.arguments["executor"],
                                           bound.arguments.get("plugins"))
        return original(*bound.args, **bound.kwargs)

    _add_single_job._megatron_resilience_check = True  # type: ignore[attr-defined]
    Experiment._add_single_job = _add_single_job


def experiment_tasks(experiment_id: str) -> list[Any]:
    """The tasks of a saved NeMo-Run experiment (``Experiment.from_id``), as ``run.Partial``/``run.Script``.

    A reloaded job keeps its task as the serializer's text (nemo-run 0.11: a zlib'd JSON string), which
    nemo_run deserializes only when it launches the job again; it is turned back into the config here."""
    run = import_nemo_run()
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    tasks = []
    for job in run.Experiment.from_id(experiment_id).jobs:
        task = getattr(job, "task", None)
        tasks.append(ZlibJSONSerializer().deserialize(task) if isinstance(task, str) else task)
    return tasks


def run_cli(argv: list[str], *, standalone_mode: bool = True) -> Any:
    """Run ``nemo <argv...>`` in this process (``argv`` without the program name)."""
    import_nemo_run()
    from nemo_run.cli.api import create_cli

    saved, sys.argv = sys.argv, ["nemo", *argv]
    try:
        return create_cli()(args=list(argv), standalone_mode=standalone_mode)
    finally:
        sys.argv = saved
