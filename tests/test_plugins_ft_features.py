"""ft_launcher's safety features on FaultTolerancePlugin: checked before submission, wired to this repo's runs.

Bad values fail when the plugin is built; a feature the target release lacks fails when the job is set
up, naming the field, the release that has it and ``nvrx_version=``. What ft_launcher makes of the
rendered jobs is judged by the releases themselves in ``test_plugins_golden.py``; real ft_launcher 0.7.0
runs are in ``test_plugins_local_launches.py``.
"""

from __future__ import annotations

import logging

import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import CheckpointConfig, ConfigError, DataConfig, RerunConfig  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin  # noqa: E402


@pytest.mark.parametrize("kwargs, message", [
    ({"restart_policy": "sometimes"},
     "FaultTolerancePlugin.restart_policy: must be one of ['any-failed', 'min-healthy'] (or None), got 'sometimes'"),
    ({"use_infra_group_rank": "yes"},
     "FaultTolerancePlugin.use_infra_group_rank: must be true, false or None (ft_launcher's default), got 'yes'"),
    ({"node_health_check_endpoint": "localhost:5000"},
     "FaultTolerancePlugin.node_health_check_endpoint: must be a Unix socket: an absolute path or unix:///path, "
     "got 'localhost:5000'"),
    ({"storage_health_check_paths": ["/data"]},
     "FaultTolerancePlugin.storage_health_check_paths: needs storage_health_check=True, got ['/data']"),
    ({"storage_health_check": True, "storage_health_check_paths": ["data/train"]},
     "FaultTolerancePlugin.storage_health_check_paths: must be an absolute path without commas, got 'data/train'"),
    ({"storage_health_check": True, "storage_health_check_paths": ["/a,/b"]},
     "FaultTolerancePlugin.storage_health_check_paths: must be an absolute path without commas, got '/a,/b'"),
    ({"storage_health_check": True, "storage_health_check_paths": []},
     "FaultTolerancePlugin.storage_health_check_paths: must be a non-empty list of absolute paths, got []"),
    ({"gpu_memory_reclaim_timeout": float("inf")},
     "FaultTolerancePlugin.gpu_memory_reclaim_timeout: must be a finite number > 0 (or None), got inf"),
    ({"gpu_memory_tolerance_mb": -1}, "FaultTolerancePlugin.gpu_memory_tolerance_mb: must be a finite number >= 0 "
                                      "(or None), got -1"),
    ({"gpu_memory_poll_interval": 0}, "FaultTolerancePlugin.gpu_memory_poll_interval: must be a finite number > 0 "
                                      "(or None), got 0"),
    ({"gpus_per_numa": 0}, "FaultTolerancePlugin.gpus_per_numa: must be an integer >= 1, got 0"),
    ({"numa_bind_strict": False}, "FaultTolerancePlugin.numa_bind_strict: needs gpus_per_numa (NUMA binding is on "
                                  "only with NVRX_GPUS_PER_NUMA), got False"),
    ({"attribution_endpoint": "attrsvc:8000"},
     "FaultTolerancePlugin.attribution_endpoint: must be 'localhost' (ft_launcher starts the service), "
     "http(s)://host:port, grpc://host:port or unix:///path, got 'attrsvc:8000'"),
    ({"attribution_stop_action": "no-restart"},
     "FaultTolerancePlugin.attribution_stop_action: needs attribution_endpoint, got 'no-restart'"),
    ({"attribution_endpoint": "localhost", "attribution_stop_action": "stop"},
     "FaultTolerancePlugin.attribution_stop_action: must be one of ['log', 'no-restart'] (or None), got 'stop'"),
    ({"max_no_progress_cycles": -2}, "FaultTolerancePlugin.max_no_progress_cycles: must be an integer >= -1, got -2"),
    ({"min_progress_iterations": 0}, "FaultTolerancePlugin.min_progress_iterations: must be an integer >= 1, got 0"),
    ({"checkpoint_iteration_file": "ckpt/latest_checkpointed_iteration.txt"},
     "FaultTolerancePlugin.checkpoint_iteration_file: must be an absolute path without commas, "
     "got 'ckpt/latest_checkpointed_iteration.txt'"),
    ({"no_restart_exit_code": 256}, "FaultTolerancePlugin.no_restart_exit_code: must be an integer 1..255, got 256"),
    ({"no_restart_exit_code": 17},
     "FaultTolerancePlugin.no_restart_exit_code: must differ from the rerun state machine's exit codes [16, 17], "
     "which the batch script treats on their own, got 17"),
    ({"mode": "beats"}, "FaultTolerancePlugin.mode: must be one of ['sections', 'heartbeats'] (or None: the "
                        "trainer's own), got 'beats'"),
    ({"script_args_converter_fn": "megatron_lm"},
     "FaultTolerancePlugin.script_args_converter_fn: must be a function of FaultTolerancePluginScriptArgs, "
     "got 'megatron_lm'"),
])
def test_bad_values_fail_when_the_plugin_is_built(kwargs, message):
    with pytest.raises(ConfigError) as err:
        FaultTolerancePlugin(**kwargs)
    assert str(err.value) == message


