"""Which trainer a task runs, and how a plugin's trainer settings reach it.

Executor changes never depend on this; only the task's own settings do. In order:

1. our trainer (``run.Partial(megatron_resilience.entry.pretrain)`` or ``python -m megatron_resilience``):
   config fields are set directly (``_task.TaskEditor``), whatever converter is given (logged);
2. a ``run.Script`` with a ``script_args_converter_fn``: the plugin's ``...ScriptArgs`` go through it and
   the result is appended to ``task.args`` (Megatron-Bridge's contract);
3. a ``run.Script`` that looks like Megatron-LM's or Megatron-Bridge's command line: the matching
   built-in converter (``script_args.detect_converter``), with a log line saying why;
4. a ``run.Partial`` of Megatron-Bridge (``config=ConfigContainer``) or NeMo 2.0 (a Lightning ``trainer``):
   their own config fields / callbacks (``partial_trainers``);
5. anything else: no change to the task, and one warning that says what the trainer must do itself.

Converted arguments the task already carries are not added twice (``append_script_args``). Besides,
:func:`trainer_paths` reads what the launcher settings and the job-level decision need from the task
(checkpoint and data directories, the rerun mode, the last step) for the trainers the plugins understand.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins.job_plan import plan_of
from megatron_resilience.plugins.script_args import (
    converter_name,
    detect_converter,
    megatron_bridge_args,
    megatron_lm_args,
)
from megatron_resilience.records.names import TRACKER_FILE
from megatron_resilience.tasks import partial_trainers, trainer_detect
from megatron_resilience.tasks.our_trainer import TaskEditor, describe_task, our_trainer_editor
from megatron_resilience.upstream import import_nemo_run

log = logging.getLogger("megatron_resilience.plugins")

# Tracker file of the newest complete checkpoint: the same name in our trainer
# (records/checkpoint_layout.TRACKER_FILE), Megatron-LM and Megatron-Bridge. Not imported: the runtime
# package is the compute-node room.
CHECKPOINT_TRACKER_FILE = TRACKER_FILE


@dataclass
class TrainerTarget:
    """How a plugin reaches the task's trainer: our editor, a converter, or neither."""

    task: Any
    editor: TaskEditor | None = None
    converter: Callable[[Any], list[str]] | None = None
    why: str = ""
    bridge: Any = None  # a Megatron-Bridge Partial's ConfigContainer
    nemo: Any = None  # a NeMo 2.0 Partial's trainer

    @property
    def known(self) -> bool:
        return any(x is not None for x in (self.editor, self.converter, self.bridge, self.nemo))


def trainer_target(task: Any, plugin: str, converter_fn: Callable[[Any], list[str]] | None) -> TrainerTarget:
    run = import_nemo_run()
    editor = our_trainer_editor(task, plugin)
    if editor is not None:
        if converter_fn is not None:
            log.info("%s: script_args_converter_fn=%s is not used: %s runs megatron_resilience's trainer, whose "
                     "settings the plugin sets directly", plugin, converter_name(converter_fn), describe_task(task))
        return TrainerTarget(task=task, editor=editor)
    if isinstance(task, run.Partial):
        bridge, nemo = partial_trainers.bridge_config(task), partial_trainers.nemo_trainer(task)
        if converter_fn is not None and (bridge is not None or nemo is not None):
            log.info("%s: script_args_converter_fn=%s is not used: %s is a run.Partial, whose settings the plugin "
                     "sets in its config", plugin, converter_name(converter_fn), describe_task(task))
        if bridge is not None:
            return TrainerTarget(task=task, bridge=bridge, why="Megatron-Bridge ConfigContainer")
        if nemo is not None:
            return TrainerTarget(task=task, nemo=nemo, why="NeMo 2.0 / Lightning trainer")
        return TrainerTarget(task=task)
    if not isinstance(task, run.Script) or task.inline:
        return TrainerTarget(task=task)
    if converter_fn is not None:
        return TrainerTarget(task=task, converter=converter_fn, why="script_args_converter_fn")
    detected = detect_converter(task)
    if detected is None:
        return TrainerTarget(task=task)
    converter, why = detected
    return TrainerTarget(task=task, converter=converter, why=f"detected: {why}")


def _valued_flags(args: list[str]) -> dict[str, str]:
    """``--flag value`` pairs among ``args`` (a flag followed by a non-flag), for conflict checks."""
    return {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("-")}


def append_script_args(target: TrainerTarget, plugin: str, script_args: Any) -> list[str]:
    """Append ``converter(script_args)`` to the Script's args (logged); returns what was appended.

    Arguments the task already has are not repeated (a Megatron-LM command line that carries
    ``--enable-ft-package`` itself); a ``--flag value`` the task gives with another value is a conflict.
    """
    args = list(target.converter(script_args))
    if not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{plugin}.script_args_converter_fn: must return a list of strings, got {args!r}")
    existing = [str(a) for a in target.task.args]
    theirs, ours = _valued_flags(existing), _valued_flags(args)
    if target.converter is megatron_lm_args and hasattr(script_args, "exit_signal"):
        ours.setdefault("--exit-signal", script_args.exit_signal)  # SIGTERM is Megatron-LM's default: not rendered
    for flag, value in ours.items():
        if flag in theirs and theirs[flag] != value:
            raise ConfigError(f"conflicting settings: the task's arguments give {flag} {theirs[flag]}, but {plugin} "
                              f"needs {flag} {value}; remove it from the task or change the plugin's setting")
    new, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg in ours and i + 1 < len(args):  # a --flag value pair travels together
            if arg not in theirs:  # (the same --flag value already there: not repeated)
                new += args[i:i + 2]
            i += 2
            continue
        if arg not in existing:  # a lone flag or Hydra override already there is not repeated
            new.append(arg)
        i += 1
    kept = [a for a in args if a not in new]
    if kept:
        log.info("%s: task args already carry %s: not added again", plugin, kept)
    target.task.args = existing + new
    if new:
        log.info("%s: task args += %s (%s, %s)", plugin, new, converter_name(target.converter), target.why)
    return new


