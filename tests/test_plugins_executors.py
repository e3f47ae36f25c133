"""Every NeMo-Run executor class gets what it can take from the plugins, and a log line for what it cannot.

The executor changes never depend on the task: each test runs the same plugins on our trainer's Partial
and on a script the plugins do not know, and the executor ends up the same. SkyPilot and Kubeflow need
packages that are not installed here (``skypilot``, ``kubernetes``; their ``__post_init__`` checks), so a
subclass that skips that check stands in for them, which also shows that subclasses get their base
class's treatment.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import ConfigError  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402

LOGGER = "megatron_resilience.plugins"


@dataclasses.dataclass(kw_only=True)
class Skypilot(run.SkypilotExecutor):
    def __post_init__(self):  # skypilot is not installed here
        pass


@dataclasses.dataclass(kw_only=True)
class Kubeflow(run.KubeflowExecutor):
    def __post_init__(self):  # kubernetes is not installed here
        pass


@dataclasses.dataclass(kw_only=True)
class SiteSlurm(run.SlurmExecutor):
    """A site's own SlurmExecutor subclass."""


EXECUTORS = {
    "local": lambda: run.LocalExecutor(ntasks_per_node=2),
    "docker": lambda: run.DockerExecutor(container_image="img", ntasks_per_node=2),
    "skypilot": lambda: Skypilot(gpus="A100", gpus_per_node=2, num_nodes=1),
    "lepton": lambda: run.LeptonExecutor(container_image="img", nemo_run_dir="/nemo", nodes=1, gpus_per_node=2,
                                         nprocs_per_node=2),
    "dgxcloud": lambda: run.DGXCloudExecutor(
        base_url="u", kube_apiserver_url="k", client_id="c", client_secret="s", project_name="p", container_image="i",
        pvc_nemo_run_dir="/pvc", pvcs=[{"path": "/pvc", "claimName": "c"}], nodes=1, gpus_per_node=2,
        nprocs_per_node=2),
    "kubeflow": lambda: Kubeflow(image="img", num_nodes=1, gpus_per_node=2),
    "slurm_subclass": lambda: SiteSlurm(account="a", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp")),
}


@pytest.fixture
def home(tmp_path):
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    saved = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "home"))
    yield str(tmp_path / "home")
    set_nemorun_home(saved)


def set_up(kind: str, task, tmp_path, plugins=None):
    executor = EXECUTORS[kind]()
    executor.assign("exp_1", str(tmp_path / kind / "exp_1"), task_id="job", task_dir="job")
    for plugin in plugins or [FaultTolerancePlugin(), PreemptionPlugin()]:
        plugin.setup(task, executor)
    return executor


def comparable(executor) -> dict:
    return {k: v for k, v in executor.__dict__.items() if not k.startswith("_") and k != "launcher"} | {
        "launcher": repr(executor.launcher)}


@pytest.mark.parametrize("kind", sorted(EXECUTORS))
def test_executor_changes_do_not_depend_on_the_task(kind, tmp_path, home):
    ours = set_up(kind, run.Partial(pretrain, run_dir="/runs/gpt"), tmp_path / "a")
    other = set_up(kind, run.Script(path="train.py", entrypoint="python"), tmp_path / "b")
    assert isinstance(ours.launcher, run.FaultTolerance) and ours.launcher.max_restarts == 3
    a, b = comparable(ours), comparable(other)
    for d in (a, b):  # paths of the two assignments
        d.pop("job_dir", None), d.pop("experiment_dir", None), d.pop("experiment_id", None)
    # The one thing read from the task: where our trainer writes its run files (the job-level decision's inputs).
    a_lines, b_lines = a.pop("setup_lines", None), b.pop("setup_lines", None)
    assert a == b
    if kind == "slurm_subclass":
        assert '"run_dir": "/runs/gpt",' in a_lines and '"run_dir": null,' in b_lines
        only_a = set(a_lines.splitlines()) - set(b_lines.splitlines())
        assert only_a and all("/runs/gpt" in line for line in only_a)
    else:
        assert a_lines == b_lines


def messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def test_local(tmp_path, home, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    executor = set_up("local", run.Partial(pretrain, run_dir="/r"), tmp_path)
    assert os.path.dirname(executor.env_vars["PET_FT_CFG_PATH"]) == os.path.join(home, "ft_configs")
    assert executor.retries == 0 and executor.env_vars.keys() == {"PET_FT_CFG_PATH"}
    logged = messages(caplog)
    assert ("FaultTolerancePlugin: num_job_retries_on_failure=2 does not apply on LocalExecutor: nemo_run has no "
            "job-level retries there (use the platform's own restart settings)") in logged
    assert any(m.startswith("PreemptionPlugin: LocalExecutor has no scheduler signal before a time limit") for m in
               logged)


def test_docker_mounts_the_ft_config_and_counts_restarts(tmp_path, home, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    executor = set_up("docker", run.Partial(pretrain, run_dir="/r"), tmp_path)
    path = executor.env_vars["PET_FT_CFG_PATH"]
    assert path.startswith("/megatron_resilience/ft_configs/ft_cfg_") and path.endswith(".yml")
    assert executor.volumes == [f"{home}/ft_configs:/megatron_resilience/ft_configs:ro"]
    assert os.path.exists(os.path.join(home, "ft_configs", os.path.basename(path)))
    assert executor.retries == 2  # Docker's on-failure restart count: N, not N + 1
    assert any("PreemptionPlugin: DockerExecutor has no scheduler signal" in m for m in messages(caplog))


def test_skypilot_ships_the_ft_config_as_a_file_mount(tmp_path, home):
    executor = set_up("skypilot", run.Partial(pretrain, run_dir="/r"), tmp_path)
    path = executor.env_vars["PET_FT_CFG_PATH"]
    assert executor.file_mounts == {path: os.path.join(home, "ft_configs", os.path.basename(path))}


def test_lepton_writes_the_ft_config_before_launch(tmp_path, home):
    executor = set_up("lepton", run.Partial(pretrain, run_dir="/r"), tmp_path)
    path = executor.env_vars["PET_FT_CFG_PATH"]
    assert path == f"/tmp/megatron_resilience/{executor.job_name}_ft_cfg.yml"
    assert executor.pre_launch_commands[0] == "mkdir -p /tmp/megatron_resilience"
    heredoc = f"cat > {path} <<'MEGATRON_RESILIENCE_FT_CFG'\nfault_tolerance:\n"
    assert executor.pre_launch_commands[1].startswith(heredoc)


@pytest.mark.parametrize("kind, restarts_apply", [("dgxcloud", False), ("kubeflow", True)])
def test_no_way_to_ship_the_ft_config(kind, restarts_apply, tmp_path, home, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    executor = set_up(kind, run.Partial(pretrain, run_dir="/r"), tmp_path)
    assert "PET_FT_CFG_PATH" not in executor.env_vars
    name = type(executor).__name__
    assert messages(caplog, logging.WARNING) == [
        f"FaultTolerancePlugin: {name}: nemo_run gives plugins no way to ship ft_launcher's config file there, so the "
        "section timeouts do not apply (ft_launcher gets only the heartbeat timeouts, check interval, termination "
        "signal and log level nemo_run renders); with mode=sections hangs are not detected there, crashes are"]
    restarts = (f"FaultTolerancePlugin: num_in_job_restarts=3 does not apply on {name}: nemo_run drops ft_launcher's "
                "--max-restarts there")
    assert (restarts in messages(caplog)) is not restarts_apply
    caplog.clear()  # what the plugin fills in itself (the progress tracker's file) is no error there, only logged
    from megatron_resilience.config import CheckpointConfig

    set_up(kind, run.Partial(pretrain, run_dir="/r", checkpoint=run.Config(CheckpointConfig, save="/ckpt")),
           tmp_path / "derived", [FaultTolerancePlugin(nvrx_version="0.7")])
    assert messages(caplog, logging.WARNING)[0].endswith("crashes are; not applied either: checkpoint_iteration_file")
    with pytest.raises(ConfigError, match=r"^FaultTolerancePlugin: cycle_info_dir reach ft_launcher only through "
                                          rf"its config file, and nemo_run gives plugins no way to ship a file to "
                                          rf"{name}; use a SlurmExecutor"):
        set_up(kind, run.Partial(pretrain, run_dir="/r"), tmp_path / "again",
               [FaultTolerancePlugin(nvrx_version="0.7", cycle_info=True)])


def test_a_slurm_subclass_is_a_slurm_executor(tmp_path, home):
    executor = set_up("slurm_subclass", run.Partial(pretrain, run_dir="/r"), tmp_path)
    assert executor.signal == "SIGTERM@60" and executor.retries == 3
    assert executor.env_vars["PET_FT_CFG_PATH"] == "/nemo_run/job_ft_cfg.yml"


def test_flag_only_settings_need_the_sbatch_script(tmp_path, home):
    with pytest.raises(ConfigError) as err:
        set_up("local", run.Partial(pretrain, run_dir="/r"), tmp_path,
               [FaultTolerancePlugin(nvrx_version="0.7", node_health_check_endpoint="/run/nvhcd.sock")])
    assert str(err.value) == (
        "FaultTolerancePlugin.node_health_check_endpoint: nvidia-resiliency-ext 0.7 reads it only from the "
        "ft_launcher command line (--ft-node-health-check-endpoint), which nemo_run cannot extend; the plugin adds "
        "it in the sbatch script, so it needs a SlurmExecutor (got LocalExecutor)")


@pytest.mark.parametrize("kind", sorted(EXECUTORS))
def test_only_slurm_has_a_batch_script_a_node_range_a_port_block_and_srun(kind):
    """The abilities the plugins ask for (``plugins/executors.py``'s table), per executor class: a site's subclass
    gets SlurmExecutor's, every other executor none of them."""
    from megatron_resilience.plugins.executors import executor_profile

    p = executor_profile(EXECUTORS[kind](), "test")
    abilities = (p.batch_script, p.node_range, p.port_block, p.srun, p.command_flags, p.scheduler_signal)
    assert abilities == ((True,) * 6 if kind == "slurm_subclass" else (False,) * 6), (kind, p)
