"""The table of bad inputs that tests/test_validation_interfaces.py feeds to every interface: what is typed, the
exact message each interface must answer with, and which interfaces have the setting.
"""

ALL, NO_PYTHON, NO_TRAINER = "cpt", "ct", "cp"  # c: CLI, p: Python, t: trainer command line

WORLD = "parallel: tensor_model_parallel_size * pipeline_model_parallel_size = {} must divide the world size 2, got {}"
SIGNALS = "['SIGTERM', 'SIGINT', 'SIGUSR1', 'SIGUSR2', 'SIGHUP', 'SIGQUIT', 'SIGALRM', 'SIGCONT']"

# (overrides, message, interfaces). {tmp}: this test's folder.
TASK_CASES = [
    (["train.max_steps=-5"], "train.max_steps: must be an integer >= 1, got -5", ALL),
    (["train.max_steps=abc"], "train.max_steps: must be an integer, got 'abc'", ALL),
    (["train.max_steps=1.5"], "train.max_steps: must be an integer, got '1.5'", ALL),
    (["train.max_steps=null"], "train.max_steps: must be an integer, got 'null'", ALL),
    (["model.precision=fp8"], "model.precision: must be one of ['fp32', 'bf16', 'fp16'], got 'fp8'", ALL),
    (["optim.lr=nan"], "optim.lr: must be a finite number, got nan", ALL),
    (["optim.lr=inf"], "optim.lr: must be a finite number, got inf", ALL),
    (["optim.lr=-1"], "optim.lr: must be a number > 0, got -1.0", ALL),
    (["optim.lr=0"], "optim.lr: must be a number > 0, got 0.0", ALL),
    (["optim.lr=fast"], "optim.lr: must be a number, got 'fast'", ALL),
    (["optim.min_lr=0.1"], "optim.min_lr: must be <= optim.lr=0.003, got 0.1", ALL),
    (["optim.adam_beta1=1.0"], "optim.adam_beta1: must be a number in [0, 1), got 1.0", ALL),
    (["optim.adam_beta2=nan"], "optim.adam_beta2: must be a finite number, got nan", ALL),
    (["optim.clip_grad=-1"], "optim.clip_grad: must be a number >= 0, got -1.0", ALL),
    (["optim.lr_decay_style=exp"],
     "optim.lr_decay_style: must be one of ['constant', 'linear', 'cosine', 'inverse-square-root'], got 'exp'", ALL),
    (["optim.optimizer=lamb"], "optim.optimizer: must be one of ['adam', 'sgd'], got 'lamb'", ALL),
    (["optim.lr_warmup_steps=100"], "optim.lr_warmup_steps: must be <= train.max_steps=50, got 100", ALL),
    (["train.exit_duration_in_mins=nan"], "train.exit_duration_in_mins: must be a finite number, got nan", ALL),
    (["train.exit_duration_in_mins=0"], "train.exit_duration_in_mins: must be a number > 0, got 0.0", ALL),
    (["train.exit_signal=SIGKILL"], f"train.exit_signal: must be one of {SIGNALS}, got 'SIGKILL'", ALL),
    (["train.exit_signal_handler=maybe"], "train.exit_signal_handler: must be true or false, got 'maybe'", ALL),
    (["train.device=tpu"], "train.device: must be one of ['auto', 'cpu', 'cuda'], got 'tpu'", ALL),
    (["train.log_interval=0"], "train.log_interval: must be an integer >= 1, got 0", ALL),
    (["train.micro_batch_size=0"], "train.micro_batch_size: must be an integer >= 1, got 0", ALL),
    (["train.global_batch_size=6"], "train.global_batch_size: must be a multiple of train.micro_batch_size=4, got 6",
     ALL),
    (["train.global_batch_size=4"],
     "train.global_batch_size: must be a multiple of train.micro_batch_size * data-parallel size = 4 * 2 = 8, "
     "got 4", ALL),
    (["train.eval_interval=10"], "train.eval_iters: must be >= 1 when train.eval_interval is set, got 0", ALL),
    (["train.seed=-1"], "train.seed: must be an integer >= 0, got -1", ALL),
    (["model.num_layers=0"], "model.num_layers: must be an integer >= 1, got 0", ALL),
    (["model.hidden_size=65"], "model.hidden_size: must be divisible by model.num_attention_heads=4, got 65", ALL),
    (["model.normalization=BatchNorm"], "model.normalization: must be one of ['LayerNorm', 'RMSNorm'], got 'BatchNorm'",
     ALL),
    (["model.max_position_embeddings=32"], "model.max_position_embeddings: must be >= model.seq_length=64, got 32",
     ALL),
    (["model.hidden_dropout=1.5"], "model.hidden_dropout: must be a number in [0, 1), got 1.5", ALL),
    (["model.init_method_std=-0.1"], "model.init_method_std: must be a number >= 0, got -0.1", ALL),
    (["model.share_embeddings_and_output_weights=2"],
     "model.share_embeddings_and_output_weights: must be true or false, got '2'", ALL),
    (["parallel.tensor_model_parallel_size=8"],
     "parallel.tensor_model_parallel_size: must divide model.num_attention_heads=4, got 8", ALL),
    (["parallel.tensor_model_parallel_size=4"], WORLD.format(4, 4), ALL),
    (["parallel.pipeline_model_parallel_size=3"],
     "parallel.pipeline_model_parallel_size: must divide model.num_layers=2, got 3", ALL),
    (["parallel.tensor_model_parallel_size=0"], "parallel.tensor_model_parallel_size: must be an integer >= 1, got 0",
     ALL),
    (["parallel.sequence_parallel=true"],
     "parallel.sequence_parallel: needs parallel.tensor_model_parallel_size > 1, got True", ALL),
    (["checkpoint.save_interval=10"], "checkpoint.save: must be set when checkpoint.save_interval is set, got None",
     ALL),
    (["checkpoint.async_save=true"], "checkpoint.save: must be set when checkpoint.async_save is true, got None", ALL),
    (["checkpoint.keep_last_n=0"], "checkpoint.keep_last_n: must be an integer >= 1, got 0", ALL),
    (["checkpoint.save="], "checkpoint.save: must be a directory path or None, got ''", ALL),
    (["checkpoint.interval_policy=daly"],
     "checkpoint.interval_policy: must be one of ['fixed', 'young_daly'], got 'daly'", ALL),
    (["checkpoint.expected_mtbf_hours=nan"], "checkpoint.expected_mtbf_hours: must be a finite number, got nan", ALL),
    (["checkpoint.expected_mtbf_hours=0"], "checkpoint.expected_mtbf_hours: must be a number > 0, got 0.0", ALL),
    (["checkpoint.save={tmp}/ck", "checkpoint.save_interval=5", "checkpoint.interval_policy=young_daly"],
     "checkpoint.expected_mtbf_hours: must be set (hours > 0) with checkpoint.interval_policy='young_daly': it is "
     "the failure rate until the run has measured its own, got None", ALL),
    # the data-parallel strategy: what Megatron-LM refuses, then what this package's trainer runs (issue 33)
    (["parallel.data_parallel_strategy=zero3"],
     "parallel.data_parallel_strategy: must be one of ['ddp', 'torch_fsdp2', 'megatron_fsdp'], got 'zero3'", ALL),
    (["parallel.data_parallel_sharding_strategy=full"],
     "parallel.data_parallel_sharding_strategy: must be one of ['no_shard', 'optim', 'optim_grads', "
     "'optim_grads_params'], got 'full'", ALL),
    (["parallel.data_parallel_sharding_strategy=optim"],
     "parallel.data_parallel_sharding_strategy: needs parallel.data_parallel_strategy='megatron_fsdp' (ddp shards "
     "the optimizer state with parallel.use_distributed_optimizer; torch_fsdp2 shards everything), got 'optim'", ALL),
    (["parallel.data_parallel_strategy=torch_fsdp2", "parallel.pipeline_model_parallel_size=2"],
     "parallel.pipeline_model_parallel_size: must be 1 with parallel.data_parallel_strategy='torch_fsdp2' "
     "(Megatron-LM has no pipeline parallelism with torch FSDP2; use data_parallel_strategy 'ddp', with "
     "use_distributed_optimizer=true to shard the optimizer state), got 2", ALL),
    (["parallel.data_parallel_strategy=torch_fsdp2", "parallel.use_distributed_optimizer=true"],
     "parallel.use_distributed_optimizer: must be false with parallel.data_parallel_strategy='torch_fsdp2' (FSDP2 "
     "shards the optimizer state itself; Megatron-LM refuses both), got True", ALL),
    (["parallel.data_parallel_strategy=torch_fsdp2", "model.precision=fp16"],
     "model.precision: must be 'fp32' with parallel.data_parallel_strategy='torch_fsdp2' (Megatron-LM has no fp16 "
     "loss scaling with torch FSDP2), got 'fp16'", ALL),
    (["parallel.data_parallel_strategy=torch_fsdp2", "model.precision=bf16"],
     "model.precision: must be 'fp32' with parallel.data_parallel_strategy='torch_fsdp2': bf16 is not supported by "
     "this package's FSDP2 path yet (its fp32 main weights would not be restored by the in-place load), "
     "got 'bf16'", ALL),
    (["parallel.data_parallel_strategy=torch_fsdp2", "model.share_embeddings_and_output_weights=false",
      "inprocess.enabled=true"],
     "inprocess.enabled: must be false with parallel.data_parallel_strategy='torch_fsdp2': in-process restart is not "
     "supported by this package's FSDP2 path yet (restarts in new processes under ft_launcher are), got True", ALL),
    (["parallel.data_parallel_strategy=torch_fsdp2"],
     "model.share_embeddings_and_output_weights: must be false with parallel.data_parallel_strategy='torch_fsdp2' "
     "(a tied embedding fails in FSDP2's forward; Megatron-LM requires --untie-embeddings-and-output-weights), "
     "got True", ALL),
    (["parallel.data_parallel_strategy=megatron_fsdp", "checkpoint.ckpt_format=torch_dist"],
     "checkpoint.ckpt_format: must be 'fsdp_dtensor' (or null) with parallel.data_parallel_strategy="
     "'megatron_fsdp': the only format Megatron-FSDP checkpoints in, got 'torch_dist'", ALL),
    (["checkpoint.ckpt_format=fsdp_dtensor"],
     "checkpoint.ckpt_format: must be 'torch_dist' (or null) with parallel.data_parallel_strategy='ddp': "
     "'fsdp_dtensor' holds Megatron-FSDP's shards (parallel.data_parallel_strategy='megatron_fsdp'), "
     "got 'fsdp_dtensor'", ALL),
    (["checkpoint.ckpt_format=zip"],
     "checkpoint.ckpt_format: must be one of ['torch_dist', 'fsdp_dtensor'], got 'zip'", ALL),
    (["parallel.data_parallel_strategy=megatron_fsdp", "parallel.data_parallel_sharding_strategy=optim",
      "model.precision=bf16"],
     "model.precision: must be 'fp32' with parallel.data_parallel_strategy='megatron_fsdp': not supported by this "
     "package's Megatron-FSDP path yet, got 'bf16'", ALL),
    (["data.tokenizer=sentencepiece"], "data.tokenizer: must be one of ['null', 'gpt2'], got 'sentencepiece'", ALL),
    (["data.tokenizer=gpt2"], "data.tokenizer: 'gpt2' needs data.vocab_file and data.merge_file, got 'gpt2'", ALL),
    (["data.split=90,10"],
     "data.split: must be three comma-separated non-negative weights like '969,30,1', got '90,10'", ALL),
    (["data.num_workers=-1"], "data.num_workers: must be an integer >= 0, got -1", ALL),
    (["ft.enabled=maybe"], "ft.enabled: must be true or false, got 'maybe'", ALL),
    (["ft.mode=always"], "ft.mode: must be one of ['sections', 'heartbeats'], got 'always'", ALL),
    (["ft.min_learned_timeout=0"], "ft.min_learned_timeout: must be a number > 0, got 0.0", ALL),
    (["ft.simulated_fault_type=rank_slow"],
     "ft.simulated_fault_type: must be one of ['rank_hung', 'rank_killed', 'random', 'exception', 'rank_stalled', "
     "'nan'], "
     "got 'rank_slow'", ALL),
    (["ft.simulated_fault_step=999"], "ft.simulated_fault_step: must be <= train.max_steps=50, got 999", ALL),
    (["ft.simulated_fault_section=checkpointing"],
     "ft.simulated_fault_section: needs ft.simulated_fault_step to be set, got 'checkpointing'", ALL),
    (["ft.simulated_fault_rank=-2"], "ft.simulated_fault_rank: must be an integer >= 0, got -2", ALL),
    (["straggler.gpu_relative_perf_threshold=1.5"],
     "straggler.gpu_relative_perf_threshold: must be a number in [0, 1], got 1.5", ALL),
    (["straggler.report_time_interval=nan"], "straggler.report_time_interval: must be a finite number, got nan", ALL),
    (["straggler.profiling_interval=0"], "straggler.profiling_interval: must be an integer >= 1, got 0", ALL),
    (["straggler.simulated_straggler_rank=-1"],
     "straggler.simulated_straggler_rank: must be an integer >= 0, got -1", ALL),
    (["rerun.rerun_mode=always"],
     "rerun.rerun_mode: must be one of ['disabled', 'validate_results', 'report_stats'], got 'always'", ALL),
    (["rerun.error_injection_rate=-1"], "rerun.error_injection_rate: must be an integer >= 0, got -1", ALL),
    (["rerun.error_injection_type=bad"],
     "rerun.error_injection_type: must be one of ['correct_result', 'transient_error', 'persistent_error'], "
     "got 'bad'", ALL),
    # paths this machine sees: the trainer checks them too, before torch loads
    (["checkpoint.save=/proc/ckpt"],
     "checkpoint.save: must be a writable directory, got '/proc/ckpt' "
     "(cannot create directories in '/proc': No such file or directory)", ALL),
    (["run_dir={tmp}/afile"], "run_dir: must be a directory, got '{tmp}/afile' (a file)", ALL),
    (["checkpoint.save={tmp}/afile/ckpt"],
     "checkpoint.save: must be a directory we can create, got '{tmp}/afile/ckpt' ('{tmp}/afile' is a file)", ALL),
    (["data.data_path={tmp}/missing"],
     "data.data_path: must name indexed datasets (PREFIX.bin and PREFIX.idx), got '{tmp}/missing' "
     "({tmp}/missing.bin, {tmp}/missing.idx not found)", ALL),
    (["data.tokenizer=gpt2", "data.vocab_file={tmp}/vocab.json", "data.merge_file={tmp}/afile"],
     "data.vocab_file: must be an existing file, got '{tmp}/vocab.json' (not found)", ALL),
    # a resume the user asked for that is not there: an error, not a silent start from step 0 (issue 27)
    (["checkpoint.load={tmp}/missing"],
     "checkpoint.load: must be a folder holding a checkpoint to resume from, got '{tmp}/missing' (not found); "
     "checkpoint.load_optional=true starts from step 0 when it holds none", ALL),
    (["checkpoint.load={tmp}"],
     "checkpoint.load: must be a folder holding a checkpoint to resume from, got '{tmp}' (no checkpoint in it: no "
     "iter_NNNNNNN folder, no latest_checkpointed_iteration.txt); checkpoint.load_optional=true starts from step 0 "
     "when it holds none", ALL),
    (["checkpoint.load_optional=true"], "checkpoint.load: must be set when checkpoint.load_optional is true, got None",
     ALL),
    # a shape that cannot fit one rank's memory (config/memory.py)
    (["model.vocab_size=1000000000000000"],
     "model.vocab_size: the model does not fit: about 9.54e+08 GiB per rank (6.4e+16 parameters on the first "
     "pipeline stage x 16 bytes for fp32 weights and gradients and Adam state = 9.54e+08 GiB, + activations of at "
     "least 0.00208 GiB), more than train.gpu_memory_gib=80; make it smaller, split it over more ranks "
     "(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size), shard the optimizer "
     "(parallel.use_distributed_optimizer=true) or the weights and gradients too "
     "(parallel.data_parallel_strategy='torch_fsdp2'), or set train.gpu_memory_gib to the GPUs' memory, got "
     "1000000000000000", ALL),
    (["train.gpu_memory_gib=0"], "train.gpu_memory_gib: must be a number > 0, got 0.0", ALL),
    # keys: the Python side cannot hold an unknown key (Fiddle rejects the attribute, see below)
    (["train.max_stepz=3"],
     "train.max_stepz: unknown key; did you mean train.max_steps? valid keys in train: train.max_steps, "
     "train.micro_batch_size, train.global_batch_size, train.seed, train.log_interval, train.eval_interval, "
     "train.eval_iters, train.exit_signal_handler, train.exit_signal, train.exit_signal_handler_for_dataloader, "
     "train.exit_duration_in_mins, train.preemption_notice, train.preemption_notice_interval, "
     "train.preemption_notice_url, train.device, train.gpu_memory_gib", NO_PYTHON),
    (["trian.max_steps=3"],
     "trian.max_steps: unknown key; did you mean train.max_steps? sections: run_dir, model, parallel, data, optim, "
     "train, checkpoint, ft, straggler, rerun, logger, inprocess (every key: python -m megatron_resilience --help)",
     NO_PYTHON),
    (["optim.learning_rate=0.1"],
     "optim.learning_rate: unknown key; valid keys in optim: optim.optimizer, optim.lr, optim.min_lr, "
     "optim.lr_warmup_steps, optim.lr_decay_steps, optim.lr_decay_style, optim.weight_decay, optim.adam_beta1, "
     "optim.adam_beta2, optim.adam_eps, optim.clip_grad, optim.initial_loss_scale", NO_PYTHON),
    (["train.lr=0.1"],
     "train.lr: unknown key; did you mean optim.lr? valid keys in train: train.max_steps, train.micro_batch_size, "
     "train.global_batch_size, train.seed, train.log_interval, train.eval_interval, train.eval_iters, "
     "train.exit_signal_handler, train.exit_signal, train.exit_signal_handler_for_dataloader, "
     "train.exit_duration_in_mins, train.preemption_notice, train.preemption_notice_interval, "
     "train.preemption_notice_url, train.device, train.gpu_memory_gib", NO_PYTHON),
    (["train=5"],
     "train: unknown key (train is a section: name one of its fields); valid keys in train: train.max_steps, "
     "train.micro_batch_size, train.global_batch_size, train.seed, train.log_interval, train.eval_interval, "
     "train.eval_iters, train.exit_signal_handler, train.exit_signal, train.exit_signal_handler_for_dataloader, "
     "train.exit_duration_in_mins, train.preemption_notice, train.preemption_notice_interval, "
     "train.preemption_notice_url, train.device, train.gpu_memory_gib", NO_PYTHON),
    (["train.max_steps"], "'train.max_steps': expected key=value, e.g. train.max_steps=100", NO_PYTHON),
]

