"""``run_pretraining(config)``: set up, train, clean up. The runtime behind ``pretrain()`` and the CLI.

Order (FT sections follow it): hooks are built first from the launcher's
environment; inside ``hooks.setup_section()`` come torch.distributed and
Megatron-Core parallel state, seeds, model, optimizer, scheduler, data, the
checkpoint load and the data position; then ``hooks.after_setup``, the loop,
``hooks.on_exit``, and teardown. A rerun exit code (16/17) is raised as
``SystemExit`` after teardown; every other ending returns normally.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time

from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.runtime.hooks import TrainingHooks
from megatron_resilience.runtime.state import TrainState

log = logging.getLogger("megatron_resilience")


def _setup_logging(rank: int) -> None:
    """Rank 0 logs INFO (progress lines); other ranks only warnings. Megatron-Core's INFO chatter is muted."""
    logging.basicConfig(format="[%(asctime)s] [rank %(rank)s] %(name)s: %(message)s", level=logging.WARNING,
                        force=True)
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "_mr_rank", False):
        def record_factory(*args, **kwargs):
            record = factory(*args, **kwargs)
            record.rank = rank
            return record

        record_factory._mr_rank = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(record_factory)
    logging.getLogger("megatron_resilience").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logging.getLogger("megatron").setLevel(logging.WARNING)


def build_hooks(config: PretrainConfig, *, rank: int, world_size: int) -> TrainingHooks:
    """The resilience hooks when ``megatron_resilience.resilience.build_hooks`` exists, else no-op hooks."""
    import megatron_resilience.resilience as resilience

    factory = getattr(resilience, "build_hooks", None)
    if factory is None:
        return TrainingHooks()
    return factory(config, rank=rank, world_size=world_size)


class NoCheckpoints:
    """Stand-in while ``runtime/checkpoint.py`` is absent: nothing to load, nothing saved."""

    def __init__(self, config, *, run_dir: str) -> None:
        if config.save is not None or config.load_dir is not None:
            raise RuntimeError("checkpoint.save/load is set but megatron_resilience.runtime.checkpoint is missing")

    def load_latest(self, state: TrainState) -> bool:
        return False

    def should_save(self, step: int) -> bool:
        return False

    def save(self, state: TrainState) -> None:
        pass

    def finalize(self) -> None:
        pass


def _checkpoint_manager_cls():
    if importlib.util.find_spec("megatron_resilience.runtime.checkpoint") is None:
        return NoCheckpoints
    from megatron_resilience.runtime.checkpoint import CheckpointManager

    return CheckpointManager


def _init_rerun_state_machine(config: PretrainConfig) -> None:
    from megatron.core.rerun_state_machine import (
        RerunDiagnostic, RerunErrorInjector, RerunMode, initialize_rerun_state_machine,
    )

    r = config.rerun
    modes = {"disabled": RerunMode.DISABLED, "validate_results": RerunMode.VALIDATE_RESULTS,
             "report_stats": RerunMode.REPORT_DETERMINISM_STATS}
    initialize_rerun_state_machine(
        mode=modes[r.rerun_mode],
        error_injector=RerunErrorInjector(error_injection_rate=r.error_injection_rate,
                                          error_injection_type=RerunDiagnostic(r.error_injection_type)),
        result_rejected_tracker_filename=r.result_rejected_tracker_filename,
    )


def run_pretraining(config: PretrainConfig) -> None:
    """Train ``config`` on this process's rank; returns when finished or stopped, exits 16/17 on rerun codes."""
    start_time = time.monotonic()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _setup_logging(rank)
    hooks = build_hooks(config, rank=rank, world_size=world_size)
    exit_code = None
    try:
        with hooks.setup_section():
            ctx = _setup(config, hooks, start_time)
        hooks.after_setup(ctx.state)
        from megatron_resilience.runtime.loop import train

        reason, exit_code = train(ctx)
        ctx.metrics.event("end", step=ctx.state.step, reason=reason, exit_code=exit_code or 0)
        hooks.on_exit(ctx.state, reason)
        if rank == 0:
            log.info("training ended: %s at step %d (%.1f s)", reason, ctx.state.step, time.monotonic() - start_time)
        ctx.metrics.close()
    except ConfigError as err:  # a setting that only the job's size can check, e.g. TP*PP vs world size
        raise SystemExit(f"megatron_resilience: {err}") from None
    finally:
        _teardown()
    if exit_code is not None:
        sys.exit(exit_code)


def _setup(config: PretrainConfig, hooks: TrainingHooks, start_time: float):
    from megatron.core import parallel_state

    from megatron_resilience.runtime import data
    from megatron_resilience.runtime.distributed import init_distributed, seed_everything
    from megatron_resilience.runtime.loop import TrainContext
    from megatron_resilience.runtime.metrics import MetricsLogger
    from megatron_resilience.runtime.model import build_model
    from megatron_resilience.runtime.optimizer import build_optimizer, build_scheduler

    dist = init_distributed(config)
    _init_rerun_state_machine(config)
    # Same seed on every data- and tensor-parallel rank (identical replicas, TP splits of one matrix);
    # pipeline stages get their own, as in Megatron-LM, so stage 2's layers differ from stage 1's.
    seed_everything(config.train.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    model = build_model(config, dist)
    optimizer = build_optimizer(config, model)
    scheduler = build_scheduler(config, optimizer)
    gbs = config.train.resolved_global_batch_size(dist.dp)
    num_microbatches = gbs // (config.train.micro_batch_size * dist.dp)
    datasets = data.build_datasets(config, global_batch_size=gbs)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    checkpoints = _checkpoint_manager_cls()(config.checkpoint, run_dir=config.run_dir)
    resumed = checkpoints.load_latest(state)
    metrics = MetricsLogger(config.run_dir, enabled=dist.rank == 0, max_steps=config.train.max_steps)
    metrics.event("start", step=state.step, consumed_samples=state.consumed_samples, resumed=resumed,
                  world_size=dist.world_size, tp=dist.tp, pp=dist.pp, dp=dist.dp)
    if dist.rank == 0:
        log.info("setup: %s at step %d (consumed_samples=%d), global batch %d = %d micro-batches x %d x dp %d",
                 "resumed" if resumed else "starting", state.step, state.consumed_samples, gbs, num_microbatches,
                 config.train.micro_batch_size, dist.dp)
    train_iterator = data.train_iterator(datasets, config, consumed_samples=state.consumed_samples,
                                         device=dist.device, worker_init_fn=hooks.dataloader_worker_init)
    return TrainContext(config=config, dist=dist, state=state, hooks=hooks, checkpoints=checkpoints,
                        metrics=metrics, datasets=datasets, train_iterator=train_iterator,
                        global_batch_size=gbs, num_microbatches=num_microbatches, start_time=start_time)


def _teardown() -> None:
    """Leave the process reusable (tests run pretraining more than once): rerun machine, groups, process group."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    from megatron_resilience.runtime.distributed import destroy_distributed

    destroy_rerun_state_machine()
    destroy_distributed()
