"""Optimizer and learning-rate schedule (Megatron-Core ``OptimizerConfig`` + ``OptimizerParamScheduler``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.config.validate import (
    check_below_one,
    check_choice,
    check_int,
    check_non_negative,
    check_positive,
    check_types,
    fail,
)

OPTIMIZERS = ("adam", "sgd")
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(kw_only=True)
class OptimizerConfig:
    optimizer: str = "adam"
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None  # None -> train.max_steps
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    # fp16 only: the dynamic loss scaler's first scale. Megatron-LM's default 2**32 overflows the gradients of
    # small models for the first ~16 steps (each skipped); 2**16 rarely does. Logged at start.
    initial_loss_scale: float = 2.0**16

    def __post_init__(self) -> None:
        check_types(self, "optim")
        check_choice("optim.optimizer", self.optimizer, OPTIMIZERS)
        check_choice("optim.lr_decay_style", self.lr_decay_style, DECAY_STYLES)
        check_positive("optim.lr", self.lr)
        check_non_negative("optim.min_lr", self.min_lr)
        if self.min_lr > self.lr:
            fail("optim.min_lr", f"must be <= optim.lr={self.lr}", self.min_lr)
        check_int("optim.lr_warmup_steps", self.lr_warmup_steps, minimum=0)
        check_int("optim.lr_decay_steps", self.lr_decay_steps, minimum=1, allow_none=True)
        check_non_negative("optim.weight_decay", self.weight_decay)
        check_non_negative("optim.clip_grad", self.clip_grad)
        check_positive("optim.adam_eps", self.adam_eps)
        check_positive("optim.initial_loss_scale", self.initial_loss_scale)
        for name in ("adam_beta1", "adam_beta2"):
            check_below_one(f"optim.{name}", getattr(self, name))
