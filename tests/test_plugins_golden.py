"""Golden sbatch scripts rendered by ``preview`` with our plugins, compared byte for byte.

The cases and the regeneration command live in ``tests/golden_cases.py``; this module only compares
(regenerate there, review the diff of tests/golden/ by eye, then run this).

Besides the goldens: every rendered ft_launcher command is run through bash as the batch script runs it
and handed to the nvidia-resiliency-ext release it was rendered for (0.4.1 installed, 0.6.0 and 0.7.0
unpacked here: ``tests/nvrx_releases.py``), whose own parser and config loader must accept it and end up
with the plugin's settings; plugin order does not change the script; ``preview`` equals the script
nemo_run's ``Experiment.dryrun`` writes; and the task the job runs, deserialized from the file nemo_run
writes for it, carries the plugins' trainer settings.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re

import pytest
import yaml
from golden_cases import CASES, JOB_DIR, golden_path, nvrx_release, render, slurm
from nvrx_releases import job_step, probe

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import FaultToleranceConfig, TrainingConfig  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402
from megatron_resilience.upstream.versions import parse_version  # noqa: E402

GOLDEN = os.path.dirname(golden_path("x"))
RELEASE = {"0.4.1": "0.4.1", "0.6": "0.6.0", "0.7": "0.7.0"}  # what a case's nvrx_version names -> the release


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_sbatch(case):
    if os.environ.get("UPDATE_GOLDEN"):
        pytest.fail("UPDATE_GOLDEN is not honoured here: regenerate with `.venv/bin/python tests/golden_cases.py`, "
                    "review `git diff tests/golden/`, then run this test without it")
    script = render(case)
    with open(golden_path(case)) as f:
        assert script == f.read(), (f"{case}: rendered sbatch differs from {golden_path(case)} "
                                    "(regenerate with tests/golden_cases.py and review the diff)")


def test_no_stale_golden_files():
    assert sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(GOLDEN, "*.sh"))) == sorted(CASES)


FT_CASES = [c for c in sorted(CASES) if c.startswith("ft_")]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """case -> (job step, what the case's own nvidia-resiliency-ext release makes of it); one probe per release."""
    steps = {case: job_step(render(case), str(tmp_path_factory.mktemp(case))) for case in FT_CASES}
    # 0.6's quirk, shown: the same settings in the config file instead of on the command line
    quirk = dict(steps["ft_progress_flags_nvrx_0_6"])
    quirk["argv"] = [a for a in quirk["argv"] if a not in (
        "--ft-max-no-progress-cycles", "4", "--ft-min-progress-iterations", "20")]
    yaml_path = str(tmp_path_factory.mktemp("quirk") / "ft_cfg.yml")
    with open(quirk["env"]["PET_FT_CFG_PATH"]) as src, open(yaml_path, "w") as dst:
        dst.write(src.read() + "  max_no_progress_cycles: 4\n  min_progress_iterations: 20\n")
    quirk["env"] = {**quirk["env"], "PET_FT_CFG_PATH": yaml_path}
    steps["0.6 without flags"] = quirk
    out = {}
    for release in sorted({RELEASE[nvrx_release(c)] for c in FT_CASES}):
        cases = [c for c in FT_CASES if RELEASE[nvrx_release(c)] == release]
        cases += ["0.6 without flags"] if release == "0.6.0" else []
        answer = probe(release, {"parse": [{"argv": steps[c]["argv"], "env": steps[c]["env"]} for c in cases]})
        out.update({c: (steps[c], r) for c, r in zip(cases, answer["parsed"])})
    return out


@pytest.mark.parametrize("case", FT_CASES)
def test_ft_launcher_command_is_accepted_by_its_release(case, parsed):
    """The job step's ft_launcher command (after our srun function) parsed by the release it was rendered for;
    the FT config that release ends up with (YAML via PET_FT_CFG_PATH, then the flags) has the plugin's settings."""
    step, result = parsed[case]
    assert "error" not in result, f"{case}: nvidia-resiliency-ext {nvrx_release(case)} rejected {step['argv']}"
    args, cfg = result["args"], result["config"]
    assert args["ft_cfg_path"] == step["env"]["PET_FT_CFG_PATH"]
    # num_in_job_restarts=None: no count where ft_launcher tracks progress (>= 0.6 with the checkpoint tracker)
    tracked = parse_version(nvrx_release(case)) >= (0, 6) and cfg.get("checkpoint_iteration_file") is not None
    assert args["max_restarts"] == (1000 if tracked else 3), (case, nvrx_release(case))
    heartbeats = case in ("ft_heartbeats_preemption_inline", "ft_preemption_nemo_partial")  # NeMo: heartbeats only
    sections = {} if heartbeats else {"setup": 600.0, "step": 180.0, "checkpointing": 420.0}
    assert cfg["rank_section_timeouts"] == sections
    assert cfg["rank_out_of_section_timeout"] == (None if heartbeats else 300.0)
    assert cfg["initial_rank_heartbeat_timeout"] == (1800.0 if heartbeats else None)
    assert cfg["rank_heartbeat_timeout"] == (300.0 if heartbeats else None)
    assert (cfg["workload_check_interval"], cfg["rank_termination_signal"]) == (5.0, "SIGKILL")
    assert "--ignore-missing-fault-tol-cfg" not in step["argv"]
    with open(step["env"]["PET_FT_CFG_PATH"]) as f:  # every key we wrote is one the release took, with our value
        written = yaml.safe_load(f)["fault_tolerance"]
    written["log_level"] = logging.getLevelName(written["log_level"])
    assert {key: cfg.get(key, "<not a field of this release>") for key in written} == written
    if case == "ft_preemption_2x8_partial":
        assert (args["nnodes"], args["nproc_per_node"]) == ("2", "8")
    if case == "ft_preemption_4x8_partial":
        assert (args["nnodes"], args["nproc_per_node"]) == ("4", "8")
    if case == "ft_min_nodes_2x8_partial":  # 0.4.1: an elastic range up to the attempt's nodes; survivors kept
        assert (args["nnodes"], args["nproc_per_node"]) == ("1:2", "8")
        assert "--kill-on-bad-exit=0" in step["srun"] and "--wait=0" in step["srun"]
        assert step["srun"][0] == "--ntasks=2"  # one agent per node of the attempt, whatever Slurm's SLURM_NTASKS
    if case == "ft_min_nodes_2x8_nvrx_0_7":  # 0.7 reads a range as hot spares: the attempt's node count only
        assert (args["nnodes"], args["nproc_per_node"]) == ("2", "8")
        assert "--kill-on-bad-exit=1" in step["srun"] and "--wait=60" in step["srun"]
        assert step["srun"][0] == "--ntasks=2"


def test_every_feature_reaches_ft_launcher_0_7(parsed):
    step, result = parsed["ft_every_feature_nvrx_0_7"]
    args, cfg = result["args"], result["config"]
    job = f"{JOB_DIR}/gpt/gpt_preview/gpt"
    assert {k: args[k] for k in ("ft_node_health_check_endpoint", "ft_no_restart_exit_code",
                                 "ft_per_cycle_applog_prefix")} == {
        "ft_node_health_check_endpoint": "unix:///var/run/nvhcd.sock", "ft_no_restart_exit_code": 94,
        "ft_per_cycle_applog_prefix": f"{job}/ft_cycle_logs/cycle"}
    assert {k: cfg[k] for k in (
        "enable_dist_storage_healthcheck", "storage_healthcheck_path", "gpu_memory_reclaim_timeout",
        "gpu_memory_tolerance_mb", "gpu_memory_poll_interval", "numa_bind_strict", "attribution_endpoint",
        "attribution_stop_action", "cycle_info_dir", "max_no_progress_cycles", "min_progress_iterations",
        "checkpoint_iteration_file")} == {
        "enable_dist_storage_healthcheck": True, "storage_healthcheck_path": "/lustre/runs/gpt/ckpt",
        "gpu_memory_reclaim_timeout": 120.0, "gpu_memory_tolerance_mb": 256.0, "gpu_memory_poll_interval": 1.0,
        "numa_bind_strict": False, "attribution_endpoint": "localhost", "attribution_stop_action": "log",
        "cycle_info_dir": f"{job}/ft_cycle_info", "max_no_progress_cycles": 3, "min_progress_iterations": 10,
        "checkpoint_iteration_file": "/lustre/runs/gpt/ckpt/latest_checkpointed_iteration.txt"}
    assert step["env"]["NVRX_GPUS_PER_NUMA"] == "4"  # read by the launcher itself, not by its parser


def test_every_feature_reaches_ft_launcher_0_4(parsed):
    _, result = parsed["ft_every_feature_nvrx_0_4"]
    assert result["args"]["ft_restart_policy"] == "min-healthy"


def test_progress_settings_reach_ft_launcher_0_6_despite_its_command_line_defaults(parsed):
    """0.6.0's --ft-max-no-progress-cycles/--ft-min-progress-iterations default to 2/1 and override the config
    file; the plugin therefore puts them on the command line for 0.6, and 0.6.0 itself ends up with them."""
    _, result = parsed["ft_progress_flags_nvrx_0_6"]
    assert (result["config"]["max_no_progress_cycles"], result["config"]["min_progress_iterations"]) == (4, 20)
    assert result["config"]["checkpoint_iteration_file"] == "/lustre/runs/gpt/ckpt/latest_checkpointed_iteration.txt"
    _, yaml_only = parsed["0.6 without flags"]  # the values in the YAML instead: 0.6.0's defaults win
    assert (yaml_only["config"]["max_no_progress_cycles"], yaml_only["config"]["min_progress_iterations"]) == (2, 1)


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
    """Experiment.from_id rebuilds plugins from their fiddle config: fields are plain data or importable functions."""
    import fiddle as fdl
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    from megatron_resilience.plugins import megatron_lm_args

    for plugin in (FaultTolerancePlugin(num_in_job_restarts=5, step_timeout=None, nvrx_version="0.7",
                                        storage_health_check=True, storage_health_check_paths=["/data", "/ckpt"],
                                        script_args_converter_fn=megatron_lm_args),
                   PreemptionPlugin(preempt_time=90, signal="SIGUSR1", script_args_converter_fn=megatron_lm_args)):
        serializer = ZlibJSONSerializer()
        rebuilt = fdl.build(serializer.deserialize(serializer.serialize(plugin.to_config())))
        assert rebuilt == plugin


def test_job_runs_a_task_with_the_plugins_settings_after_a_serialization_round_trip(tmp_path, monkeypatch):
    """The task file nemo_run writes for the job (``configs/<job>_fn_or_script``), deserialized and built the
    way the job's ``nemo_run.core.runners.fdl_runner`` does, carries the plugins' trainer settings."""
    import fiddle as fdl
    from nemo_run.config import get_nemorun_home, set_nemorun_home
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    monkeypatch.setattr("sys.stdin", open(os.devnull))
    task, executor, plugins = CASES["ft_preemption_partial"]()
    executor.packager = run.Packager()
    home = get_nemorun_home()
    set_nemorun_home(str(tmp_path))
    try:
        with run.Experiment("gpt", executor=executor, log_level="WARN") as exp:
            exp.add(task, name="gpt", plugins=plugins)
            exp.dryrun(log=False, delete_exp_dir=False)
            job_dir = exp.jobs[0].executor.job_dir
    finally:
        set_nemorun_home(home)
    with open(os.path.join(job_dir, "configs", "gpt_fn_or_script")) as f:
        built = fdl.build(fdl.cast(run.Partial, ZlibJSONSerializer().deserialize(f.read())))
    assert built.func.__qualname__ == "pretrain"
    assert built.keywords["ft"] == FaultToleranceConfig(enabled=True, calc_ft_timeouts=True)
    assert built.keywords["train"] == TrainingConfig(max_steps=1000, exit_signal_handler=True, exit_signal="SIGTERM")
    assert built.keywords["run_dir"] == "/lustre/runs/gpt"


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
