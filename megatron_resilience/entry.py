"""The pretraining entry point that recipes, plugins and the CLI target.

It takes one keyword argument per config section so NeMo-Run overrides read
``train.max_steps=2000 ft.calc_ft_timeouts=true``. Importing this module is
cheap (no torch): the runtime is imported only when the function runs, on the
compute node. It also makes ``run.run``/``Experiment.add`` check our tasks, plugins or not
(``plugins/submit_check.py``), whichever of nemo_run and this module is imported first: at once when nemo_run is
already imported, else right after ``import nemo_run`` finishes (``config.after_import``). Nothing heavy is
imported here for that: the check itself (the plugins, fiddle) loads at the first submission.
"""

from __future__ import annotations

from typing import Any

from megatron_resilience.config import (
    CheckpointConfig,
    DataConfig,
    FaultToleranceConfig,
    InProcessConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PretrainConfig,
    RerunConfig,
    StragglerConfig,
    TrainingConfig,
)
from megatron_resilience.config.after_import import call_after_import


def pretrain(
    *,
    run_dir: str,
    model: ModelConfig | None = None,
    parallel: ParallelConfig | None = None,
    data: DataConfig | None = None,
    optim: OptimizerConfig | None = None,
    train: TrainingConfig | None = None,
    checkpoint: CheckpointConfig | None = None,
    ft: FaultToleranceConfig | None = None,
    straggler: StragglerConfig | None = None,
    rerun: RerunConfig | None = None,
    logger: LoggerConfig | None = None,
    inprocess: InProcessConfig | None = None,
) -> None:
    """Validate the config, then run Megatron-Core GPT pretraining on this node's ranks."""
    config = PretrainConfig(
        run_dir=run_dir,
        model=model or ModelConfig(),
        parallel=parallel or ParallelConfig(),
        data=data or DataConfig(),
        optim=optim or OptimizerConfig(),
        train=train or TrainingConfig(),
        checkpoint=checkpoint or CheckpointConfig(),
        ft=ft or FaultToleranceConfig(),
        straggler=straggler or StragglerConfig(),
        rerun=rerun or RerunConfig(),
        logger=logger or LoggerConfig(),
        inprocess=inprocess or InProcessConfig(),
    )
    from megatron_resilience.trainer import run_pretraining

    run_pretraining(config)


def _check_submission(task: Any, executor: Any, plugins: Any = None) -> list[Any]:
    """``plugins.submit_check.check_submission``, imported at the first submission: the hook below fires while
    nemo_run (or our plugins package, which imports it) is still being imported, when the plugins cannot be."""
    from megatron_resilience.plugins.submit_check import check_submission

    return check_submission(task, executor, plugins)


def _check_our_tasks() -> None:
    from megatron_resilience.upstream.nemorun import before_experiment_add

    before_experiment_add(_check_submission)


call_after_import("nemo_run", _check_our_tasks)  # on a login node: run.run checks ours, plugins or not
