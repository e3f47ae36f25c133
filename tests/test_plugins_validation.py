"""Bad plugin inputs fail before anything is submitted, each with a message that names the setting."""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import ConfigError  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402


def task():
    return run.Partial(pretrain, run_dir="/runs/gpt")


def slurm(**kw):
    kw.setdefault("time", "01:00:00")
    return run.SlurmExecutor(account="acct", tunnel=run.LocalTunnel(job_dir="/cluster/experiments"), **kw)


def other_function(x: int = 1) -> int:
    return x


@pytest.mark.parametrize("kwargs, message", [
    ({"step_timeout": 0}, "FaultTolerancePlugin.step_timeout: must be a number > 0, got 0"),
    ({"setup_timeout": -5}, "FaultTolerancePlugin.setup_timeout: must be a number > 0, got -5"),
    ({"checkpointing_timeout": -1.5}, "FaultTolerancePlugin.checkpointing_timeout: must be a number > 0, got -1.5"),
    ({"out_of_section_timeout": 0}, "FaultTolerancePlugin.out_of_section_timeout: must be a number > 0, got 0"),
    ({"initial_rank_heartbeat_timeout": 0},
     "FaultTolerancePlugin.initial_rank_heartbeat_timeout: must be a number > 0, got 0"),
    ({"rank_heartbeat_timeout": -300}, "FaultTolerancePlugin.rank_heartbeat_timeout: must be a number > 0, got -300"),
    ({"workload_check_interval": 0}, "FaultTolerancePlugin.workload_check_interval: must be a number > 0, got 0"),
    ({"num_in_job_restarts": -1}, "FaultTolerancePlugin.num_in_job_restarts: must be an integer >= 0, got -1"),
    ({"num_job_retries_on_failure": -2},
     "FaultTolerancePlugin.num_job_retries_on_failure: must be an integer >= 0, got -2"),
    ({"num_in_job_restarts": 1.5}, "FaultTolerancePlugin.num_in_job_restarts: must be an integer, got 1.5"),
    ({"rank_termination_signal": "SIGFOO"}, "FaultTolerancePlugin.rank_termination_signal: must be one of ["),
    ({"log_level": "LOUD"},
     "FaultTolerancePlugin.log_level: must be one of ['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'], got 'LOUD'"),
    ({"nvrx_version": "latest"},
     "FaultTolerancePlugin.nvrx_version: must be a version string from '0.4' on, like '0.7'"),
    ({"enable_ft_package": "yes"}, "FaultTolerancePlugin.enable_ft_package: must be true or false, got 'yes'"),
])
def test_fault_tolerance_plugin_rejects(kwargs, message):
    with pytest.raises(ConfigError) as err:
        FaultTolerancePlugin(**kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("kwargs, message", [
    ({"preempt_time": 0}, "PreemptionPlugin.preempt_time: must be an integer >= 1, got 0"),
    ({"preempt_time": -60}, "PreemptionPlugin.preempt_time: must be an integer >= 1, got -60"),
    ({"signal": "SIGKILL"}, "PreemptionPlugin.signal: must be one of ['SIGTERM', 'SIGINT', 'SIGUSR1', 'SIGUSR2', "
                            "'SIGHUP', 'SIGQUIT', 'SIGALRM', 'SIGCONT'], got 'SIGKILL'"),
    ({"signal": "TERM"}, "PreemptionPlugin.signal: must be one of ['SIGTERM'"),
    ({"enable_exit_handler": 1}, "PreemptionPlugin.enable_exit_handler: must be true or false, got 1"),
    ({"cloud_notice": "oracle"},
     "PreemptionPlugin.cloud_notice: must be one of ['aws', 'azure', 'gcp'] or None, got 'oracle'"),
    ({"cloud_notice": "aws", "cloud_notice_interval": 0},
     "PreemptionPlugin.cloud_notice_interval: must be a number > 0, got 0"),
    ({"cloud_notice": "gcp", "enable_exit_handler": False},
     "PreemptionPlugin.enable_exit_handler: must be true with cloud_notice"),
    ({"cloud_notice": "aws", "cloud_notice_url": "metadata.internal"},
     "PreemptionPlugin.cloud_notice_url: must be http(s)://HOST[:PORT]"),
])
def test_preemption_plugin_rejects(kwargs, message):
    with pytest.raises(ConfigError) as err:
        PreemptionPlugin(**kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("time, preempt_time, message", [
    ("01:00:00", 3600, "PreemptionPlugin.preempt_time: must be below the executor's time limit "
                       "executor.time='01:00:00' (3600 s), got 3600"),
    ("1", 60, "PreemptionPlugin.preempt_time: must be below the executor's time limit "
              "executor.time='1' (60 s), got 60"),
    ("00:01:00", 90, "PreemptionPlugin.preempt_time: must be below the executor's time limit "
                     "executor.time='00:01:00' (60 s), got 90"),
    ("1:30", 120, "PreemptionPlugin.preempt_time: must be below the executor's time limit executor.time='1:30' "
                  "(90 s), got 120"),
    ("soon", 60, "executor.time: must be a Slurm time like '01:30:00' or '1-00:00:00', got 'soon'"),
])
def test_preempt_time_must_be_below_the_time_limit(time, preempt_time, message):
    with pytest.raises(ConfigError) as err:
        preview(task(), slurm(time=time), [PreemptionPlugin(preempt_time=preempt_time)])
    assert str(err.value) == message


@pytest.mark.parametrize("time, preempt_time", [("1-00:00:00", 86399), ("2-0", 3600), ("00:02:00", 30),
                                                ("UNLIMITED", 10**6)])
def test_preempt_time_below_the_limit_is_accepted(time, preempt_time):
    assert f"#SBATCH --signal=SIGTERM@{preempt_time}" in preview(
        task(), slurm(time=time), [PreemptionPlugin(preempt_time=preempt_time)])


@dataclasses.dataclass(kw_only=True)
class HomeGrownExecutor(run.Executor):
    """An executor class nemo_run has no scheduler for (as KubeRayExecutor, which hosts Ray clusters; it needs the
    kubernetes package, not installed here)."""


@pytest.mark.parametrize("plugin", [FaultTolerancePlugin, PreemptionPlugin])
def test_executor_that_cannot_run_a_launcher_is_an_error_naming_those_that_can(plugin):
    executor = HomeGrownExecutor()
    with pytest.raises(ConfigError) as err:
        plugin().setup(task(), executor)
    assert str(err.value) == (
        f"{plugin.__name__}: {type(executor).__name__} cannot run a task under a launcher (nemo_run has no scheduler "
        "that starts run.Script or run.Partial tasks on it), so there is nothing to set up; use one of: "
        "run.SlurmExecutor, run.LocalExecutor, run.DockerExecutor, run.SkypilotExecutor, run.SkypilotJobsExecutor, "
        "run.LeptonExecutor, run.DGXCloudExecutor, run.KubeflowExecutor")


def test_preview_needs_a_slurm_executor():
    with pytest.raises(ConfigError, match=r"^preview: needs a run.SlurmExecutor \(the sbatch script\), "
                                          r"got LocalExecutor$"):
        preview(task(), run.LocalExecutor(), [])


@pytest.mark.parametrize("bad_task, message", [
    (run.Config(other_function), "unsupported task type Config; a task is a run.Partial or a run.Script"),
    (run.Script(inline="python -m megatron_resilience run_dir=/a\npython -m megatron_resilience run_dir=/b"),
     "the inline run.Script must run 'python -m megatron_resilience key=value ...' exactly once, found 2"),
    (run.Script(inline="python -m megatron_resilience run_dir=/a\necho done"),
     "'python -m megatron_resilience' must be the last command of the inline run.Script"),
    (run.Script(inline="python -m megatron_resilience run_dir=/a | tee log"),
     "the trainer line of the inline run.Script must be a single command (no |)"),
    (run.Script(inline="cd /work && python -m megatron_resilience run_dir=/a"),
     "the trainer line of the inline run.Script must be a single command (no &&)"),
])
@pytest.mark.parametrize("plugin", [FaultTolerancePlugin, PreemptionPlugin])
def test_task_the_plugins_cannot_make_signal_safe(plugin, bad_task, message):
    """Not a task form at all, or our trainer in an inline script in a way that cannot be exec'ed."""
    with pytest.raises(ConfigError) as err:
        preview(bad_task, slurm(), [plugin()])
    assert str(err.value).startswith(f"{plugin.__name__}: {message}")


@pytest.mark.parametrize("plugins, executor_kw, message", [
    (lambda: [FaultTolerancePlugin(), FaultTolerancePlugin(num_in_job_restarts=5)], {},
     "conflicting plugins: FaultTolerancePlugin is given twice for the same job; "
     "pass one FaultTolerancePlugin with all its settings"),
    (lambda: [PreemptionPlugin(), FaultTolerancePlugin(), PreemptionPlugin(preempt_time=30)], {},
     "conflicting plugins: PreemptionPlugin is given twice for the same job; "
     "pass one PreemptionPlugin with all its settings"),
    (lambda: [FaultTolerancePlugin()], {"launcher": run.FaultTolerance(max_restarts=5)},
     "conflicting settings: executor.launcher.max_restarts=5 but FaultTolerancePlugin needs 3 (mode=sections); "
     "configure fault tolerance on the FaultTolerancePlugin only"),
    (lambda: [FaultTolerancePlugin()], {"launcher": run.FaultTolerance(rank_heartbeat_timeout=600)},
     "conflicting settings: executor.launcher.rank_heartbeat_timeout=600 but FaultTolerancePlugin needs None "
     "(mode=sections)"),
    (lambda: [FaultTolerancePlugin()], {"launcher": run.SlurmTemplate(template_inline="{{ command }}")},
     "conflicting launcher: executor.launcher is SlurmTemplate, but FaultTolerancePlugin needs ft_launcher "
     "(run.FaultTolerance); use launcher=None, 'torchrun' or 'ft'"),
    (lambda: [FaultTolerancePlugin()], {"env_vars": {"PET_FT_CFG_PATH": "/my/ft.yaml"}},
     "conflicting settings: executor.env_vars['PET_FT_CFG_PATH']='/my/ft.yaml', but FaultTolerancePlugin sets it "
     "to '/nemo_run/megatron_resilience.entry.pretrain_ft_cfg.yml'; remove the env var"),
    (lambda: [PreemptionPlugin()], {"signal": "USR1@300"},
     "conflicting settings: executor.signal='USR1@300' but PreemptionPlugin needs 'SIGTERM@60'; "
     "set signal and preempt_time on the PreemptionPlugin only"),
    (lambda: [PreemptionPlugin(preempt_time=90)], {"additional_parameters": {"signal": "B:SIGTERM@90"}},
     "conflicting settings: executor.additional_parameters['signal']='B:SIGTERM@90' but PreemptionPlugin needs "
     "'SIGTERM@90'"),
])
def test_conflicts(plugins, executor_kw, message):
    with pytest.raises(ConfigError) as err:
        preview(task(), slurm(**executor_kw), plugins())
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("plugins, launcher, name", [
    (lambda: [FaultTolerancePlugin(), PreemptionPlugin(signal="SIGUSR1")], None, "FaultTolerancePlugin"),
    (lambda: [PreemptionPlugin(signal="SIGUSR1"), FaultTolerancePlugin()], None, "FaultTolerancePlugin"),
    (lambda: [PreemptionPlugin(signal="SIGUSR2")], "torchrun", "PreemptionPlugin"),
])
def test_signal_a_launcher_would_not_forward(plugins, launcher, name):
    with pytest.raises(ConfigError) as err:
        preview(task(), slurm(launcher=launcher), plugins())
    sig = "SIGUSR2" if launcher else "SIGUSR1"
    which = "torchrun" if launcher else "ft_launcher"
    if name == "FaultTolerancePlugin" and plugins()[0].__class__ is FaultTolerancePlugin:
        name = "PreemptionPlugin"  # FT ran first: the PreemptionPlugin finds ft_launcher already there
    assert str(err.value) == (
        f"{name}: PreemptionPlugin.signal={sig} would not reach the trainer: {which} forwards only SIGTERM, "
        f"SIGINT, SIGHUP, SIGQUIT to the training ranks (any other signal ends {which} itself); use one of those")


def test_compatible_user_launchers_are_accepted():
    ft = preview(task(), slurm(launcher=run.FaultTolerance(max_restarts=3, log_level="INFO")), [FaultTolerancePlugin()])
    torchrun = preview(task(), slurm(launcher=run.Torchrun(rdzv_port=29600)), [FaultTolerancePlugin()])
    assert "ft_launcher --ft-workload_check_interval 5.0" in ft
    assert "--rdzv-endpoint localhost:0" in torchrun and "ft_launcher" in torchrun
    same_signal = preview(task(), slurm(signal="SIGTERM@60"), [PreemptionPlugin()])
    assert same_signal.count("#SBATCH --signal=SIGTERM@60") == 1


def test_errors_come_before_anything_is_submitted(tmp_path):
    """Through run.run (dryrun) the error is raised while the job is added: no sbatch, no job dir."""
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    home = get_nemorun_home()
    set_nemorun_home(str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="PreemptionPlugin.preempt_time: must be below"):
            run.run(task(), executor=slurm(time="00:01:00"), plugins=[PreemptionPlugin()], dryrun=True)
    finally:
        set_nemorun_home(home)
    assert not [f for _, _, files in os.walk(tmp_path) for f in files]


@pytest.mark.parametrize("no_run_dir, message", [
    (run.Partial(pretrain), "run_dir: required, e.g. run.Partial(pretrain, run_dir='/path/to/run')"),
    (run.Script(path="megatron_resilience", m=True, entrypoint="python"),
     "run_dir: required, e.g. run_dir=/path/to/run"),
])
def test_preemption_needs_the_run_dir_for_the_requeue_decision(no_run_dir, message):
    # The submit-time task check (plugins/task_check.py) names the missing key before the plugin would.
    with pytest.raises(ConfigError) as err:
        preview(no_run_dir, slurm(launcher="torchrun"), [PreemptionPlugin()])
    assert str(err.value) == message


def _trained(**train):
    from megatron_resilience.config import ParallelConfig, TrainingConfig

    tp = train.pop("tp", 1)
    return run.Partial(pretrain, run_dir="/runs/gpt", train=run.Config(TrainingConfig, **train),
                       parallel=run.Config(ParallelConfig, tensor_model_parallel_size=tp))


@pytest.mark.parametrize("make_task, nodes, min_nodes, message", [
    (task, 2, 3, "FaultTolerancePlugin.min_nodes: must be between 1 and the job's node count executor.nodes=2, "
                 "got 3"),
    (lambda: _trained(micro_batch_size=4, global_batch_size=16), 4, 3,
     "train.global_batch_size: must be a multiple of train.micro_batch_size * data-parallel size at every node "
     "count FaultTolerancePlugin.min_nodes=3 allows (3..4 nodes: DP 3, 4, micro batch 4): allowed values are "
     "multiples of 48, got 16"),
    (lambda: _trained(tp=2), 4, 1,
     "FaultTolerancePlugin.min_nodes: at 1 node(s) x 1 rank(s) the world size 1 is not a multiple of tensor x "
     "pipeline parallel = 2; allowed values: [4], got 1"),
])
def test_a_node_range_the_job_cannot_run_is_refused_at_submit_time(make_task, nodes, min_nodes, message):
    with pytest.raises(ConfigError) as err:
        preview(make_task(), slurm(nodes=nodes, ntasks_per_node=1), [FaultTolerancePlugin(min_nodes=min_nodes)])
    assert str(err.value) == message


def test_an_unset_global_batch_is_fixed_at_the_full_size_with_a_log_line(caplog):
    import fiddle as fdl

    caplog.set_level("INFO", "megatron_resilience.plugins")
    job = _trained(micro_batch_size=2)
    executor = slurm(nodes=2, ntasks_per_node=1)
    executor.assign("gpt_1", "/tmp/gpt_1", task_id="gpt", task_dir="gpt")
    FaultTolerancePlugin(min_nodes=1).setup(job, executor)
    assert fdl.build(job.train).global_batch_size == 4  # micro batch 2 x DP 2, also a multiple of 2 x DP 1
    assert ("FaultTolerancePlugin: task train.global_batch_size: None (default) -> 4 (min_nodes=1: fixed at the full "
            "size's micro batch x DP 2, so the training stays the same on fewer nodes)") in caplog.messages


def test_min_nodes_is_checked_when_the_plugin_is_made():
    with pytest.raises(ConfigError, match=r"^FaultTolerancePlugin\.min_nodes: must be an integer >= 1, got 0$"):
        FaultTolerancePlugin(min_nodes=0)


@pytest.mark.parametrize("policy, inprocess, min_nodes, version, warned", [
    ("min-healthy", False, 1, (0, 4, 1), "FaultTolerancePlugin.min_nodes=1 with FaultTolerancePlugin.restart_policy="
     "'min-healthy' on nvidia-resiliency-ext 0.4.1: "),
    ("min-healthy", True, 1, (0, 5), "FaultTolerancePlugin.min_nodes=1 with FaultTolerancePlugin.restart_policy="
     "'min-healthy' (chosen by FaultTolerancePlugin.inprocess_restart=True) on nvidia-resiliency-ext 0.5: "),
    ("any-failed", False, 1, (0, 4, 1), None),
    (None, False, 1, (0, 4, 1), None),
    ("min-healthy", False, 2, (0, 4, 1), None),  # no range: min_nodes = executor.nodes
    ("min-healthy", False, 1, (0, 7), None),  # 0.6+: a range is hot spares (and min-healthy is refused there)
])
def test_min_healthy_on_a_node_range_is_a_warning_naming_both_keys(caplog, policy, inprocess, min_nodes, version,
                                                                     warned):
    """docs/elastic.md: with min-healthy the shrink and the job-level grow-back work, but ft_launcher adds no node
    that joins after a round closed and counts restarts per round: a warning that says so and what to set, at the
    node range's submit-time check (``node_range.setup``, given the policy the plugin renders)."""
    from megatron_resilience.plugins import node_range
    from megatron_resilience.plugins.executors import executor_profile

    caplog.set_level("WARNING", "megatron_resilience.plugins")
    executor = slurm(nodes=2, ntasks_per_node=1)
    node_range.setup(min_nodes, editor=None, executor=executor, profile=executor_profile(executor, "x"),
                     version=version, restart_policy=policy, inprocess_restart=inprocess)
    found = [m for m in caplog.messages if "min-healthy mode" in m]
    if warned is None:
        assert found == []
        return
    tail = " (with inprocess_restart=True every dead process then restarts all workers)" if inprocess else ""
    assert found == [warned + (
        "ft_launcher turns upscaling off in min-healthy mode, so a node that joins after a rendezvous round closed "
        "(one that started late) is not added to the running job until the next restart, and in-job restarts are "
        "counted per rendezvous round for the whole job; a lost node still shrinks the job, and the job level grows "
        "it back at the next requeue. To let a late node join inside the allocation, set "
        "FaultTolerancePlugin.restart_policy='any-failed'") + tail]
    assert node_range.remembered(executor) == {"min_nodes": 1, "nodes": 2, "ntasks_per_node": 1}  # still set up


@pytest.mark.parametrize("kwargs, chosen_by_inprocess", [
    ({"inprocess_restart": True}, True),
    ({"restart_policy": "min-healthy"}, False),
])
def test_the_plugin_warns_about_min_healthy_on_a_node_range_it_renders(caplog, kwargs, chosen_by_inprocess):
    """Through ``FaultTolerancePlugin.setup`` itself: the policy the plugin renders (the user's, or the one in-process
    restart chooses on 0.4.x) reaches the node range's check."""
    caplog.set_level("WARNING", "megatron_resilience.plugins")
    executor = slurm(nodes=2, ntasks_per_node=1)
    executor.assign("gpt_1", "/tmp/gpt_1", task_id="gpt", task_dir="gpt")
    FaultTolerancePlugin(min_nodes=1, nvrx_version="0.4.1", **kwargs).setup(_trained(micro_batch_size=2), executor)
    source = "FaultTolerancePlugin.restart_policy='min-healthy'" + (
        " (chosen by FaultTolerancePlugin.inprocess_restart=True)" if chosen_by_inprocess else "")
    found = [m for m in caplog.messages if "min-healthy mode" in m]
    assert len(found) == 1 and found[0].startswith(f"FaultTolerancePlugin.min_nodes=1 with {source} on "
                                                   "nvidia-resiliency-ext 0.4.1: "), found
