"""Recipes: shapes from the GPT-3 table, resilience wired in, validation at build time, no torch on the login node."""

import json
import os
import subprocess
import sys

import fiddle as fdl
import pytest

from megatron_resilience.config import (
    CheckpointConfig,
    ConfigError,
    FaultToleranceConfig,
    ModelConfig,
    PretrainConfig,
    RerunConfig,
    StragglerConfig,
    TrainingConfig,
)
from megatron_resilience.entry import pretrain
from megatron_resilience.recipes import (
    RECIPES,
    apply_overrides,
    gpt_1_3b,
    gpt_7b,
    gpt_126m,
    gpt_tiny,
    to_config,
    validate,
)

# name -> (layers, hidden, heads, vocab, seq, TP, PP, micro-batch, global batch at 1x8 GPUs, lr)
EXPECTED = {
    "gpt_tiny": (2, 64, 4, 1024, 64, 1, 1, 4, None, 3e-3),
    "gpt_126m": (12, 768, 12, 50304, 2048, 1, 1, 8, 256, 6e-4),
    "gpt_350m": (24, 1024, 16, 50304, 2048, 1, 1, 4, 256, 3e-4),
    "gpt_1_3b": (24, 2048, 16, 50304, 2048, 1, 1, 4, 512, 2e-4),
    "gpt_7b": (32, 4096, 32, 50304, 2048, 2, 1, 2, 1024, 1.2e-4),
}


