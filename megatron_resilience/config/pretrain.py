"""The one top-level config: every section, plus the checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_resilience.config.checkpoint import CheckpointConfig
from megatron_resilience.config.data import DataConfig
from megatron_resilience.config.inprocess import InProcessConfig
from megatron_resilience.config.logger import LoggerConfig
from megatron_resilience.config.memory import check_memory
from megatron_resilience.config.model import ModelConfig
from megatron_resilience.config.optimizer import OptimizerConfig
from megatron_resilience.config.parallel import ParallelConfig
from megatron_resilience.config.resilience import FaultToleranceConfig, RerunConfig, StragglerConfig
from megatron_resilience.config.training import TrainingConfig
from megatron_resilience.config.validate import check_int, fail

SECTIONS = ("model", "parallel", "data", "optim", "train", "checkpoint", "ft", "straggler", "rerun", "logger",
            "inprocess")


@dataclass(kw_only=True)
class PretrainConfig:
    run_dir: str  # metrics.jsonl and run logs go here
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    rerun: RerunConfig = field(default_factory=RerunConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    inprocess: InProcessConfig = field(default_factory=InProcessConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.run_dir, str) or not self.run_dir:
            fail("run_dir", "must be a non-empty path", self.run_dir)
        expected = {
            "model": ModelConfig, "parallel": ParallelConfig, "data": DataConfig, "optim": OptimizerConfig,
            "train": TrainingConfig, "checkpoint": CheckpointConfig, "ft": FaultToleranceConfig,
            "straggler": StragglerConfig, "rerun": RerunConfig,
            "logger": LoggerConfig, "inprocess": InProcessConfig,
        }
        for name, cls in expected.items():
            if not isinstance(getattr(self, name), cls):
                fail(name, f"must be a {cls.__name__}", type(getattr(self, name)).__name__)
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        if self.model.num_attention_heads % tp:
            fail("parallel.tensor_model_parallel_size",
                 f"must divide model.num_attention_heads={self.model.num_attention_heads}", tp)
        groups = self.model.query_groups
        if groups % tp and tp % groups:
            fail("parallel.tensor_model_parallel_size",
                 f"must divide model.num_query_groups={groups} or be a multiple of it", tp)
        if self.model.num_layers % pp:
            fail("parallel.pipeline_model_parallel_size", f"must divide model.num_layers={self.model.num_layers}", pp)
        if self.ft.simulated_fault_step is not None and self.ft.simulated_fault_step > self.train.max_steps:
            fail("ft.simulated_fault_step", f"must be <= train.max_steps={self.train.max_steps}",
                 self.ft.simulated_fault_step)
        if self.checkpoint.keep_best is not None and self.train.eval_interval is None:
            fail("checkpoint.keep_best", "needs train.eval_interval (the validation loss the best checkpoints are "
                 "ranked by)", self.checkpoint.keep_best)
        if self.optim.lr_warmup_steps > self.train.max_steps:
            fail("optim.lr_warmup_steps", f"must be <= train.max_steps={self.train.max_steps}",
                 self.optim.lr_warmup_steps)
        self._check_data_parallel_strategy()

    def _check_data_parallel_strategy(self) -> None:
        """What each data-parallel strategy needs of the other sections, as Megatron-LM refuses it."""
        strategy = self.parallel.data_parallel_strategy
        named = f"parallel.data_parallel_strategy={strategy!r}"
        if strategy == "torch_fsdp2":
            if self.model.precision == "fp16":
                fail("model.precision", f"must be 'fp32' with {named} (Megatron-LM has no fp16 loss scaling with "
                     "torch FSDP2)", self.model.precision)
            if self.model.precision == "bf16":
                fail("model.precision", f"must be 'fp32' with {named}: bf16 is not supported by this package's "
                     "FSDP2 path yet (its fp32 main weights would not be restored by the in-place load)",
                     self.model.precision)
            if self.inprocess.enabled:
                fail("inprocess.enabled", f"must be false with {named}: in-process restart is not supported by this "
                     "package's FSDP2 path yet (restarts in new processes under ft_launcher are)", True)
            if self.model.share_embeddings_and_output_weights:
                fail("model.share_embeddings_and_output_weights", f"must be false with {named} (a tied embedding "
                     "fails in FSDP2's forward; Megatron-LM requires --untie-embeddings-and-output-weights)", True)
        if strategy == "megatron_fsdp":
            self._check_megatron_fsdp(named)
        fmt = self.checkpoint.ckpt_format
        if strategy == "megatron_fsdp" and fmt not in (None, "fsdp_dtensor"):
            fail("checkpoint.ckpt_format", f"must be 'fsdp_dtensor' (or null) with {named}: the only format "
                 "Megatron-FSDP checkpoints in", fmt)
        if strategy != "megatron_fsdp" and fmt == "fsdp_dtensor":
            fail("checkpoint.ckpt_format", f"must be 'torch_dist' (or null) with {named}: 'fsdp_dtensor' holds "
                 "Megatron-FSDP's shards (parallel.data_parallel_strategy='megatron_fsdp')", fmt)

    def _check_megatron_fsdp(self, named: str) -> None:
        """What this package's Megatron-FSDP path (issue 33's first slice) does not run yet: refused, not broken."""
        not_yet = f"with {named}: not supported by this package's Megatron-FSDP path yet"
        if self.model.precision != "fp32":
            fail("model.precision", f"must be 'fp32' {not_yet}", self.model.precision)
        if self.parallel.model_parallel_size > 1:
            fail("parallel", f"tensor_model_parallel_size and pipeline_model_parallel_size must be 1 {not_yet}",
                 self.parallel.model_parallel_size)
        if self.checkpoint.local_dir is not None:
            fail("checkpoint.local_dir", f"must be null {not_yet} (no node-local fsdp_dtensor tier)",
                 self.checkpoint.local_dir)
        if self.inprocess.enabled:
            fail("inprocess.enabled", f"must be false {not_yet} (restarts in new processes under ft_launcher are "
                 "supported)", True)

    @property
    def ckpt_format(self) -> str:
        """The format checkpoints are written in: the key, or the data-parallel strategy's format."""
        if self.checkpoint.ckpt_format is not None:
            return self.checkpoint.ckpt_format
        return "fsdp_dtensor" if self.parallel.data_parallel_strategy == "megatron_fsdp" else "torch_dist"

    def validate_world_size(self, world_size: int) -> int:
        """Checks that need the job's size; returns the data-parallel size. Called by plugins and the runtime."""
        check_int("world_size", world_size, minimum=1)
        if self.parallel.sequence_parallel and self.model.seq_length % self.parallel.tensor_model_parallel_size:
            fail("model.seq_length", "must be divisible by parallel.tensor_model_parallel_size with sequence_parallel",
                 self.model.seq_length)
        dp = self.parallel.data_parallel_size(world_size)
        self.train.resolved_global_batch_size(dp)
        check_memory(self, world_size)
        return dp
