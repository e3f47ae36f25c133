"""The training loop: Megatron-Core forward-backward under the rerun state machine, eval, hooks, stop reasons.

Shaped like Megatron-LM's ``train()``/``train_step()`` so its resilience
features plug in at the same points:

- ``while rerun_state_machine.should_run_forward_backward(it):`` around the
  forward-backward pass, and ``validate_result`` on the loss (NaN/Inf, spiky
  loss), so a suspicious step is re-run and attributed;
- ``should_checkpoint_and_exit()`` before the optimizer step: save if asked and
  exit with Megatron-Core's code (16 resume-to-disambiguate, 17 failed validation);
- :class:`~megatron_resilience.runtime.hooks.TrainingHooks` around setup, each
  step, eval and checkpointing, and after each step for an agreed stop reason.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_resilience.config import PretrainConfig
from megatron_resilience.runtime.distributed import DistInfo
from megatron_resilience.runtime.hooks import TrainingHooks
from megatron_resilience.runtime.loss_checks import report_rerun_outcome, validate_loss
from megatron_resilience.runtime.metrics import MetricsLogger
from megatron_resilience.runtime.optimizer import loss_scale
from megatron_resilience.runtime.state import TrainState

log = logging.getLogger(__name__)


# Stop reasons a run can end with (besides a rerun exit code).
FINISHED = "finished"
DURATION = "duration"


@dataclass(kw_only=True)
class TrainContext:
    """Everything the loop needs, built by ``megatron_resilience/trainer.py``."""

    config: PretrainConfig
    dist: DistInfo
    state: TrainState
    hooks: TrainingHooks
    checkpoints: Any  # checkpointing.tiers.TieredCheckpoints
    metrics: MetricsLogger
    datasets: Any
    train_iterator: Any
    global_batch_size: int
    num_microbatches: int
    start_time: float = field(default_factory=time.monotonic)


@dataclass(kw_only=True)
class StepResult:
    exit_code: int | None = None  # set when the rerun state machine asks to stop
    save_before_exit: bool = False
    loss: torch.Tensor | None = None  # mean loss over this rank's micro-batches (last pipeline stage only)
    grad_norm: float | None = None
    update_successful: bool = True


# --- forward step and loss ------------------------------------------------------------------------------------


def loss_func(config: PretrainConfig, loss_mask: torch.Tensor, output_tensor: torch.Tensor, poison: bool = False):
    """Token-mean LM loss, validated by the rerun state machine (runtime/loss_checks.py).
    ``poison``: the chaos tool's silent data corruption (``rerun.accept_chaos_nan``): the loss is NaN."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    if poison:
        loss = loss * float("nan")
    validate_loss(config, loss)
    # A copy: the schedule divides the returned loss by num_microbatches in place.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(config: PretrainConfig, data_iterator, model, poison: bool = False):
    """One micro-batch through this pipeline stage (Megatron-Core's ``forward_step_func`` contract)."""
    batch = next(data_iterator)
    # No attention mask in the batch: causal masks are built by the attention backend (runtime/data.py).
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, config, batch["loss_mask"], poison=poison)


def _mean_micro_loss(losses_reduced: list[dict]) -> torch.Tensor | None:
    if not losses_reduced:  # not the last pipeline stage
        return None
    return torch.stack([d["lm loss"].float() for d in losses_reduced]).mean()


def reduce_loss(ctx: TrainContext, local: torch.Tensor | None) -> float:
    """This step's (or interval's) loss averaged over data-parallel ranks, on every rank.

    Only the last pipeline stage computes the loss: others contribute 0 to a
    sum over the pipeline group, so rank 0 (first stage) can log it.
    """
    from megatron.core import parallel_state

    device = ctx.dist.device
    value = torch.zeros(1, dtype=torch.float64, device=device) if local is None else \
        local.detach().double().reshape(1).to(device)
    if local is not None:
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
        value /= parallel_state.get_data_parallel_world_size()
    if ctx.dist.pp > 1:
        torch.distributed.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return float(value.item())


