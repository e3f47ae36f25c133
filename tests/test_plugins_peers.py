"""What a Megatron-Bridge or NeMo 2.0 user expects of these plugins, from those projects' documentation.

Megatron-Bridge documents ``FaultTolerancePlugin`` / ``PreemptionPlugin`` on ``run.Script`` tasks: the
same field names and defaults (FT: enable_ft_package, calc_ft_timeouts, 3 in-job restarts, 2 job
retries, 1800 s / 300 s heartbeat timeouts; preemption: 60 s, exit handler on, data-loader handler
off), SIGTERM from Slurm ``preempt_time`` seconds before the limit, Hydra-style overrides appended to
the script's arguments, ft_launcher as the launcher, a ``script_args_converter_fn`` receiving
``PreemptionPluginScriptArgs`` / ``FaultTolerancePluginScriptArgs`` for scripts with other flags, and
``enable_exit_handler=False`` leaving the task alone. NeMo 2.0 documents the same FT fields and defaults.
Where ours deliberately differ (job retries are counted as attempts on Slurm; section timeouts by
default), docs/migration.md's table says why, and the tests below pin the difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import sys

import pytest
from golden_cases import bridge_task, megatron_lm_task

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import FaultToleranceConfig, RerunConfig, StragglerConfig  # noqa: E402
from megatron_resilience.config.overrides import config_from_overrides, config_to_overrides  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import (  # noqa: E402
    FaultTolerancePlugin,
    FaultTolerancePluginScriptArgs,
    PreemptionPlugin,
    PreemptionPluginScriptArgs,
    megatron_lm_args,
    preview,
)

LOGGER = "megatron_resilience.plugins"


def other_trainer(steps: int = 1) -> None:
    """A training function the plugins know nothing about."""


def slurm(tmp_path, **kw):
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"), **kw)
    executor.assign("job_1", str(tmp_path / "job_1"), task_id="job", task_dir="job")
    return executor


def setup(plugins, task, executor):
    for plugin in plugins:
        plugin.setup(task, executor)
    return task, executor


def test_field_names_and_defaults_are_bridges_and_nemos():
    ft, pre = FaultTolerancePlugin(), PreemptionPlugin()
    assert (ft.enable_ft_package, ft.calc_ft_timeouts, ft.num_job_retries_on_failure,
            ft.initial_rank_heartbeat_timeout, ft.rank_heartbeat_timeout, ft.script_args_converter_fn) == (
        True, True, 2, 1800, 300, None)
    # num_in_job_restarts: theirs is 3; ours is None, chosen by release (3 where ft_launcher cannot track progress,
    # tests/test_plugins_golden.py), and an explicit 3 from their code is used as given
    assert ft.num_in_job_restarts is None and FaultTolerancePlugin(num_in_job_restarts=3).num_in_job_restarts == 3
    assert (pre.preempt_time, pre.enable_exit_handler, pre.enable_exit_handler_for_data_loader,
            pre.script_args_converter_fn) == (60, True, False, None)
    # Bridge users construct and read the ScriptArgs by these names (ours add fields only after them, with defaults)
    assert [f.name for f in dataclasses.fields(PreemptionPluginScriptArgs)][:2] == [
        "enable_exit_handler", "enable_exit_handler_for_data_loader"]
    assert [f.name for f in dataclasses.fields(FaultTolerancePluginScriptArgs)] == [
        "enable_ft_package", "calc_ft_timeouts"]
    assert PreemptionPluginScriptArgs(True, False) == PreemptionPluginScriptArgs(
        enable_exit_handler=True, enable_exit_handler_for_data_loader=False, exit_signal="SIGTERM")


def test_bridge_script_gets_bridges_overrides_the_launcher_and_the_signal(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task, executor = setup([FaultTolerancePlugin(), PreemptionPlugin()], bridge_task(), slurm(tmp_path))
    # FT in the form Bridge's own Hydra parser accepts on a recipe whose ConfigContainer.ft is None (every recipe):
    # Bridge's own "ft.enable_ft_package=true" raises OverridesError there (tests/test_peers_bridge.py).
    assert task.args == ["train.train_iters=1000", "checkpoint.save=/lustre/runs/llama/ckpt",
                         "checkpoint.save_interval=100",
                         "++ft._target_=megatron.bridge.training.config.FaultToleranceConfig",
                         "++ft.enable_ft_package=true", "++ft.calc_ft_timeouts=true",
                         "train.exit_signal_handler=True", "train.exit_signal_handler_for_dataloader=False"]
    assert isinstance(executor.launcher, run.FaultTolerance) and executor.launcher.max_restarts == 3
    assert executor.signal == "SIGTERM@60"  # Bridge writes TERM@60: the same request (see test_signal_spellings...)
    # Deliberate difference: on Slurm nemo_run's FT script counts attempts, so N retries need retries = N + 1.
    assert executor.retries == 3
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert ("FaultTolerancePlugin: task args += ['++ft._target_=megatron.bridge.training.config.FaultToleranceConfig', "
            "'++ft.enable_ft_package=true', '++ft.calc_ft_timeouts=true'] "
            "(megatron_bridge_args, detected: Megatron-Bridge Hydra-style overrides (train.train_iters, "
            "checkpoint.save, checkpoint.save_interval))") in logged


def test_bridge_overrides_are_accepted_by_our_trainer_under_one_canonical_name():
    config = config_from_overrides([
        "run_dir=/r", "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true", "train.exit_signal_handler=True",
        "train.exit_signal_handler_for_dataloader=False", "train.train_iters=7", "nvrx_straggler.enabled=true",
        "nvrx_straggler.report_time_interval=60", "rerun_state_machine.rerun_mode=report_determinism_stats"])
    assert config.ft == FaultToleranceConfig(enabled=True, calc_ft_timeouts=True)
    assert (config.train.max_steps, config.train.exit_signal_handler) == (7, True)
    assert config.straggler == StragglerConfig(enabled=True, report_time_interval=60.0)
    assert config.rerun == RerunConfig(rerun_mode="report_stats")
    written = config_to_overrides(config)
    assert "ft.enabled=true" in written and "train.max_steps=7" in written
    assert not [w for w in written if w.split("=")[0] in ("ft.enable_ft_package", "train.train_iters")
                or w.startswith(("nvrx_straggler.", "rerun_state_machine."))]


def test_cli_dry_run_writes_the_canonical_name(tmp_path):
    from nemo_run.cli.api import create_cli

    argv = ["nemo", "megatron_resilience", "pretrain", "--factory", f"gpt_tiny(dir={tmp_path})", "--dryrun",
            "ft.enable_ft_package=false", "train.train_iters=12"]
    saved, sys.argv = sys.argv, argv
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = create_cli()(args=argv[1:], standalone_mode=False)
    finally:
        sys.argv = saved
    lines = out.getvalue().splitlines()
    assert (code or 0) == 0
    assert "ft.enabled=false" in lines and "train.max_steps=12" in lines
    assert not [line for line in lines if line.startswith(("ft.enable_ft_package", "train.train_iters"))]


def test_user_converter_receives_bridges_script_args(tmp_path):
    """The converter shape of Bridge's documentation: a function of the ScriptArgs returning argparse flags."""
    seen = []

    def argparse_preemption_converter(args: PreemptionPluginScriptArgs) -> list[str]:
        seen.append(args)
        return ["--enable-exit-handler"] + (["--enable-exit-handler-dataloader"]
                                            if args.enable_exit_handler_for_data_loader else [])

    def argparse_ft_converter(args: FaultTolerancePluginScriptArgs) -> list[str]:
        seen.append(args)
        return ["--ft"] if args.enable_ft_package else []

    task = run.Script(path="train.py", entrypoint="python", args=["--lr", "0.1"])
    setup([PreemptionPlugin(enable_exit_handler_for_data_loader=True,
                            script_args_converter_fn=argparse_preemption_converter),
           FaultTolerancePlugin(script_args_converter_fn=argparse_ft_converter)], task, slurm(tmp_path))
    assert task.args == ["--lr", "0.1", "--enable-exit-handler", "--enable-exit-handler-dataloader", "--ft"]
    assert seen == [PreemptionPluginScriptArgs(enable_exit_handler=True, enable_exit_handler_for_data_loader=True),
                    FaultTolerancePluginScriptArgs(enable_ft_package=True, calc_ft_timeouts=True)]


