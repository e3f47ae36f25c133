"""Golden sbatch scripts rendered by ``preview`` with our plugins, compared byte for byte.

Regenerate after an intended change with ``UPDATE_GOLDEN=1 pytest tests/test_plugins_golden.py`` and
review the diff of tests/golden/ by eye. The only random part of a script (torchrun's --rdzv-id) is
masked by ``preview``; the experiment id is fixed (``<name>_preview``); paths come from the
executor's LocalTunnel(job_dir=...) and do not depend on this machine.

Besides the goldens: every rendered ft_launcher command is parsed by the installed
nvidia-resiliency-ext's own argument parser, the embedded FT YAML is loaded by its own config
loader, plugin order does not change the script, and ``preview`` equals the script nemo_run's
``Experiment.dryrun`` writes for the same job.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex

import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import CheckpointConfig, FaultToleranceConfig, TrainingConfig  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
JOB_DIR = "/cluster/experiments"


def partial_task():
    return run.Partial(
        pretrain, run_dir="/lustre/runs/gpt",
        train=run.Config(TrainingConfig, max_steps=1000),
        checkpoint=run.Config(CheckpointConfig, save="/lustre/runs/gpt/ckpt", save_interval=100),
    )


def script_task():
    return run.Script(path="megatron_resilience", m=True, entrypoint="python",
                      args=["run_dir=/lustre/runs/gpt", "train.max_steps=1000", "checkpoint.save=/lustre/runs/gpt/ckpt",
                            "checkpoint.save_interval=100"])


def inline_task():
    return run.Script(inline="export OMP_NUM_THREADS=1\n"
                             "python -m megatron_resilience run_dir=/lustre/runs/gpt train.max_steps=1000 \\\n"
                             "    checkpoint.save=/lustre/runs/gpt/ckpt checkpoint.save_interval=100\n")


def slurm(nodes=1, gpus=2, launcher=None, **kw):
    return run.SlurmExecutor(account="acct", partition="batch", nodes=nodes, ntasks_per_node=gpus, gpus_per_node=gpus,
                             time="04:00:00", launcher=launcher, tunnel=run.LocalTunnel(job_dir=JOB_DIR), **kw)


CASES = {
    "ft_partial": lambda: (partial_task(), slurm(), [FaultTolerancePlugin()]),
    "preemption_partial": lambda: (partial_task(), slurm(launcher="torchrun"), [PreemptionPlugin()]),
    "ft_preemption_partial": lambda: (partial_task(), slurm(), [FaultTolerancePlugin(), PreemptionPlugin()]),
    "ft_preemption_nsys_partial": lambda: (
        partial_task(), slurm(launcher=run.Torchrun(nsys_profile=True)), [FaultTolerancePlugin(), PreemptionPlugin()]),
    "ft_preemption_2x8_partial": lambda: (
        partial_task(), slurm(nodes=2, gpus=8), [FaultTolerancePlugin(), PreemptionPlugin(preempt_time=120)]),
    "ft_preemption_script": lambda: (script_task(), slurm(), [FaultTolerancePlugin(), PreemptionPlugin()]),
    "preemption_script": lambda: (script_task(), slurm(launcher="torchrun"), [PreemptionPlugin()]),
    "ft_heartbeats_preemption_inline": lambda: (
        inline_task(), slurm(), [FaultTolerancePlugin(nvrx_version="0.7"), PreemptionPlugin(signal="SIGINT")]),
    "preemption_inline": lambda: (inline_task(), slurm(), [PreemptionPlugin(signal="SIGUSR1", preempt_time=300)]),
}


def render(case: str) -> str:
    task, executor, plugins = CASES[case]()
    if case == "ft_heartbeats_preemption_inline":
        task.inline = task.inline.replace("train.max_steps=1000", "train.max_steps=1000 ft.mode=heartbeats")
    return preview(task, executor, plugins, name="gpt", with_scripts=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_sbatch(case):
    script = render(case)
    path = os.path.join(GOLDEN, f"{case}.sh")
    if os.environ.get("UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(script)
    with open(path) as f:
        assert script == f.read(), f"{case}: rendered sbatch differs from {path} (UPDATE_GOLDEN=1 to regenerate)"


def test_no_stale_golden_files():
    assert sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(GOLDEN, "*.sh"))) == sorted(CASES)


def _srun_command(script: str) -> list[str]:
    line = next(line for line in script.splitlines() if line.startswith("srun --output"))
    return shlex.split(line.replace("<random>", "1234").replace("$head_node_ip", "10.0.0.1")
                       .replace("$SLURM_NODEID", "0"))


def _ft_launcher_args(script: str) -> list[str]:
    args = _srun_command(script)
    return args[args.index("ft_launcher") + 1:]


FT_CASES = [c for c in sorted(CASES) if c.startswith("ft_")]


@pytest.mark.parametrize("case", FT_CASES)
def test_ft_launcher_command_parses_with_installed_nvidia_resiliency_ext(case, tmp_path, monkeypatch):
    """The rendered command is accepted by ft_launcher's own parser, and the FT config it ends up with
    (YAML via PET_FT_CFG_PATH, then CLI flags) has the plugin's settings."""
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig as NvrxConfig

    from megatron_resilience.upstream import ft_launcher_args_parser

    script = render(case)
    yaml_text = re.search(r"<<'MEGATRON_RESILIENCE_FT_CFG'\n(.*?)MEGATRON_RESILIENCE_FT_CFG\n", script, re.S).group(1)
    cfg_file = tmp_path / "ft_cfg.yml"
    cfg_file.write_text(yaml_text)
    monkeypatch.setenv("PET_FT_CFG_PATH", str(cfg_file))
    args = ft_launcher_args_parser().parse_args(_ft_launcher_args(script))
    assert args.ft_cfg_path == str(cfg_file)
    assert args.max_restarts == 3
    cfg = NvrxConfig.from_args(args)
    heartbeats = case == "ft_heartbeats_preemption_inline"
    assert cfg.rank_section_timeouts == ({} if heartbeats else {"setup": 600.0, "step": 180.0, "checkpointing": 420.0})
    assert cfg.rank_out_of_section_timeout == (None if heartbeats else 300.0)
    assert cfg.initial_rank_heartbeat_timeout == (1800.0 if heartbeats else None)
    assert cfg.rank_heartbeat_timeout == (300.0 if heartbeats else None)
    assert cfg.workload_check_interval == 5.0
    assert cfg.rank_termination_signal.name == "SIGKILL"
    assert "--ignore-missing-fault-tol-cfg" not in _ft_launcher_args(script)
    if case == "ft_preemption_2x8_partial":
        assert (args.nnodes, args.nproc_per_node) == ("2", "8")


