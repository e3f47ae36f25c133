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
import typing

from megatron_resilience.config import PretrainConfig
from megatron_resilience.config._validate import ConfigError
from megatron_resilience.config.overrides import _parse, _valid_keys
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

_HINTS = typing.get_type_hints(PretrainConfig)


def valid_keys() -> list[str]:
    """Every key a task override may name: ``run_dir`` and ``<section>.<field>``."""
    return _valid_keys()


def apply_overrides(task: "run.Partial", overrides: list[str]) -> "run.Partial":
    """A copy of ``task`` with each ``key=value`` applied; the input is left unchanged.

    Values are parsed by the field's annotated type (``train.max_steps=100`` is an int,
    ``ft.enabled=false`` a bool, ``checkpoint.save_interval=null`` None). A section the
    task does not set yet (a bare ``run.Partial(pretrain)``) is created from its defaults.
    """
    task = copy.deepcopy(task)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise ConfigError(f"{item!r}: expected key=value, e.g. train.max_steps=100")
        section, _, name = key.partition(".")
        if section not in _HINTS or (name and not dataclasses.is_dataclass(_HINTS[section])) \
                or (not name and dataclasses.is_dataclass(_HINTS[section])):
            raise ConfigError(f"{key}: unknown key; valid keys: {', '.join(valid_keys())}")
        if not name:
            setattr(task, section, _parse(key, raw, _HINTS[section]))
            continue
        cls = _HINTS[section]
        field_types = typing.get_type_hints(cls)
        if name not in field_types:
            valid = [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
            raise ConfigError(f"{key}: unknown key; valid keys in {section}: {', '.join(valid)}")
        value = _parse(key, raw, field_types[name])
        config = getattr(task, section, None)
        if config is None:
            config = run.Config(cls)
            setattr(task, section, config)
        setattr(config, name, value)
    return task
