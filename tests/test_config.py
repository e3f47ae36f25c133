"""Config validation: every bad value is rejected early, with the key and the allowed values in the message."""

import re

import pytest

from megatron_resilience.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    FaultToleranceConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PretrainConfig,
    RerunConfig,
    StragglerConfig,
    TrainingConfig,
)
from megatron_resilience.config.slurm_time import slurm_time_seconds, time_note

BAD_VALUES = [
    (lambda: ModelConfig(num_layers=0), "model.num_layers: must be an integer >= 1, got 0"),
    (lambda: ModelConfig(hidden_size=65, num_attention_heads=4),
     "model.hidden_size: must be divisible by model.num_attention_heads=4, got 65"),
    (lambda: ModelConfig(normalization="BatchNorm"),
     "model.normalization: must be one of ['LayerNorm', 'RMSNorm'], got 'BatchNorm'"),
    (lambda: ModelConfig(precision="fp8"), "model.precision: must be one of ['fp32', 'bf16', 'fp16'], got 'fp8'"),
    (lambda: ParallelConfig(tensor_model_parallel_size=0),
     "parallel.tensor_model_parallel_size: must be an integer >= 1, got 0"),
    (lambda: ParallelConfig(sequence_parallel=True),
     "parallel.sequence_parallel: needs parallel.tensor_model_parallel_size > 1, got True"),
    (lambda: DataConfig(tokenizer="sentencepiece"),
     "data.tokenizer: must be one of ['null', 'gpt2'], got 'sentencepiece'"),
    (lambda: DataConfig(split="90,10"),
     "data.split: must be three comma-separated non-negative weights like '969,30,1', got '90,10'"),
    (lambda: OptimizerConfig(lr=-1.0), "optim.lr: must be a number > 0, got -1.0"),
    (lambda: OptimizerConfig(lr=1e-3, min_lr=1e-2), "optim.min_lr: must be <= optim.lr=0.001, got 0.01"),
    (lambda: OptimizerConfig(lr_decay_style="exp"),
     "optim.lr_decay_style: must be one of ['constant', 'linear', 'cosine', 'inverse-square-root'], got 'exp'"),
    (lambda: TrainingConfig(max_steps=0), "train.max_steps: must be an integer >= 1, got 0"),
    (lambda: TrainingConfig(micro_batch_size=4, global_batch_size=6),
     "train.global_batch_size: must be a multiple of train.micro_batch_size=4, got 6"),
    (lambda: TrainingConfig(exit_signal="SIGKILL"),
     "train.exit_signal: must be one of ['SIGTERM', 'SIGINT', 'SIGUSR1', 'SIGUSR2', 'SIGHUP', 'SIGQUIT', "
     "'SIGALRM', 'SIGCONT'], got 'SIGKILL'"),
    (lambda: CheckpointConfig(keep_last_n=0), "checkpoint.keep_last_n: must be an integer >= 1, got 0"),
    (lambda: CheckpointConfig(save_interval=10), "checkpoint.save: must be set when checkpoint.save_interval is set"),
    (lambda: FaultToleranceConfig(simulated_fault_type="rank_slow"),
     "ft.simulated_fault_type: must be one of ['rank_hung', 'rank_killed', 'random', 'exception', 'rank_stalled', "
     "'nan'], got 'rank_slow'"),
    (lambda: StragglerConfig(gpu_relative_perf_threshold=1.5),
     "straggler.gpu_relative_perf_threshold: must be a number in [0, 1], got 1.5"),
    (lambda: RerunConfig(rerun_mode="always"),
     "rerun.rerun_mode: must be one of ['disabled', 'validate_results', 'report_stats'], got 'always'"),
    (lambda: PretrainConfig(run_dir="/tmp/r", model=ModelConfig(num_attention_heads=4),
                            parallel=ParallelConfig(tensor_model_parallel_size=8)),
     "parallel.tensor_model_parallel_size: must divide model.num_attention_heads=4, got 8"),
    (lambda: PretrainConfig(run_dir="/tmp/r", model=ModelConfig(num_layers=3),
                            parallel=ParallelConfig(pipeline_model_parallel_size=2)),
     "parallel.pipeline_model_parallel_size: must divide model.num_layers=3, got 2"),
    (lambda: PretrainConfig(run_dir="/tmp/r", train=TrainingConfig(max_steps=5),
                            ft=FaultToleranceConfig(simulated_fault_step=9)),
     "ft.simulated_fault_step: must be <= train.max_steps=5, got 9"),
    # NaN passes every comparison; every float field must be finite
    (lambda: OptimizerConfig(lr=float("nan")), "optim.lr: must be a finite number, got nan"),
    (lambda: OptimizerConfig(weight_decay=float("inf")), "optim.weight_decay: must be a finite number, got inf"),
    (lambda: TrainingConfig(exit_duration_in_mins=float("nan")),
     "train.exit_duration_in_mins: must be a finite number, got nan"),
    (lambda: FaultToleranceConfig(simulated_fault_base_delay=float("-inf")),
     "ft.simulated_fault_base_delay: must be a finite number, got -inf"),
    # the annotated type, whichever way the value arrives
    (lambda: TrainingConfig(max_steps="100"), "train.max_steps: must be an integer, got '100'"),
    (lambda: TrainingConfig(max_steps=True), "train.max_steps: must be an integer, got True"),
    (lambda: FaultToleranceConfig(enabled="yes"), "ft.enabled: must be true or false, got 'yes'"),
    (lambda: DataConfig(data_path=["a", 1]), "data.data_path: must be a list of strings, got ['a', 1]"),
    (lambda: ModelConfig(normalization=None), "model.normalization: must not be None, got None"),
    (lambda: CheckpointConfig(save=5), "checkpoint.save: must be a string, got 5"),
    (lambda: CheckpointConfig(save=""), "checkpoint.save: must be a directory path or None, got ''"),
]


