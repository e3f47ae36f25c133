"""Megatron-Bridge users' launches, judged by Megatron-Bridge's own code (megatron-bridge 0.6.2's wheel).

* The Hydra overrides our plugins append to a Bridge script are applied by Bridge's own parser
  (``training/utils/omegaconf_utils.process_config_with_overrides``) to a recipe's ``ConfigContainer``
  with ``ft`` None (every recipe) and with ``ft`` set; Bridge's own default overrides fail on the first.
* Bridge's ``run.Partial(pretrain, config=ConfigContainer(...))`` is configured as Bridge's plugin did.
  ``ConfigContainer`` cannot import here (Transformer Engine, Python 3.12: ``tests/peer_standins.py``); the
  stand-ins' fields and defaults are checked against the wheel's sources.
"""

from __future__ import annotations

import os

import fiddle as fdl
import peer_standins as ps
import peers
import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402

# --- Bridge's real plugins and ours, on the same real NeMo-Run objects -------------------------------------------

DOC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "migration.md")


def _slurm_job() -> tuple:
    """A Bridge recipe script and a Slurm executor assigned to a job (as ``run.run`` does before plugins run)."""
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    return run.Script(path="/opt/Megatron-Bridge/scripts/training/run_recipe.py", entrypoint="python"), executor


def test_bridges_plugins_and_ours_on_a_bridge_script_differ_only_where_the_migration_guide_says():
    """Bridge's plugins from its wheel (not a copy) set up one job, ours another: the signal is the same request
    written as Slurm's own name, and Bridge's FT overrides, which its parser rejects on a recipe whose ``ft`` is
    None (below), become ones that build a FaultToleranceConfig."""
    with peers.bridge_modules("megatron.bridge.recipes.run_plugins") as modules:
        bridge = modules["megatron.bridge.recipes.run_plugins"]
        got = {}
        for name, preemption, ft in (("bridge", bridge.PreemptionPlugin(), bridge.FaultTolerancePlugin()),
                                     ("ours", PreemptionPlugin(), FaultTolerancePlugin())):
            task, executor = _slurm_job()
            preemption.setup(task, executor)
            ft.setup(task, executor)
            got[name] = (executor.signal, [a for a in task.args if "ft." in a])
    assert got["bridge"] == ("TERM@60", ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]), got
    assert got["ours"] == ("SIGTERM@60", ["++ft._target_=megatron.bridge.training.config.FaultToleranceConfig",
                                          "++ft.enable_ft_package=true", "++ft.calc_ft_timeouts=true"]), got
    text = open(DOC, encoding="utf-8").read()
    for phrase in ("`SIGTERM@60` (Bridge writes `TERM@60`)", "`++ft.enable_ft_package=true`"):
        assert phrase in text, f"docs/migration.md does not mention {phrase!r}"


# --- the Hydra overrides we render, through Bridge's own parser --------------------------------------------------

_HYDRA_PROBE = r"""
import dataclasses, importlib, json, sys, types, typing, typing_extensions
typing.override = typing_extensions.override  # megatron.training (Megatron-Core 0.19) needs Python 3.12's
sys.path.insert(0, sys.argv[1])
import peers, peer_standins as ps
with ps.installed(), peers.bridge_modules("megatron.bridge.training.utils.omegaconf_utils") as m:
    utils = m["megatron.bridge.training.utils.omegaconf_utils"]
    out = []
    for case in json.load(sys.stdin):
        config = ps.bridge_container()
        if case["ft"] is not None:
            config.ft = ps.FaultToleranceConfig(**case["ft"])
        try:
            utils.process_config_with_overrides(config, cli_overrides=case["overrides"])
        except Exception as err:
            out.append({"error": f"{type(err).__name__}: {err}"})
            continue
        ft = config.ft
        out.append({"ft_type": type(ft).__name__, "ft": dataclasses.asdict(ft) if dataclasses.is_dataclass(ft) else ft,
                    "train": {k: getattr(config.train, k) for k in ("exit_signal_handler",
                              "exit_signal_handler_for_dataloader", "train_iters")},
                    "exit_signal": int(config.train.exit_signal)})
print("HYDRA " + json.dumps(out))
"""


def _hydra(cases: list[dict]) -> list[dict]:
    return peers.bridge_hydra(_HYDRA_PROBE, cases)


def _rendered_overrides(**preemption) -> list[str]:
    from golden_cases import bridge_config_file_task

    task = bridge_config_file_task()
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    for plugin in (FaultTolerancePlugin(calc_ft_timeouts=False), PreemptionPlugin(**preemption)):
        plugin.setup(task, executor)
    return task.args[2:]  # after --config-file X: what Bridge's script hands to Hydra


