"""What the plugins change on the task and the executor, and the log line for each change.

Partial tasks are checked by building the edited section configs; Script tasks by parsing the edited
command line with the trainer's own ``config_from_overrides``.
"""

from __future__ import annotations

import logging
import os
import shlex

import fiddle as fdl
import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import ConfigError, FaultToleranceConfig, TrainingConfig  # noqa: E402
from megatron_resilience.config.overrides import config_from_overrides  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402

LOGGER = "megatron_resilience.plugins"


def slurm(tmp_path, **kw):
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"), **kw)
    executor.assign("gpt_1", str(tmp_path / "gpt_1"), task_id="gpt", task_dir="gpt")
    return executor


def local(tmp_path, **kw):
    executor = run.LocalExecutor(**kw)
    executor.assign("gpt_1", str(tmp_path / "gpt_1"), task_id="gpt", task_dir="gpt")
    return executor


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_partial_defaults_get_sections_created_and_every_change_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Partial(pretrain, run_dir="/runs/gpt")
    executor = slurm(tmp_path)
    FaultTolerancePlugin().setup(task, executor)
    PreemptionPlugin(enable_exit_handler_for_data_loader=True).setup(task, executor)
    assert fdl.build(task.ft) == FaultToleranceConfig(enabled=True, calc_ft_timeouts=True)
    assert fdl.build(task.train) == TrainingConfig(exit_signal_handler=True, exit_signal_handler_for_dataloader=True)
    assert messages(caplog) == [
        "FaultTolerancePlugin: task ft.enabled: False (default) -> True (enable_ft_package)",
        "FaultTolerancePlugin: task ft.calc_ft_timeouts: False (default) -> True (calc_ft_timeouts)",
        "FaultTolerancePlugin: num_in_job_restarts=None -> 3 (nvidia-resiliency-ext 0.4.1 tracks no progress); after "
        "the last one the batch script's decision requeues an advancing run with its budget refilled",
        "FaultTolerancePlugin: mode=sections: heartbeat timeouts are not set (section messages do not reset the "
        "heartbeat timer); hangs are caught by the section timeouts setup=600.0 step=180.0 checkpointing=420.0 "
        "out-of-section=300.0",
        "FaultTolerancePlugin: executor.launcher: None -> ft_launcher (run.FaultTolerance)",
        "FaultTolerancePlugin: executor.env_vars['MEGATRON_RESILIENCE_JOB_PORT'] = '$((25000+SLURM_JOB_ID%1942*4))': "
        "the job's own port block (rendezvous, process-group store, in-process store), outside the kernel's "
        "ephemeral range",
        "FaultTolerancePlugin: executor.launcher.rdzv_port: 29500 -> $MEGATRON_RESILIENCE_JOB_PORT (nemo_run's fixed "
        "port is shared by every job on the head node)",
        "FaultTolerancePlugin: executor.retries: 0 -> 3 (num_job_retries_on_failure=2: nemo_run's FT sbatch script "
        "stops requeueing once TORCHX_MAX_RETRIES=executor.retries attempts in a row failed, so a failing job runs "
        "1 + 2 times)",
        "FaultTolerancePlugin: ft_launcher rendered for nvidia-resiliency-ext 0.4.1 (installed nvidia-resiliency-ext); "
        "mode=sections; FT config at /nemo_run/gpt_ft_cfg.yml",
        "PreemptionPlugin: task train.exit_signal_handler: False (default) -> True (enable_exit_handler)",
        "PreemptionPlugin: task train.exit_signal_handler_for_dataloader: False (default) -> True "
        "(enable_exit_handler_for_data_loader)",
        "PreemptionPlugin: executor.signal: None -> 'SIGTERM@60' (#SBATCH --signal=SIGTERM@60)",
        "PreemptionPlugin: executor.env_vars['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'] = '60' (seconds torchrun waits for "
        "the ranks to save and exit)",
    ]
    launcher = executor.launcher
    assert (launcher.max_restarts, launcher.workload_check_interval, launcher.rank_termination_signal,
            launcher.log_level, launcher.initial_rank_heartbeat_timeout, launcher.rank_heartbeat_timeout) == (
        3, 5.0, "SIGKILL", "INFO", None, None)
    assert executor.retries == 3 and executor.signal == "SIGTERM@60"


def test_partial_user_values_are_overridden_with_a_log_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Partial(pretrain, run_dir="/runs/gpt",
                       ft=run.Config(FaultToleranceConfig, enabled=False, mode="heartbeats"),
                       train=run.Config(TrainingConfig, max_steps=7, exit_signal="SIGUSR1"))
    executor = slurm(tmp_path)
    FaultTolerancePlugin(calc_ft_timeouts=False, rank_heartbeat_timeout=120).setup(task, executor)
    PreemptionPlugin(signal="SIGHUP", preempt_time=120).setup(task, executor)
    assert fdl.build(task.ft) == FaultToleranceConfig(enabled=True, mode="heartbeats", calc_ft_timeouts=False)
    assert fdl.build(task.train) == TrainingConfig(max_steps=7, exit_signal="SIGHUP", exit_signal_handler=True)
    logged = messages(caplog)
    assert "FaultTolerancePlugin: task ft.enabled: False -> True (enable_ft_package)" in logged
    assert not any("calc_ft_timeouts" in m for m in logged)  # already False (default): nothing changed
    assert "PreemptionPlugin: task train.exit_signal: 'SIGUSR1' -> 'SIGHUP' (signal)" in logged
    launcher = executor.launcher
    assert (launcher.initial_rank_heartbeat_timeout, launcher.rank_heartbeat_timeout) == (1800.0, 120.0)
    assert executor.signal == "SIGHUP@120"