def test_ft_yaml_path_is_the_same_in_env_heredoc_and_nemo_run_export():
    script = render("ft_partial")
    env = re.search(r"^export PET_FT_CFG_PATH=(\S+)$", script, re.M).group(1)
    heredoc = re.search(r"^cat > (\S+) <<'MEGATRON_RESILIENCE_FT_CFG'$", script, re.M).group(1)
    nemo_run = re.search(r'^export FAULT_TOL_CFG_PATH="(\S+)"$', script, re.M).group(1)
    assert env == heredoc == nemo_run == f"{JOB_DIR}/gpt/gpt_preview/gpt/gpt_ft_cfg.yml"
    assert script.index("cat > ") < script.index("srun --output")


def test_plugin_order_does_not_change_the_script():
    task, executor, _ = CASES["ft_preemption_nsys_partial"]()
    forward = preview(task, executor, [FaultTolerancePlugin(), PreemptionPlugin()], name="gpt")
    backward = preview(task, executor, [PreemptionPlugin(), FaultTolerancePlugin()], name="gpt")
    assert forward == backward
    assert "nsys" not in forward


@dataclasses.dataclass(kw_only=True)
class CallsGetLauncher(run.Plugin):
    """Stands for any earlier plugin that sets the launcher up (nemo_run does that only once)."""

    def setup(self, task, executor):
        executor.get_launcher()


def test_launcher_already_set_up_gets_ft_file_paths():
    task, executor, plugins = CASES["ft_partial"]()
    executor.launcher = "torchrun"
    assert preview(task, executor, [CallsGetLauncher(), *plugins], name="gpt") == render("ft_partial")


