"""megatron-core on the compute node: layer specs, process groups and attention limits, per version.

Every difference between the megatron-core releases we support (0.13 .. 0.19 tested: 0.16.1 and
0.19.2) that the model and attention code meet lives here. Nothing is imported at module import
(torch and megatron load only when a function runs).
"""

from __future__ import annotations

import dataclasses
from typing import Any


def tensor_parallel_size(process_groups: dict[str, Any]) -> int:
    """The tensor-parallel group size a ``core_attention`` module is built for.

    Attention passes its groups as ``pg_collection`` (0.14+; ``model_comm_pgs`` in some 0.14/0.15
    releases), each with a ``tp`` group; 0.13 passes none and the global parallel state holds it.
    """
    for name in ("pg_collection", "model_comm_pgs"):
        groups = process_groups.get(name)
        if groups is not None and getattr(groups, "tp", None) is not None:
            return groups.tp.size()
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def unsupported_for_sdpa(config: Any, layer_number: int) -> str:
    """What in ``config`` the SDPA core attention cannot do (empty when nothing), checked at build time."""
    reasons = []
    if getattr(config, "context_parallel_size", 1) != 1:
        reasons.append(f"context_parallel_size={config.context_parallel_size}")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        reasons.append(f"softmax_type={config.softmax_type!r}")
    window = getattr(config, "window_size", None)
    if window:
        skip = getattr(config, "window_attn_skip_freq", None)
        try:
            from megatron.core.transformer.utils import is_layer_window_attention
        except ImportError:  # releases before per-layer windows: a window applies to every layer
            windowed = True
        else:
            windowed = is_layer_window_attention(window, skip, layer_number)
        if windowed:
            reasons.append(f"window_size={window}")
    return ", ".join(reasons)


def local_layer_spec(*, normalization: str, core_attention: type | None = None):
    """Megatron-Core's local GPT layer spec, with its ``core_attention`` replaced when one is given.

    0.16 builds the spec in ``get_gpt_layer_local_spec``; 0.19 wraps ``get_gpt_layer_local_submodules``
    in it. Both return ``ModuleSpec(TransformerLayer, submodules=TransformerLayerSubmodules(
    self_attention=ModuleSpec(SelfAttention, submodules=SelfAttentionSubmodules(core_attention=...))))``;
    the replacement makes new dataclasses rather than editing upstream's.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=normalization)
    if core_attention is None:
        return spec
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise RuntimeError(f"megatron-core's local layer spec has no self_attention.submodules.core_attention "
                           f"({type(attention.submodules).__name__}); this megatron-core is not supported")
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def transformer_engine_layer_spec():
    """Megatron-Core's Transformer Engine GPT layer spec (dense, no MoE/MLA), as Megatron-LM builds it for GPT."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def import_megatron_core() -> None:
    """``import megatron.core`` without importing torch's compiler stack for fusions the run may never call.

    megatron-core (0.12+) decorates its fused bias/activation functions with ``jit_fuser = torch.compile``
    at import time; each decoration imports ``torch._dynamo`` and ``torch._inductor`` (about 30 % of the
    CPU time of importing megatron-core, measured here; seconds of every restart), although the local
    and TE specs call those functions only with ``bias_activation_fusion``/``bias_dropout_fusion`` on.
    During this import ``torch.compile`` is replaced by a wrapper that compiles on the first *call*
    (which is when torch.compile compiles anyway); modules go to the real ``torch.compile``. Outside
    the import nothing changes. A second call, or megatron-core already imported, does nothing.
    """
    import sys

    if "megatron.core" in sys.modules:
        return
    import functools

    import torch

    real_compile = torch.compile

    def compile_on_first_call(model=None, **options):
        if model is None:  # @torch.compile(...) with options
            return functools.partial(compile_on_first_call, **options)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real_compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = compile_on_first_call
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real_compile
