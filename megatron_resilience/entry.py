"""The pretraining entry point that recipes, plugins and the CLI target.

It takes one keyword argument per config section so NeMo-Run overrides read
``train.max_steps=2000 ft.calc_ft_timeouts=true``. Importing this module is
cheap (no torch): the runtime is imported only when the function runs, on the
compute node.
"""

from __future__ import annotations

from megatron_resilience.config import (
    CheckpointConfig,
    DataConfig,
    FaultToleranceConfig,
    InProcessConfig,
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
        inprocess=inprocess or InProcessConfig(),
    )
    from megatron_resilience.trainer import run_pretraining

    run_pretraining(config)
