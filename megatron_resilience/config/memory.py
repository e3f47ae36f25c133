"""Will the model fit? Memory per rank from the model shape, precision, parallelism and optimizer, at submit time.

A shape whose weights, gradients and optimizer state cannot fit a GPU (``model.vocab_size=10**15``) used to
pass every check and die after torch loaded, minutes into the job. The public estimate Megatron-LM prints
(``theoretical_memory_usage``, after Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models") is enough to reject what cannot fit, and is computed here for the first pipeline stage
(the embedding's stage, which also holds the most in-flight micro-batches under 1F1B):

* parameters on that rank: the word (and learned position) embeddings split over TP, the transformer layers
  of one stage (attention ``2h^2 + 2h * kv``, MLP ``2 h ffn``, biases and norms) split over TP, and the
  output layer when it is not tied or there is one stage;
* bytes per parameter: bf16/fp16 weights with fp32 gradients, fp32 master weights and Adam's two moments:
  18 (Megatron-LM's figure), or 6 + 12 / DP with ``parallel.use_distributed_optimizer``; fp32: 16, or
  8 + 8 / DP; SGD keeps one momentum instead of two moments (4 bytes less, sharded alike). FSDP divides what it
  shards by DP too (``sharded_parts``): torch FSDP2 all of it (18 / DP), Megatron-FSDP what its sharding strategy
  names; a sharded model also gathers one layer whole at a time (its weights, and its gradients in the backward).
  Megatron-FSDP keeps fp32 main weights in a buffer of their own in fp32 too (``preserve_fp32_weights=True`` in
  megatron-core 0.16, ``megatron_fsdp_main_params_dtype=float32`` in 0.19, both defaults), sharded with the
  optimizer state: 20 bytes in fp32, 4 + 16 / DP with ``optim_grads``, 20 / DP with ``optim_grads_params``
  (``benchmarks/fsdp_memory.py`` measures these shards on every rank as estimated). Megatron-FSDP gathers per
  transformer layer, and the parameters outside the layers (the embeddings and the output layer: one bucket)
  whole while they compute; megatron-core 0.19.2 still holds that bucket gathered after the optimizer step
  (measured: the live tensors then exceed the shards by its weights, within 0.1 %; 0.16.1 does not), so with
  sharded weights the gathered part counts it beside one layer;
* activations, a lower bound: ``s b h (10 + 24 / TP)`` bytes per layer (``34 / TP`` with sequence
  parallelism), 2-byte values (twice that in fp32), times the layers of the stage and the micro-batches in
  flight (min(PP, micro-batches per step)); the attention scores are left out (flash and SDPA kernels do not
  keep them), and so are the logits, workspace and fragmentation.

The estimate is checked against ``train.gpu_memory_gib`` (the memory of one rank's device; 80 by default,
an H100/A100 80 GB; null skips the check): above it is a ConfigError naming the key that contributes most,
above 90 % a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_resilience.config.validate import ConfigError

GIB = 1024 ** 3
NEAR = 0.9
log = logging.getLogger("megatron_resilience.config")


@dataclass(frozen=True)
class MemoryEstimate:
    embedding_params: float  # on the first stage's rank (word + position embeddings, output layer if there)
    layer_params: float  # the stage's transformer layers on one rank
    bytes_per_param: float
    activations: float  # bytes, lower bound
    why_bytes: str
    gathered: float = 0.0  # bytes gathered whole while they compute (FSDP: see _gathered), else 0


    @property
    def params(self) -> float:
        return self.embedding_params + self.layer_params

    @property
    def total(self) -> float:
        return self.params * self.bytes_per_param + self.activations + self.gathered


# What each data-parallel strategy shards over the data-parallel ranks: (weights, gradients, master weights and
# optimizer state). ddp shards the last with the distributed optimizer; torch FSDP2 shards all three; Megatron-FSDP
# what its sharding strategy names (parallel.data_parallel_sharding_strategy).
_SHARDED = {
    "no_shard": (False, False, False),
    "optim": (False, False, True),
    "optim_grads": (False, True, True),
    "optim_grads_params": (True, True, True),
}


def sharded_parts(parallel: Any) -> tuple[bool, bool, bool]:
    """(weights, gradients, optimizer state) sharded over the data-parallel ranks, for ``parallel``'s strategy."""
    strategy = parallel.data_parallel_strategy
    if strategy == "torch_fsdp2":
        return _SHARDED["optim_grads_params"]
    if strategy == "megatron_fsdp":
        return _SHARDED[parallel.sharding_strategy]
    return _SHARDED["optim" if parallel.use_distributed_optimizer else "no_shard"]


