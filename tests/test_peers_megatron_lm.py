"""Megatron-LM's own argument parser judges the command lines our plugins render for its ``pretrain_gpt.py``.

The parser is ``megatron/training/arguments.py`` as megatron-core 0.19.2's wheel ships it (the newest lane,
``scripts/newest/install.sh``), in a subprocess (``tests/peers.py``). Each task goes through the plugins as a
user's would (trainer detected from its flags, no converter given); the parsed namespace must carry exactly
the settings the plugins asked for, and a user's own flags are not repeated.
"""

from __future__ import annotations

import peers
import pytest
from golden_cases import megatron_lm_own_flags_task, megatron_lm_task

from megatron_resilience.config import ConfigError
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402


def configured(task, *plugins):
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    for plugin in plugins:
        plugin.setup(task, executor)
    return [str(a) for a in task.args]


CASES = {
    "defaults": (megatron_lm_task, lambda: [FaultTolerancePlugin(), PreemptionPlugin()]),
    "sigint_dataloader_no_timeouts": (megatron_lm_task, lambda: [
        FaultTolerancePlugin(calc_ft_timeouts=False),
        PreemptionPlugin(signal="SIGINT", enable_exit_handler_for_data_loader=True)]),
    "own_flags": (megatron_lm_own_flags_task, lambda: [FaultTolerancePlugin(), PreemptionPlugin()]),
}
EXPECTED = {  # what Megatron-LM's parser makes of the rendered command line
    "defaults": dict(enable_ft_package=True, calc_ft_timeouts=True, exit_signal_handler=True, exit_signal=15,
                     exit_signal_handler_for_dataloader=False),
    "sigint_dataloader_no_timeouts": dict(enable_ft_package=True, calc_ft_timeouts=False, exit_signal_handler=True,
                                          exit_signal=2, exit_signal_handler_for_dataloader=True),
    "own_flags": dict(enable_ft_package=True, calc_ft_timeouts=True, exit_signal_handler=True, exit_signal=15,
                      exit_signal_handler_for_dataloader=False),
}


@pytest.fixture(scope="module")
def parsed():
    argvs = {name: configured(task(), *plugins()) for name, (task, plugins) in CASES.items()}
    return argvs, dict(zip(argvs, peers.megatron_lm_parse(list(argvs.values()))))


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_lm_parses_what_the_plugins_render(parsed, case):
    argvs, results = parsed
    result = results[case]
    assert "error" not in result and result["unknown"] == [], (argvs[case], result)
    assert {k: result[k] for k in EXPECTED[case]} == EXPECTED[case]
    assert (result["train_iters"], result["save"], result["micro_batch_size"]) == (1000, "/lustre/runs/gpt/ckpt", 4)


def test_a_users_own_flags_are_not_repeated(parsed):
    argv = parsed[0]["own_flags"]
    for flag in ("--enable-ft-package", "--exit-signal-handler", "--calc-ft-timeouts"):
        assert argv.count(flag) == 1, argv
    assert argv[-3:] == ["--enable-ft-package", "--exit-signal-handler", "--calc-ft-timeouts"]


def test_a_users_other_exit_signal_is_a_conflict():
    task = megatron_lm_task()
    task.args = [*task.args, "--exit-signal", "SIGUSR1"]
    with pytest.raises(ConfigError, match=r"^conflicting settings: the task's arguments give --exit-signal SIGUSR1, "
                                          r"but PreemptionPlugin needs --exit-signal SIGINT"):
        configured(task, PreemptionPlugin(signal="SIGINT"))


def test_a_users_exit_signal_must_be_the_one_slurm_sends():
    task = megatron_lm_task()
    task.args = [*task.args, "--exit-signal", "SIGUSR1"]  # Megatron-LM would wait for SIGUSR1; Slurm sends SIGTERM
    with pytest.raises(ConfigError, match=r"^conflicting settings: the task's arguments give --exit-signal SIGUSR1, "
                                          r"but PreemptionPlugin needs --exit-signal SIGTERM"):
        configured(task, PreemptionPlugin())
    task = megatron_lm_task()
    task.args = [*task.args, "--exit-signal", "SIGTERM"]
    assert configured(task, PreemptionPlugin())[-3:] == ["--exit-signal", "SIGTERM", "--exit-signal-handler"]