# --- one training step ----------------------------------------------------------------------------------------


def train_step(ctx: TrainContext) -> StepResult:
    """Forward-backward (re-run while the rerun state machine asks), then the optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    from megatron_resilience.runtime.chaos_nan import poisoned

    config, state = ctx.config, ctx.state
    rerun = get_rerun_state_machine()
    diagnosing = rerun.state == RerunState.WILL_RERUN_FROM_CHECKPOINT  # resumed to re-run this step elsewhere
    forward_backward = get_forward_backward_func()
    losses_reduced: list[dict] = []
    poison = poisoned(config, ctx.dist.rank)
    while rerun.should_run_forward_backward(ctx.train_iterator):
        for chunk in state.model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        losses_reduced = forward_backward(
            forward_step_func=partial(forward_step, config, poison=poison),
            data_iterator=ctx.train_iterator,
            model=state.model,
            num_microbatches=ctx.num_microbatches,
            seq_length=config.model.seq_length,
            micro_batch_size=config.train.micro_batch_size,
            decoder_seq_length=config.model.seq_length,
            forward_only=False,
        )
    should_checkpoint, should_exit, exit_code = rerun.should_checkpoint_and_exit()
    report_rerun_outcome(rerun, diagnosing=diagnosing, step=state.step + 1, should_exit=should_exit)
    if should_exit:
        return StepResult(exit_code=exit_code, save_before_exit=should_checkpoint)
    update_successful, grad_norm, _ = state.optimizer.step()
    if update_successful:
        state.scheduler.step(increment=1)
    return StepResult(loss=_mean_micro_loss(losses_reduced), update_successful=update_successful,
                      grad_norm=None if grad_norm is None else float(grad_norm))


# --- evaluation -----------------------------------------------------------------------------------------------


def evaluate(ctx: TrainContext) -> float:
    """``eval_iters`` global batches from the start of the validation split, forward only."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    from megatron_resilience.runtime.data import valid_iterator

    config, state = ctx.config, ctx.state
    rerun = get_rerun_state_machine()
    mode = rerun.get_mode()
    rerun.set_mode(RerunMode.DISABLED)  # as Megatron-LM: no re-runs during evaluation
    iterator = valid_iterator(ctx.datasets, config, device=ctx.dist.device,
                              worker_init_fn=ctx.hooks.dataloader_worker_init)
    forward_backward = get_forward_backward_func()
    for chunk in state.model:
        chunk.eval()
    losses = []
    try:
        with torch.no_grad():
            for _ in range(config.train.eval_iters):
                reduced = forward_backward(
                    forward_step_func=partial(forward_step, config), data_iterator=iterator, model=state.model,
                    num_microbatches=ctx.num_microbatches, seq_length=config.model.seq_length,
                    micro_batch_size=config.train.micro_batch_size, decoder_seq_length=config.model.seq_length,
                    forward_only=True)
                mean = _mean_micro_loss(reduced)
                if mean is not None:
                    losses.append(mean)
    finally:
        for chunk in state.model:
            chunk.train()
        rerun.set_mode(mode)
    return reduce_loss(ctx, torch.stack(losses).mean() if losses else None)


# --- stop reasons and checkpoints -----------------------------------------------------------------------------


