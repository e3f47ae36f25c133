"""``FaultTolerancePlugin(inprocess_restart=True, local_checkpoint_dir=..., replication_factor=...)`` on a
Megatron-LM or Megatron-Bridge task, judged by those projects' own code.

* Megatron-LM's argument parser (megatron-core 0.19.2's ``megatron/training/arguments.py``, the newest lane)
  parses the flags the plugin appends into ``inprocess_restart``, ``non_persistent_ckpt_type='local'``, ...;
* Megatron-Bridge's Hydra parser (megatron-bridge 0.6.2's ``process_config_with_overrides``) applies the
  overrides the plugin appends to a recipe's ``ConfigContainer`` whose ``inprocess_restart`` is None (every
  recipe): ``++inprocess_restart._target_=...InProcessRestartConfig`` builds the section, as ``++ft._target_``
  does for FT; the plain ``inprocess_restart.enabled=true`` that a Bridge user might write fails there;
* a Bridge ``run.Partial(pretrain, config=ConfigContainer(...))`` gets the same fields set on its config.

The stand-ins (``tests/peer_standins.py``) are checked against the wheel's sources here
(``InProcessRestartConfig``, ``ConfigContainer.inprocess_restart``) and in tests/test_peers_bridge.py
(``CheckpointConfig``).
"""

from __future__ import annotations

import dataclasses

import fiddle as fdl
import peer_standins as ps
import peers
import pytest
from golden_cases import bridge_config_file_task, megatron_lm_task

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin  # noqa: E402

PLUGIN = dict(inprocess_restart=True, local_checkpoint_dir="/local/ckpt", local_checkpoint_interval=10,
              replication_factor=2)


