"""Every config key with its type, default and one-line meaning: what ``--help`` prints.

``python -m megatron_resilience --help [RECIPE]`` and ``nemo megatron_resilience pretrain --help
[--factory RECIPE]`` print :func:`key_listing`; with a recipe, a column shows the recipe's value.
The meanings live here, one line per key; a test checks that every key has one.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from megatron_resilience.config.pretrain import PretrainConfig
from megatron_resilience.config.validate import type_name

MEANING = {
    "run_dir": "folder for metrics.jsonl, stop_reason.json and run logs",
    "model.num_layers": "transformer layers",
    "model.hidden_size": "model width (d_model)",
    "model.num_attention_heads": "attention heads; must divide hidden_size",
    "model.num_query_groups": "key/value head groups (grouped-query attention); None = one per head",
    "model.attention_backend": "auto, sdpa, unfused or te (auto: te on a GPU where it imports, else sdpa)",
    "model.ffn_hidden_size": "MLP width; null = 4 x hidden_size",
    "model.vocab_size": "vocabulary size (token ids < vocab_size)",
    "model.seq_length": "tokens per sample",
    "model.max_position_embeddings": "position table size; null = seq_length",
    "model.normalization": "LayerNorm or RMSNorm",
    "model.position_embedding_type": "learned_absolute or rope",
    "model.share_embeddings_and_output_weights": "tie the input embedding and the output layer",
    "model.init_method_std": "std of the normal weight init",
    "model.hidden_dropout": "dropout after attention and MLP, in [0, 1)",
    "model.attention_dropout": "dropout on attention probabilities, in [0, 1)",
    "model.precision": "fp32, bf16 or fp16",
    "parallel.tensor_model_parallel_size": "TP: ranks that split each layer's matrices",
    "parallel.pipeline_model_parallel_size": "PP: pipeline stages (must divide num_layers)",
    "parallel.sequence_parallel": "split layer norms and dropout over TP ranks (needs TP > 1)",
    "parallel.use_distributed_optimizer": "shard optimizer state over data-parallel ranks",
    "parallel.data_parallel_strategy": "ddp, torch_fsdp2 or megatron_fsdp: what the data-parallel ranks shard",
    "parallel.data_parallel_sharding_strategy": "megatron_fsdp: no_shard, optim, optim_grads or optim_grads_params; "
                                                "null = optim_grads_params",
    "data.data_path": "indexed dataset prefixes (PREFIX.bin/.idx) or a weighted blend; empty = mock data",
    "data.split": "train,valid,test weights, e.g. 969,30,1",
    "data.tokenizer": "null (token ids as they are) or gpt2 (needs vocab_file and merge_file)",
    "data.vocab_file": "GPT-2 vocab.json",
    "data.merge_file": "GPT-2 merges.txt",
    "data.num_workers": "data loader worker processes per rank",
    "data.cache_dir": "where dataset index files are cached; null = next to the data",
    "optim.optimizer": "adam or sgd",
    "optim.lr": "peak learning rate",
    "optim.min_lr": "learning rate at the end of the decay",
    "optim.lr_warmup_steps": "linear warmup steps",
    "optim.lr_decay_steps": "decay steps; null = train.max_steps",
    "optim.lr_decay_style": "constant, linear, cosine or inverse-square-root",
    "optim.weight_decay": "decoupled weight decay",
    "optim.adam_beta1": "Adam beta1, in [0, 1)",
    "optim.adam_beta2": "Adam beta2, in [0, 1)",
    "optim.adam_eps": "Adam epsilon",
    "optim.clip_grad": "gradient-norm clipping; 0 = off",
    "optim.initial_loss_scale": "fp16: the dynamic loss scaler's starting scale",
    "train.max_steps": "optimizer steps to train",
    "train.micro_batch_size": "samples per rank per forward-backward",
    "train.global_batch_size": "samples per step; null = micro_batch_size x data-parallel size",
    "train.seed": "random seed",
    "train.log_interval": "steps between progress lines and metrics records",
    "train.eval_interval": "steps between evaluations; null = no evaluation",
    "train.eval_iters": "batches per evaluation",
    "train.exit_signal_handler": "on train.exit_signal: checkpoint and exit 0 (preemption)",
    "train.exit_signal": "the signal that means 'save and stop'",
    "train.exit_signal_handler_for_dataloader": "install the handler in data loader workers too",
    "train.preemption_notice": "aws, gcp or azure: a spot/preemptible node's notice on the instance metadata service "
                               "acts as train.exit_signal; null = off",
    "train.preemption_notice_interval": "seconds between polls of the metadata service (local rank 0 of each node)",
    "train.preemption_notice_url": "http://HOST[:PORT] replacing the provider's metadata host; null = its own",
    "train.exit_duration_in_mins": "save and stop after this many minutes; null = no limit",
    "train.device": "auto (cuda when available), cpu or cuda",
    "train.gpu_memory_gib": "one rank's device memory (GiB) for the submit-time size check; null = no check",
    "checkpoint.save": "checkpoint folder; null = never save",
    "checkpoint.load": "folder to resume from (must hold a checkpoint unless it is checkpoint.save); null = save",
    "checkpoint.load_optional": "a checkpoint.load without a checkpoint starts from step 0 instead of failing",
    "checkpoint.save_interval": "steps between checkpoints; null = only at the end",
    "checkpoint.keep_last_n": "keep this many newest checkpoints; null = all",
    "checkpoint.keep_best": "also keep this many checkpoints with the lowest validation loss, outside keep_last_n "
                            "(needs train.eval_interval); null = off",
    "checkpoint.async_save": "write checkpoints in the background",
    "checkpoint.simulated_slow_save": "testing aid: hold every save this many seconds (first attempt only)",
    "checkpoint.save_on_exit": "save when training ends or stops early",
    "checkpoint.local_dir": "node-local folder for frequent non-persistent checkpoints; null = none",
    "checkpoint.local_interval": "steps between local checkpoints (needs local_dir)",
    "checkpoint.local_keep_last_n": "local checkpoints kept per rank",
    "checkpoint.replication_factor": "ranks holding each local part, itself included; 1 = no replicas",
    "checkpoint.replication_jump": "rank distance to a replica; null = ranks per node (another node)",
    "checkpoint.interval_policy": "fixed (every save_interval steps) or young_daly (the trainer picks Daly's optimum)",
    "checkpoint.expected_mtbf_hours": "the job's expected mean time between failures; young_daly's M until measured",
    "checkpoint.ckpt_format": "torch_dist or fsdp_dtensor (megatron_fsdp's); null = the data-parallel strategy's",
    "ft.enabled": "report to nvidia-resiliency-ext's rank monitor (under ft_launcher)",
    "ft.mode": "sections (setup/step/checkpointing timeouts) or heartbeats",
    "ft.calc_ft_timeouts": "learn timeouts from the run and keep them in ft_state.json",
    "ft.min_learned_timeout": "seconds; learned timeouts are never shorter",
    "ft.simulate_fault": "inject a fault to test the setup (first attempt only)",
    "ft.simulated_fault_type": "rank_hung, rank_killed, random, exception, rank_stalled or nan",
    "ft.simulated_fault_exception": "exception fault: cuda_oom, nccl_timeout or nccl_error",
    "ft.simulated_fault_repeat": "fire the simulated fault on every attempt, not only the first",
    "ft.simulated_fault_rank": "rank that faults; null = a random rank",
    "ft.simulated_fault_base_delay": "seconds after setup before the fault",
    "ft.simulated_fault_step": "fault at this step instead of after a delay",
    "ft.simulated_fault_section": "step or checkpointing: where the fault fires",
    "straggler.enabled": "nvidia-resiliency-ext straggler detection around the train step",
    "straggler.report_time_interval": "seconds between straggler reports",
    "straggler.calc_relative_gpu_perf": "score GPUs against each other",
    "straggler.calc_individual_gpu_perf": "score each GPU against its own history",
    "straggler.num_gpu_perf_scores_to_print": "best and worst ranks listed in a report",
    "straggler.gpu_relative_perf_threshold": "relative score below which a rank is a straggler, in [0, 1]",
    "straggler.gpu_individual_perf_threshold": "individual score below which a rank is a straggler, in [0, 1]",
    "straggler.stop_if_detected": "checkpoint and exit 0 when a straggler is found",
    "straggler.enable_logging": "log the reports",
    "straggler.profiling_interval": "profile every n-th step",
    "straggler.logger_name": "logger the reports go to",
    "straggler.simulated_straggler_rank": "rank made slow to test the setup; null = none",
    "straggler.simulated_straggler_delay": "extra seconds per step on that rank",
    "straggler.simulated_straggler_mode": "compute (burn CPU) or wait (sleep): how that rank spends its delay",
    "rerun.rerun_mode": "disabled, validate_results (re-run NaN/Inf steps) or report_stats",
    "rerun.check_for_nan_in_loss": "validate the loss for NaN and Inf",
    "rerun.check_for_spiky_loss": "also re-run steps whose loss is 10x the largest seen",
    "rerun.continue_after_persistent_error": "train on when another GPU does not reproduce the NaN/Inf (else exit 17)",
    "rerun.error_injection_rate": "inject an error once in this many checks; 0 = never",
    "rerun.error_injection_type": "correct_result, transient_error or persistent_error",
    "rerun.result_rejected_tracker_filename": "file that counts rejected results across restarts",
    "rerun.accept_chaos_nan": "testing aid: the loss is NaN while the chaos tool's trigger names this attempt",
    "logger.tensorboard_dir": "TensorBoard event files (rank 0); relative = under run_dir; null = none",
    "logger.wandb_project": "Weights & Biases project; null = no W&B run (WANDB_MODE=offline works)",
    "logger.wandb_entity": "W&B team or user; null = the default",
    "logger.wandb_exp_name": "W&B run name; null = the run_dir's folder name",
    "logger.wandb_save_dir": "where W&B writes wandb/*-run-*; relative = under run_dir; null = run_dir",
    "inprocess.enabled": "restart training inside the same processes after a fault (nvidia-resiliency-ext)",
    "inprocess.max_iterations": "calls of the training function per process, the first included",
    "inprocess.soft_timeout": "seconds without progress before every rank restarts in-process",
    "inprocess.hard_timeout": "seconds without progress before the rank is terminated",
    "inprocess.heartbeat_interval": "seconds between the ranks' liveness heartbeats",
    "inprocess.heartbeat_timeout": "seconds of silence after which a rank is treated as lost",
    "inprocess.barrier_timeout": "seconds for the wrapper's barriers",
    "inprocess.completion_timeout": "seconds for every rank to finish after the first one did",
    "inprocess.monitor_thread_interval": "seconds between the monitor thread's checks",
    "inprocess.monitor_process_interval": "seconds between the monitor process's checks",
    "inprocess.progress_watchdog_interval": "seconds between automatic progress timestamps",
    "inprocess.last_call_wait": "seconds to collect other ranks' faults before restarting",
    "inprocess.termination_grace_time": "seconds between SIGTERM and SIGKILL of a rank past the hard timeout",
    "inprocess.granularity": "node or rank: what a terminated rank takes out with it",
    "inprocess.empty_cuda_cache": "free cached GPU memory between restarts",
}


def format_value(value: Any) -> str:
    """A value the way a ``key=value`` override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value) if value else "[]"
    return str(value)