def test_megatron_lm_script_gets_its_own_flags(tmp_path):
    task, _ = setup([FaultTolerancePlugin(calc_ft_timeouts=False), PreemptionPlugin(signal="SIGINT")],
                    megatron_lm_task(), slurm(tmp_path))
    assert task.args[-4:] == ["--enable-ft-package", "--exit-signal-handler", "--exit-signal", "SIGINT"]
    assert "--calc-ft-timeouts" not in task.args  # a store_true flag: off is its absence


def test_megatron_lm_flag_names_are_megatron_lms():
    """The names as Megatron-LM's argument definitions spell them (megatron/training/arguments.py: the
    ft_package group; the training group built from its TrainingConfig dataclass: exit_signal_handler,
    exit_signal, exit_signal_handler_for_dataloader -> --exit-signal-handler, --exit-signal, ...)."""
    assert megatron_lm_args(FaultTolerancePluginScriptArgs(True, True)) == ["--enable-ft-package",
                                                                            "--calc-ft-timeouts"]
    assert megatron_lm_args(PreemptionPluginScriptArgs(True, True, "SIGINT")) == [
        "--exit-signal-handler", "--exit-signal-handler-for-dataloader", "--exit-signal", "SIGINT"]


@pytest.mark.parametrize("task_factory", [
    bridge_task,
    lambda: run.Partial(pretrain, run_dir="/runs/gpt"),
    lambda: run.Script(inline="python -m megatron_resilience run_dir=/r train.max_steps=3\n"),
])
def test_enable_exit_handler_false_leaves_the_task_alone(task_factory, tmp_path):
    task = task_factory()
    before = repr(task)
    _, executor = setup([PreemptionPlugin(enable_exit_handler=False)], task, slurm(tmp_path, launcher="torchrun"))
    assert repr(task) == before
    assert executor.signal == "SIGTERM@60"  # the executor is still set up: the signal reaches the trainer's own handler


