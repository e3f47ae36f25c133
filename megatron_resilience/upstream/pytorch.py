"""torch features the runtime uses that not every supported torch (>= 2.4) has."""

from __future__ import annotations

import functools


@functools.cache
def sdpa_has_gqa() -> bool:
    """``scaled_dot_product_attention(..., enable_gqa=True)`` exists (torch >= 2.5)."""
    from megatron_resilience.upstream.versions import package_version

    version = package_version("torch")
    return version is not None and version[:2] >= (2, 5)
