"""Read and change megatron_resilience's trainer settings on a task, whatever form the task has.

Two task forms run our trainer:

* ``run.Partial(megatron_resilience.entry.pretrain, ft=run.Config(FaultToleranceConfig, ...), ...)``:
  settings are set on the section's ``run.Config`` (created when the section is left at its default).
* ``run.Script`` running ``python -m megatron_resilience key=value ...``, either as
  ``run.Script(path="megatron_resilience", m=True, entrypoint="python", args=[...])`` or as an inline
  bash script whose last command is that python line. Settings are appended as ``key=value``
  overrides (the last occurrence wins in ``config_from_overrides``).

Every change is logged (``megatron_resilience.plugins``): a plugin that silently flips a user's
setting is a debugging trap. Other trainers are reached through converters (``task_settings``); an
inline script that runs our trainer in a way that cannot be made signal-safe is rejected.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import typing
from typing import Any

from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.config.aliases import canonical_key
from megatron_resilience.config.overrides import config_from_overrides
from megatron_resilience.upstream import import_nemo_run

log = logging.getLogger("megatron_resilience.plugins")

ENTRY = "megatron_resilience.entry.pretrain"
MODULE = "megatron_resilience"
SUPPORTED_TASKS = (
    f"run.Partial({ENTRY}, ...), "
    f"run.Script(path='{MODULE}', m=True, entrypoint='python', args=[key=value, ...]), "
    f"run.Script(inline=...) whose last command is 'python -m {MODULE} key=value ...'"
)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_CONTROL = {"|", "||", "&&", ";", "&", ";;", "(", ")", "|&"}


def _section_class(section: str) -> type:
    return typing.get_type_hints(PretrainConfig)[section]


def _default(key: str) -> Any:
    section, _, name = key.partition(".")
    spec = {f.name: f for f in dataclasses.fields(_section_class(section))}[name]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def _as_override(key: str, value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


def _describe(value: Any, explicit: bool) -> str:
    return repr(value) if explicit else f"{value!r} (default)"


class TaskEditor:
    """Uniform get/set of ``section.field`` trainer settings on a Partial or Script task."""

    def __init__(self, task: Any, plugin: str):
        self.task = task
        self.plugin = plugin

    # -- subclass hooks -------------------------------------------------------------------------------------
    def _lookup(self, key: str) -> tuple[bool, Any]:
        raise NotImplementedError

    def _store(self, key: str, value: Any) -> None:
        raise NotImplementedError

    def run_dir(self) -> str | None:
        """The trainer's ``run_dir`` (where it writes stop_reason.json), or None when not set."""
        raise NotImplementedError

    def make_trainer_direct_task(self) -> None:
        """Make the python trainer the process the launcher / srun starts (so it gets signals)."""

    def drop_nsys(self) -> bool:
        """Remove an nsys wrapper the task itself requests; True when there was one."""
        return False

    # -- public ---------------------------------------------------------------------------------------------
    def get(self, key: str) -> Any:
        explicit, value = self._lookup(key)
        return value if explicit else _default(key)

    def set(self, key: str, value: Any, why: str = "") -> None:
        explicit, old = self._lookup(key)
        if not explicit:
            old = _default(key)
        if explicit and old == value:
            return
        self._store(key, value)
        if old != value:
            log.info("%s: task %s: %s -> %r%s", self.plugin, key, _describe(old, explicit), value,
                     f" ({why})" if why else "")


class PartialEditor(TaskEditor):
    def run_dir(self) -> str | None:
        return getattr(self.task, "__arguments__", {}).get("run_dir")

    def _section(self, section: str, create: bool) -> Any:
        cfg = getattr(self.task, section, None)
        if cfg is None and create:
            run = import_nemo_run()
            cfg = run.Config(_section_class(section))
            setattr(self.task, section, cfg)
        return cfg

    def _lookup(self, key: str) -> tuple[bool, Any]:
        section, _, name = key.partition(".")
        cfg = self._section(section, create=False)
        if cfg is None:
            return False, None
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            return True, getattr(cfg, name)
        arguments = getattr(cfg, "__arguments__", {})
        if name in arguments:
            return True, arguments[name]
        return False, None

    def _store(self, key: str, value: Any) -> None:
        section, _, name = key.partition(".")
        cfg = self._section(section, create=True)
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            setattr(self.task, section, dataclasses.replace(cfg, **{name: value}))
        else:
            setattr(cfg, name, value)


