"""The pretraining entry point that recipes, plugins and the CLI target.

It takes one keyword argument per config section so NeMo-Run overrides read
``train.max_steps=2000 ft.calc_ft_timeouts=true``. Importing this module is
cheap (no torch): the runtime is imported only when the function runs, on the
compute node. Where nemo_run is already imported (a login node building ``run.Partial(pretrain, ...)``), it
makes ``run.run``/``Experiment.add`` check our tasks, plugins or not (``plugins/submit_check.py``).
"""

from __future__ import annotations

import sys

from megatron_resilience.config import (
    CheckpointConfig,
    DataConfig,
    FaultToleranceConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PretrainConfig,
    RerunConfig,
    StragglerConfig,
    TrainingConfig,
)


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
    )
    from megatron_resilience.trainer import run_pretraining

    run_pretraining(config)


if "nemo_run" in sys.modules:  # building tasks on a login node: run.run checks ours, plugins or not
    from megatron_resilience.plugins.submit_check import install

    install()
