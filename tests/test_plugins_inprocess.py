"""FaultTolerancePlugin(inprocess_restart=True, local_checkpoint_dir=...): task and executor together, per trainer
and per nvidia-resiliency-ext release, and every bad combination refused before submission naming its key.
The full sbatch scripts are frozen in tests/golden/ft_inprocess_*.sh (test_plugins_golden.py); srun's handling of
the two --kill-on-bad-exit flags is proven on the Slurm cluster (tests/slurm/test_inprocess_on_slurm.py)."""

from __future__ import annotations

import logging

import fiddle as fdl
import pytest
from golden_cases import bridge_task, megatron_lm_task

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import CheckpointConfig, ConfigError, InProcessConfig  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, megatron_bridge_args, megatron_lm_args  # noqa: E402
from megatron_resilience.plugins.script_args import InProcessRestartPluginScriptArgs  # noqa: E402

LOGGER = "megatron_resilience.plugins"
LOCAL = {"local_checkpoint_dir": "/local/ckpt", "local_checkpoint_interval": 10}


def slurm(tmp_path, nodes=2, **kw):
    executor = run.SlurmExecutor(account="acct", time="01:00:00", nodes=nodes, ntasks_per_node=8,
                                 tunnel=run.LocalTunnel(job_dir="/cluster/exp"), **kw)
    executor.assign("job_1", str(tmp_path / "job_1"), task_id="job", task_dir="job")
    return executor


def flags_block(executor) -> str:
    return executor.setup_lines or ""


def test_our_trainer_gets_its_keys_and_slurm_keeps_the_survivors(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task, executor = run.Partial(pretrain, run_dir="/runs/gpt"), slurm(tmp_path)
    FaultTolerancePlugin(nvrx_version="0.4.1", inprocess_restart=True, replication_factor=2, **LOCAL).setup(
        task, executor)
    assert fdl.build(task.inprocess) == InProcessConfig(enabled=True)
    assert fdl.build(task.checkpoint) == CheckpointConfig(local_dir="/local/ckpt", local_interval=10,
                                                          replication_factor=2)
    assert executor.srun_args == ["--kill-on-bad-exit=0"]
    env = executor.env_vars
    assert {k: env[k] for k in ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "NCCL_NVLS_ENABLE", "TORCH_CPP_LOG_LEVEL",
                                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "MEGATRON_RESILIENCE_JOB_PORT")} == {
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_CPP_LOG_LEVEL": "error",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480", "MEGATRON_RESILIENCE_JOB_PORT": "$((25000+SLURM_JOB_ID%1942*4))"}
    assert executor.launcher.rdzv_port == "${MEGATRON_RESILIENCE_JOB_PORT}"
    assert "megatron_resilience_ft_launcher_flags=(--ft-restart-policy min-healthy)" in flags_block(executor)
    logged = [r.getMessage() for r in caplog.records]
    assert "FaultTolerancePlugin: task inprocess.enabled: False (default) -> True (inprocess_restart)" in logged
    assert "FaultTolerancePlugin: task checkpoint.local_dir: None (default) -> '/local/ckpt' (local_checkpoint_dir)" \
        in logged
    assert ("FaultTolerancePlugin: executor.srun_args += '--kill-on-bad-exit=0' (nemo_run renders --kill-on-bad-exit=1 "
            "first; srun takes the last: a rank that dies must not make srun kill the ranks the in-process wrapper "
            "keeps alive)") in logged
    assert ("FaultTolerancePlugin: inprocess_restart: restart_policy -> 'min-healthy' (ft_launcher restarts the "
            "workers only when too few nodes are healthy; the in-process wrapper handles faults of live "
            "ranks)") in logged