# Plugin fields: (plugin index in [FaultTolerancePlugin, PreemptionPlugin], field, value as typed, message).
PLUGIN_CASES = [
    (0, "step_timeout", "nan", "FaultTolerancePlugin.step_timeout: must be a finite number, got nan"),
    (0, "setup_timeout", "-5", "FaultTolerancePlugin.setup_timeout: must be a number > 0, got -5.0"),
    (0, "workload_check_interval", "inf", "FaultTolerancePlugin.workload_check_interval: must be a finite number, "
                                          "got inf"),
    (0, "initial_rank_heartbeat_timeout", "nan",
     "FaultTolerancePlugin.initial_rank_heartbeat_timeout: must be a finite number, got nan"),
    (0, "num_in_job_restarts", "-1", "FaultTolerancePlugin.num_in_job_restarts: must be an integer >= 0, got -1"),
    (0, "log_level", "LOUD",
     "FaultTolerancePlugin.log_level: must be one of ['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'], got 'LOUD'"),
    (1, "preempt_time", "0", "PreemptionPlugin.preempt_time: must be an integer >= 1, got 0"),
    (1, "signal", "SIGKILL", f"PreemptionPlugin.signal: must be one of {SIGNALS}, got 'SIGKILL'"),
    (1, "preempt_time", "20000", "PreemptionPlugin.preempt_time: must be below the executor's time limit "
                                 "executor.time='04:00:00' (14400 s), got 20000"),
]