@pytest.mark.parametrize("task", [run.Script(path="train.sh"), run.Script(inline="cd /w\nexec python my_train.py\n"),
                                  run.Partial(other_trainer, steps=5)])
def test_unknown_trainer_executor_still_set_up_with_one_warning(task, tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    before = repr(task)
    _, executor = setup([FaultTolerancePlugin(), PreemptionPlugin()], task, slurm(tmp_path))
    assert repr(task) == before
    assert isinstance(executor.launcher, run.FaultTolerance) and executor.signal == "SIGTERM@60"
    assert executor.retries == 3 and "PET_FT_CFG_PATH" in executor.env_vars
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per plugin
    assert warnings[0].startswith("FaultTolerancePlugin: ") and "must itself talk to ft_launcher's rank monitor" in \
        warnings[0]
    assert "must itself save a checkpoint and exit 0 when it receives SIGTERM" in warnings[1]


def test_our_trainer_ignores_a_converter_with_a_log_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Script(path="megatron_resilience", m=True, entrypoint="python", args=["run_dir=/r"])
    setup([FaultTolerancePlugin(script_args_converter_fn=megatron_lm_args)], task, slurm(tmp_path))
    assert task.args == ["run_dir=/r", "ft.enabled=true", "ft.calc_ft_timeouts=true"]
    assert any("script_args_converter_fn=megatron_lm_args is not used" in r.getMessage() for r in caplog.records)


def test_converter_must_return_strings(tmp_path):
    from megatron_resilience.config import ConfigError

    plugin = FaultTolerancePlugin(script_args_converter_fn=lambda args: ["--ft", 1])
    with pytest.raises(ConfigError, match=r"^FaultTolerancePlugin.script_args_converter_fn: must return a list of "
                                          r"strings, got \['--ft', 1\]$"):
        plugin.setup(run.Script(path="train.py", entrypoint="python"), slurm(tmp_path))


def test_preview_of_a_megatron_lm_job_carries_its_flags():
    script = preview(megatron_lm_task(), run.SlurmExecutor(account="a", time="01:00:00"),
                     [FaultTolerancePlugin(), PreemptionPlugin()], name="gpt")
    assert "pretrain_gpt.py --tensor-model-parallel-size 2" in script
    assert script.rstrip().endswith("fi")
    assert "--enable-ft-package --calc-ft-timeouts --exit-signal-handler\n" in script