def _bytes_per_param(config: Any, dp: int) -> tuple[float, str]:
    mixed = config.model.precision in ("bf16", "fp16")
    state = 8.0 if config.optim.optimizer == "adam" else 4.0  # Adam: two fp32 moments; SGD: one momentum
    main_copy = config.parallel.data_parallel_strategy == "megatron_fsdp"  # its main-weight buffer, fp32 too
    master = 4.0 if mixed or main_copy else 0.0  # fp32 master weights next to bf16/fp16 ones
    weights, grads_bytes = (2.0, 4.0) if mixed else (4.0, 4.0)
    grads = (" with fp32 gradients and master weights" if mixed else
             ", gradients, Megatron-FSDP's fp32 main weights" if main_copy else " and gradients")
    what = f"{config.model.precision} weights{grads} and {'Adam' if config.optim.optimizer == 'adam' else 'SGD'} state"
    parts = sharded_parts(config.parallel)
    total = sum(size / dp if shard else size for size, shard in zip((weights, grads_bytes, master + state), parts))
    names = [name for name, shard in zip(("weights", "gradients", "optimizer state"), parts) if shard]
    if names:
        return total, f"{what}, {', '.join(names)} sharded over {dp} data-parallel ranks"
    return total, what


def _gathered(config: Any, layer_params: float, embedding_params: float) -> float:
    """Bytes gathered whole while they compute, when the weights are sharded (FSDP): one transformer layer's
    weights and, in the backward, its gradients; with Megatron-FSDP also the weights of the bucket outside its
    per-layer units (the embeddings and the output layer), which megatron-core 0.19 keeps gathered."""
    if not sharded_parts(config.parallel)[0] or not config.model.num_layers:
        return 0.0
    weight_bytes = 2.0 if config.model.precision in ("bf16", "fp16") else 4.0
    per_layer = layer_params / max(1, config.model.num_layers // config.parallel.pipeline_model_parallel_size)
    outside = embedding_params * weight_bytes if config.parallel.data_parallel_strategy == "megatron_fsdp" else 0.0
    return per_layer * (weight_bytes + 4.0) + outside


def estimate(config: Any, world_size: int) -> MemoryEstimate:
    m, p, t = config.model, config.parallel, config.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = max(1, world_size // (tp * pp))
    h, kv = m.hidden_size, m.hidden_size * m.query_groups // m.num_attention_heads
    per_layer = 2 * h * h + 2 * h * kv + 2 * h * m.ffn_size + (3 * h + 2 * kv + m.ffn_size) + 4 * h
    layers = (m.num_layers // pp) * per_layer / tp
    embedding = m.vocab_size * h / tp + (m.max_positions * h if m.position_embedding_type == "learned_absolute" else 0)
    if pp == 1 and not m.share_embeddings_and_output_weights:  # the output layer: on this rank when one stage
        embedding += m.vocab_size * h / tp
    per_token_layer = (34.0 / tp) if p.sequence_parallel else (10.0 + 24.0 / tp)
    value_bytes = 2.0 if m.precision in ("bf16", "fp16") else 4.0
    gbs = t.global_batch_size or t.micro_batch_size * dp
    in_flight = min(pp, max(1, gbs // (t.micro_batch_size * dp)))
    activations = (m.seq_length * t.micro_batch_size * h * per_token_layer * value_bytes / 2.0
                   * (m.num_layers // pp) * in_flight)
    bpp, why = _bytes_per_param(config, dp)
    return MemoryEstimate(embedding_params=embedding, layer_params=layers, bytes_per_param=bpp,
                          activations=activations, why_bytes=why, gathered=_gathered(config, layers, embedding))


def _gib(x: float) -> str:
    return f"{x / GIB:.3g} GiB"


def check_memory(config: Any, world_size: int) -> MemoryEstimate | None:
    """ConfigError when the estimate exceeds ``train.gpu_memory_gib``; a logged warning above 90 % of it."""
    budget_gib = config.train.gpu_memory_gib
    if budget_gib is None:
        return None
    est = estimate(config, world_size)
    budget = budget_gib * GIB
    states = est.params * est.bytes_per_param
    text = (f"about {_gib(est.total)} per rank ({est.params:.3g} parameters on the first pipeline stage x "
            f"{est.bytes_per_param:.3g} bytes for {est.why_bytes} = {_gib(states)}, + activations of at least "
            f"{_gib(est.activations)}"
            + (f", + {_gib(est.gathered)} that FSDP gathers whole" if est.gathered else "") + ")")
    if est.total > budget:
        m = config.model
        if est.activations > states:
            key, value = "train.micro_batch_size", config.train.micro_batch_size
        elif est.embedding_params > est.layer_params:
            key, value = "model.vocab_size", m.vocab_size
        else:
            key, value = "model.num_layers", m.num_layers
        raise ConfigError(
            f"{key}: the model does not fit: {text}, more than train.gpu_memory_gib={budget_gib:g}; make it smaller, "
            f"split it over more ranks "
            f"(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size), shard the optimizer "
            f"(parallel.use_distributed_optimizer=true) or the weights and gradients too "
            f"(parallel.data_parallel_strategy='torch_fsdp2'), or set train.gpu_memory_gib to the GPUs' memory, "
            f"got {value!r}")
    if est.total > NEAR * budget:
        log.warning("memory: near the limit: %s, %.0f%% of train.gpu_memory_gib=%g; a larger micro-batch or "
                    "sequence may not fit", text, 100 * est.total / budget, budget_gib)
    return est
