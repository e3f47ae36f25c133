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
import inspect
import re
import typing
from typing import Any, Callable

from megatron_resilience.config import PretrainConfig
from megatron_resilience.config.overrides import closest_keys, did_you_mean, parse_override, parse_value
from megatron_resilience.config.validate import ConfigError, base_type
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
            hint = did_you_mean(closest_keys(f"plugins.{name}", valid)) if valid else ""
            raise ConfigError(f"{key}: unknown key; {hint}valid keys: {', '.join(valid) or '(no plugins set)'}")
        for i in chosen:
            plugins[i] = dataclasses.replace(plugins[i], **{name: parse_value(key, raw,
                                                                          typing.get_type_hints(type(plugins[i]))[name])})
    return plugins


# --- the CLI's own words: --factory RECIPE(args), run.plugins=..., run.executor.X=... -------------------------


def _split_arguments(text: str) -> list[str]:
    """``a=1,b=(x,y),c=[1,2]`` -> ``["a=1", "b=(x,y)", "c=[1,2]"]`` (commas inside brackets stay)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in [*parts, current] if p.strip()]


def recipe_call(spec: str, recipes: dict) -> tuple[Callable, dict[str, Any]] | None:
    """``gpt_126m(num_nodes=2,dir=/x)`` -> (recipe, typed keyword arguments); None when ``spec`` names no recipe
    of ours in that form (nemo_run then resolves it: a dotted import path, another registered factory).

    Arguments are typed by the recipe's signature, with the messages the recipe gives in Python.
    """
    match = re.fullmatch(r"\s*(\w+)\s*(?:\((.*)\))?\s*", spec, flags=re.S)
    if not match:
        return None
    name, arg_text = match.groups()
    if name not in recipes:
        if "." in spec.split("(")[0]:
            return None
        raise ConfigError(f"--factory {name}: unknown recipe; {did_you_mean(closest_keys(name, list(recipes)))}"
                          f"recipes: {', '.join(recipes)}")
    recipe = recipes[name]
    params = inspect.signature(recipe).parameters
    hints = typing.get_type_hints(recipe)
    kwargs: dict[str, Any] = {}
    for item in _split_arguments(arg_text or ""):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--factory {spec}: arguments must be name=value, got {item!r}")
        if key not in params:
            raise ConfigError(f"{key}: unknown argument of {name}; {did_you_mean(closest_keys(key, list(params)))}"
                              f"arguments: {', '.join(params)}")
        kwargs[key] = parse_value(key, raw, hints.get(key, str))
    return recipe, kwargs


def plugin_list(spec: str, factories: dict[str, Callable]) -> list:
    """``ft``, ``[ft,preemption]`` or ``resilience`` -> built plugins; each plugin at most once."""
    names = [n.strip().strip("'\"") for n in spec.strip().strip("[]").split(",") if n.strip()]
    if not names:
        raise ConfigError(f"run.plugins={spec}: name at least one plugin; plugins: {', '.join(factories)}")
    plugins: list = []
    for name in names:
        if name not in factories:
            raise ConfigError(f"run.plugins={spec}: unknown plugin {name!r}; "
                              f"{did_you_mean(closest_keys(name, list(factories)))}plugins: {', '.join(factories)}")
        built = factories[name]()
        for plugin in built if isinstance(built, list) else [built]:
            kind = type(plugin).__name__
            if any(type(p).__name__ == kind for p in plugins):
                raise ConfigError(f"run.plugins={spec}: {kind} is given twice (resilience = ft + preemption); "
                                  f"give each plugin once")
            plugins.append(plugin)
    return plugins


def split_executor_overrides(executor_cls: type, overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``executor.X=value`` -> ({X: typed value} for plain-typed fields, the rest for nemo_run's parser).

    Plain fields (int, float, bool, str) are typed here like task overrides: nemo_run's own message for a
    bad value is a nested repr several hundred characters long, and it cannot parse an empty value
    (``executor.account=``). Unknown X fails with the closest fields.
    """
    fields = [f.name for f in dataclasses.fields(executor_cls) if f.init and not f.name.startswith("_")]
    hints = typing.get_type_hints(executor_cls)
    typed: dict[str, Any] = {}
    rest = []
    for item in overrides:
        key, _, raw = item.partition("=")
        key = key.strip()
        name = key[len("executor."):].split(".")[0].split("[")[0]
        if name not in fields:
            raise ConfigError(f"{key}: unknown key; "
                              f"{did_you_mean(['executor.' + c for c in closest_keys(name, fields)])}"
                              f"valid keys: {', '.join('executor.' + f for f in fields)}")
        kind, _ = base_type(hints.get(name, Any))
        if kind in (int, float, bool, str) and key == f"executor.{name}":
            typed[name] = parse_value(key, raw, hints[name])
        else:
            rest.append(item)
    return typed, rest
