"""The data-parallel strategy (issue 33): ``parallel.data_parallel_strategy`` and
``parallel.data_parallel_sharding_strategy`` through the Python API, the recipes and their overrides, and the
refusals that depend on the installed megatron-core (``upstream/fsdp.py``). The messages every interface answers
with (CLI, preview, the trainer's command line) are in ``tests/validation_cases.py``.
"""

from __future__ import annotations

import pytest

from megatron_resilience.config import CheckpointConfig, ConfigError, ModelConfig, PretrainConfig
from megatron_resilience.config.parallel import ParallelConfig
from megatron_resilience.recipes import apply_overrides, gpt_126m, gpt_tiny, to_config, validate
from megatron_resilience.upstream.fsdp import check_data_parallel_strategy, strategy_refusal
from megatron_resilience.upstream.versions import package_version

WRONG_GRADIENTS = ("parallel.data_parallel_strategy: 'megatron_fsdp' at data-parallel size 1 computes wrong "
                   "gradients on megatron-core {} (grad norm 2x to 3.14x DDP's; correct from megatron-core 0.19); "
                   "use 'ddp' or more data-parallel ranks, got 'megatron_fsdp'")


def test_defaults_keep_todays_ddp():
    config = PretrainConfig(run_dir="/tmp/r")
    assert config.parallel.data_parallel_strategy == "ddp"
    assert config.parallel.data_parallel_sharding_strategy is None and config.parallel.sharding_strategy is None
    assert config.ckpt_format == "torch_dist"
    check_data_parallel_strategy(config, 2)  # accepted


def test_python_api_is_keyword_only_and_validates():
    with pytest.raises(TypeError):
        ParallelConfig(1, 1)  # the dataclass is keyword-only
    parallel = ParallelConfig(data_parallel_strategy="megatron_fsdp")
    assert parallel.sharding_strategy == "optim_grads_params"  # Megatron-Bridge's perf recipes' choice
    assert ParallelConfig(data_parallel_strategy="megatron_fsdp",
                          data_parallel_sharding_strategy="optim").sharding_strategy == "optim"
    config = PretrainConfig(run_dir="/tmp/r", parallel=parallel)
    assert config.ckpt_format == "fsdp_dtensor"  # the strategy's format when checkpoint.ckpt_format is null
    config = PretrainConfig(run_dir="/tmp/r", parallel=parallel,
                            checkpoint=CheckpointConfig(ckpt_format="fsdp_dtensor"))
    assert config.ckpt_format == "fsdp_dtensor"
    with pytest.raises(ConfigError) as err:
        ParallelConfig(data_parallel_strategy="fsdp")
    assert str(err.value) == ("parallel.data_parallel_strategy: must be one of ['ddp', 'torch_fsdp2', "
                              "'megatron_fsdp'], got 'fsdp'")
    with pytest.raises(ConfigError) as err:
        ParallelConfig(data_parallel_strategy=2)
    assert str(err.value).startswith("parallel.data_parallel_strategy: must be")


def test_torch_fsdp2_untied_is_accepted():
    config = PretrainConfig(run_dir="/tmp/r", parallel=ParallelConfig(data_parallel_strategy="torch_fsdp2"),
                            model=ModelConfig(share_embeddings_and_output_weights=False))
    assert config.ckpt_format == "torch_dist"
    check_data_parallel_strategy(config, 2)
    assert strategy_refusal("torch_fsdp2", 1, (0, 16, 1)) is None


PLAIN, MAIN = "fp32 weights and gradients", "fp32 weights, gradients, Megatron-FSDP's fp32 main weights"


@pytest.mark.parametrize("parallel, bytes_per_param, what, sharded", [
    ({}, 16.0, PLAIN, ""),
    ({"use_distributed_optimizer": True}, 8 + 8 / 8, PLAIN, "optimizer state sharded over 8"),
    ({"data_parallel_strategy": "torch_fsdp2"}, 16 / 8, PLAIN, "weights, gradients, optimizer state sharded over 8"),
    # Megatron-FSDP keeps fp32 main weights of its own in fp32 too, sharded with the optimizer state
    ({"data_parallel_strategy": "megatron_fsdp", "data_parallel_sharding_strategy": "no_shard"}, 20.0, MAIN, ""),
    ({"data_parallel_strategy": "megatron_fsdp", "data_parallel_sharding_strategy": "optim"}, 8 + 12 / 8, MAIN,
     "optimizer state sharded over 8"),
    ({"data_parallel_strategy": "megatron_fsdp", "data_parallel_sharding_strategy": "optim_grads"}, 4 + 16 / 8,
     MAIN, "gradients, optimizer state sharded over 8"),
    ({"data_parallel_strategy": "megatron_fsdp"}, 20 / 8, MAIN, "weights, gradients, optimizer state sharded over 8"),
])
def test_the_memory_estimate_knows_what_each_strategy_shards(parallel, bytes_per_param, what, sharded):
    """fp32 on 8 ranks: 4 bytes of weights, 4 of gradients, 8 of Adam moments (and 4 of Megatron-FSDP's main
    weights); what is gathered whole: one layer's weights and gradients, and with Megatron-FSDP the weights of the
    embeddings and the output layer (its bucket outside the layers)."""
    from megatron_resilience.config.memory import estimate

    config = PretrainConfig(run_dir="/tmp/r", parallel=ParallelConfig(**parallel),
                            model=ModelConfig(share_embeddings_and_output_weights=False))
    est = estimate(config, 8)
    assert est.bytes_per_param == bytes_per_param
    assert est.why_bytes == f"{what} and Adam state" + (f", {sharded} data-parallel ranks" if sharded else "")
    layer = est.layer_params / config.model.num_layers
    outside = est.embedding_params * 4 if parallel.get("data_parallel_strategy") == "megatron_fsdp" else 0.0
    assert est.gathered == (layer * 8 + outside if sharded.startswith("weights") else 0.0)


