"""Issue 22: which trainer a migrating user's task runs, and the exact settings it receives; Slurm signal spellings.

The launch shapes are the ones ``tests/golden_cases.py`` freezes as sbatch files; here the task itself is
checked after the plugins ran: the arguments a script receives, in order, or the config values of a Partial.
"""

from __future__ import annotations

import logging

import peer_standins as ps
import pytest
from golden_cases import (
    bridge_config_file_task,
    bridge_old_pretrain_gpt_task,
    bridge_run_recipe_task,
    bridge_task,
    megatron_lm_own_flags_task,
    megatron_lm_task,
)

from megatron_resilience.config import ConfigError
from megatron_resilience.config.slurm_signal import parse_slurm_signal, same_slurm_signal
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402
from megatron_resilience.tasks.trainer_detect import detect_script_trainer, script_run_facts  # noqa: E402

LOGGER = "megatron_resilience.plugins"
BRIDGE_FT = ["++ft._target_=megatron.bridge.training.config.FaultToleranceConfig", "++ft.enable_ft_package=true",
             "++ft.calc_ft_timeouts=true"]
BRIDGE_EXIT = ["train.exit_signal_handler=True", "train.exit_signal_handler_for_dataloader=False"]


def slurm(**kw):
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"), **kw)
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    return executor


def configured(task, plugins=None, executor=None):
    executor = executor or slurm()
    for plugin in plugins or [FaultTolerancePlugin(), PreemptionPlugin()]:
        plugin.setup(task, executor)
    return task, executor


def script(path, *args):
    return run.Script(path=path, entrypoint="python", args=list(args))


@pytest.mark.parametrize("task, expected", [
    # Bridge's launchers: their flags decide, whatever the script is called
    (bridge_config_file_task(), ("bridge", "Megatron-Bridge launcher flags (--config-file)")),
    (script("pretrain_llama3_8b.py", "--config_file=/c.yaml"),
     ("bridge", "Megatron-Bridge launcher flags (--config_file)")),
    (bridge_old_pretrain_gpt_task(), ("bridge", "Megatron-Bridge launcher flags (--recipe)")),
    (bridge_run_recipe_task(), ("bridge", "Megatron-Bridge launcher flags (--recipe)")),
    # Megatron-LM's flags; Hydra overrides; a checkout; the name last, only when nothing contradicts it
    (megatron_lm_task(), ("megatron_lm", "Megatron-LM command line (flags --tensor-model-parallel-size, "
                                         "--micro-batch-size, --train-iters)")),
    (bridge_task(), ("bridge", "Megatron-Bridge Hydra-style overrides (train.train_iters, checkpoint.save, "
                               "checkpoint.save_interval)")),
    (script("train.py", "+model.num_layers=4"),
     ("bridge", "Megatron-Bridge Hydra-style overrides (+model.num_layers)")),
    (script("train.py", "~ft.simulate_fault"),
     ("bridge", "Megatron-Bridge Hydra-style overrides (~ft.simulate_fault)")),
    (script("/src/Megatron-Bridge/tools/my_launch.py"),
     ("bridge", "a script of a Megatron-Bridge checkout (/src/Megatron-Bridge/tools/my_launch.py)")),
    (script("/src/Megatron-LM/pretrain_bert.py", "--foo"), ("megatron_lm", "a script of a Megatron-LM checkout "
                                                                         "(/src/Megatron-LM/pretrain_bert.py)")),
    (script("/w/pretrain_gpt.py", "--yaml-cfg", "/w/gpt.yaml"),
     ("megatron_lm", "Megatron-LM command line (flags --yaml-cfg)")),
    # Megatron-LM's own pretrain_gpt.py at the root of its repository: its flags identify it, not its name
    (script("/workspace/pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--train-iters", "10"),
     ("megatron_lm", "Megatron-LM command line (flags --num-layers, --hidden-size, --train-iters)")),
    # Bridge's layout, with no arguments or only its own --debug (its documented basic usage: the default config)
    (script("examples/recipes/llama/pretrain_llama3_8b.py"),
     ("bridge", "a launcher in Megatron-Bridge's layout (examples/recipes/: "
                "examples/recipes/llama/pretrain_llama3_8b.py)")),
    (script("/workspace/examples/recipes/llama/pretrain_llama3_8b.py", "--debug"),
     ("bridge", "a launcher in Megatron-Bridge's layout (examples/recipes/: "
                "/workspace/examples/recipes/llama/pretrain_llama3_8b.py)")),
    (script("/workspace/scripts/training/pretrain_gpt.py"),
     ("bridge", "a launcher in Megatron-Bridge's layout (scripts/training/: "
                "/workspace/scripts/training/pretrain_gpt.py)")),
    (script("scripts/performance/run_script.py", "-m", "llama", "-mr", "llama3_8b", "-ng", "8", "-ms", "50"),
     ("bridge", "a launcher in Megatron-Bridge's layout (scripts/performance/: scripts/performance/run_script.py)")),
    (script("pretrain_llama3_8b.py"), ("bridge", "the name of a Megatron-Bridge example recipe script "
                                                 "(pretrain_llama3_8b.py), no argument says otherwise")),
    (script("pretrain_qwen3_simple.py", "--debug"),
     ("bridge", "the name of a Megatron-Bridge example recipe script (pretrain_qwen3_simple.py), no argument says "
                "otherwise")),
    # nothing says which trainer: not recognised (a pretrain_*.py name alone decides nothing, it is both projects')
    (script("/w/pretrain_gpt.py"), None),
    (script("/w/pretrain_gpt.py", "--debug"), None),
    (script("/w/pretrain_gpt.py", "--my-flag", "1"), None),
    (script("pretrain_llama3_8b.py", "--my-flag", "1"), None),  # a flag Bridge's example scripts do not have
    (script("/w/scripts/training/train.py", "--lr", "0.1"), None),  # not one of Bridge's launchers
    (script("/w/pretrain_gpt.py", "config.yaml"), None),
    (script("/w/train.py", "--lr", "0.1"), None),
    (run.Script(inline="python train.py\n"), None),
])
def test_trainer_is_recognised_from_its_arguments(task, expected):
    assert detect_script_trainer(task) == expected