def slurm(nodes=2):
    executor = run.SlurmExecutor(account="acct", time="01:00:00", nodes=nodes, ntasks_per_node=8,
                                 tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    return executor


def test_megatron_lm_parses_the_in_process_and_local_checkpoint_flags():
    full, only_restart = megatron_lm_task(), megatron_lm_task()
    # Megatron-LM's in-process restart runs only without its FT package, on a megatron-core before 0.18
    # (plugins/megatron_lm_flags.py check_inprocess_restart)
    lm = dict(enable_ft_package=False, megatron_core_version="0.17.0")
    FaultTolerancePlugin(**PLUGIN, **lm).setup(full, slurm())
    FaultTolerancePlugin(inprocess_restart=True, **lm).setup(only_restart, slurm())
    fields = ("inprocess_restart", "non_persistent_ckpt_type", "non_persistent_local_ckpt_dir",
              "non_persistent_save_interval", "replication", "replication_jump", "replication_factor")
    got = peers.megatron_lm_parse([[str(a) for a in full.args], [str(a) for a in only_restart.args]], fields)
    for result in got:
        assert "error" not in result and result["unknown"] == [], result
    assert {k: got[0][k] for k in fields} == dict(
        inprocess_restart=True, non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir="/local/ckpt",
        non_persistent_save_interval=10, replication=True, replication_jump=8, replication_factor=2)
    assert (got[1]["inprocess_restart"], got[1]["non_persistent_ckpt_type"], got[1]["replication"]) == (
        True, None, False)
    assert (got[0]["enable_ft_package"], got[0]["train_iters"]) == (False, 1000)


_HYDRA_PROBE = r"""
import dataclasses, json, sys, typing, typing_extensions
typing.override = typing_extensions.override  # megatron.training (Megatron-Core 0.19) needs Python 3.12's
sys.path.insert(0, sys.argv[1])
import peers, peer_standins as ps
FIELDS = ("non_persistent_ckpt_type", "non_persistent_local_ckpt_dir", "non_persistent_save_interval", "replication",
          "replication_jump", "replication_factor")
with ps.installed(), peers.bridge_modules("megatron.bridge.training.utils.omegaconf_utils") as m:
    utils = m["megatron.bridge.training.utils.omegaconf_utils"]
    out = []
    for overrides in json.load(sys.stdin):
        config = ps.bridge_container()
        try:
            utils.process_config_with_overrides(config, cli_overrides=overrides)
        except Exception as err:
            out.append({"error": f"{type(err).__name__}: {err}"})
            continue
        section = config.inprocess_restart
        out.append({"type": type(section).__name__,
                    "inprocess_restart": dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section,
                    "checkpoint": {k: getattr(config.checkpoint, k) for k in FIELDS}})
print("HYDRA " + json.dumps(out))
"""


def _hydra(cases: list[list[str]]) -> list[dict]:
    return peers.bridge_hydra(_HYDRA_PROBE, cases)


def test_bridges_parser_builds_its_in_process_restart_config_from_our_overrides():
    task = bridge_config_file_task()
    FaultTolerancePlugin(**PLUGIN).setup(task, slurm())
    ours = [a for a in task.args[2:] if not a.startswith("++ft.")]  # after --config-file X; FT's own is proven
    plain = ["inprocess_restart.enabled=true"]  # what a Bridge user might write by hand
    got = _hydra([ours, plain])
    assert got[0]["type"] == "InProcessRestartConfig", got[0]
    assert got[0]["inprocess_restart"] == {**dataclasses.asdict(ps.InProcessRestartConfig()), "enabled": True}
    assert got[0]["checkpoint"] == dict(
        non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir="/local/ckpt", non_persistent_save_interval=10,
        replication=True, replication_jump=8, replication_factor=2)
    assert got[1]["error"].startswith("OverridesError"), got[1]


def test_the_standins_have_the_wheels_in_process_fields_and_defaults():
    peers.ensure()
    bridge_config = peers.BRIDGE / "megatron" / "bridge" / "training" / "config.py"
    wheel = peers.class_fields(bridge_config, "InProcessRestartConfig")
    ours = {f.name: f.default for f in dataclasses.fields(ps.InProcessRestartConfig)}
    assert {k: wheel[k] for k in ours} == ours
    assert peers.class_fields(bridge_config, "ConfigContainer")["inprocess_restart"] is None


@pytest.mark.parametrize("as_config", [False, True])
def test_a_bridge_partial_gets_the_section_and_the_checkpoint_fields(as_config, caplog):
    import logging

    caplog.set_level(logging.INFO, "megatron_resilience.plugins")
    with ps.installed():
        task = ps.bridge_partial(as_config=as_config)
        FaultTolerancePlugin(**PLUGIN).setup(task, slurm())
        built = fdl.build(task).keywords["config"]
    assert built.inprocess_restart == ps.InProcessRestartConfig(enabled=True)
    checkpoint = built.checkpoint
    assert (checkpoint.non_persistent_ckpt_type, checkpoint.non_persistent_local_ckpt_dir,
            checkpoint.non_persistent_save_interval, checkpoint.replication, checkpoint.replication_jump,
            checkpoint.replication_factor) == ("local", "/local/ckpt", 10, True, 8, 2)
    logged = [r.getMessage() for r in caplog.records]
    assert ("FaultTolerancePlugin: task config.inprocess_restart: None -> InProcessRestartConfig() (Megatron-Bridge's "
            "defaults; the fields below are set on it)") in logged
    assert "FaultTolerancePlugin: task config.checkpoint.non_persistent_ckpt_type: None -> 'local' " \
           "(local_checkpoint_dir)" in logged


def test_a_nemo_partial_is_warned_about():
    import logging

    with ps.installed():
        trainer = run.Config(ps.Trainer, max_steps=10, num_nodes=2)
        task = run.Partial(ps.nemo_pretrain, model=None, data=None, trainer=trainer,
                           log=run.Config(ps.NeMoLogger, log_dir="/logs"))
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("megatron_resilience.plugins")
        logger.addHandler(handler)
        try:
            FaultTolerancePlugin(inprocess_restart=True, mode="heartbeats").setup(task, slurm())
        finally:
            logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert warnings == [
        "FaultTolerancePlugin: inprocess_restart/local_checkpoint_dir on a NeMo 2.0 task: NeMo has no in-process "
        "restart nor Megatron-style node-local checkpoints to switch on; the executor is set up (srun keeps the ranks "
        "alive), but the trainer must wrap its training function in nvidia-resiliency-ext's in-process restart "
        "wrapper itself"]