def warn_unknown_trainer(target: TrainerTarget, plugin: str, needs: str) -> None:
    """The one warning for a task whose trainer the plugin cannot configure."""
    run = import_nemo_run()
    inline = isinstance(target.task, run.Script) and bool(target.task.inline)
    if inline:
        how = ("an inline script cannot take converted arguments; start the trainer with 'exec' as the script's "
               "last command so it is the process that receives signals")
    elif isinstance(target.task, run.Script):
        how = ("pass script_args_converter_fn (megatron_resilience.plugins.megatron_lm_args, megatron_bridge_args or "
               "your own function of the ScriptArgs) to have the plugin add them")
    else:  # script_args_converter_fn never applies to a Partial: say what does
        how = ("the plugins configure run.Partial tasks of megatron_resilience.entry.pretrain, of Megatron-Bridge "
               "(config=ConfigContainer) and of NeMo 2.0 (a Lightning trainer=); this function is none of them")
    log.warning("%s: %s is not a trainer the plugins know (megatron_resilience, Megatron-LM, Megatron-Bridge): the "
                "executor is set up, but the trainer must itself %s; %s", plugin, describe_task(target.task),
                needs, how)


@dataclass
class TrainerPaths:
    """What launcher settings need to know about the trainer's run (None / empty: unknown)."""

    checkpoint_save: str | None = None
    checkpoint_load: str | None = None
    data_dirs: list[str] = field(default_factory=list)
    rerun_mode: str | None = None
    train_iters: int | None = None  # the run's last step (jobs/finished.py compares the checkpoint tracker to it)

    @property
    def tracker_file(self) -> str | None:
        directory = self.checkpoint_save or self.checkpoint_load
        return os.path.join(directory, CHECKPOINT_TRACKER_FILE) if directory else None

    def storage_dirs(self) -> list[str]:
        dirs = [self.checkpoint_save, self.checkpoint_load, *self.data_dirs]
        return list(dict.fromkeys(d for d in dirs if d))


def _data_dirs(prefixes: list[str]) -> list[str]:
    # Megatron blends interleave weights and path prefixes ("0.7 /data/a 0.3 /data/b"): keep the paths.
    return [os.path.dirname(p) for p in prefixes if os.path.isabs(p)]


def trainer_paths(target: TrainerTarget) -> TrainerPaths:
    if target.editor is not None:
        editor = target.editor
        data = editor.get("data.data_path") or []
        return TrainerPaths(checkpoint_save=editor.get("checkpoint.save"),
                            checkpoint_load=editor.get("checkpoint.load"),
                            data_dirs=_data_dirs(list(data)) + [d for d in [editor.get("data.cache_dir")] if d],
                            rerun_mode=editor.get("rerun.rerun_mode"), train_iters=editor.get("train.max_steps"))
    if target.bridge is not None:
        save, load, iters = partial_trainers.bridge_run_facts(target.bridge)
        return TrainerPaths(checkpoint_save=save, checkpoint_load=load, train_iters=iters)
    if target.nemo is not None:  # NeMo's checkpoints have no Megatron tracker: the end-of-training line decides
        return TrainerPaths(train_iters=partial_trainers.nemo_max_steps(target.nemo))
    if target.converter is megatron_lm_args:
        args = [str(a) for a in target.task.args]
        data = [p for value in trainer_detect.flag_values_all(args, "--data-path") for p in shlex.split(value)]
        save, load, iters = trainer_detect.script_run_facts("megatron_lm", args)
        return TrainerPaths(checkpoint_save=save, checkpoint_load=load, data_dirs=_data_dirs(data),
                            rerun_mode=next(iter(trainer_detect.flag_values(args, "--rerun-mode")), None),
                            train_iters=iters)
    if target.converter is megatron_bridge_args:
        args = [str(a) for a in target.task.args]
        save, load, iters = trainer_detect.script_run_facts("bridge", args)
        rerun = trainer_detect.override_values(args, "rerun_state_machine.rerun_mode")
        return TrainerPaths(checkpoint_save=save, checkpoint_load=load, train_iters=iters,
                            rerun_mode=rerun[0] if rerun else None)
    return TrainerPaths()




def remember_finished_evidence(executor: Any, target: TrainerTarget) -> None:
    """Where the job-level decision finds whether a trainer other than ours finished (``jobs/finished.py``): the
    checkpoint directory whose tracker to read and the run's last step, as read from the task at submit time.
    Our trainer reports it itself (``stop_reason.json`` and the finished flag)."""
    if target.editor is not None:
        return
    paths = trainer_paths(target)
    directory = paths.checkpoint_save or paths.checkpoint_load
    plan_of(executor).finished_evidence = {"checkpoint_dir": directory if isinstance(directory, str) else None,
                                           "train_iters": paths.train_iters}


def finished_evidence(executor: Any) -> dict[str, Any]:
    """What :func:`remember_finished_evidence` recorded on this executor ({} when nothing)."""
    return dict(plan_of(executor).finished_evidence)


__all__ = ["CHECKPOINT_TRACKER_FILE", "TrainerPaths", "TrainerTarget", "append_script_args", "finished_evidence",
           "remember_finished_evidence", "trainer_paths", "trainer_target", "warn_unknown_trainer"]
