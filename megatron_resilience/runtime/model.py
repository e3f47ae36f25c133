"""The Megatron-Core GPT model, wrapped in Megatron DDP or torch FSDP2 (``parallel.data_parallel_strategy``), for
this rank's pipeline stage."""

from __future__ import annotations

import logging

import torch

from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.runtime.distributed import DistInfo

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(config: PretrainConfig, dist: DistInfo):
    """``TransformerConfig`` from our plain ``ModelConfig`` + ``ParallelConfig``.

    On CPU the weights are initialised on CPU (``use_cpu_initialization``): the
    full matrix is drawn from the shared seed and then split, so a TP=2 run starts
    from exactly the weights of a single-process run.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p = config.model, config.parallel
    dtype = _DTYPES[m.precision]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=m.precision == "bf16",
        fp16=m.precision == "fp16",
        use_cpu_initialization=dist.is_cpu,
        # torch FSDP2 shards each transformer layer; with Transformer Engine's implementation it would also shard
        # the linears inside an already sharded layer ("Invariant encountered: value was None"): the local one
        **({"transformer_impl": "local"} if p.data_parallel_strategy == "torch_fsdp2" else {}),
    )


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def resolve_attention_backend(config: PretrainConfig, dist: DistInfo) -> str:
    """``model.attention_backend`` -> "te", "sdpa" or "unfused" for this device (auto: te on a GPU with TE)."""
    requested = config.model.attention_backend
    if config.parallel.data_parallel_strategy == "torch_fsdp2":  # the local layer spec (transformer_config)
        if requested == "te":
            raise ConfigError("model.attention_backend: 'te' needs Transformer Engine's layer spec, which torch FSDP2 "
                              "cannot shard (parallel.data_parallel_strategy='torch_fsdp2'); use 'auto' or 'sdpa', "
                              "got 'te'")
        return "sdpa" if requested == "auto" else requested
    if requested in ("auto", "te"):
        has_te = not dist.is_cpu and _importable("transformer_engine")
        if has_te:
            return "te"
        if requested == "te":
            raise ConfigError("model.attention_backend: 'te' needs Transformer Engine on a GPU "
                              f"(device={dist.device.type}, transformer_engine importable: "
                              f"{False if dist.is_cpu else has_te}); use 'auto' or 'sdpa', got 'te'")
        return "sdpa"
    return requested


def layer_spec(config: PretrainConfig, dist: DistInfo, backend: str):
    """Transformer Engine's layer spec for "te"; Megatron-Core's local spec otherwise, with SDPA core attention.

    The TE path is Megatron-LM's own for a dense GPT (``get_gpt_layer_with_transformer_engine_spec()``:
    TE linears with fused layer norms, ``TEDotProductAttention`` choosing flash/fused attention).
    """
    from megatron_resilience.upstream import mcore

    if backend == "te":
        return mcore.transformer_engine_layer_spec()
    if config.parallel.sequence_parallel and not _importable("apex.normalization"):
        # Megatron-Core's torch LayerNorm asserts on sequence parallelism; only TE/Apex norms support it.
        raise ConfigError("parallel.sequence_parallel: needs Transformer Engine (GPU) or Apex layer norms, "
                          f"neither is usable here (device={dist.device.type}), got True")
    core_attention = None
    if backend == "sdpa":
        from megatron_resilience.runtime.attention import SDPAttention

        core_attention = SDPAttention
    return mcore.local_layer_spec(normalization=config.model.normalization, core_attention=core_attention)


def build_model(config: PretrainConfig, dist: DistInfo) -> list[torch.nn.Module]:
    """GPT for this pipeline stage in Megatron DDP; one chunk (no virtual pipeline).

    Megatron DDP only all-reduces gradients when the pipeline schedule calls
    ``config.finalize_model_grads_func`` (and uses ``config.no_sync_func`` to
    skip reductions between micro-batches): both are set here, else data-parallel
    replicas would silently drift apart (FACTS.md).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    tconfig = transformer_config(config, dist)
    m = config.model
    backend = resolve_attention_backend(config, dist)
    gpt = GPTModel(
        config=tconfig,
        transformer_layer_spec=layer_spec(config, dist, backend),
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_positions,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
    )
    if not dist.is_cpu:
        gpt.cuda(torch.cuda.current_device())
    module: torch.nn.Module = gpt
    if m.precision != "fp32":
        module = Float16Module(tconfig, gpt)
    # fp16 overflows are the dynamic loss scaler's job (it skips the step and lowers the scale): a NaN/Inf
    # check on the raw gradients would stop the run on the first overflow instead.
    check_grads = config.rerun.check_for_nan_in_loss and m.precision != "fp16"
    strategy = config.parallel.data_parallel_strategy
    fsdp_fields = {}
    if strategy == "megatron_fsdp":
        from megatron_resilience.upstream import megatron_fsdp

        fsdp_fields = megatron_fsdp.ddp_config_fields(config.parallel.sharding_strategy,
                                                      backend=torch.distributed.get_backend())
        if dist.rank == 0:
            log.info("model: Megatron-FSDP (sharding %s) with Megatron's distributed optimizer%s",
                     config.parallel.sharding_strategy,
                     "" if config.parallel.use_distributed_optimizer else
                     " (parallel.use_distributed_optimizer=false overridden: Megatron-FSDP runs only with it, "
                     "as Megatron-LM's --use-megatron-fsdp forces it)")
    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True,
        "overlap_grad_reduce": False,
        "use_distributed_optimizer": config.parallel.use_distributed_optimizer,
        "check_for_nan_in_grad": check_grads,
        **fsdp_fields,
    })
    if strategy == "torch_fsdp2":
        from megatron_resilience.upstream import torch_fsdp2

        ddp = torch_fsdp2.wrap(tconfig, ddp_config, module, device_type=dist.device.type)
        torch_fsdp2.install_param_map_fix()
    elif strategy == "megatron_fsdp":
        ddp = megatron_fsdp.wrap(tconfig, ddp_config, module, device=dist.device)
    else:
        ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=module)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp.no_sync
    if dist.rank == 0:
        # what this rank holds: its pipeline stage and tensor shard, and with FSDP2 its data-parallel shard (a
        # DTensor's numel() is the whole parameter's)
        n_params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in gpt.parameters())
        log.info("model: GPT %d layers, hidden %d, heads %d (%d query groups), attention %s%s, "
                 "%d parameters held by this rank", m.num_layers, m.hidden_size, m.num_attention_heads,
                 m.query_groups, backend, "" if m.attention_backend == backend else f" ({m.attention_backend})",
                 n_params)
    return [ddp]