class ScriptEditor(TaskEditor):
    """Overrides live in ``task.args`` (module form) or on the trainer line of an inline script."""

    def __init__(self, task: Any, plugin: str):
        super().__init__(task, plugin)
        self.inline = bool(task.inline)
        if self.inline:
            self._find_trainer_line()

    # Inline scripts: logical lines (backslash continuations joined) and the trainer command among them.
    def _logical_lines(self) -> list[tuple[int, int]]:
        lines = self.task.inline.split("\n")
        spans, start = [], 0
        for i, line in enumerate(lines):
            if line.rstrip().endswith("\\"):
                continue
            spans.append((start, i))
            start = i + 1
        if start < len(lines):
            spans.append((start, len(lines) - 1))
        return spans

    def _text(self, span: tuple[int, int]) -> str:
        lines = self.task.inline.split("\n")[span[0]:span[1] + 1]
        return " ".join(line.rstrip().rstrip("\\") for line in lines)

    @staticmethod
    def _tokens(text: str) -> list[str]:
        try:
            return shlex.split(text, comments=True)
        except ValueError:
            return []

    @staticmethod
    def _trainer_index(tokens: list[str]) -> int | None:
        for i, tok in enumerate(tokens[:-2]):
            if _PYTHON.match(os.path.basename(tok)) and tokens[i + 1] == "-m" and tokens[i + 2] == MODULE:
                return i
        return None

    def _find_trainer_line(self) -> None:
        spans = [s for s in self._logical_lines() if self._tokens(self._text(s))]
        trainers = [s for s in spans if self._trainer_index(self._tokens(self._text(s))) is not None]
        if len(trainers) != 1:
            raise ConfigError(
                f"{self.plugin}: the inline run.Script must run 'python -m {MODULE} key=value ...' exactly once, "
                f"found {len(trainers)} such lines; supported tasks: {SUPPORTED_TASKS}")
        span = trainers[0]
        if span != spans[-1]:
            raise ConfigError(
                f"{self.plugin}: 'python -m {MODULE}' must be the last command of the inline run.Script "
                f"(it is exec'ed so the trainer receives signals); got: {self._text(span)!r}")
        lexer = shlex.shlex(self._text(span), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        control = [tok for tok in lexer if tok in _CONTROL]
        if control:
            raise ConfigError(
                f"{self.plugin}: the trainer line of the inline run.Script must be a single command "
                f"(no {' '.join(sorted(set(control)))}), so the trainer can be exec'ed; got: {self._text(span)!r}")
        self.span = span

    def _overrides(self) -> list[str]:
        if self.inline:
            tokens = self._tokens(self._text(self.span))
            return tokens[self._trainer_index(tokens) + 3:]
        return list(self.task.args)

    def run_dir(self) -> str | None:
        value = None
        for item in self._overrides():
            key, sep, raw = item.partition("=")
            if sep and key.strip().removeprefix("--") == "run_dir":
                value = raw
        return value

    def _lookup(self, key: str) -> tuple[bool, Any]:
        found, raw = False, None
        for item in self._overrides():
            k, sep, v = item.partition("=")
            if sep and canonical_key(k.strip().removeprefix("--")) == key:
                found, raw = True, v
        if not found:
            return False, None
        section, _, name = key.partition(".")
        parsed = config_from_overrides(["run_dir=/unused", f"{key}={raw}"])  # the trainer's own parsing
        return True, getattr(getattr(parsed, section), name)

    def _replace_span(self, new_lines: list[str]) -> None:
        lines = self.task.inline.split("\n")
        lines[self.span[0]:self.span[1] + 1] = new_lines
        self.task.inline = "\n".join(lines)
        self.span = (self.span[0], self.span[0] + len(new_lines) - 1)

    def _store(self, key: str, value: Any) -> None:
        override = _as_override(key, value)
        if not self.inline:
            self.task.args = list(self.task.args) + [override]
            return
        lines = self.task.inline.split("\n")[self.span[0]:self.span[1] + 1]
        lines[-1] = f"{lines[-1].rstrip()} {shlex.quote(override)}"
        self._replace_span(lines)

    def make_trainer_direct_task(self) -> None:
        if not self.inline:
            return  # python -m megatron_resilience is already the process srun / the launcher starts
        lines = self.task.inline.split("\n")[self.span[0]:self.span[1] + 1]
        if lines[0].lstrip().startswith("exec "):
            return
        indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
        lines[0] = f"{indent}exec {lines[0].lstrip()}"
        self._replace_span(lines)
        log.info("%s: task: inline script now ends in 'exec python -m %s ...' so the trainer, not bash, is the "
                 "process that receives the scheduler's signal", self.plugin, MODULE)

    def drop_nsys(self) -> bool:
        if not self.inline:
            return False
        tokens = self._tokens(self._text(self.span))
        start = self._trainer_index(tokens)
        prefix = tokens[:start]
        nsys = next((i for i, tok in enumerate(prefix) if os.path.basename(tok) == "nsys"), None)
        if nsys is None:
            return False
        kept = prefix[:nsys] + tokens[start:]
        indent = self.task.inline.split("\n")[self.span[0]]
        indent = indent[: len(indent) - len(indent.lstrip())]
        self._replace_span([indent + shlex.join(kept)])
        return True


def describe_task(task: Any) -> str:
    """A short name for a task in log lines and errors."""
    run = import_nemo_run()
    if isinstance(task, run.Script):
        if task.inline:
            return "run.Script(inline=...)"
        return f"run.Script(path={task.path!r}, m={task.m}, entrypoint={task.entrypoint!r})"
    if isinstance(task, run.Partial):
        fn = task.__fn_or_cls__
        return f"run.Partial({getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')})"
    return type(task).__name__


def our_trainer_editor(task: Any, plugin: str) -> TaskEditor | None:
    """The editor when ``task`` runs megatron_resilience's trainer; None for any other trainer.

    An inline script that runs our trainer in a way the plugins cannot make signal-safe (twice, not as
    its last command, inside a pipeline) is a ConfigError naming the supported forms.
    """
    run = import_nemo_run()
    if isinstance(task, run.Script):
        if task.inline:
            lines = task.inline.replace("\\\n", " ").split("\n")
            if all(ScriptEditor._trainer_index(ScriptEditor._tokens(line)) is None for line in lines):
                return None
            return ScriptEditor(task, plugin)
        if task.path == MODULE and task.m and "python" in os.path.basename(task.entrypoint):
            return ScriptEditor(task, plugin)
        return None
    if isinstance(task, run.Partial):
        fn = task.__fn_or_cls__
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
        return PartialEditor(task, plugin) if name == ENTRY else None
    raise ConfigError(f"{plugin}: unsupported task type {type(task).__name__}; a task is a run.Partial or a "
                      f"run.Script")


__all__ = ["SUPPORTED_TASKS", "TaskEditor", "describe_task", "our_trainer_editor"]