def test_from_nvrx_0_6_only_any_failed_exists_and_the_log_says_what_that_means(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    executor = slurm(tmp_path)
    FaultTolerancePlugin(nvrx_version="0.7", inprocess_restart=True).setup(run.Partial(pretrain, run_dir="/r"),
                                                                           executor)
    assert "--ft-restart-policy" not in flags_block(executor)
    assert any("nvidia-resiliency-ext 0.7 restarts every worker when any worker process fails" in r.getMessage()
               and "a dead process, the in-process wrapper's hard-timeout kills included, is always a process restart"
               in r.getMessage() for r in caplog.records)


def test_a_users_restart_policy_ports_and_block_are_kept(tmp_path):
    executor = slurm(tmp_path, launcher=run.Torchrun(rdzv_port=29777),
                     env_vars={"MEGATRON_RESILIENCE_JOB_PORT": "13000"})
    FaultTolerancePlugin(nvrx_version="0.4.1", inprocess_restart=True, restart_policy="any-failed").setup(
        run.Partial(pretrain, run_dir="/r"), executor)
    assert "--ft-restart-policy any-failed" in flags_block(executor)
    assert executor.launcher.rdzv_port == 29777 and executor.env_vars["MEGATRON_RESILIENCE_JOB_PORT"] == "13000"


def test_script_trainers_get_their_own_flags(tmp_path):
    lm, bridge = megatron_lm_task(), bridge_task()
    # Megatron-LM's in-process restart runs only without its FT package, on a megatron-core before 0.18
    # (plugins/megatron_lm_flags.py check_inprocess_restart, tests/test_plugins_megatron_lm_inprocess.py)
    FaultTolerancePlugin(inprocess_restart=True, replication_factor=2, enable_ft_package=False,
                         megatron_core_version="0.17.0", **LOCAL).setup(lm, slurm(tmp_path))
    FaultTolerancePlugin(inprocess_restart=True, replication_factor=2, **LOCAL).setup(bridge, slurm(tmp_path))
    assert lm.args[-12:] == ["--inprocess-restart", "--non-persistent-ckpt-type", "local",
                             "--non-persistent-local-ckpt-dir", "/local/ckpt", "--non-persistent-save-interval", "10",
                             "--replication", "--replication-jump", "8", "--replication-factor", "2"]
    assert "--calc-ft-timeouts" not in lm.args and "--enable-ft-package" not in lm.args
    assert bridge.args[-8:] == ["++inprocess_restart._target_=megatron.bridge.training.config.InProcessRestartConfig",
                                "++inprocess_restart.enabled=true", "checkpoint.non_persistent_ckpt_type=local",
                                "checkpoint.non_persistent_local_ckpt_dir=/local/ckpt",
                                "checkpoint.non_persistent_save_interval=10", "checkpoint.replication=true",
                                "checkpoint.replication_jump=8", "checkpoint.replication_factor=2"]
    only_restart = InProcessRestartPluginScriptArgs(inprocess_restart=True)
    assert megatron_lm_args(only_restart) == ["--inprocess-restart"]
    assert megatron_bridge_args(only_restart) == [
        "++inprocess_restart._target_=megatron.bridge.training.config.InProcessRestartConfig",
        "++inprocess_restart.enabled=true"]


def test_a_flags_value_is_kept_even_when_the_task_has_the_same_token_elsewhere(tmp_path):
    task = run.Script(path="/opt/megatron-lm/pretrain_gpt.py",
                      args=["--tensor-model-parallel-size", "2", "--replication"])
    FaultTolerancePlugin(inprocess_restart=True, replication_factor=2, enable_ft_package=False,
                         megatron_core_version="0.17.0", **LOCAL).setup(task, slurm(tmp_path))
    assert task.args.count("--replication") == 1  # a lone flag the task has is not repeated
    assert task.args[-2:] == ["--replication-factor", "2"]  # ... but "2" is a value, not a duplicate


def test_without_the_new_fields_nothing_changes_for_another_trainers_converter(tmp_path):
    seen = []
    task = run.Script(path="train.py", args=["--x"])
    FaultTolerancePlugin(script_args_converter_fn=lambda a: seen.append(type(a).__name__) or []).setup(
        task, slurm(tmp_path))
    assert seen == ["FaultTolerancePluginScriptArgs"]  # a Bridge-style converter never meets the new ScriptArgs


@pytest.mark.parametrize("kwargs, nodes, message", [
    ({"inprocess_restart": True, "nvrx_version": "0.3"}, 2,  # below the plugin's floor: refused at construction
     "FaultTolerancePlugin.nvrx_version: must be a version string from '0.4' on"),
    ({"inprocess_restart": True, "step_timeout": 60.0}, 2,
     "FaultTolerancePlugin.step_timeout: must be > inprocess.hard_timeout=90 with inprocess_restart (ft_launcher would "
     "end as hung a rank that the in-process restart recovers), got 60"),
    ({"inprocess_restart": True, "mode": "heartbeats", "rank_heartbeat_timeout": 90.0}, 2,
     "FaultTolerancePlugin.rank_heartbeat_timeout: must be > inprocess.hard_timeout=90"),
    ({"replication_factor": 4, **LOCAL}, 2,
     "FaultTolerancePlugin.replication_factor: must be <= the node count and divide it (each replica on another "
     "node), got 4 for 2 node(s)"),
    ({"replication_factor": 2, **LOCAL}, 3, "FaultTolerancePlugin.replication_factor: must be <= the node count and "
                                            "divide it (each replica on another node), got 2 for 3 node(s)"),
])
def test_bad_combinations_fail_before_submission_naming_the_key(tmp_path, kwargs, nodes, message):
    with pytest.raises(ConfigError) as err:
        FaultTolerancePlugin(**kwargs).setup(run.Partial(pretrain, run_dir="/r"), slurm(tmp_path, nodes=nodes))
    assert str(err.value).startswith(message), str(err.value)


def test_the_tasks_own_settings_are_checked_too(tmp_path):
    task = run.Partial(pretrain, run_dir="/r", inprocess=run.Config(InProcessConfig, hard_timeout=400.0,
                                                                    barrier_timeout=500.0),
                       checkpoint=run.Config(CheckpointConfig, local_dir="/l", local_interval=5, replication_factor=4))
    with pytest.raises(ConfigError, match=r"^FaultTolerancePlugin\.step_timeout: must be > inprocess\.hard_timeout"):
        FaultTolerancePlugin(inprocess_restart=True).setup(task, slurm(tmp_path))
    with pytest.raises(ConfigError, match=r"^checkpoint\.replication_factor: must be <= the node count"):
        FaultTolerancePlugin(step_timeout=900.0, setup_timeout=900.0, checkpointing_timeout=900.0,
                             out_of_section_timeout=900.0).setup(task, slurm(tmp_path))
    wrong_order = run.Partial(pretrain, run_dir="/r", inprocess=run.Config(InProcessConfig, soft_timeout=95.0))
    with pytest.raises(ConfigError, match=r"^inprocess\.soft_timeout: must be < inprocess\.hard_timeout=90, got 95"):
        FaultTolerancePlugin(inprocess_restart=True).setup(wrong_order, slurm(tmp_path))


@pytest.mark.parametrize("executor_kw, message", [
    ({"srun_args": ["--kill-on-bad-exit=1"]}, "conflicting settings: executor.srun_args has ['--kill-on-bad-exit=1'], "
                                              "but inprocess_restart needs --kill-on-bad-exit=0"),
    ({"env_vars": {"TORCH_CPP_LOG_LEVEL": "info"}}, "conflicting settings: executor.env_vars['TORCH_CPP_LOG_LEVEL']="
                                                    "'info', but in-process restart needs 'error'"),
    ({"env_vars": {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60"}},
     "conflicting settings: executor.env_vars['TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC']='60' must be > "
     "inprocess.hard_timeout=90"),
])
def test_executor_settings_that_would_undo_it_are_refused(tmp_path, executor_kw, message):
    with pytest.raises(ConfigError) as err:
        FaultTolerancePlugin(inprocess_restart=True).setup(run.Partial(pretrain, run_dir="/r"),
                                                           slurm(tmp_path, **executor_kw))
    assert str(err.value).startswith(message), str(err.value)


INPROCESS_WITHOUT_FT = (
    "inprocess.enabled: true on a SlurmExecutor needs FaultTolerancePlugin(inprocess_restart=True) among the job's "
    "plugins (without it srun keeps nemo_run's --kill-on-bad-exit=1, which kills the ranks the in-process wrapper "
    "keeps alive, and the wrapper's environment is not set), got plugins {}")


def test_inprocess_restart_on_slurm_without_the_ft_plugin_is_refused_given_the_jobs_plugins(tmp_path):
    """check_task(..., plugins=...): the job's plugins before they run (run.run's check) or after (preview's).
    A plugin's own setup does not know the others (plugins=None): no verdict there."""
    from megatron_resilience.plugins import PreemptionPlugin
    from megatron_resilience.plugins.task_check import check_task

    task = run.Partial(pretrain, run_dir="/r", inprocess=run.Config(InProcessConfig, enabled=True))
    for plugins in ([], [PreemptionPlugin()]):
        with pytest.raises(ConfigError) as err:
            check_task(task, slurm(tmp_path), plugins=plugins)
        assert str(err.value) == INPROCESS_WITHOUT_FT.format([type(p).__name__ for p in plugins])
    preemption_first = [PreemptionPlugin(), FaultTolerancePlugin()]  # any FaultTolerancePlugin sets it up
    assert check_task(task, slurm(tmp_path), plugins=preemption_first).inprocess.enabled is True
    assert check_task(task, slurm(tmp_path)) is not None  # a plugin's setup: the other plugins are not known
    local = run.LocalExecutor(ntasks_per_node=2)  # no srun: nothing to keep alive
    assert check_task(task, local, plugins=[]).inprocess.enabled is True
    assert check_task(run.Partial(pretrain, run_dir="/r"), slurm(tmp_path), plugins=[]) is not None
    executor = slurm(tmp_path)  # after the FT plugin ran: set up, and the same check passes
    FaultTolerancePlugin().setup(task, executor)
    assert check_task(task, executor, plugins=[FaultTolerancePlugin()]) is not None
    assert executor.srun_args == ["--kill-on-bad-exit=0"]


@pytest.mark.parametrize("kwargs, message", [
    ({"inprocess_restart": "yes"}, "FaultTolerancePlugin.inprocess_restart: must be true or false, got 'yes'"),
    ({"local_checkpoint_dir": "local", "local_checkpoint_interval": 5},
     "FaultTolerancePlugin.local_checkpoint_dir: must be an absolute path on the nodes' local storage (or None), "
     "got 'local'"),
    ({"local_checkpoint_dir": "/l"}, "FaultTolerancePlugin.local_checkpoint_interval: and local_checkpoint_dir go "
                                     "together (both or neither), got None"),
    ({"replication_factor": 2}, "FaultTolerancePlugin.replication_factor: needs local_checkpoint_dir (replicas are "
                                "of local checkpoints), got 2"),
    ({"replication_factor": 0, **LOCAL}, "FaultTolerancePlugin.replication_factor: must be an integer >= 1, got 0"),
])
def test_bad_fields_name_the_key(kwargs, message):
    with pytest.raises(ConfigError) as err:
        FaultTolerancePlugin(**kwargs)
    assert str(err.value) == message
