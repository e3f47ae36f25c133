"""Which trainer a task runs, and how a plugin's trainer settings reach it.

Executor changes never depend on this; only the task's own settings do. In order:

1. our trainer (``run.Partial(megatron_resilience.entry.pretrain)`` or ``python -m megatron_resilience``):
   config fields are set directly (``_task.TaskEditor``), whatever converter is given (logged);
2. a ``run.Script`` with a ``script_args_converter_fn``: the plugin's ``...ScriptArgs`` go through it and
   the result is appended to ``task.args`` (Megatron-Bridge's contract);
3. a ``run.Script`` that looks like Megatron-LM's or Megatron-Bridge's command line: the matching
   built-in converter (``script_args.detect_converter``), with a log line saying why;
4. anything else: no change to the task, and one warning that says what the trainer must do itself.

Besides, :func:`trainer_paths` reads what the launcher settings need from the task (checkpoint and
data directories, the rerun mode) for the trainers the plugins understand.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_resilience.plugins._task import TaskEditor, describe_task, our_trainer_editor
from megatron_resilience.plugins.script_args import (
    converter_name,
    detect_converter,
    megatron_bridge_args,
    megatron_lm_args,
)
from megatron_resilience.upstream import import_nemo_run

log = logging.getLogger("megatron_resilience.plugins")

# Tracker file of the newest complete checkpoint: the same name in our trainer
# (runtime/checkpoint_layout.TRACKER_FILE), Megatron-LM and Megatron-Bridge. Not imported: the runtime
# package is the compute-node room.
CHECKPOINT_TRACKER_FILE = "latest_checkpointed_iteration.txt"


@dataclass
class TrainerTarget:
    """How a plugin reaches the task's trainer: our editor, a converter, or neither."""

    task: Any
    editor: TaskEditor | None = None
    converter: Callable[[Any], list[str]] | None = None
    why: str = ""

    @property
    def known(self) -> bool:
        return self.editor is not None or self.converter is not None


def trainer_target(task: Any, plugin: str, converter_fn: Callable[[Any], list[str]] | None) -> TrainerTarget:
    run = import_nemo_run()
    editor = our_trainer_editor(task, plugin)
    if editor is not None:
        if converter_fn is not None:
            log.info("%s: script_args_converter_fn=%s is not used: %s runs megatron_resilience's trainer, whose "
                     "settings the plugin sets directly", plugin, converter_name(converter_fn), describe_task(task))
        return TrainerTarget(task=task, editor=editor)
    if not isinstance(task, run.Script) or task.inline:
        return TrainerTarget(task=task)
    if converter_fn is not None:
        return TrainerTarget(task=task, converter=converter_fn, why="script_args_converter_fn")
    detected = detect_converter(task)
    if detected is None:
        return TrainerTarget(task=task)
    converter, why = detected
    return TrainerTarget(task=task, converter=converter, why=f"detected: {why}")


def append_script_args(target: TrainerTarget, plugin: str, script_args: Any) -> list[str]:
    """Append ``converter(script_args)`` to the Script's args (logged); returns what was appended."""
    args = list(target.converter(script_args))
    if not all(isinstance(a, str) for a in args):
        from megatron_resilience.config import ConfigError

        raise ConfigError(f"{plugin}.script_args_converter_fn: must return a list of strings, got {args!r}")
    target.task.args = list(target.task.args) + args
    log.info("%s: task args += %s (%s, %s)", plugin, args, converter_name(target.converter), target.why)
    return args


def warn_unknown_trainer(target: TrainerTarget, plugin: str, needs: str) -> None:
    """The one warning for a task whose trainer the plugin cannot configure."""
    run = import_nemo_run()
    inline = isinstance(target.task, run.Script) and bool(target.task.inline)
    how = ("an inline script cannot take converted arguments; start the trainer with 'exec' as the script's "
           "last command so it is the process that receives signals" if inline else
           "pass script_args_converter_fn (megatron_resilience.plugins.megatron_lm_args, megatron_bridge_args or "
           "your own function of the ScriptArgs) to have the plugin add them")
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


def _flag_values(args: list[str], flag: str) -> list[str]:
    values = []
    for i, arg in enumerate(args):
        if arg == flag:
            values += [a for a in args[i + 1:] if not a.startswith("--")][:None if flag == "--data-path" else 1]
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def _override_values(args: list[str], key: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.lstrip("+").split("=", 1)[0] == key and "=" in a]


def trainer_paths(target: TrainerTarget) -> TrainerPaths:
    if target.editor is not None:
        editor = target.editor
        data = editor.get("data.data_path") or []
        return TrainerPaths(checkpoint_save=editor.get("checkpoint.save"),
                            checkpoint_load=editor.get("checkpoint.load"),
                            data_dirs=_data_dirs(list(data)) + [d for d in [editor.get("data.cache_dir")] if d],
                            rerun_mode=editor.get("rerun.rerun_mode"))
    if target.converter is megatron_lm_args:
        args = [str(a) for a in target.task.args]
        data = [p for value in _flag_values(args, "--data-path") for p in shlex.split(value)]
        return TrainerPaths(checkpoint_save=next(iter(_flag_values(args, "--save")), None),
                            checkpoint_load=next(iter(_flag_values(args, "--load")), None), data_dirs=_data_dirs(data),
                            rerun_mode=next(iter(_flag_values(args, "--rerun-mode")), None))
    if target.converter is megatron_bridge_args:
        args = [str(a) for a in target.task.args]
        return TrainerPaths(checkpoint_save=next(iter(_override_values(args, "checkpoint.save")), None),
                            checkpoint_load=next(iter(_override_values(args, "checkpoint.load")), None),
                            rerun_mode=next(iter(_override_values(args, "rerun_state_machine.rerun_mode")), None))
    return TrainerPaths()


__all__ = ["CHECKPOINT_TRACKER_FILE", "TrainerPaths", "TrainerTarget", "append_script_args", "trainer_paths",
           "trainer_target", "warn_unknown_trainer"]