def test_script_module_form_gets_overrides_the_trainer_parses(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Script(path="megatron_resilience", m=True, entrypoint="python",
                      args=["run_dir=/runs/gpt", "ft.enabled=false", "train.exit_signal=SIGUSR1"])
    executor = slurm(tmp_path)
    PreemptionPlugin().setup(task, executor)
    FaultTolerancePlugin(calc_ft_timeouts=False).setup(task, executor)
    assert task.args == ["run_dir=/runs/gpt", "ft.enabled=false", "train.exit_signal=SIGUSR1",
                         "train.exit_signal_handler=true", "train.exit_signal=SIGTERM",
                         "train.exit_signal_handler_for_dataloader=false", "ft.enabled=true",
                         "ft.calc_ft_timeouts=false"]
    config = config_from_overrides(task.args)
    assert (config.ft.enabled, config.ft.calc_ft_timeouts) == (True, False)
    assert (config.train.exit_signal_handler, config.train.exit_signal) == (True, "SIGTERM")
    logged = messages(caplog)
    assert "PreemptionPlugin: task train.exit_signal: 'SIGUSR1' -> 'SIGTERM' (signal)" in logged
    assert "FaultTolerancePlugin: task ft.enabled: False -> True (enable_ft_package)" in logged


def test_inline_script_trainer_is_execed_and_gets_overrides(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    inline = ("set -e\nexport OMP_NUM_THREADS=1  # one thread per rank\n\n"
              "  python3 -m megatron_resilience run_dir=/runs/gpt \\\n    train.max_steps=9 'data.split=98,1,1'\n")
    task = run.Script(inline=inline)
    PreemptionPlugin().setup(task, slurm(tmp_path))
    assert task.inline == ("set -e\nexport OMP_NUM_THREADS=1  # one thread per rank\n\n"
                           "  exec python3 -m megatron_resilience run_dir=/runs/gpt \\\n"
                           "    train.max_steps=9 'data.split=98,1,1' train.exit_signal_handler=true "
                           "train.exit_signal=SIGTERM train.exit_signal_handler_for_dataloader=false\n")
    tokens = shlex.split(task.inline.split("\n", 3)[3].replace("\\\n", " "))
    config = config_from_overrides(tokens[4:])
    assert (config.train.max_steps, config.data.split, config.train.exit_signal_handler) == (9, "98,1,1", True)
    assert ("PreemptionPlugin: task: inline script now ends in 'exec python -m megatron_resilience ...' so the "
            "trainer, not bash, is the process that receives the scheduler's signal") in messages(caplog)
    PreemptionPlugin().setup(task, slurm(tmp_path / "again"))  # idempotent: no second exec, no new overrides
    assert task.inline.count("exec ") == 1 and task.inline.count("train.exit_signal=SIGTERM") == 1


def test_cloud_notice_reaches_the_trainer_of_a_partial_and_a_script_and_refuses_other_trainers(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Partial(pretrain, run_dir="/runs/gpt")
    PreemptionPlugin(cloud_notice="gcp", cloud_notice_interval=2).setup(task, slurm(tmp_path))
    assert fdl.build(task.train) == TrainingConfig(exit_signal_handler=True, preemption_notice="gcp",
                                                   preemption_notice_interval=2.0)
    assert ("PreemptionPlugin: task train.preemption_notice: None (default) -> 'gcp' (cloud_notice)"
            in messages(caplog))
    script = run.Script(path="megatron_resilience", m=True, entrypoint="python", args=["run_dir=/runs/gpt"])
    PreemptionPlugin(cloud_notice="azure", cloud_notice_url="http://10.0.0.1:8080").setup(script,
                                                                                         slurm(tmp_path / "s"))
    config = config_from_overrides(script.args)
    assert (config.train.preemption_notice, config.train.preemption_notice_interval,
            config.train.preemption_notice_url) == ("azure", 5.0, "http://10.0.0.1:8080")
    other = run.Script(path="/opt/megatron-lm/pretrain_gpt.py", entrypoint="python")
    with pytest.raises(ConfigError, match=r"^PreemptionPlugin\.cloud_notice='aws': only megatron_resilience's "
                                          r"trainer polls the instance metadata service"):
        PreemptionPlugin(cloud_notice="aws").setup(other, slurm(tmp_path / "o"))


def test_nsys_requested_on_launcher_or_task_is_turned_off_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Script(inline="nsys profile -o /tmp/prof python -m megatron_resilience run_dir=/runs/gpt")
    executor = slurm(tmp_path, launcher=run.Torchrun(nsys_profile=True))
    PreemptionPlugin().setup(task, executor)
    assert executor.launcher.nsys_profile is False
    assert task.inline == ("exec python -m megatron_resilience run_dir=/runs/gpt train.exit_signal_handler=true "
                           "train.exit_signal=SIGTERM train.exit_signal_handler_for_dataloader=false")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "PreemptionPlugin: turned off nsys profiling requested on executor.launcher (nsys_profile=True -> False): "
        "nsys would be the process that receives the preemption signal, not the trainer",
        "PreemptionPlugin: removed the 'nsys' wrapper from the task's trainer command: nsys would be the process "
        "that receives the preemption signal, not the trainer",
    ]


def test_ft_turns_off_nsys_of_a_replaced_launcher(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    executor = slurm(tmp_path, launcher=run.Torchrun(nsys_profile=True, rdzv_port=29777))
    FaultTolerancePlugin().setup(run.Partial(pretrain, run_dir="/r"), executor)
    assert isinstance(executor.launcher, run.FaultTolerance)
    assert (executor.launcher.nsys_profile, executor.launcher.rdzv_port) == (False, 29777)
    assert any(r.levelno == logging.WARNING and "turned off nsys profiling" in r.getMessage() for r in caplog.records)


def test_local_executor(tmp_path, caplog):
    """LocalExecutor: ft_launcher locally with the FT YAML under NEMORUN_HOME; no scheduler signal."""
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    caplog.set_level(logging.INFO, LOGGER)
    home = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "home"))
    try:
        task = run.Partial(pretrain, run_dir="/runs/gpt")
        executor = local(tmp_path, ntasks_per_node=2)
        FaultTolerancePlugin(step_timeout=77).setup(task, executor)
        PreemptionPlugin().setup(task, executor)
    finally:
        set_nemorun_home(home)
    path = executor.env_vars["PET_FT_CFG_PATH"]
    assert os.path.dirname(path) == str(tmp_path / "home" / "ft_configs")
    with open(path) as f:
        assert "    step: 77.0\n" in f.read()
    # no job-level retries without a scheduler: executor.retries is left as it was
    assert isinstance(executor.launcher, run.FaultTolerance) and executor.retries == 0
    assert fdl.build(task.train).exit_signal_handler is True
    assert ("PreemptionPlugin: LocalExecutor has no scheduler signal before a time limit: none is configured; the "
            "trainer saves a checkpoint and exits 0 when it receives SIGTERM (e.g. when the platform stops the job)"
            ) in messages(caplog)


def test_ft_yaml_is_loaded_by_nvidia_resiliency_ext(tmp_path):
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig as NvrxConfig

    from megatron_resilience.plugins import ft_config

    for mode in ("sections", "heartbeats"):
        plugin = FaultTolerancePlugin(checkpointing_timeout=None, rank_termination_signal="SIGTERM", log_level="DEBUG")
        path = tmp_path / f"{mode}.yml"
        path.write_text(ft_config.render_yaml(ft_config.ft_settings(plugin, mode)))
        cfg = NvrxConfig.from_yaml_file(str(path))
        cfg._fix_rank_termination_signal_type()
        cfg._fix_log_level_type()
        if mode == "sections":
            assert cfg.rank_section_timeouts == {"setup": 600.0, "step": 180.0, "checkpointing": None}
            assert (cfg.initial_rank_heartbeat_timeout, cfg.rank_heartbeat_timeout) == (None, None)
        else:
            assert (cfg.rank_section_timeouts, cfg.rank_out_of_section_timeout) == ({}, None)
            assert (cfg.initial_rank_heartbeat_timeout, cfg.rank_heartbeat_timeout) == (1800.0, 300.0)
        assert (cfg.rank_termination_signal.name, cfg.log_level) == ("SIGTERM", logging.DEBUG)


@pytest.mark.parametrize("version, env, cli_fields", [
    # (every release: the job's own port block, MEGATRON_RESILIENCE_JOB_PORT)
    ("0.4.1", ["PET_FT_CFG_PATH", "MEGATRON_RESILIENCE_JOB_PORT"], 5.0),
    ("0.7", ["PET_FT_CFG_PATH", "MEGATRON_RESILIENCE_JOB_PORT"], 5.0),  # 0.7: no-restart code to the job-level config
])
def test_rendering_follows_nvrx_version(tmp_path, version, env, cli_fields):
    from megatron_resilience import upstream

    executor = slurm(tmp_path)
    FaultTolerancePlugin(nvrx_version=version).setup(run.Partial(pretrain, run_dir="/r"), executor)
    assert list(executor.env_vars) == env
    assert executor.launcher.workload_check_interval == cli_fields
    assert executor.launcher.max_restarts == 3
    parsed = upstream.parse_version(version)
    assert upstream.unaccepted_ft_launcher_flags(["--ft-log_level", "INFO"], parsed) == (
        ["--ft-log_level"] if parsed < (0, 4) else [])
    assert upstream.unaccepted_ft_launcher_flags(["--ignore-missing-fault-tol-cfg"], parsed) == (
        ["--ignore-missing-fault-tol-cfg"] if parsed >= (0, 5) else [])
