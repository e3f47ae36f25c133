"""``run_pretraining(config)``: set up, train, clean up. The orchestrator behind ``pretrain()`` and the CLI.

It sits above both ``runtime/`` (the Megatron-Core pieces) and ``resilience/`` (hooks built on the runtime),
so that every module imports only from rooms below it.

Order (FT sections follow it): hooks are built first from the launcher's
environment; inside ``hooks.setup_section()`` come torch.distributed and
Megatron-Core parallel state, seeds, model, optimizer, scheduler, data, the
checkpoint load and the data position; then ``hooks.after_setup``, the loop,
``hooks.on_exit``, and teardown. A rerun exit code (16/17) is raised as
``SystemExit`` after teardown; every other ending returns normally.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time

from megatron_resilience import upstream
from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.config.paths import check_paths
from megatron_resilience.dashboards import check_installed
from megatron_resilience.resilience import build_hooks
from megatron_resilience.resilience.cloud_notice import start_poller
from megatron_resilience.resilience.preemption import install_at_process_start
from megatron_resilience.runtime import model_shape
from megatron_resilience.runtime.hooks import TrainingHooks
from megatron_resilience.runtime.launch_env import adopt_launch_env
from megatron_resilience.runtime.setup_timeline import SetupTimeline
from megatron_resilience.runtime.state import TrainState
from megatron_resilience.upstream.fsdp import check_data_parallel_strategy
from megatron_resilience.upstream.harmless_warnings import silence_harmless_warnings

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
    silence_harmless_warnings()


def _init_rerun_state_machine(config: PretrainConfig) -> None:
    from megatron.core.rerun_state_machine import (
        RerunDiagnostic,
        RerunErrorInjector,
        RerunMode,
        initialize_rerun_state_machine,
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
    """Train ``config`` on this process's rank; returns when finished or stopped, exits 16/17 on rerun codes.

    With ``inprocess.enabled`` the training (hooks to teardown) runs under nvidia-resiliency-ext's in-process
    restart wrapper (resilience/inprocess.py): after a fault it is called again in the same process.
    """
    start_time = time.monotonic()
    # First: a preemption signal during the seconds of imports and setup below must stop the run, not kill it.
    signals = install_at_process_start(config.train.exit_signal_handler, config.train.exit_signal,
                                       run_dir=config.run_dir, checkpoint_root=config.checkpoint.load_dir)
    timeline = SetupTimeline()
    timeline.mark("entered")
    launch = adopt_launch_env()  # torchrun/ft_launcher variables, or Slurm's under a bare srun (no torch)
    rank, world_size = launch.rank, launch.world_size
    try:  # before torch loads: a bad folder or job size fails here, in seconds, not at the first save
        config.validate_world_size(world_size)
        check_data_parallel_strategy(config, world_size)
        check_paths(config)
        model_shape.check_resume(config)  # another model shape than the checkpoint's: named now, not at the load
        notes = check_installed(config)
    except ConfigError as err:
        raise SystemExit(f"megatron_resilience: {err}") from None
    _setup_logging(rank)
    for note in notes if rank == 0 else []:
        log.warning("%s", note)
    if signals is not None and rank == 0:
        log.info("preemption: %s handler installed at process start (pid %d): a signal during setup exits 0 at "
                 "once, later ones stop the run with a checkpoint", config.train.exit_signal, os.getpid())
    notices = None
    if config.train.preemption_notice is not None and signals is not None:
        t = config.train
        notices = start_poller(provider=t.preemption_notice, interval=t.preemption_notice_interval,
                               url=t.preemption_notice_url, handler=signals, local_rank=launch.local_rank, rank=rank)
    try:
        if config.inprocess.enabled:
            from megatron_resilience.resilience import inprocess

            def once(call_wrapper) -> int | None:
                iteration_timeline = timeline if inprocess.current_iteration() == 0 else SetupTimeline()
                iteration_timeline.mark("entered")
                return _train(config, rank, world_size, start_time, iteration_timeline, call_wrapper, notices)

            exit_code = inprocess.run_restartable(config, once, rank=rank, world_size=world_size)
        else:
            exit_code = _train(config, rank, world_size, start_time, timeline, None, notices)
    finally:  # the poller outlives in-process restarts: a notice during a restart still stops the run
        if notices is not None:
            notices.stop()
    if exit_code is not None:
        sys.exit(exit_code)


def _train(config: PretrainConfig, rank: int, world_size: int, start_time: float, timeline: SetupTimeline,
           call_wrapper, notices) -> int | None:
    """Hooks, setup, the loop, teardown: one call of the training function. Returns a rerun exit code or None.

    Under in-process restart (``call_wrapper`` set) every exception propagates, so the wrapper restarts (a lost
    peer is part of every in-process restart). Exit codes are the process's: the rerun state machine's 16 asks
    for the step to be re-run on other hardware, which an in-process restart cannot give.
    """
    hooks = build_hooks(config, rank=rank, world_size=world_size)
    if call_wrapper is not None:
        hooks.progress = call_wrapper.ping
        if getattr(hooks, "ft", None) is not None:  # messages to ft_launcher's rank monitor are never cut in two
            hooks.ft.atomic = call_wrapper.atomic
    exit_code = None
    try:
        with hooks.setup_section():
            ctx = _setup(config, hooks, start_time, timeline)
        hooks.after_setup(ctx.state)
        from megatron_resilience.runtime.loop import train

        reason, exit_code, at_stop = train(ctx)
        if notices is not None:
            notices.stop()  # training is over: a notice from now on has nothing to stop
        ctx.metrics.event("end", step=ctx.state.step, reason=reason, exit_code=exit_code or 0)
        hooks.on_exit(ctx.state, reason, checkpoint_step=ctx.checkpoints.latest_step, checkpoint_at_stop=at_stop)
        if rank == 0:
            log.info("training ended: %s at step %d (%.1f s)", reason, ctx.state.step, time.monotonic() - start_time)
        ctx.metrics.close()
    except ConfigError as err:  # a setting that only the job's size can check, e.g. TP*PP vs world size
        raise SystemExit(f"megatron_resilience: {err}") from None
    except Exception as err:
        if call_wrapper is not None:
            from megatron_resilience.resilience import inprocess

            inprocess.note_own_exception(err)
            raise
        hooks.on_failure(err)  # the launcher's teardown SIGTERM from now on is no preemption
        why = lost_a_peer(err)
        if why is None:
            raise
        # Expected when another rank died: the launcher restarts the whole group. One line, not a traceback.
        log.warning("rank %d: lost contact with another rank (%s: %s); exiting with code 1 so the launcher restarts "
                    "the worker group", rank, type(err).__name__, why)
        raise SystemExit(1) from None
    finally:
        _teardown()
    return exit_code


# What torch.distributed raises on a rank whose peer process is gone (gloo's TCP pair, NCCL's abort).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
              "ncclRemoteError")


def lost_a_peer(err: BaseException) -> str | None:
    """What a surviving rank's communication error says when another rank died mid-collective, else None.

    The whole chain is read: a save or a cleanup that fails because the peer is gone raises its own exception
    with the communication error as its cause or context, which would otherwise print chained tracebacks.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (RuntimeError, OSError)):
            found = next((text for text in _PEER_LOST if text in str(err)), None)
            if found:
                return found
        err = err.__cause__ or err.__context__
    return None


