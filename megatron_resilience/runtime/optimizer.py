"""Megatron-Core optimizer and LR/weight-decay schedule from our ``OptimizerConfig``."""

from __future__ import annotations

import logging

import torch

from megatron_resilience.config import PretrainConfig

log = logging.getLogger(__name__)


def build_optimizer(config: PretrainConfig, model: list[torch.nn.Module]):
    """``get_megatron_optimizer`` (fused Adam from TE/apex when present, torch AdamW otherwise).

    Also sets ``grad_scale_func`` on the model config, as Megatron-LM does, so the
    pipeline schedule scales the loss for fp16 (a no-op scale of 1 for fp32/bf16).
    """
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config

    o, m = config.optim, config.model
    mcore = McoreOptimizerConfig(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=m.precision == "bf16",
        fp16=m.precision == "fp16",
        params_dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[m.precision],
        # Megatron-FSDP runs with Megatron's distributed optimizer only (upstream/megatron_fsdp.py)
        use_distributed_optimizer=(config.parallel.use_distributed_optimizer
                                   or config.parallel.data_parallel_strategy == "megatron_fsdp"),
        initial_loss_scale=o.initial_loss_scale,  # fp16 only (see OptimizerConfig)
    )
    optimizer = get_megatron_optimizer(mcore, model)
    get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
    if m.precision == "fp16" and torch.distributed.get_rank() == 0:
        log.info("optimizer: fp16 with dynamic loss scaling: initial loss scale %g (optim.initial_loss_scale); "
                 "a step whose gradients overflow is skipped, and after %d overflows in a row the scale halves "
                 "(min %g); it doubles after %d clean steps", o.initial_loss_scale, mcore.hysteresis,
                 mcore.min_loss_scale, mcore.loss_scale_window)
    return optimizer


def loss_scale(optimizer) -> float | None:
    """The fp16 loss scaler's current scale (None without one: fp32 and bf16 do not scale the loss)."""
    scaler = getattr(getattr(optimizer, "chained_optimizers", [optimizer])[0], "grad_scaler", None)
    return None if scaler is None else float(scaler.scale.item())


def build_scheduler(config: PretrainConfig, optimizer):
    """``OptimizerParamScheduler`` counted in optimizer steps; ``lr_decay_steps`` None -> ``train.max_steps``.

    The scheduler's own checkpoint values win on resume (``use_checkpoint_opt_param_scheduler``),
    so a resumed run continues the same curve.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = config.optim
    decay_steps = o.lr_decay_steps or config.train.max_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.lr_warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, o.lr_warmup_steps + 1),  # upstream asserts warmup < decay
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