def key_rows(recipe: PretrainConfig | None = None) -> list[tuple[str, str, str, str | None, str]]:
    """(key, type, default, recipe value or None, meaning) for every key, in section order."""
    rows = []
    hints = typing.get_type_hints(PretrainConfig)
    for top in dataclasses.fields(PretrainConfig):
        cls = hints[top.name]
        if not dataclasses.is_dataclass(cls):
            value = getattr(recipe, top.name) if recipe is not None else None
            rows.append((top.name, type_name(cls), "(required)", None if value is None else format_value(value),
                         MEANING.get(top.name, "")))
            continue
        defaults = cls()
        sub_hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{top.name}.{f.name}"
            value = None if recipe is None else format_value(getattr(getattr(recipe, top.name), f.name))
            rows.append((key, type_name(sub_hints[f.name]), format_value(getattr(defaults, f.name)), value,
                         MEANING.get(key, "")))
    return rows


def key_listing(recipe: PretrainConfig | None = None, recipe_name: str | None = None) -> str:
    """A plain-text table of every key; with ``recipe``, a column with its values (``*`` marks a change)."""
    header = ("key", "type", "default", recipe_name or "recipe", "meaning")
    rows = []
    for key, kind, default, value, meaning in key_rows(recipe):
        if recipe is not None and value != default and default != "(required)":
            value = f"{value} *"
        rows.append((key, kind, default, value or "", meaning))
    columns = [0, 1, 2, 3, 4] if recipe is not None else [0, 1, 2, 4]
    widths = {c: max(len(r[c]) for r in [header, *rows]) for c in columns[:-1]}

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(row[c].ljust(widths[c]) if c in widths else row[c] for c in columns).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)]) + "\n"