def test_preview_equals_experiment_dryrun(tmp_path, monkeypatch):
    """preview renders what nemo_run's own Experiment.dryrun writes (run.Packager: no git needed)."""
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    monkeypatch.setattr("sys.stdin", open(os.devnull))  # nemo_run's packaging shells out through invoke

    task, executor, plugins = CASES["ft_preemption_partial"]()
    executor.packager = run.Packager()
    home = get_nemorun_home()
    set_nemorun_home(str(tmp_path))
    try:
        with run.Experiment("gpt", executor=executor, log_level="WARN") as exp:
            exp.add(task, name="gpt", plugins=plugins)
            exp.dryrun(log=False, delete_exp_dir=False)
            exp_id, exp_dir = exp._id, exp._exp_dir
        with open(os.path.join(exp_dir, "gpt_sbatch.sh")) as f:
            dryrun = re.sub(r"--rdzv-id \d+", "--rdzv-id <random>", f.read())
    finally:
        set_nemorun_home(home)
    assert dryrun.replace(exp_id, "gpt_preview") == preview(task, executor, plugins, name="gpt")


def test_preview_leaves_no_files_and_does_not_touch_nemorun_home(tmp_path, monkeypatch):
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    home = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    try:
        task, _, plugins = CASES["ft_preemption_partial"]()
        executor = run.SlurmExecutor(account="acct", time="01:00:00")  # LocalTunnel(job_dir=""): NEMORUN_HOME
        script = preview(task, executor, plugins, name="gpt")
    finally:
        set_nemorun_home(home)
    assert f"{tmp_path}/home/experiments/gpt/gpt_preview/gpt/gpt_ft_cfg.yml" in script
    assert not os.path.exists(tmp_path / "home")
    assert os.listdir(tmp_path / "tmp") == []


def test_plugins_rebuild_from_serialized_config():
    """Experiment.from_id rebuilds plugins from their fiddle config: fields must be plain data."""
    import fiddle as fdl
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    for plugin in (FaultTolerancePlugin(num_in_job_restarts=5, step_timeout=None, nvrx_version="0.7"),
                   PreemptionPlugin(preempt_time=90, signal="SIGUSR1")):
        serializer = ZlibJSONSerializer()
        rebuilt = fdl.build(serializer.deserialize(serializer.serialize(plugin.to_config())))
        assert rebuilt == plugin


def test_partial_task_settings_in_serialized_job_config(tmp_path):
    """The task the job runs (the serialized Partial) carries the plugins' trainer settings."""
    import fiddle as fdl

    task, executor, plugins = CASES["ft_preemption_partial"]()
    ex = executor.clone()
    ex.assign("gpt_x", str(tmp_path), task_id="gpt", task_dir="gpt")
    for plugin in plugins:
        plugin.setup(task, ex)
    built = fdl.build(task.ft), fdl.build(task.train)
    assert built[0] == FaultToleranceConfig(enabled=True, calc_ft_timeouts=True)
    assert built[1] == TrainingConfig(max_steps=1000, exit_signal_handler=True, exit_signal="SIGTERM")


def test_preview_with_ssh_tunnel_does_not_connect():
    """From a laptop: the remote job dir comes from SSHTunnel(job_dir=...); nothing connects or copies."""
    task, _, plugins = CASES["ft_preemption_partial"]()
    executor = run.SlurmExecutor(account="acct", time="04:00:00", ntasks_per_node=2, gpus_per_node=2,
                                 tunnel=run.SSHTunnel(host="login.invalid", user="me", job_dir="/remote/exp"))
    script = preview(task, executor, plugins, name="gpt")
    assert "export PET_FT_CFG_PATH=/remote/exp/gpt/gpt_preview/gpt/gpt_ft_cfg.yml" in script
    assert executor.tunnel.session is None


def test_container_job_reads_files_through_the_nemo_run_mount():
    """With a container the batch shell writes host paths; job steps read them under the /nemo_run mount."""
    task, _, plugins = CASES["ft_preemption_partial"]()
    executor = slurm(container_image="nvcr.io/nvidia/pytorch:25.09-py3")
    script = preview(task, executor, plugins, name="gpt")
    host = f"{JOB_DIR}/gpt/gpt_preview/gpt"
    assert "export PET_FT_CFG_PATH=/nemo_run/gpt_ft_cfg.yml\n" in script
    assert f"cat > {host}/gpt_ft_cfg.yml <<'MEGATRON_RESILIENCE_FT_CFG'\n" in script
    assert f"--container-mounts {host}:/nemo_run" in script

    task, _, plugins = CASES["preemption_partial"]()
    script = preview(task, slurm(launcher="torchrun", container_image="img"), plugins, name="gpt")
    assert "export FAULT_TOL_FINISHED_FLAG_FILE=/nemo_run/gpt_finished_flag\n" in script
    assert f'[ ! -f {host}/gpt_finished_flag ]' in script