@pytest.mark.parametrize("kind, args, expected", [
    # Bridge's launchers hand everything but their own flags to Hydra
    ("bridge", ["--recipe", "r", "train.train_iters=1000", "checkpoint.save=/c", "checkpoint.load=/l"],
     ("/c", "/l", 1000)),
    ("bridge", ["++checkpoint.save=/c", "+train.train_iters=7"], ("/c", None, 7)),
    # Bridge's performance scripts have flags for them, applied after the overrides: a flag wins
    ("bridge", ["-m", "llama", "-mr", "llama3_8b", "-ms", "50", "--save_dir", "/s", "--load_dir", "/l"],
     ("/s", "/l", 50)),
    ("bridge", ["--max_steps=70", "train.train_iters=1000", "checkpoint.save=/c", "--save_dir", "/s"],
     ("/s", None, 70)),
    ("bridge", ["--config-file", "/c.yaml"], (None, None, None)),  # in the YAML: unknown here
    ("megatron_lm", megatron_lm_task().args, ("/lustre/runs/gpt/ckpt", "/lustre/runs/gpt/ckpt", 1000)),
])
def test_the_runs_checkpoint_dir_and_length_are_read_from_either_form(kind, args, expected):
    assert script_run_facts(kind, args) == expected


@pytest.mark.parametrize("factory, args", [
    (bridge_config_file_task, ["--config-file", "/lustre/conf/llama3_8b.yaml", *BRIDGE_FT, *BRIDGE_EXIT]),
    (bridge_run_recipe_task, ["--recipe", "llama32_1b_pretrain_config", "train.train_iters=1000",
                              "checkpoint.save=/lustre/runs/llama/ckpt", *BRIDGE_FT, *BRIDGE_EXIT]),
    (bridge_old_pretrain_gpt_task, ["--recipe", "llama3_8b_pretrain_config", *BRIDGE_FT, *BRIDGE_EXIT]),
    # Bridge's basic usage (no arguments: its default config file) and the old script without --recipe
    (lambda: script("examples/recipes/llama/pretrain_llama3_8b.py"), [*BRIDGE_FT, *BRIDGE_EXIT]),
    (lambda: script("/workspace/examples/recipes/llama/pretrain_llama3_8b.py", "--debug"),
     ["--debug", *BRIDGE_FT, *BRIDGE_EXIT]),
    (lambda: script("/workspace/scripts/training/pretrain_gpt.py"), [*BRIDGE_FT, *BRIDGE_EXIT]),
    (megatron_lm_own_flags_task, [*megatron_lm_task().args, "--enable-ft-package", "--exit-signal-handler",
                                  "--calc-ft-timeouts"]),
])
def test_each_launch_shape_receives_exactly_its_trainers_arguments(factory, args):
    task, _ = configured(factory())
    assert task.args == args