# Executor fields: ({field: value as typed}, {plugin field: value}, message).
EXECUTOR_CASES = [
    ({"account": ""}, {}, "executor.account: must be a Slurm account name, got ''"),
    ({"time": "soon"}, {}, "executor.time: must be a Slurm time like '01:30:00' or '1-00:00:00', got 'soon'"),
    ({"time": ""}, {}, "executor.time: must be a Slurm time like '01:30:00' or '1-00:00:00', got ''"),
    ({"time": "1:2:3:4"}, {}, "executor.time: must be a Slurm time like '01:30:00' or '1-00:00:00', got '1:2:3:4'"),
    ({"time": "01:30"}, {"preempt_time": "120"},
     "PreemptionPlugin.preempt_time: must be below the executor's time limit executor.time='01:30' (90 s), got 120"),
    ({"time": "1"}, {}, "PreemptionPlugin.preempt_time: must be below the executor's time limit executor.time='1' "
                        "(60 s), got 60"),
    ({"nodes": "0"}, {}, "executor.nodes: must be an integer >= 1, got 0"),
    ({"ntasks_per_node": "0"}, {}, "executor.ntasks_per_node: must be an integer >= 1, got 0"),
]

# Recipe arguments: (recipe, {argument: value as typed}, message).
RECIPE_CASES = [
    ("gpt_126m", {"num_nodes": "two"}, "num_nodes: must be an integer, got 'two'"),
    ("gpt_126m", {"num_nodes": "0"}, "num_nodes: must be an integer >= 1, got 0"),
    ("gpt_tiny", {"num_gpus_per_node": "0"}, "num_gpus_per_node: must be an integer >= 1, got 0"),
    ("gpt_126m", {"name": "a/b"}, "name: must be a non-empty string without '/', got 'a/b'"),
    ("gpt_7b", {"num_gpus_per_node": "1"},
     "num_nodes * num_gpus_per_node: must be a multiple of gpt_7b's tensor x pipeline parallel size 2x1=2 "
     "(or override parallel.*), got 1"),
]