@pytest.mark.parametrize("build, message", BAD_VALUES, ids=[m.split(":")[0] for _, m in BAD_VALUES])
def test_bad_value_is_rejected_with_key_and_allowed_values(build, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build()


def test_world_size_checks_name_the_fields():
    config = PretrainConfig(run_dir="/tmp/r", parallel=ParallelConfig(tensor_model_parallel_size=2),
                            train=TrainingConfig(micro_batch_size=4, global_batch_size=12))
    with pytest.raises(ConfigError, match=re.escape("must divide the world size 3")):
        config.validate_world_size(3)
    with pytest.raises(ConfigError, match=re.escape(
            "train.global_batch_size: must be a multiple of train.micro_batch_size * data-parallel size = "
            "4 * 2 = 8, got 12")):
        config.validate_world_size(4)
    assert PretrainConfig(run_dir="/tmp/r").validate_world_size(2) == 2


def test_configs_are_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig(2)  # type: ignore[misc]


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("01:30", 90), ("1:30", 90), ("01:30:00", 5400), ("2-", 172800), ("1-12", 129600),
    ("1-12:30", 131400), ("1-12:30:15", 131415), ("0", None), ("00:00", None), ("-1", None), ("UNLIMITED", None),
    ("infinite", None), (None, None), (60, 3600),
])
def test_slurm_time_strings_read_as_slurm_reads_them(text, seconds):
    assert slurm_time_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", " ", "soon", "1:2:3:4", "1-2-3", "-5", ":30", "1:", "1-:30", "1.5", "1h"])
def test_slurm_rejects_these_time_strings(text):
    with pytest.raises(ConfigError) as err:
        slurm_time_seconds(text)
    assert str(err.value) == f"executor.time: must be a Slurm time like '01:30:00' or '1-00:00:00', got {text!r}"


def test_minutes_seconds_form_gets_a_note():
    assert time_note("01:30") == ("executor.time='01:30' is 1 min 30 s to Slurm (minutes:seconds); "
                                  "for 1 h 30 min write '01:30:00'")
    assert [time_note(t) for t in ("01:30:00", "90", "1-01:30", "0:00")] == [None, None, None, None]
