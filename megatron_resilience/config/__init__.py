"""Plain-data configuration. Importing it never imports torch or megatron."""

from megatron_resilience.config.checkpoint import CheckpointConfig
from megatron_resilience.config.data import DataConfig
from megatron_resilience.config.inprocess import InProcessConfig
from megatron_resilience.config.logger import LoggerConfig
from megatron_resilience.config.model import ModelConfig
from megatron_resilience.config.optimizer import OptimizerConfig
from megatron_resilience.config.parallel import ParallelConfig
from megatron_resilience.config.pretrain import SECTIONS, PretrainConfig
from megatron_resilience.config.resilience import FaultToleranceConfig, RerunConfig, StragglerConfig
from megatron_resilience.config.training import TrainingConfig
from megatron_resilience.config.validate import CATCHABLE_SIGNALS, ConfigError

__all__ = [
    "CATCHABLE_SIGNALS", "CheckpointConfig", "ConfigError", "DataConfig", "FaultToleranceConfig", "InProcessConfig",
    "LoggerConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "PretrainConfig", "RerunConfig", "SECTIONS",
    "StragglerConfig",
    "TrainingConfig",
]
