"""``FaultTolerancePlugin(inprocess_restart=True)`` on a Megatron-LM script, by megatron-core release
(plugins/megatron_lm_flags.py ``check_inprocess_restart``): refused with ``--enable-ft-package`` on every release and
without it from 0.18, warned on 0.17.1, left alone before.

Why: Megatron-LM's real trainer (megatron-core 0.19.2, nvidia-resiliency-ext 0.7.0, 2 CPU ranks) restarted in-process
after an exception fails every restart iteration, with ``AssertionError('rank monitor client is already
initialized.')`` under ``--enable-ft-package`` and ``AssertionError('args is not initialized.')`` without, and never
resumes (``tests/megatron_lm/test_megatron_lm_inprocess_restart.py``, the lane ``make test-megatron-lm``; the
upstream changes and their releases: ``megatron_resilience/upstream/megatron_lm.py``). The release checked is the
one the user names (``megatron_core_version``) or else the one installed where the job is submitted.
"""

from __future__ import annotations

import logging

import pytest

from megatron_resilience.config import ConfigError
from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.upstream.versions import package_version

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin  # noqa: E402

LOGGER = "megatron_resilience.plugins"
SCRIPT = "/opt/megatron-lm/pretrain_gpt.py"
OWN = ["--micro-batch-size", "4", "--train-iters", "1000", "--save", "/lustre/ckpt", "--save-interval", "100"]
INSTEAD = ("use ft_launcher's in-job restart instead: FaultTolerancePlugin(inprocess_restart=False) restarts the "
           "worker group, which resumes from --load (local_checkpoint_dir still adds node-local saves)")
FT_REASON = ("with --enable-ft-package (enable_ft_package=True) each one fails in Megatron-LM's ft_integration.setup "
             "with 'AssertionError: rank monitor client is already initialized.': the first iteration's client is "
             "shut down only by a pretrain that returns (every release with --inprocess-restart, 0.13.0 to "
             "Megatron-LM's main, read; measured with 0.19.2)")
FOREVER = " (a failed iteration is restarted forever: no release passes --inprocess-max-iterations to the wrapper)"
STORE = ("from 0.17.1 (Megatron-LM PR #4420, backported by #4453) pretrain annotates inprocess_call_wrapper as "
         "Optional[Any], so nvidia-resiliency-ext's wrapper never passes it its CallWrapper and every restart "
         "iteration's process group meets the previous one's keys in one restart store")
HEAD = "FaultTolerancePlugin.inprocess_restart: no in-process restart iteration of Megatron-LM can run here: "


def args_reason(version: str, source: str) -> str:
    return (f"with megatron-core {version} ({source}) each one fails with 'AssertionError: args is not "
            f"initialized.': from 0.18 (Megatron-LM PR #4225) pretrain_gpt.py parses its arguments before the "
            f"in-process wrapper, whose finalize destroys them (measured with 0.19.2)")


def refusal(version: str, source: str, ft: bool) -> str:
    reasons = ([FT_REASON] if ft else []) + [args_reason(version, source)]
    return (HEAD + "; and ".join(reasons) + FOREVER + f"; also, {STORE}; {INSTEAD}; if the cluster's container "
            "runs another megatron-core, name it: FaultTolerancePlugin(megatron_core_version='0.17.0')")


SHARED_STORE = ("FaultTolerancePlugin: Megatron-LM --inprocess-restart with megatron-core 0.17.1 "
                f"(FaultTolerancePlugin.megatron_core_version='0.17.1'): {STORE} (seen once by hand with 0.19.2: two "
                "restart iterations failed in the process-group rendezvous before a third resumed)")


def slurm():
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    return executor


