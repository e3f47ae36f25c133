"""Fault mixes: which causes a chaos run draws, with which weights, from which published source.

A mix file (YAML; the presets are in ``chaos/mixes/``)::

    name: llama3
    source: where the numbers come from (a paper and its table)
    description: what the mix includes
    causes:                      # one entry per real-world cause; its count is its weight
      - {cause: Faulty GPU, category: GPU, count: 148, percent: 30.1, fault: gpu_xid}

or a mix derived from another one: ``base: llama3`` with ``exclude_faults: [python_bug]``. Every key is
checked when the mix is loaded (unknown keys, unknown fault kinds, counts that are not positive integers):
the error names the file and the key.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from megatron_resilience.chaos.faults import FAULTS
from megatron_resilience.config.validate import ConfigError, check_keys
from megatron_resilience.jobs.monitors import read_raw

MIX_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixes")
KEYS = ("name", "source", "description", "causes", "base", "exclude_faults")
CAUSE_KEYS = ("cause", "category", "count", "percent", "fault")


@dataclass(frozen=True)
class Cause:
    cause: str
    category: str
    count: int
    fault: str
    percent: float | None = None


@dataclass(frozen=True)
class Mix:
    name: str
    source: str
    description: str
    causes: tuple[Cause, ...]
    excluded: tuple[str, ...] = ()
    path: str = ""

    def draw(self, rng: random.Random) -> Cause:
        return rng.choices(self.causes, weights=[c.count for c in self.causes])[0]

    def weights_by_fault(self) -> dict[str, float]:
        total = sum(c.count for c in self.causes)
        out: dict[str, float] = {}
        for c in self.causes:
            out[c.fault] = out.get(c.fault, 0.0) + c.count / total
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "description": self.description, "path": self.path,
                "excluded_faults": list(self.excluded), "weights_by_fault": self.weights_by_fault(),
                "causes": [vars(c) for c in self.causes]}


def preset_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(MIX_DIR) if f.endswith(".yaml"))


def load_mix(spec: str) -> Mix:
    """A preset name (``llama3``) or a YAML file path."""
    path = os.path.join(MIX_DIR, f"{spec}.yaml") if spec in preset_names() else spec
    if not os.path.exists(path):
        raise ConfigError(f"mix: {spec!r} is neither a preset ({', '.join(preset_names())}) nor a file")
    data = read_raw(path)  # a syntax error is one line naming the file, as for policies and monitors
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping with keys {list(KEYS)}")
    check_keys(path, "", data, KEYS)
    name = str(data.get("name") or os.path.basename(path)[:-5])
    if data.get("base"):
        base = load_mix(str(data["base"]))
        excluded = data.get("exclude_faults") or []
        if not isinstance(excluded, list) or any(e not in FAULTS for e in excluded):
            raise ConfigError(f"{path}: exclude_faults: must be a list of fault kinds {sorted(FAULTS)}, "
                              f"got {excluded!r}")
        causes = tuple(c for c in base.causes if c.fault not in excluded)
        return Mix(name=name, source=base.source, description=str(data.get("description") or base.description),
                   causes=causes, excluded=tuple(excluded), path=path)
    causes = []
    for i, entry in enumerate(data.get("causes") or []):
        where = f"{path}: causes[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be a mapping with keys {list(CAUSE_KEYS)}")
        check_keys(path, f"causes[{i}]", entry, CAUSE_KEYS)
        if entry.get("fault") not in FAULTS:
            raise ConfigError(f"{where}.fault: must be one of {sorted(FAULTS)}, got {entry.get('fault')!r}")
        count = entry.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{where}.count: must be an integer >= 1, got {count!r}")
        causes.append(Cause(cause=str(entry.get("cause") or entry["fault"]), category=str(entry.get("category", "")),
                            count=count, fault=entry["fault"], percent=entry.get("percent")))
    if not causes:
        raise ConfigError(f"{path}: causes: must list at least one cause")
    if not data.get("source"):
        raise ConfigError(f"{path}: source: must say where the numbers come from")
    return Mix(name=name, source=str(data["source"]), description=str(data.get("description") or ""),
               causes=tuple(causes), path=path)