def slurm(tmp_path):
    executor = run.SlurmExecutor(account="a", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", str(tmp_path / "job_1"), task_id="job", task_dir="job")
    return executor


def task(**sections):
    return run.Partial(pretrain, run_dir="/runs/gpt", **sections)


@pytest.mark.parametrize("version, kwargs, message", [
    ("0.4.1", {"cycle_info": True},
     "FaultTolerancePlugin.cycle_info: needs nvidia-resiliency-ext >= 0.6 (ft_launcher --ft-cycle-info-dir), but the "
     "job is rendered for 0.4.1 (FaultTolerancePlugin.nvrx_version); if the cluster runs a newer release, say which: "
     "FaultTolerancePlugin(nvrx_version='0.6')"),
    ("0.6.0", {"no_restart_exit_code": 94},
     "FaultTolerancePlugin.no_restart_exit_code: needs nvidia-resiliency-ext >= 0.7 (ft_launcher "
     "--ft-no-restart-exit-code), but the job is rendered for 0.6.0 (FaultTolerancePlugin.nvrx_version); if the "
     "cluster runs a newer release, say which: FaultTolerancePlugin(nvrx_version='0.7')"),
    ("0.5", {"gpus_per_numa": 4},
     "FaultTolerancePlugin.gpus_per_numa: needs nvidia-resiliency-ext >= 0.6 (NVRX_GPUS_PER_NUMA), but the job is "
     "rendered for 0.5 (FaultTolerancePlugin.nvrx_version); if the cluster runs a newer release, say which: "
     "FaultTolerancePlugin(nvrx_version='0.6')"),
    ("0.7", {"use_infra_group_rank": False},
     "FaultTolerancePlugin.use_infra_group_rank: nvidia-resiliency-ext 0.6 removed ft_launcher "
     "--ft-use-infra-group-rank, and the job is rendered for 0.7 (FaultTolerancePlugin.nvrx_version); it exists in "
     "0.5.x only"),
    ("0.7", {"restart_policy": "min-healthy"},
     "FaultTolerancePlugin.restart_policy: nvidia-resiliency-ext 0.7 accepts only ['any-failed'] "
     "(FaultTolerancePlugin.nvrx_version); the min-healthy policy exists up to 0.5"),
])
def test_a_feature_the_release_lacks_fails_before_submission(version, kwargs, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        FaultTolerancePlugin(nvrx_version=version, **kwargs).setup(task(), slurm(tmp_path))
    assert str(err.value) == message


def test_installed_release_is_the_default_target(tmp_path):
    with pytest.raises(ConfigError, match=r"needs nvidia-resiliency-ext >= 0.6 .* rendered for 0.4.1 \(installed "
                                          r"nvidia-resiliency-ext\); if the cluster runs a newer release, say which: "
                                          r"FaultTolerancePlugin\(nvrx_version='0.6'\)$"):
        FaultTolerancePlugin(per_cycle_logs=True).setup(task(), slurm(tmp_path))


def yaml_of(executor) -> str:
    return executor.setup_lines.split("<<'MEGATRON_RESILIENCE_FT_CFG'\n", 1)[1].split("MEGATRON_RESILIENCE_FT_CFG")[0]


def test_storage_check_defaults_to_the_runs_checkpoint_and_data_directories(tmp_path):
    # through an SSH tunnel: the cluster's /lustre is not this machine's, so the submit-time path check stays off
    executor = run.SlurmExecutor(account="a", time="01:00:00",
                                 tunnel=run.SSHTunnel(host="login", user="u", job_dir="/cluster/exp"))
    executor.assign("job_1", str(tmp_path / "job_1"), task_id="job", task_dir="job")
    t = task(checkpoint=run.Config(CheckpointConfig, save="/lustre/ckpt", load="/lustre/pretrained"),
             data=run.Config(DataConfig, data_path=["0.7", "/lustre/data/a_text", "0.3", "/datasets/b_text"]))
    FaultTolerancePlugin(nvrx_version="0.7", storage_health_check=True).setup(t, executor)
    assert "  storage_healthcheck_path: /lustre/ckpt,/lustre/pretrained,/lustre/data,/datasets\n" in yaml_of(executor)
    assert executor.setup_lines.startswith("# >>> megatron_resilience FaultTolerancePlugin ft_launcher config >>>\n"
                                           "mkdir -p /lustre/ckpt\n")  # a fresh run's checkpoint directory
    with pytest.raises(ConfigError, match=r"^FaultTolerancePlugin.storage_health_check: the task names no checkpoint "
                                          r"or data directory the plugin can read; set storage_health_check_paths"):
        FaultTolerancePlugin(nvrx_version="0.7", storage_health_check=True).setup(
            run.Script(path="train.py", entrypoint="python"), slurm(tmp_path / "x"))


def test_progress_tracker_reads_the_checkpoint_tracker_file_and_allows_the_rerun_replay(tmp_path):
    ckpt = run.Config(CheckpointConfig, save="/lustre/ckpt", save_interval=100)
    executor = slurm(tmp_path)
    FaultTolerancePlugin(nvrx_version="0.7").setup(task(checkpoint=ckpt), executor)
    assert "  checkpoint_iteration_file: /lustre/ckpt/latest_checkpointed_iteration.txt\n" in yaml_of(executor)
    executor = slurm(tmp_path / "off")
    FaultTolerancePlugin(nvrx_version="0.7", max_no_progress_cycles=0).setup(task(checkpoint=ckpt), executor)
    assert "checkpoint_iteration_file" not in yaml_of(executor)  # tracking off: no file to point at
    with pytest.raises(ConfigError) as err:
        FaultTolerancePlugin(nvrx_version="0.7", max_no_progress_cycles=1).setup(
            task(checkpoint=ckpt, rerun=run.Config(RerunConfig, rerun_mode="validate_results")), slurm(tmp_path / "r"))
    assert str(err.value) == (
        "FaultTolerancePlugin.max_no_progress_cycles: must be >= 2 (or <= 0: off) while the rerun state machine "
        "validates results (rerun_mode=validate_results): after its exit 16 the next cycle replays the suspicious "
        "step from the same checkpoint, a cycle without checkpoint progress by design; got 1")


def test_megatron_lm_run_gets_its_tracker_file_and_data_directory(tmp_path):
    from golden_cases import megatron_lm_task

    executor = slurm(tmp_path)
    FaultTolerancePlugin(nvrx_version="0.7", storage_health_check=True).setup(megatron_lm_task(), executor)
    assert "  storage_healthcheck_path: /lustre/runs/gpt/ckpt,/lustre/data\n" in yaml_of(executor)
    assert "  checkpoint_iteration_file: /lustre/runs/gpt/ckpt/latest_checkpointed_iteration.txt\n" in yaml_of(executor)


def test_in_job_restart_count_is_chosen_by_release_and_said(caplog):
    """num_in_job_restarts=None: no count where ft_launcher tracks progress, NeMo's 3 where it cannot; an explicit
    count is kept. The log line says which and why (a plugin that picks a user's setting says so)."""
    from megatron_resilience.plugins import in_job_restarts

    tracker = "/lustre/run/ckpt/latest_checkpointed_iteration.txt"
    with caplog.at_level(logging.INFO, logger="megatron_resilience.plugins"):
        assert in_job_restarts.resolve(None, (0, 7), tracker) == 1000
        assert in_job_restarts.resolve(None, (0, 4, 1), None) == 3
        assert in_job_restarts.resolve(None, (0, 7), None) == 3
        assert in_job_restarts.resolve(5, (0, 7), tracker) == 5
    assert [r.getMessage() for r in caplog.records] == [
        "FaultTolerancePlugin: num_in_job_restarts=None -> 1000: ft_launcher (nvidia-resiliency-ext 0.7) tracks "
        f"progress in {tracker}, so only cycles without a newer checkpoint end the in-job restarts (and the "
        "allocation's time limit), not a count",
        "FaultTolerancePlugin: num_in_job_restarts=None -> 3 (nvidia-resiliency-ext 0.4.1 tracks no progress); after "
        "the last one the batch script's decision requeues an advancing run with its budget refilled",
        "FaultTolerancePlugin: num_in_job_restarts=None -> 3 (ft_launcher's progress tracking is off or has no "
        "checkpoint tracker file to read); after the last one the batch script's decision requeues an advancing run "
        "with its budget refilled"]
