"""``section.field=value`` overrides onto a ``PretrainConfig``: the command line of ``python -m megatron_resilience``.

Used for ``run.Script`` tasks and for launching the trainer by hand under
torchrun or ft_launcher. Values are parsed by the field's annotated type; an
unknown key fails with the valid keys listed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from megatron_resilience.config.aliases import canonical_key, canonical_value
from megatron_resilience.config.pretrain import PretrainConfig
from megatron_resilience.config.validate import ConfigError, base_type

_TRUE, _FALSE, _NONE = ("true", "yes", "1", "on"), ("false", "no", "0", "off"), ("none", "null")


def parse_value(key: str, raw: str, annotation: Any) -> Any:
    """``raw`` as the field's type; a text that does not parse fails with the message the field's own check gives."""
    text = raw.strip()
    kind, optional = base_type(annotation)
    if optional and text.lower() in _NONE:
        return None
    if typing.get_origin(kind) is list or kind is list:
        text = text.strip("[]")
        return [part.strip().strip("'\"") for part in text.split(",") if part.strip()]
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{key}: must be true or false, got {raw!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key}: must be an integer, got {raw!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}: must be a number, got {raw!r}") from None
    return text.strip("'\"")


def valid_keys() -> list[str]:
    """Every key an override may name: ``run_dir`` and ``<section>.<field>``."""
    keys = []
    hints = typing.get_type_hints(PretrainConfig)
    for f in dataclasses.fields(PretrainConfig):
        cls = hints[f.name]
        if dataclasses.is_dataclass(cls):
            keys += [f"{f.name}.{sub.name}" for sub in dataclasses.fields(cls)]
        else:
            keys.append(f.name)
    return keys


KEY_LISTING = "every key: python -m megatron_resilience --help"


def closest_keys(key: str, keys: list[str], n: int = 3) -> list[str]:
    """The valid keys nearest a mistyped one: close spellings, and the same field name in other sections."""
    field_name = key.rpartition(".")[2]
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.75)
    same_field = [k for k in keys if k.rpartition(".")[2] == field_name and k not in close]
    return (close + same_field)[:n]


def did_you_mean(candidates: list[str]) -> str:
    if not candidates:
        return ""
    listed = candidates[0] if len(candidates) == 1 else f"{', '.join(candidates[:-1])} or {candidates[-1]}"
    return f"did you mean {listed}? "


def unknown_key_error(key: str) -> ConfigError:
    """One line: the key, that it is unknown, the closest valid keys, and what exists."""
    hints = typing.get_type_hints(PretrainConfig)
    section, _, name = key.partition(".")
    if section in hints and dataclasses.is_dataclass(hints[section]):
        in_section = [f"{section}.{f.name}" for f in dataclasses.fields(hints[section])]
        if not name:
            return ConfigError(f"{key}: unknown key ({section} is a section: name one of its fields); "
                               f"valid keys in {section}: {', '.join(in_section)}")
        hint = did_you_mean(closest_keys(key, valid_keys()))
        return ConfigError(f"{key}: unknown key; {hint}valid keys in {section}: {', '.join(in_section)}")
    hint = did_you_mean(closest_keys(key, valid_keys()))
    return ConfigError(f"{key}: unknown key; {hint}sections: {', '.join(hints)} ({KEY_LISTING})")


def reject_repeated_keys(items: list[str], where: str = "the command line") -> None:
    """A key typed twice (``train.max_steps=3 train.max_steps=2``) is an error naming it and both values, not a
    silent last-one-wins. (The trainer's own argv is exempt: a plugin may append a setting it changes, and says so
    in its log.)"""
    seen: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            continue
        key = canonical_key(key.strip().removeprefix("--"))
        if key in seen:
            raise ConfigError(f"{key}: given twice on {where} ({seen[key]!r}, then {value!r}); give it once")
        seen[key] = value


def parse_override(item: str) -> tuple[str, str | None, Any]:
    """One ``key=value`` string -> ``(section, field or None, typed value)``.

    The single place that resolves a key against ``PretrainConfig`` and parses its
    value: used here and by the recipes' overrides on a ``run.Partial``.
    """
    hints = typing.get_type_hints(PretrainConfig)
    key, sep, raw = item.partition("=")
    key = canonical_key(key.strip().removeprefix("--"))  # other projects' spellings (config/aliases.py)
    raw = canonical_value(key, raw)
    if not sep or not key:
        raise ConfigError(f"{item!r}: expected key=value, e.g. train.max_steps=100")
    section, _, name = key.partition(".")
    if section not in hints or bool(name) != dataclasses.is_dataclass(hints[section]):
        raise unknown_key_error(key)
    if not name:
        return section, None, parse_value(key, raw, hints[section])
    field_types = typing.get_type_hints(hints[section])
    if name not in field_types:
        raise unknown_key_error(key)
    return section, name, parse_value(key, raw, field_types[name])


def config_from_overrides(overrides: list[str], base: PretrainConfig | None = None) -> PretrainConfig:
    """Apply ``key=value`` strings to ``base`` (or the defaults) and validate the result."""
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for item in overrides:
        section, name, value = parse_override(item)
        if name is None:
            top[section] = value
        else:
            sections.setdefault(section, {})[name] = value
    if base is None:
        if "run_dir" not in top:
            raise ConfigError("run_dir: required, e.g. run_dir=/path/to/run")
        base = PretrainConfig(run_dir=top["run_dir"])
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(PretrainConfig)}
    values.update(top)
    for section, changes in sections.items():
        values[section] = dataclasses.replace(values[section], **changes)
    return PretrainConfig(**values)


def config_to_overrides(config: PretrainConfig) -> list[str]:
    """The inverse: every field as ``key=value`` (for ``run.Script`` tasks and logs)."""
    out = [f"run_dir={config.run_dir}"]
    for f in dataclasses.fields(PretrainConfig):
        section = getattr(config, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for sub in dataclasses.fields(section):
            value = getattr(section, sub.name)
            text = "null" if value is None else (",".join(value) if isinstance(value, list) else str(value).lower()
                                                   if isinstance(value, bool) else str(value))
            out.append(f"{f.name}.{sub.name}={text}")
    return out