def _import_runtime(config: PretrainConfig) -> None:
    """Import what this run uses up front, so the setup record's ``imports`` mark covers the import cost."""
    import importlib

    from megatron_resilience.upstream import mcore

    mcore.import_megatron_core()
    # torch._dynamo: torch.optim imports it when the first optimizer is built (torch._disable_dynamo).
    for name in ("megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
                 "megatron.core.datasets.gpt_dataset", "torch._dynamo"):
        importlib.import_module(name)
    if config.checkpoint.save is not None or config.checkpoint.load_dir is not None:
        importlib.import_module("megatron.core.dist_checkpointing")


def _setup(config: PretrainConfig, hooks: TrainingHooks, start_time: float, timeline: SetupTimeline | None = None):
    timeline = timeline or SetupTimeline()
    _import_runtime(config)
    from megatron.core import parallel_state

    from megatron_resilience import dashboards
    from megatron_resilience.checkpointing import reshard
    from megatron_resilience.checkpointing.tiers import build_checkpoints
    from megatron_resilience.runtime import data
    from megatron_resilience.runtime.distributed import init_distributed, seed_everything
    from megatron_resilience.runtime.loop import TrainContext
    from megatron_resilience.runtime.metrics import (
        MetricsLogger,
        attempt_info,
        describe_attempt,
        describe_resume,
        last_logged_step,
    )
    from megatron_resilience.runtime.model import build_model
    from megatron_resilience.runtime.optimizer import build_optimizer, build_scheduler

    timeline.mark("imports")
    dist = init_distributed(config)
    _init_rerun_state_machine(config)
    # Same seed on every data- and tensor-parallel rank (identical replicas, TP splits of one matrix);
    # pipeline stages get their own, as in Megatron-LM, so stage 2's layers differ from stage 1's.
    seed_everything(config.train.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    timeline.mark("distributed")
    model = build_model(config, dist)
    timeline.mark("model")
    optimizer = build_optimizer(config, model)
    scheduler = build_scheduler(config, optimizer)
    timeline.mark("optimizer")
    gbs = config.train.resolved_global_batch_size(dist.dp)
    num_microbatches = gbs // (config.train.micro_batch_size * dist.dp)
    datasets = data.build_datasets(config, global_batch_size=gbs)
    timeline.mark("data")
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, global_batch_size=gbs,
                       micro_batch_size=config.train.micro_batch_size)
    layout = reshard.layout(world_size=dist.world_size, tp=dist.tp, pp=dist.pp, dp=dist.dp, global_batch_size=gbs,
                            micro_batch_size=config.train.micro_batch_size)
    checkpoints = build_checkpoints(config, dist=dist, resume_check=functools.partial(
        reshard.check_resume, current=layout, announce=dist.rank == 0,
        global_batch_explicit=config.train.global_batch_size is not None))
    resumed = checkpoints.load_latest(state)
    timeline.mark("checkpoint_load")
    attempt = attempt_info()
    logged = last_logged_step(config.run_dir) if dist.rank == 0 else None
    sink = dashboards.open_sink(config) if dist.rank == 0 else None
    metrics = MetricsLogger(config.run_dir, enabled=dist.rank == 0, max_steps=config.train.max_steps,
                            sinks=[sink] if sink else [])
    for retry in sink.retries() if sink else []:
        metrics.event("retry", **retry)
    if attempt["inprocess_restart"]:
        from megatron_resilience.resilience import inprocess

        metrics.event("inprocess_restart", **inprocess.restart_record(),
                      began_time=timeline.marks.get("entered"), restored_from=dict(checkpoints.resumed_from))
    metrics.event("start", step=state.step, consumed_samples=state.consumed_samples, resumed=resumed,
                  resumed_from=checkpoints.resumed_from["step"] if resumed else None,
                  resumed_tier=checkpoints.resumed_from["tier"], attempt=attempt, last_logged_step=logged,
                  world_size=dist.world_size, tp=dist.tp, pp=dist.pp, dp=dist.dp,
                  versions=upstream.installed_versions(), setup=timeline.record(),
                  dashboards=dashboards.where(config))
    if dist.rank == 0:
        log.info("setup: %s at step %d (consumed_samples=%d), global batch %d = %d micro-batches x %d x dp %d; "
                 "attempt: %s; %s", "resumed" if resumed else "starting", state.step, state.consumed_samples, gbs,
                 num_microbatches, config.train.micro_batch_size, dist.dp, describe_attempt(attempt),
                 describe_resume(state.step, resumed, logged))
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