def test_every_recipe_builds_with_fdl_build_without_importing_torch(tmp_path):
    """In a fresh interpreter: build each recipe with fdl.build (the dataclasses validate) and check no torch."""
    code = f"""
import json, sys
import fiddle as fdl
from megatron_resilience.recipes import RECIPES
out = {{}}
for name, recipe in RECIPES.items():
    built = fdl.build(recipe(dir={str(tmp_path)!r}))
    kw = built.keywords
    out[name] = [built.func.__module__ + "." + built.func.__name__,
                 {{k: type(v).__name__ for k, v in kw.items()}},
                 [kw["model"].num_layers, kw["model"].hidden_size, kw["model"].num_attention_heads]]
out["heavy"] = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("heavy") == []
    assert set(out) == set(EXPECTED)
    for name, (target, types, shape) in out.items():
        assert target == "megatron_resilience.entry.pretrain"
        assert types == {
            "run_dir": "str", "model": "ModelConfig", "parallel": "ParallelConfig", "data": "DataConfig",
            "optim": "OptimizerConfig", "train": "TrainingConfig", "checkpoint": "CheckpointConfig",
            "ft": "FaultToleranceConfig", "straggler": "StragglerConfig", "rerun": "RerunConfig",
        }
        assert shape == list(EXPECTED[name][:3])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_shapes_and_parallel_layout(name, tmp_path):
    layers, hidden, heads, vocab, seq, tp, pp, mbs, gbs, lr = EXPECTED[name]
    config = to_config(RECIPES[name](dir=str(tmp_path)))
    assert isinstance(config, PretrainConfig)
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.vocab_size, m.seq_length) == \
        (layers, hidden, heads, vocab, seq)
    assert (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size) == (tp, pp)
    assert config.parallel.sequence_parallel is (tp > 1)
    assert config.train.micro_batch_size == mbs
    assert config.train.global_batch_size == gbs
    assert config.optim.lr == lr
    if name != "gpt_tiny":
        assert config.model.ffn_hidden_size == 4 * hidden and config.model.precision == "bf16"
        assert gbs * seq >= 2**19  # at least the paper's 0.5M-token batch


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_wires_in_resilience_with_production_defaults(name, tmp_path):
    config = to_config(RECIPES[name](dir=str(tmp_path), name="exp1"))
    assert config.ft == FaultToleranceConfig(enabled=True, mode="sections", calc_ft_timeouts=True)
    assert config.straggler.enabled and not config.straggler.stop_if_detected
    assert config.train.exit_signal_handler and config.train.exit_signal == "SIGTERM"
    assert config.rerun == RerunConfig(rerun_mode="validate_results", check_for_nan_in_loss=True)
    assert config.run_dir == os.path.join(str(tmp_path), "exp1")
    assert config.checkpoint.save == os.path.join(str(tmp_path), "exp1", "checkpoints")
    assert config.checkpoint.save_interval is not None and config.checkpoint.save_on_exit


def test_recipe_is_a_partial_of_the_entry_point_with_one_config_per_section(tmp_path):
    task = gpt_126m(dir=str(tmp_path))
    assert task.__fn_or_cls__ is pretrain
    assert fdl.get_callable(task.train) is TrainingConfig and fdl.get_callable(task.model) is ModelConfig
    assert fdl.get_callable(task.checkpoint) is CheckpointConfig and fdl.get_callable(task.straggler) is StragglerConfig
    task.train.max_steps = 100  # plain fiddle edits work like CLI overrides
    task.optim.lr_warmup_steps = 10
    assert fdl.build(task).keywords["train"].max_steps == 100


def test_global_batch_is_rounded_up_to_whole_micro_batches_per_data_parallel_rank(tmp_path):
    # 16 nodes x 8 GPUs, TP1: DP=128, micro-batch 8 -> 1024 sequences per step at least.
    config = validate(gpt_126m(dir=str(tmp_path), num_nodes=16), num_nodes=16, num_gpus_per_node=8)
    assert config.train.global_batch_size == 1024
    assert config.train.max_steps == 143052  # 300B tokens / (1024 x 2048)
    # 7B at TP2 on 4 nodes: DP=16, micro-batch 2 -> 1024 (the paper's 2M tokens) already fits.
    assert to_config(gpt_7b(dir=str(tmp_path), num_nodes=4)).train.global_batch_size == 1024


@pytest.mark.parametrize("make, message", [
    (lambda d: gpt_7b(dir=d, num_gpus_per_node=1),
     "num_nodes * num_gpus_per_node: must be a multiple of gpt_7b's tensor x pipeline parallel size 2x1=2 "
     "(or override parallel.*), got 1"),
    (lambda d: gpt_126m(dir=d, num_nodes=0), "num_nodes: must be an integer >= 1, got 0"),
    (lambda d: gpt_tiny(dir=d, num_gpus_per_node=0), "num_gpus_per_node: must be an integer >= 1, got 0"),
    (lambda d: gpt_1_3b(dir=d, name="a/b"), "name: must be a non-empty string without '/', got 'a/b'"),
])
def test_bad_recipe_arguments_fail_at_build_time(make, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        make(str(tmp_path))
    assert str(err.value) == message


def test_world_size_is_checked_against_tensor_and_pipeline_parallel(tmp_path):
    task = apply_overrides(gpt_tiny(dir=str(tmp_path)), ["parallel.tensor_model_parallel_size=2"])
    assert validate(task, num_nodes=1, num_gpus_per_node=2).parallel.data_parallel_size(2) == 1
    with pytest.raises(ConfigError) as err:
        validate(task, num_nodes=1, num_gpus_per_node=3)
    assert str(err.value) == ("parallel: tensor_model_parallel_size * pipeline_model_parallel_size = 2 "
                              "must divide the world size 3, got 2")


def test_fdl_build_runs_the_dataclass_validation(tmp_path):
    task = gpt_tiny(dir=str(tmp_path))
    task.model.hidden_size = 66
    expected = r"^model.hidden_size: must be divisible by model.num_attention_heads=4, got 66\n"
    with pytest.raises(ConfigError, match=expected):
        fdl.build(task)  # Fiddle appends where it failed
    with pytest.raises(ConfigError) as err:
        to_config(task)
    assert str(err.value) == "model.hidden_size: must be divisible by model.num_attention_heads=4, got 66"
