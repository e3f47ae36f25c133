"""GPT pretraining recipes: ``run.Partial`` of ``megatron_resilience.entry.pretrain`` with resilience on.

A recipe is plain configuration, built on the login node. Every recipe turns on
the four protections a long production run needs, with defaults that suit a
real cluster:

- fault tolerance (``ft.enabled``, timeouts learned from the run: ``ft.calc_ft_timeouts``),
- straggler detection (reports only; ``straggler.stop_if_detected=true`` to act on it),
- the preemption exit handler (``train.exit_signal_handler`` on SIGTERM: checkpoint and exit 0),
- Megatron-Core's rerun state machine (``rerun.rerun_mode=validate_results``).

Checkpoints and run logs live under ``<dir>/<name>``. The model shapes follow
the GPT-3 paper's table (125M, 350M, 1.3B, 6.7B); data is Megatron's mock
dataset until ``data.data_path`` is set. Each recipe is validated when it is
made: the dataclasses' own checks run (``fdl.build``) and the world size
``num_nodes * num_gpus_per_node`` is checked against TP x PP and the batch size,
so a recipe that cannot run fails here, not on the cluster.
"""

import math
import os
from dataclasses import dataclass
from typing import Optional

from megatron_resilience.config import (
    CheckpointConfig,
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
from megatron_resilience.config.validate import check_int, fail
from megatron_resilience.entry import pretrain
from megatron_resilience.plugins.task_check import task_config
from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.upstream.fsdp import check_data_parallel_strategy

run = import_nemo_run()

# GPT-3 trained on 300B tokens; the schedules below are sized from it.
_TOKENS = 300e9
_WARMUP_TOKENS = 375e6
_GPT2_VOCAB_PADDED = 50304  # 50257 padded to a multiple of 128 (fast embedding GEMMs at any TP <= 8)


@dataclass(frozen=True, kw_only=True)
class _Shape:
    """One row of the size table: model shape, batch, learning rate and the parallel layout we default to."""

    layers: int
    hidden: int
    heads: int
    lr: float
    batch_tokens: int  # GPT-3 paper's batch size in tokens
    tp: int
    pp: int
    micro_batch: int
    seq: int = 2048


SIZES = {
    "gpt_126m": _Shape(layers=12, hidden=768, heads=12, lr=6e-4, batch_tokens=2**19, tp=1, pp=1, micro_batch=8),
    "gpt_350m": _Shape(layers=24, hidden=1024, heads=16, lr=3e-4, batch_tokens=2**19, tp=1, pp=1, micro_batch=4),
    "gpt_1_3b": _Shape(layers=24, hidden=2048, heads=16, lr=2e-4, batch_tokens=2**20, tp=1, pp=1, micro_batch=4),
    "gpt_7b": _Shape(layers=32, hidden=4096, heads=32, lr=1.2e-4, batch_tokens=2**21, tp=2, pp=1, micro_batch=2),
}


def run_dir_for(dir: Optional[str], name: str) -> str:
    """``<dir>/<name>`` as an absolute path (``dir`` defaults to ``./runs``): where logs and checkpoints go."""
    if not isinstance(name, str) or not name or "/" in name:
        fail("name", "must be a non-empty string without '/'", name)
    if dir is not None and (not isinstance(dir, str) or not dir):
        fail("dir", "must be a folder path (or None: ./runs)", dir)
    return os.path.join(os.path.abspath(dir or "runs"), name)


def to_config(task) -> PretrainConfig:
    """Build the plain ``PretrainConfig`` a recipe (or a CLI-edited copy) describes; runs every validation.

    Only dataclasses are constructed, so this is cheap and never imports torch. The same function
    checks tasks in the plugins and ``preview()`` (``plugins/task_check.py``).
    """
    config, _ = task_config(task)
    if config is None:
        fail("task", "must be a run.Partial of megatron_resilience.entry.pretrain", task.__fn_or_cls__)
    return config


def validate(task, *, num_nodes: int, num_gpus_per_node: int) -> PretrainConfig:
    """``to_config`` plus the checks that need the job's size (TP x PP must divide it, batch sizes fit)."""
    check_int("num_nodes", num_nodes, minimum=1)
    check_int("num_gpus_per_node", num_gpus_per_node, minimum=1)
    config = to_config(task)
    config.validate_world_size(num_nodes * num_gpus_per_node)
    check_data_parallel_strategy(config, num_nodes * num_gpus_per_node)
    return config


def _production_resilience(*, cpu: bool) -> dict:
    """The resilience sections every recipe turns on. CPU runs keep straggler reports (no GPU scores there)."""
    return dict(
        ft=run.Config(FaultToleranceConfig, enabled=True, mode="sections", calc_ft_timeouts=True),
        straggler=run.Config(
            StragglerConfig, enabled=True, report_time_interval=60.0 if cpu else 300.0, stop_if_detected=False,
            gpu_relative_perf_threshold=0.7, gpu_individual_perf_threshold=0.7,
        ),
        rerun=run.Config(RerunConfig, rerun_mode="validate_results", check_for_nan_in_loss=True,
                         check_for_spiky_loss=False),
    )


def _gpt(size: str, *, dir: str | None, name: str, num_nodes: int, num_gpus_per_node: int):
    shape = SIZES[size]
    root = run_dir_for(dir, name)
    check_int("num_nodes", num_nodes, minimum=1)
    check_int("num_gpus_per_node", num_gpus_per_node, minimum=1)
    world = num_nodes * num_gpus_per_node
    model_parallel = shape.tp * shape.pp
    if world % model_parallel:
        fail("num_nodes * num_gpus_per_node",
             f"must be a multiple of {size}'s tensor x pipeline parallel size {shape.tp}x{shape.pp}={model_parallel} "
             f"(or override parallel.*)", world)
    dp = world // model_parallel
    # The paper's batch in sequences, rounded up so every data-parallel rank gets whole micro-batches.
    per_step = shape.micro_batch * dp
    gbs = math.ceil(shape.batch_tokens / shape.seq / per_step) * per_step
    tokens_per_step = gbs * shape.seq
    task = run.Partial(
        pretrain,
        run_dir=root,
        model=run.Config(
            ModelConfig, num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
            ffn_hidden_size=4 * shape.hidden, vocab_size=_GPT2_VOCAB_PADDED, seq_length=shape.seq,
            precision="bf16",
        ),
        parallel=run.Config(
            ParallelConfig, tensor_model_parallel_size=shape.tp, pipeline_model_parallel_size=shape.pp,
            sequence_parallel=shape.tp > 1, use_distributed_optimizer=True,
        ),
        data=run.Config(DataConfig),
        optim=run.Config(
            OptimizerConfig, lr=shape.lr, min_lr=shape.lr / 10, lr_decay_style="cosine",
            lr_warmup_steps=math.ceil(_WARMUP_TOKENS / tokens_per_step), weight_decay=0.1,
            adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
        ),
        train=run.Config(
            TrainingConfig, max_steps=math.ceil(_TOKENS / tokens_per_step), micro_batch_size=shape.micro_batch,
            global_batch_size=gbs, log_interval=10, eval_interval=2000, eval_iters=32,
            exit_signal_handler=True, exit_signal="SIGTERM",
        ),
        checkpoint=run.Config(
            CheckpointConfig, save=os.path.join(root, "checkpoints"), save_interval=1000, keep_last_n=3,
            async_save=True,
        ),
        **_production_resilience(cpu=False),
    )
    validate(task, num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node)
    return task


def gpt_tiny(dir: Optional[str] = None, name: str = "gpt_tiny", num_nodes: int = 1,
             num_gpus_per_node: int = 2) -> run.Partial:
    """Tiny GPT for CPU demos and tests (2 layers, hidden 64, vocab 1024, seq 64); ``num_gpus_per_node`` = ranks.

    Checkpoints every 10 steps and keeps all of them, so a demo can show where a restart resumed.
    """
    root = run_dir_for(dir, name)
    task = run.Partial(
        pretrain,
        run_dir=root,
        model=run.Config(ModelConfig, num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024,
                         seq_length=64, precision="fp32"),
        parallel=run.Config(ParallelConfig),
        data=run.Config(DataConfig),
        optim=run.Config(OptimizerConfig, lr=3e-3, min_lr=3e-4, lr_warmup_steps=0, lr_decay_style="cosine"),
        train=run.Config(TrainingConfig, max_steps=40, micro_batch_size=4, log_interval=1,
                         exit_signal_handler=True, exit_signal="SIGTERM", device="cpu"),
        checkpoint=run.Config(CheckpointConfig, save=os.path.join(root, "checkpoints"), save_interval=10,
                              keep_last_n=None, async_save=False),
        **_production_resilience(cpu=True),
    )
    validate(task, num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node)
    return task


def gpt_126m(dir: Optional[str] = None, name: str = "gpt_126m", num_nodes: int = 1,
             num_gpus_per_node: int = 8) -> run.Partial:
    """GPT-3 Small: 12 layers, d_model 768, 12 heads; TP1 PP1, micro-batch 8, 0.5M-token batches, lr 6e-4."""
    return _gpt("gpt_126m", dir=dir, name=name, num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node)


def gpt_350m(dir: Optional[str] = None, name: str = "gpt_350m", num_nodes: int = 1,
             num_gpus_per_node: int = 8) -> run.Partial:
    """GPT-3 Medium: 24 layers, d_model 1024, 16 heads; TP1 PP1, micro-batch 4, 0.5M-token batches, lr 3e-4."""
    return _gpt("gpt_350m", dir=dir, name=name, num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node)


def gpt_1_3b(dir: Optional[str] = None, name: str = "gpt_1_3b", num_nodes: int = 1,
             num_gpus_per_node: int = 8) -> run.Partial:
    """GPT-3 XL: 24 layers, d_model 2048, 16 heads of 128; TP1 PP1, micro-batch 4, 1M-token batches, lr 2e-4."""
    return _gpt("gpt_1_3b", dir=dir, name=name, num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node)


def gpt_7b(dir: Optional[str] = None, name: str = "gpt_7b", num_nodes: int = 1,
           num_gpus_per_node: int = 8) -> run.Partial:
    """GPT-3 6.7B: 32 layers, d_model 4096, 32 heads; TP2 (sequence parallel) PP1, micro-batch 2, 2M-token batches."""
    return _gpt("gpt_7b", dir=dir, name=name, num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node)


RECIPES = {"gpt_tiny": gpt_tiny, "gpt_126m": gpt_126m, "gpt_350m": gpt_350m, "gpt_1_3b": gpt_1_3b, "gpt_7b": gpt_7b}