def test_bridge_launcher_gets_no_megatron_lm_flag_on_any_attempt(caplog):
    """The crash-loop of the issue: Bridge's --config-file launcher named pretrain_*.py got Megatron-LM flags,
    which its script hands to Hydra (OverridesError on every rank, restart and requeue)."""
    caplog.set_level(logging.INFO, LOGGER)
    task, _ = configured(bridge_config_file_task())
    assert not [a for a in task.args if a.startswith("--") and a != "--config-file"]
    assert ("FaultTolerancePlugin: task args += " + str(BRIDGE_FT) + " (megatron_bridge_args, detected: "
            "Megatron-Bridge launcher flags (--config-file))") in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("args", [[], ["--debug"], ["config.yaml"]])
def test_an_unknown_script_gets_no_arguments_and_one_warning_per_plugin(caplog, args):
    caplog.set_level(logging.INFO, LOGGER)
    task, _ = configured(script("/w/pretrain_gpt.py", *args))
    assert task.args == args
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("pass script_args_converter_fn" in w for w in warnings)


def test_an_unknown_partial_is_not_told_to_use_a_converter(caplog):
    def my_train(steps: int = 1) -> None:
        """A training function the plugins know nothing about."""

    caplog.set_level(logging.INFO, LOGGER)
    configured(run.Partial(my_train, steps=3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert not [w for w in warnings if "script_args_converter_fn" in w]
    assert all("Megatron-Bridge (config=ConfigContainer) and of NeMo 2.0 (a Lightning trainer=)" in w
               for w in warnings)


def test_a_converter_given_for_a_bridge_partial_is_not_used_and_says_so(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    with ps.installed():
        task = run.Partial(ps.bridge_pretrain, config=ps.bridge_container(), forward_step_func=ps.bridge_forward_step)
        configured(task, [FaultTolerancePlugin(script_args_converter_fn=lambda a: ["--x"])])
    assert any("is not used: run.Partial(megatron.bridge.training.pretrain.pretrain) is a run.Partial, whose "
               "settings the plugin sets in its config" in r.getMessage() for r in caplog.records)
    assert task.config.ft.enable_ft_package is True


def test_a_bridge_partial_whose_ft_is_set_keeps_its_other_fields():
    with ps.installed():
        container = ps.bridge_container()
        container.ft = ps.FaultToleranceConfig(simulate_fault=True, simulated_fault_rank=1)
        task = run.Partial(ps.bridge_pretrain, config=container, forward_step_func=ps.bridge_forward_step)
        configured(task, [FaultTolerancePlugin(calc_ft_timeouts=False)])
        import fiddle as fdl

        built = fdl.build(task).keywords["config"].ft
    assert built == ps.FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=False, simulate_fault=True,
                                            simulated_fault_rank=1)


# --- Slurm's --signal, compared by meaning ---------------------------------------------------------------------


@pytest.mark.parametrize("a, b, same", [
    ("TERM@60", "SIGTERM@60", True), ("15@60", "SIGTERM@60", True), ("sigterm@60", "SIGTERM@60", True),
    ("TERM", "SIGTERM@60", True),  # Slurm's default time is 60 s
    ("B:TERM@60", "SIGTERM@60", False), ("R:TERM@60", "SIGTERM@60", False), ("B:USR1@90", "B:SIGUSR1@90", True),
    ("TERM@90", "SIGTERM@60", False), ("USR1@60", "SIGTERM@60", False), ("2@60", "SIGINT@60", True),
])
def test_slurm_signal_spellings(a, b, same):
    assert same_slurm_signal(a, b) is same


@pytest.mark.parametrize("value, message", [
    ("TERM@soon", "executor.signal: must be a Slurm --signal value like 'SIGTERM@60'"),
    ("FOO@60", "executor.signal: unknown signal 'FOO'"),
    ("99@60", "executor.signal: signal number 99 is not a signal of this system"),
    ("", "executor.signal: must be a Slurm --signal value"),
])
def test_a_bad_signal_is_named(value, message):
    with pytest.raises(ConfigError, match="^" + message):
        parse_slurm_signal(value)


@pytest.mark.parametrize("user", ["TERM@60", "15@60", "SIGTERM@60"])
def test_the_peers_spelling_of_the_same_signal_is_accepted_as_written(user):
    _, executor = configured(megatron_lm_task(), [PreemptionPlugin()], executor=slurm(signal=user))
    assert executor.signal == user
    _, executor = configured(megatron_lm_task(), [PreemptionPlugin()],
                             executor=slurm(additional_parameters={"signal": user}))
    assert executor.signal == "SIGTERM@60"


@pytest.mark.parametrize("user", ["B:TERM@60", "TERM@120", "USR1@60"])
def test_a_different_signal_request_is_a_conflict(user):
    with pytest.raises(ConfigError, match=rf"^conflicting settings: executor.signal='{user}' but PreemptionPlugin "
                                          r"needs 'SIGTERM@60'"):
        configured(megatron_lm_task(), [PreemptionPlugin()], executor=slurm(signal=user))
