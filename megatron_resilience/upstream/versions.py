"""Installed and requested versions of upstream packages, as comparable int tuples."""

from __future__ import annotations

import importlib.metadata


def package_version(name: str) -> tuple[int, ...] | None:
    """Installed version of a distribution as an int tuple, or None when absent."""
    try:
        raw = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts: list[int] = []
    for piece in raw.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.7"`` / ``"0.4.1"`` / ``"0.5.0rc1"`` -> int tuple; ValueError names the bad text."""
    parts: list[int] = []
    for piece in str(text).strip().split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if len(parts) < 2:
        raise ValueError(f"not a version like '0.7' or '0.4.1': {text!r}")
    return tuple(parts)


UPSTREAMS = ("torch", "megatron-core", "nvidia-resiliency-ext", "nemo-run")


def installed_versions(names: tuple[str, ...] = UPSTREAMS) -> dict[str, str | None]:
    """Version strings of the upstream distributions this process imports (None when absent)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