def setup(plugin, caplog, path=SCRIPT):
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Script(path=path, entrypoint="python", args=list(OWN))
    plugin.setup(task, slurm())
    return [str(a) for a in task.args], [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("ft", [True, False])
@pytest.mark.parametrize("version", ["0.19.2", "0.18", "1.0"])
def test_a_megatron_core_from_0_18_is_refused_with_the_field_the_release_and_the_upstream_cause(caplog, version, ft):
    with pytest.raises(ConfigError) as raised:
        setup(FaultTolerancePlugin(inprocess_restart=True, megatron_core_version=version, enable_ft_package=ft),
              caplog)
    assert str(raised.value) == refusal(version, f"FaultTolerancePlugin.megatron_core_version={version!r}", ft)


@pytest.mark.parametrize("version", ["0.17.0", "0.17.1", None])
def test_the_ft_package_is_refused_on_every_release(caplog, version, monkeypatch):
    """``None``: no megatron-core where the job is submitted (set here, not imported)."""
    from megatron_resilience.plugins import megatron_lm_flags

    monkeypatch.setattr(megatron_lm_flags, "package_version", lambda name: None)
    with pytest.raises(ConfigError) as raised:
        setup(FaultTolerancePlugin(inprocess_restart=True, megatron_core_version=version), caplog)
    assert str(raised.value) == (HEAD + FT_REASON + FOREVER + (f"; also, {STORE}" if version == "0.17.1" else "")
                                 + f"; {INSTEAD}; or FaultTolerancePlugin(enable_ft_package=False), leaving hangs "
                                 "to the in-process wrapper's timeouts")


def test_0_17_1_without_the_ft_package_is_warned_that_its_restart_iterations_share_one_store(caplog):
    args, messages = setup(FaultTolerancePlugin(inprocess_restart=True, megatron_core_version="0.17.1",
                                                enable_ft_package=False), caplog)
    assert "--inprocess-restart" in args and "--enable-ft-package" not in args
    assert SHARED_STORE in messages


@pytest.mark.parametrize("version", ["0.17.0", "0.16"])
def test_before_0_17_1_without_the_ft_package_nothing_is_said(caplog, version):
    args, messages = setup(FaultTolerancePlugin(inprocess_restart=True, megatron_core_version=version,
                                                enable_ft_package=False), caplog)
    assert "--inprocess-restart" in args
    assert not any("Megatron-LM --inprocess-restart" in m for m in messages), messages


def test_without_the_field_the_megatron_core_installed_here_decides(caplog):
    """The same test in either lane: ``make test`` has megatron-core 0.16.1 (nothing said), the newest lane 0.19.2
    (refused, naming the installed release)."""
    installed = package_version("megatron-core")
    plugin = FaultTolerancePlugin(inprocess_restart=True, enable_ft_package=False)
    if installed is not None and installed >= (0, 18):
        with pytest.raises(ConfigError) as raised:
            setup(plugin, caplog)
        assert str(raised.value) == refusal(".".join(map(str, installed)), "installed where the job is submitted",
                                            ft=False)
    else:
        assert installed is not None and installed < (0, 17, 1), installed  # both lanes' releases
        args, messages = setup(plugin, caplog)
        assert "--inprocess-restart" in args and not any("Megatron-LM --inprocess-restart" in m for m in messages)


def test_no_megatron_core_where_the_job_is_submitted_is_a_warning_naming_the_field(caplog, monkeypatch):
    """A login node without megatron-core (the installed version is set here, not imported)."""
    from megatron_resilience.plugins import megatron_lm_flags

    monkeypatch.setattr(megatron_lm_flags, "package_version", lambda name: None)
    args, messages = setup(FaultTolerancePlugin(inprocess_restart=True, enable_ft_package=False), caplog)
    assert "--inprocess-restart" in args
    assert ("FaultTolerancePlugin: Megatron-LM --inprocess-restart and no megatron-core installed here: from "
            "megatron-core 0.18 no in-process restart iteration can run (Megatron-LM PR #4225: 'AssertionError: args "
            "is not initialized.'), from 0.17.1 its iterations share one restart store (PR #4420/#4453); name the "
            "cluster's release with FaultTolerancePlugin(megatron_core_version=...) to have it checked") in messages


def test_other_trainers_and_megatron_lm_without_inprocess_restart_are_not_checked(caplog):
    # a Bridge script's in-process restart is Bridge's own adapter, not Megatron-LM's pretrain_gpt.py
    bridge = "/opt/Megatron-Bridge/scripts/training/run_recipe.py"
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Script(path=bridge, entrypoint="python", args=["--recipe", "llama3_8b"])
    FaultTolerancePlugin(inprocess_restart=True, megatron_core_version="0.19.2").setup(task, slurm())
    assert "++inprocess_restart.enabled=true" in task.args
    args, _ = setup(FaultTolerancePlugin(local_checkpoint_dir="/local/ckpt", local_checkpoint_interval=10,
                                         megatron_core_version="0.19.2"), caplog)
    assert "--inprocess-restart" not in args and "--non-persistent-ckpt-type" in args


@pytest.mark.parametrize("value, error", [
    (0.19, "FaultTolerancePlugin.megatron_core_version: must be the cluster's megatron-core release as a string, "
           "like '0.19.2' or '0.17' (or None: the one installed where the job is submitted); a number loses "
           "digits, quote it, got 0.19"),
    ("latest", "FaultTolerancePlugin.megatron_core_version: must be the cluster's megatron-core release as a "
               "string, like '0.19.2' or '0.17' (or None: the one installed where the job is submitted), got "
               "'latest'"),
])
def test_megatron_core_version_is_validated_naming_the_key(value, error):
    with pytest.raises(ConfigError) as raised:
        FaultTolerancePlugin(megatron_core_version=value)
    assert str(raised.value) == error


def test_the_users_own_inprocess_restart_flag_is_refused_too(caplog):
    """``--inprocess-restart`` written into the script's arguments, the plugin's field off: the plugin set nothing up
    for it (srun, the wrapper's environment), and Megatron-LM fails every restart iteration all the same."""
    caplog.set_level(logging.INFO, LOGGER)
    task = run.Script(path=SCRIPT, entrypoint="python", args=[*OWN, "--inprocess-restart"])
    with pytest.raises(ConfigError) as raised:
        FaultTolerancePlugin(megatron_core_version="0.19.2").setup(task, slurm())
    assert str(raised.value) == (
        "task: --inprocess-restart in the run.Script's args: no in-process restart iteration of Megatron-LM can run "
        "here: " + FT_REASON + "; and " + args_reason("0.19.2", "FaultTolerancePlugin.megatron_core_version='0.19.2'")
        + FOREVER + f"; also, {STORE}; remove --inprocess-restart from the script's args: ft_launcher's in-job restart "
        "then restarts the worker group, which resumes from --load (local_checkpoint_dir still adds node-local saves); "
        "if the cluster's container runs another megatron-core, name it: "
        "FaultTolerancePlugin(megatron_core_version='0.17.0')")
    args, messages = setup(FaultTolerancePlugin(megatron_core_version="0.17.0", enable_ft_package=False), caplog)
    assert "--inprocess-restart" not in args  # nothing checked, nothing said, where the flag is not given
