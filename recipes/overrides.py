"""``section.field=value`` overrides applied to a recipe's ``run.Partial``.

NeMo-Run's own CLI parser reads a parameter's type from its annotation object;
our config dataclasses use postponed (string) annotations, which it cannot
parse ("Failed to parse '100' as int"), and for a mistyped key it prints the
whole config instead of the keys that exist. So the CLI applies task overrides
here, with the same typed parsing as ``python -m megatron_resilience`` and
errors that list the valid keys. Only the named fields change.
"""

import copy
import dataclasses
import re
import typing

from megatron_resilience.config import PretrainConfig
from megatron_resilience.config._validate import ConfigError
from megatron_resilience.config.overrides import parse_override, parse_value, valid_keys
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

_HINTS = typing.get_type_hints(PretrainConfig)


def apply_overrides(task: "run.Partial", overrides: list[str]) -> "run.Partial":
    """A copy of ``task`` with each ``key=value`` applied; the input is left unchanged.

    Values are parsed by the field's annotated type (``train.max_steps=100`` is an int,
    ``ft.enabled=false`` a bool, ``checkpoint.save_interval=null`` None). A section the
    task does not set yet (a bare ``run.Partial(pretrain)``) is created from its defaults.
    """
    task = copy.deepcopy(task)
    for item in overrides:
        section, name, value = parse_override(item)
        if name is None:
            setattr(task, section, value)
            continue
        config = getattr(task, section, None)
        if config is None:
            config = run.Config(_HINTS[section])
            setattr(task, section, config)
        setattr(config, name, value)
    return task


def apply_plugin_overrides(plugins: list, overrides: list[str]) -> list:
    """``plugins.FIELD=value`` (every plugin with that field) or ``plugins[i].FIELD=value`` on built plugins.

    Typed like task overrides; each changed plugin is rebuilt with ``dataclasses.replace`` so its own
    validation runs again.
    """
    plugins = list(plugins)
    for item in overrides:
        key, sep, raw = item.partition("=")
        match = re.fullmatch(r"plugins(?:\[(\d+)\])?\.(\w+)", key.strip())
        if not sep or not match:
            raise ConfigError(f"{item!r}: expected plugins.FIELD=value or plugins[i].FIELD=value")
        index, name = match.groups()
        if index is not None and int(index) >= len(plugins):
            raise ConfigError(f"{key}: there are {len(plugins)} plugins (run.plugins=...)")
        chosen = [int(index)] if index is not None else \
            [i for i, p in enumerate(plugins) if name in typing.get_type_hints(type(p))]
        valid = sorted({f"plugins.{f.name}" for p in plugins for f in dataclasses.fields(p) if f.init})
        if not chosen or name not in typing.get_type_hints(type(plugins[chosen[0]])):
            raise ConfigError(f"{key}: unknown key; valid keys: {', '.join(valid) or '(no plugins set)'}")
        for i in chosen:
            plugins[i] = dataclasses.replace(plugins[i], **{name: parse_value(key, raw,
                                                                          typing.get_type_hints(type(plugins[i]))[name])})
    return plugins


def unknown_executor_keys(executor_cls: type, overrides: list[str]) -> str | None:
    """An error naming the first ``executor.X=...`` whose X is not a field of ``executor_cls``, or None."""
    fields = [f.name for f in dataclasses.fields(executor_cls) if f.init]
    for item in overrides:
        key = item.partition("=")[0]
        if key.startswith("executor."):
            name = key[len("executor."):].split(".")[0].split("[")[0]
            if name not in fields:
                return f"{key}: unknown key; valid keys: {', '.join('executor.' + f for f in fields)}"
    return None