@pytest.mark.parametrize("version, dp, expected", [
    ((0, 16, 1), 1, WRONG_GRADIENTS.format("0.16.1")),
    ((0, 18, 0), 1, WRONG_GRADIENTS.format("0.18.0")),
    ((0, 16, 1), 2, None),  # the trainer runs it (tests/test_megatron_fsdp.py)
    ((0, 19, 2), 1, None),
    (None, 1, None),  # no megatron-core here: the trainer checks again
])
def test_megatron_fsdp_at_dp1_is_refused_by_version(version, dp, expected):
    assert strategy_refusal("megatron_fsdp", dp, version) == expected
    assert strategy_refusal("ddp", dp, version) is None


def test_the_installed_megatron_core_decides_at_dp1(tmp_path):
    """One rank: data-parallel size 1, refused for wrong gradients below 0.19 (the .venv's 0.16.1), accepted from
    0.19 (the newest lane); two ranks are accepted on both."""
    task = apply_overrides(gpt_tiny(dir=str(tmp_path)), ["parallel.data_parallel_strategy=megatron_fsdp"])
    version = package_version("megatron-core")
    validate(task, num_nodes=1, num_gpus_per_node=2)
    if version >= (0, 19):
        validate(task, num_nodes=1, num_gpus_per_node=1)
        return
    with pytest.raises(ConfigError) as err:
        validate(task, num_nodes=1, num_gpus_per_node=1)
    assert str(err.value) == WRONG_GRADIENTS.format(".".join(map(str, version)))


def test_recipe_overrides_reach_the_config(tmp_path):
    overrides = ["parallel.data_parallel_strategy=megatron_fsdp",
                 "parallel.data_parallel_sharding_strategy=optim_grads", "checkpoint.ckpt_format=fsdp_dtensor"]
    with pytest.raises(ConfigError) as err:  # the recipe's bf16: not run by this package's Megatron-FSDP path yet
        to_config(apply_overrides(gpt_126m(dir=str(tmp_path)), overrides))
    assert str(err.value) == ("model.precision: must be 'fp32' with parallel.data_parallel_strategy='megatron_fsdp': "
                              "not supported by this package's Megatron-FSDP path yet, got 'bf16'")
    task = apply_overrides(gpt_126m(dir=str(tmp_path)),
                           overrides + ["model.precision=fp32"])  # the recipe's async saves: accepted
    config = to_config(task)
    assert config.checkpoint.async_save is True
    assert (config.parallel.data_parallel_strategy, config.parallel.sharding_strategy, config.ckpt_format) == \
        ("megatron_fsdp", "optim_grads", "fsdp_dtensor")
    validate(task, num_nodes=1, num_gpus_per_node=8)  # accepted
    # set in Python on the recipe, as a user would
    task = gpt_126m(dir=str(tmp_path))
    task.parallel.data_parallel_strategy = "torch_fsdp2"
    task.parallel.use_distributed_optimizer = True
    with pytest.raises(ConfigError) as err:
        to_config(task)
    assert str(err.value).startswith("parallel.use_distributed_optimizer: must be false with "
                                     "parallel.data_parallel_strategy='torch_fsdp2'")



NO_SHARD_FAILS = ("parallel.data_parallel_sharding_strategy: 'no_shard' with 'megatron_fsdp' fails at the first "
                  "optimizer step on megatron-core {}; use 'optim_grads' or 'optim_grads_params', got 'no_shard'")
OPTIM_WRONG = ("parallel.data_parallel_sharding_strategy: 'optim' with 'megatron_fsdp' computes other gradients than "
               "DDP (grad norm 0.69 vs 0.86 at step 1) on megatron-core {}; use 'optim_grads' or "
               "'optim_grads_params', got 'optim'")


@pytest.mark.parametrize("version, sharding, expected", [
    ((0, 16, 1), "no_shard", NO_SHARD_FAILS.format("0.16.1")),
    ((0, 19, 2), "no_shard", None),
    ((0, 16, 1), "optim", None),
    ((0, 19, 2), "optim", OPTIM_WRONG.format("0.19.2")),
    ((0, 16, 1), "optim_grads", None), ((0, 19, 2), "optim_grads", None),
    ((0, 16, 1), "optim_grads_params", None), ((0, 19, 2), "optim_grads_params", None),
    (None, "optim", None),  # no megatron-core here: the trainer checks again
])
def test_megatron_fsdp_sharding_strategies_measured_wrong_are_refused_by_version(version, sharding, expected):
    """Measured at DP=2 against DDP's losses (upstream/fsdp.py's module doc)."""
    assert strategy_refusal("megatron_fsdp", 2, version, sharding) == expected


def test_the_installed_megatron_core_decides_the_sharding_strategy(tmp_path):
    version = package_version("megatron-core")
    text = ".".join(map(str, version))
    for sharding, refused in (("no_shard", version < (0, 19)), ("optim", version >= (0, 19))):
        task = apply_overrides(gpt_tiny(dir=str(tmp_path)), ["parallel.data_parallel_strategy=megatron_fsdp",
                                                             f"parallel.data_parallel_sharding_strategy={sharding}"])
        if not refused:
            validate(task, num_nodes=1, num_gpus_per_node=2)
            continue
        with pytest.raises(ConfigError) as err:
            validate(task, num_nodes=1, num_gpus_per_node=2)
        assert str(err.value) == (NO_SHARD_FAILS if sharding == "no_shard" else OPTIM_WRONG).format(text)