def duration_exceeded(ctx: TrainContext) -> bool:
    """``train.exit_duration_in_mins``: true on every rank once any rank is past it (MAX all-reduce)."""
    limit = ctx.config.train.exit_duration_in_mins
    if limit is None:
        return False
    over = (time.monotonic() - ctx.start_time) / 60.0 > limit
    flag = torch.tensor([int(over)], dtype=torch.int32, device=ctx.dist.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def save_checkpoint(ctx: TrainContext, why: str) -> None:
    if ctx.config.checkpoint.save is None:
        return
    with ctx.hooks.checkpoint_section():
        start = time.monotonic()
        ctx.checkpoints.save(ctx.state, reason=why)
    seconds = time.monotonic() - start
    record_durable_checkpoints(ctx)
    if ctx.dist.rank == 0:
        log.info("checkpoint: saved step %d (%s) in %.2f s", ctx.state.step, why, seconds)


def save_local_checkpoint(ctx: TrainContext) -> None:
    """The non-persistent tier's save (node-local, replicated; checkpointing/tiers.py), inside FT's
    checkpointing section like any save."""
    with ctx.hooks.checkpoint_section():
        seconds = ctx.checkpoints.save_local(ctx.state)
    record_durable_checkpoints(ctx)
    if ctx.dist.rank == 0:
        log.info("checkpoint: saved step %d to the local tier in %.2f s", ctx.state.step, seconds)


def record_durable_checkpoints(ctx: TrainContext) -> None:
    """A ``checkpoint`` record in metrics.jsonl for each save that became durable (committed) since last time,
    and a ``checkpoint_interval`` record for each interval the trainer chose (``checkpoint.interval_policy``)."""
    for record in ctx.checkpoints.take_durable():
        ctx.metrics.event("checkpoint", **record)
    for record in ctx.checkpoints.take_interval_changes():
        ctx.metrics.event("checkpoint_interval", **record)


def poll_async_checkpoints(ctx: TrainContext) -> None:
    """Every step: commit async saves whose write finished on all ranks, without waiting for one that has not."""
    if ctx.checkpoints.pending_steps:
        ctx.checkpoints.maybe_finalize(blocking=False)
        record_durable_checkpoints(ctx)


def save_at_stop(ctx: TrainContext, reason: str, *, last_saved: int) -> str:
    """The checkpoint of a graceful stop (signal, duration, straggler): "saved", "already saved", "failed" or
    "not saved" (``checkpoint.save_on_exit=false``).

    stop_reason.json says "stopped, resume from the newest complete checkpoint" before anything is written,
    and again once pending async saves are committed, so a kill during the save still requeues the job with
    the lost steps on record. A save that fails is logged and reported; the process still exits as stopped.
    """
    hooks, ckpt, state = ctx.hooks, ctx.checkpoints, ctx.state
    hooks.record_stop(state, reason, checkpoint_step=ckpt.latest_step, checkpoint_at_stop="pending")
    try:
        if ckpt.pending_steps:
            with hooks.checkpoint_section():
                ckpt.maybe_finalize(blocking=True)
            record_durable_checkpoints(ctx)
            hooks.record_stop(state, reason, checkpoint_step=ckpt.latest_step, checkpoint_at_stop="pending")
        if state.step == last_saved:
            return "already saved"
        if not ctx.config.checkpoint.save_on_exit:
            return "not saved"
        save_checkpoint(ctx, reason)
        with hooks.checkpoint_section():
            ckpt.finalize()
        record_durable_checkpoints(ctx)
    # CheckpointException (a write that failed on some rank, raised by the commit) is a BaseException in torch
    except (Exception, CheckpointException):  # noqa: BLE001 - the stop stands; the next attempt resumes from before
        log.exception("checkpoint at the stop (step %d) failed; the next attempt resumes from step %s",
                      state.step, ckpt.latest_step)
        return "failed"
    return "saved" if ckpt.latest_step == state.step else "failed"


# --- the loop -------------------------------------------------------------------------------------------------


def train(ctx: TrainContext) -> tuple[str, int | None, str | None]:
    """Run until ``max_steps``, a stop reason, or a rerun exit. Returns (reason, exit code or None,
    what became of the checkpoint at a graceful stop or None).

    The reason is "finished", the hooks' stop reason ("signal", "straggler", ...), "duration", or
    "rerun:<code>" when the rerun state machine ends the run.
    """
    config, state, hooks = ctx.config, ctx.state, ctx.hooks
    t = config.train
    run_step: Callable[[], StepResult] = hooks.wrap_train_step(lambda: train_step(ctx))
    tokens_per_step = ctx.global_batch_size * config.model.seq_length
    last_saved = state.step  # a checkpoint at the resume step already exists (or nothing was trained)
    window_losses: list[torch.Tensor | None] = []
    window_time = 0.0
    reason, exit_code = FINISHED, None
    record_durable_checkpoints(ctx)  # the interval chosen at the restart (checkpoint.interval_policy=young_daly)
    stop = hooks.stop_requested(state)  # a signal during setup: stop before the first step
    if stop:
        reason = stop
    while not stop and state.step < t.max_steps:
        step = state.step + 1
        with hooks.step_section(step):
            start = time.perf_counter()
            result = run_step()
            elapsed = time.perf_counter() - start
        if result.exit_code is not None:
            if result.save_before_exit:
                save_checkpoint(ctx, f"rerun state machine, exit code {result.exit_code}")
            if ctx.dist.rank == 0:
                log.warning("rerun state machine: exiting with code %d at step %d", result.exit_code, step)
            reason, exit_code = f"rerun:{result.exit_code}", result.exit_code
            break
        state.step = step
        state.consumed_samples += ctx.global_batch_size
        window_losses.append(result.loss)
        window_time += elapsed
        if step % t.log_interval == 0 or step == t.max_steps:
            losses = [x for x in window_losses if x is not None]
            loss = reduce_loss(ctx, torch.stack(losses).mean() if losses else None)
            step_time = window_time / len(window_losses)
            ctx.metrics.train(
                step=step, loss=loss, lr=float(state.optimizer.param_groups[0]["lr"]), grad_norm=result.grad_norm,
                step_time_s=step_time, tokens_per_s=tokens_per_step / step_time if step_time > 0 else math.inf,
                consumed_samples=state.consumed_samples,
                **({} if result.update_successful else {"skipped": True}),
                **({} if (scale := loss_scale(state.optimizer)) is None else {"loss_scale": scale}))
            window_losses, window_time = [], 0.0
        if t.eval_interval and step % t.eval_interval == 0:
            with hooks.eval_section():
                began = time.perf_counter()
                eval_loss = evaluate(ctx)
                ctx.metrics.eval(step=step, eval_loss=eval_loss, duration_s=time.perf_counter() - began)
            ctx.checkpoints.note_validation(step, eval_loss)  # checkpoint.keep_best ranks by it
        poll_async_checkpoints(ctx)
        why = "interval" if ctx.checkpoints.should_save(step) else "best" if ctx.checkpoints.wants_best(step) else None
        if why and step != t.max_steps:
            # A signal from this step stops the run first: its stop is recorded before any slow save starts.
            stop = hooks.signal_before_save(state)
            if not stop:
                save_checkpoint(ctx, why)
                last_saved = step
        if not stop and step != t.max_steps and ctx.checkpoints.should_save_local(step):
            save_local_checkpoint(ctx)
        # After the periodic save: a signal that arrived during it stops the run right away ("already saved").
        stop = stop or hooks.after_step(state)
        for kind, fields in hooks.take_records():
            ctx.metrics.event(kind, **fields)
        if stop is None and duration_exceeded(ctx):
            stop = DURATION
        if stop:
            reason = stop
            if ctx.dist.rank == 0:
                log.warning("stopping at step %d: %s", step, stop)
    at_stop = None
    if stop:
        if (record := hooks.stop_record()) is not None:
            ctx.metrics.event(record[0], **record[1])
        if config.checkpoint.save is not None:
            at_stop = save_at_stop(ctx, reason, last_saved=last_saved)
        return reason, exit_code, at_stop
    wanted = ctx.checkpoints.should_save(state.step) or ctx.checkpoints.wants_best(state.step)
    if exit_code is None and state.step != last_saved and (config.checkpoint.save_on_exit or wanted):
        save_checkpoint(ctx, reason)
    if config.checkpoint.save is not None:
        with hooks.checkpoint_section():
            ctx.checkpoints.finalize()
        record_durable_checkpoints(ctx)
    return reason, exit_code, at_stop