def test_our_overrides_parse_with_bridges_parser_and_build_a_fault_tolerance_config():
    ours_sigterm, ours_sigint = _rendered_overrides(), _rendered_overrides(signal="SIGINT",
                                                                          enable_exit_handler_for_data_loader=True)
    bridge_default = ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true", "train.exit_signal_handler=True",
                      "train.exit_signal_handler_for_dataloader=False"]
    recipe_ft = {"enable_ft_package": False, "calc_ft_timeouts": True, "simulated_fault_rank": 3}
    got = _hydra([{"overrides": ours_sigterm, "ft": None}, {"overrides": ours_sigint, "ft": recipe_ft},
                  {"overrides": bridge_default, "ft": None}, {"overrides": bridge_default, "ft": recipe_ft}])
    default_ft = {"enable_ft_package": True, "calc_ft_timeouts": False, "simulate_fault": False,
                  "simulated_fault_type": "random", "simulated_fault_rank": None, "simulated_fault_base_delay": 0}
    assert got[0] == {"ft_type": "FaultToleranceConfig", "ft": default_ft, "exit_signal": 15,
                      "train": {"exit_signal_handler": True, "exit_signal_handler_for_dataloader": False,
                                "train_iters": 1000}}
    assert got[1] == {"ft_type": "FaultToleranceConfig", "ft": {**default_ft, "simulated_fault_rank": 3},
                      "exit_signal": 2, "train": {"exit_signal_handler": True,
                                                  "exit_signal_handler_for_dataloader": True, "train_iters": 1000}}
    # Bridge's own default converter: an OverridesError on a recipe (ft None); fine once ft exists
    assert got[2]["error"].startswith("OverridesError: Failed to parse Hydra overrides: Could not override "
                                      "'ft.enable_ft_package'"), got[2]
    assert got[3]["ft"]["enable_ft_package"] is True


# --- the stand-ins against the wheel's sources, and Bridge Partials ------------------------------------------------


def test_bridge_standins_have_the_wheels_fields_and_defaults():
    import dataclasses

    peers.ensure()
    bridge_config = peers.BRIDGE / "megatron" / "bridge" / "training" / "config.py"
    mcore_config = peers.ensure_newest() / "megatron" / "training" / "config" / "training_config.py"
    wheel_ft = peers.class_fields(bridge_config, "FaultToleranceConfig")
    assert {f.name: f.default for f in dataclasses.fields(ps.FaultToleranceConfig)} == wheel_ft
    container = peers.class_fields(bridge_config, "ConfigContainer")
    assert (container["ft"], container["train"], container["checkpoint"]) == (None, "<required>", "<required>")
    for standin, name in ((ps.TrainingConfig, "TrainingConfig"), (ps.CheckpointConfig, "CheckpointConfig")):
        real = {**peers.class_fields(mcore_config, name), **peers.class_fields(bridge_config, name)}
        for field in dataclasses.fields(standin):
            default = field.default if not isinstance(field.default, type(ps.signal.SIGTERM)) else "signal.SIGTERM"
            assert real[field.name] == default, (name, field.name, real[field.name])
    pretrain = peers.init_parameters(peers.BRIDGE / "megatron/bridge/training/pretrain.py", None, "pretrain")
    assert list(pretrain)[:2] == ["config", "forward_step_func"]


@pytest.mark.parametrize("as_config", [False, True])
def test_bridge_partial_is_configured_as_bridges_plugin_did(as_config, caplog):
    import logging

    caplog.set_level(logging.INFO, "megatron_resilience.plugins")
    with ps.installed():
        task = ps.bridge_partial(as_config=as_config)
        executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"),
                                     signal="15@60")
        executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
        for plugin in (FaultTolerancePlugin(), PreemptionPlugin(enable_exit_handler_for_data_loader=True)):
            plugin.setup(task, executor)
        built = fdl.build(task).keywords["config"]
    assert built.ft == ps.FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=True)
    assert (built.train.exit_signal_handler, built.train.exit_signal_handler_for_dataloader) == (True, True)
    assert executor.signal == "15@60"  # NeMo's spelling of the same request: kept as the user wrote it
    logged = [r.getMessage() for r in caplog.records]
    assert "FaultTolerancePlugin: task config.ft: None -> FaultToleranceConfig() (Megatron-Bridge's defaults; " \
           "the fields below are set on it)" in logged
    assert "PreemptionPlugin: task config.train.exit_signal_handler: False -> True (enable_exit_handler)" in logged
    assert not [m for m in logged if "script_args_converter_fn" in m]
