"""The log-monitoring tool's files work as they are, through every interface that takes a policy.

Fixtures (tests/joblevel_foreign/), written for these tests from that tool's documented schemas: its
"custom selective policy" example, a per-mode restart file (``SelectiveRestartPolicy`` / ``AlwaysRestartPolicy``
/ ``NoRestartPolicy``), a ``SlurmLogMonitor`` monitoring file (both signal forms), and beside each the
equivalent file in this package's schema, written by hand. Loaded through the plugin (``RestartPolicyPlugin``),
the CLI (``nemo megatron_resilience pretrain ... run.plugins=restart_policy``, the rendered job config read
back from its dry run) and the watcher (``--policy``/``--monitors``), each must decide every attempt of the
log corpus (tests/joblevel_corpus) exactly as the native file does. Also: the vocabulary mapping, monitor-only,
and the checks that reject a rule that can never fire or a requeue rule without a budget, in each interface.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
from test_cli import nemo
from test_joblevel_corpus import CASES, encode, lay_out

from megatron_resilience.config import ConfigError
from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster
from megatron_resilience.jobs.jobconfig import JobLevelConfig, resolve
from megatron_resilience.jobs.monitors import load_monitors
from megatron_resilience.jobs.policies import load_policy
from megatron_resilience.watch.cli import main as watch_main

HERE = os.path.join(os.path.dirname(__file__), "joblevel_foreign")
PAIRS = {  # foreign (policy, monitors) -> the native equivalent
    "custom_selective": (("custom_selective_policy.yaml", "production_monitoring.yaml"),
                         ("custom_selective_native.yaml", "production_native.yaml")),
    "transient": (("transient_policy.yaml", "production_monitoring.yaml"),
                  ("transient_native.yaml", "production_native.yaml")),
}


def path(name: str) -> str:
    return os.path.join(HERE, name)


def corpus_decisions(tmp_path, settings: dict) -> dict[str, tuple[str, str]]:
    """(error type, decision) of every corpus attempt, as the batch script's trap decides it with ``settings``."""
    out = {}
    for name, c in CASES.items():
        cfg, ledger = lay_out(tmp_path / name, c, None, settings)
        ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=c["exit_code"], slurm_state=c["state"],
                             by="batch", retries=3, node_info=c["node_info"], batch_signal=c["batch_signal"],
                             cluster_info=Cluster(nodes=c["nodes"] + ["spare-1", "spare-2"], partition="batch"))
        out[name] = (ending.classification.error_type, encode(ending.decision, ending.classification))
    return out


def plugin_settings(policy: str | None, monitors: str) -> dict:
    from megatron_resilience.plugins import RestartPolicyPlugin

    return RestartPolicyPlugin(policy=policy, monitors=monitors).settings()


def cli_settings(policy: str | None, monitors: str) -> dict:
    """The job-level config the CLI renders into the sbatch script (its dry run prints it)."""
    code, out, err = nemo("--factory", "gpt_126m", "--dryrun", "run.executor=slurm", "run.executor.account=acct",
                          "run.executor.partition=batch", "run.plugins=[ft,restart_policy]",
                          f"run.plugins[1].policy={policy or 'null'}", f"run.plugins[1].monitors={monitors}")
    assert code == 0, err
    found = re.search(r"<<'MEGATRON_RESILIENCE_JOB_LEVEL'\n(.*?)\nMEGATRON_RESILIENCE_JOB_LEVEL\n", out, re.S)
    cfg = json.loads(found.group(1))
    return {k: cfg[k] for k in ("policy", "monitors", "monitor_only", "inactivity_threshold")}


def watched(cfg: JobLevelConfig, tmp_path, *args: str) -> tuple[JobLevelConfig, int]:
    """The config the watcher's ``main`` (this process) would watch with for a run submitted with ``cfg``, given
    ``args`` (``--policy``/``--monitors``), and its exit code; the watching itself is replaced."""
    from unittest import mock

    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "gpt_job_level.json"
    config.write_text(cfg.to_json())
    used: list[JobLevelConfig] = []
    with mock.patch("megatron_resilience.watch.cli.watch", lambda c, **_: used.append(c) or 0):
        code = watch_main(["--config", str(config), "--job-id", "1", "--once", *args])
    return (used[0] if used else None), code


def job(tmp_path, **fields) -> JobLevelConfig:
    return JobLevelConfig(job_name="gpt", job_dir=str(tmp_path), ledger=str(tmp_path / "job_ledger.jsonl"),
                          finished_flag=str(tmp_path / "f"), **fields)


def watcher_settings(policy: str, monitors: str, tmp_path) -> dict:
    """A run submitted with a preset policy, watched with --policy/--monitors."""
    cfg, code = watched(job(tmp_path, policy=load_policy("default").to_dict()), tmp_path,
                        "--policy", policy, "--monitors", monitors)
    assert code == 0
    return {"policy": cfg.policy, "monitors": cfg.monitors, "monitor_only": cfg.monitor_only,
            "inactivity_threshold": cfg.inactivity_threshold}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_foreign_files_decide_the_corpus_like_their_native_equivalent_in_every_interface(tmp_path, pair):
    (policy, monitors), (native_policy, native_monitors) = PAIRS[pair]
    expected = corpus_decisions(tmp_path / "native", plugin_settings(path(native_policy), path(native_monitors)))
    assert len(expected) == len(CASES)
    for interface, settings in (("plugin", plugin_settings(path(policy), path(monitors))),
                                ("cli", cli_settings(path(policy), path(monitors))),
                                ("watcher", watcher_settings(path(policy), path(monitors), tmp_path / "w"))):
        got = corpus_decisions(tmp_path / interface, settings)
        differ = {k: (got[k], expected[k]) for k in expected if got[k] != expected[k]}
        assert not differ, f"{interface}: {differ}"
        assert settings["inactivity_threshold"] == 1200.0, interface  # the monitoring file's, in every interface
    # the corpus exercises what tells the policies apart
    kinds = {d for _, d in expected.values()}
    assert {"stop", "requeue", "free"} <= kinds, expected


def test_the_custom_selective_example_decides_as_documented(tmp_path):
    """That tool's example: only NCCL issues restart (5 times), OOM never, everything else stops."""
    got = corpus_decisions(tmp_path, plugin_settings(path("custom_selective_policy.yaml"),
                                                     path("production_monitoring.yaml")))
    assert got["nccl_timeout"] == ("nccl_timeout", "requeue")
    assert got["nccl_error_ib"] == ("nccl_error", "requeue")
    assert got["cuda_oom"] == ("cuda_oom", "stop")
    assert got["python_exception"] == ("python_exception", "stop")
    assert got["preempted_saved"] == ("preempted", "free")  # what every policy does
    assert got["user_cancel_after_saving"] == ("user_cancel", "stop")


def test_translation_says_what_each_foreign_key_became(caplog, monkeypatch):
    from megatron_resilience.jobs import monitors as monitors_module

    monkeypatch.setattr(monitors_module, "_SAID", set())  # said once per process: earlier tests loaded these files
    caplog.set_level(logging.INFO, logger="megatron_resilience.jobs")
    policy = load_policy(path("transient_policy.yaml"))
    assert policy.max_restarts == {"crash": 3, "stall": 2, "timeout": 1}
    assert [r.to_dict() for r in policy.rules] == [r.to_dict() for r in load_policy(
        path("transient_native.yaml")).rules]
    notes = list(policy.notes)
    for expected in (
        "policies[0] (mode crash, SelectiveRestartPolicy).exclude_error_types: oom -> cuda_oom, cpu_oom (CUDA out of "
        "memory and host out of memory)",
        "policies[0] (mode crash, SelectiveRestartPolicy).restart_on_error_types: cancelled -> system_cancel, "
        "preempted (cancelled or preempted by the system (never a person's scancel, which is never retried))",
        "policies[0] (mode crash, SelectiveRestartPolicy).restart_on_error_types: system_cancel, preempted: not a "
        "rule here",
        "policies[0] (mode crash, SelectiveRestartPolicy).restart_on_subsystems: distributed -> communication, "
        "distributed, network",
        "policies[0] (mode crash, SelectiveRestartPolicy).restart_reason: not used",
        "policies[1] (mode stall, AlwaysRestartPolicy) -> rule: requeue every stall, max_restarts.stall = 2",
        "policies[3] (mode success, NoRestartPolicy): a finished run always stops (no rule)",
        "policies[*].max_retries keeps its number and takes this package's meaning: failures of the mode since the "
        "run last advanced its checkpoint (an attempt that saved a newer checkpoint refills it), not failures over "
        "the whole run; the same failure 3 times in a row without progress always stops",
    ):
        assert any(n.startswith(expected) for n in notes), (expected, notes)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"{path('transient_policy.yaml')}: policies[1] (mode stall, AlwaysRestartPolicy) -> "
                            "rule: requeue every stall") for m in said), said
    monitors = {m.name: m for m in load_monitors([path("production_monitoring.yaml")])}
    assert (monitors["cuda_oom"].error_type, monitors["cuda_oom"].severity, monitors["xid"].error_type,
            monitors["loss_nan"].error_type) == ("cuda_oom", "fatal", "xid_error", "nan_inf")
    assert "training_iteration" not in monitors and "idle_output" not in monitors
    said = [r.getMessage() for r in caplog.records]
    assert f"{path('production_monitoring.yaml')}: inactivity_threshold_seconds: 1200 -> " \
           "RestartPolicyPlugin.inactivity_threshold (the watcher's stall detection, used while FT is off)" in said
    assert any("log_signals[1] (training_iteration): progress signal -> dropped" in m for m in said), said
    assert plugin_settings("default", path("production_monitoring.yaml"))["inactivity_threshold"] == 1200.0


@pytest.mark.parametrize("names, expected", [
    (["oom"], ("cuda_oom", "cpu_oom")),
    (["hardware"], ("xid_error", "ecc_error", "cuda_hang", "cuda_error", "node_fail", "rerun_resume")),
    (["cancelled"], ("system_cancel", "preempted")),
    (["slurm_failure", "numerical_instability"], ("node_fail", "batch_lost", "killed", "unknown", "nan_inf")),
    (["hang"], ("hang",)),  # in this package's files a shared name keeps this package's meaning
    (["watchdog_timeout", "exception"], ("watchdog_timeout", "python_exception")),
])
def test_the_foreign_vocabulary_is_accepted_wherever_an_error_type_is_named(tmp_path, names, expected):
    file = tmp_path / "p.yaml"
    file.write_text(f"name: p\nmax_restarts: {{crash: 1, stall: 1, timeout: 1}}\nexclude_error_types: {names}\n")
    assert load_policy(str(file)).exclude_error_types == expected


def test_a_name_that_maps_to_nothing_fails_naming_the_file_the_key_and_both_vocabularies(tmp_path):
    file = tmp_path / "p.yaml"
    file.write_text((open(path("custom_selective_policy.yaml")).read()).replace("- nccl_timeout", "- nccl_hiccup"))
    with pytest.raises(ConfigError) as err:
        load_policy(str(file))
    text = str(err.value)
    assert text.startswith(f"{file}: policies[0] (mode crash, SelectiveRestartPolicy).restart_on_error_types: "
                           "unknown error type 'nccl_hiccup'; must be one of this package's error types ['finished',")
    assert "'hardware'] or the log-monitoring tool's ['cancelled', 'communication', 'deadlock'," in text


@pytest.mark.parametrize("text, message", [
    ("policies:\n  - mode: crash\n    implementation: {class_name: SometimesRestartPolicy}\n",
     "policies[0].implementation.class_name: must be one of ['SelectiveRestartPolicy', 'AlwaysRestartPolicy', "
     "'NoRestartPolicy'], got 'SometimesRestartPolicy'"),
    ("policies:\n  - mode: stall\n    implementation: {class_name: AlwaysRestartPolicy}\n",
     "policies[0] (mode stall, AlwaysRestartPolicy).max_retries: not given, so restarts would be unbounded; a "
     "requeue needs a budget"),
    ("policies:\n  - mode: crash\n    implementation: {class_name: SelectiveRestartPolicy, retries: 3}\n",
     "policies[0] (mode crash, SelectiveRestartPolicy).retries: unknown key; allowed keys: ['class_name', "
     "'max_retries',"),
    ("policies:\n  - mode: hang\n    implementation: {class_name: NoRestartPolicy}\n",
     "policies[0].mode: must be one of ['crash', 'stall', 'timeout', 'success'], got 'hang'"),
    ("class_name: SlurmLogMonitor\nlog_signals:\n  - {name: x, pattern: y, state: {class_name: BrokenState}}\n",
     "log_signals[0] (x).state.class_name: must be one of ['CrashState', 'StalledState', 'TimeoutState', "
     "'SuccessState', 'StartedState', 'PendingState'], got 'BrokenState'"),
    ("class_name: SlurmLogMonitor\npoll_interval: 3\n",
     "poll_interval: unknown key of a SlurmLogMonitor file; allowed keys: ['class_name', 'poll_interval_seconds',"),
    ("class_name: SlurmLogMonitor\nlog_signals:\n  - {name: x, pattern: y, metadata: {error_type: lustre}}\n",
     "log_signals[0] (x).metadata.error_type: unknown error type 'lustre'; must be one of this package's error "
     "types"),
])
def test_bad_foreign_files_fail_naming_the_file_and_the_key(tmp_path, text, message):
    file = tmp_path / "f.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_monitors([str(file)]) if "SlurmLogMonitor" in text else load_policy(str(file))
    assert str(err.value).startswith(f"{file}: {message}"), str(err.value)


# --- the watcher's --policy / --monitors against what the job was submitted with ---------------------------------

def watch_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("megatron_resilience watch: ")
            and ": policies[" not in line]  # the translation notes of a foreign policy file: tested above


def test_watcher_policy_alone_keeps_the_monitors_the_job_was_submitted_with(tmp_path, capsys):
    """--policy FILE: the job's own monitors (its files, inlined at submission), not the policy's default set."""
    own = resolve(None, [path("production_native.yaml")])[1]
    assert any(isinstance(m, dict) for m in own)  # inlined: the user's file is not needed any more
    cfg, code = watched(job(tmp_path, policy=load_policy("default").to_dict(), monitors=own,
                            inactivity_threshold=600.0), tmp_path, "--policy", path("transient_policy.yaml"))
    assert code == 0
    assert (cfg.policy, cfg.monitors, cfg.inactivity_threshold, cfg.monitor_only) == (
        load_policy(path("transient_policy.yaml")).to_dict(), own, 600.0, False)
    assert watch_lines(capsys) == [
        f"megatron_resilience watch: deciding with policy transient_policy (--policy {path('transient_policy.yaml')}) "
        f"and monitors {len(own)} from the job's own files (the job's own)"]


def test_watcher_monitors_alone_take_the_foreign_files_inactivity_threshold(tmp_path, capsys):
    """--monitors <the log-monitoring tool's file>: its monitors, and its inactivity_threshold_seconds."""
    cfg, code = watched(job(tmp_path, policy=load_policy("default").to_dict()), tmp_path,
                        "--monitors", path("production_monitoring.yaml"))
    assert code == 0
    assert (cfg.policy, cfg.monitors, cfg.inactivity_threshold, cfg.monitor_only) == (
        load_policy("default").to_dict(), resolve(None, [path("production_monitoring.yaml")])[1], 1200.0, False)
    assert watch_lines(capsys) == [
        "megatron_resilience watch: deciding with policy default (the job's own) and monitors "
        f"{path('production_monitoring.yaml')} (--monitors)",
        "megatron_resilience watch: inactivity threshold 1200 s (inactivity_threshold_seconds of --monitors), "
        "instead of none"]


def test_watcher_monitors_of_a_monitor_only_job_stay_monitor_only(tmp_path, capsys):
    """A monitor-only job (policy=None) watched with that tool's monitoring file: still never acts; the file's
    inactivity threshold replaces the one the job was submitted with."""
    cfg, code = watched(job(tmp_path, monitor_only=True, inactivity_threshold=300.0), tmp_path,
                        "--monitors", path("production_monitoring.yaml"))
    assert code == 0
    assert (cfg.policy, cfg.monitor_only, cfg.inactivity_threshold) == (None, True, 1200.0)
    assert cfg.monitors == resolve(None, [path("production_monitoring.yaml")])[1]
    assert watch_lines(capsys) == [
        "megatron_resilience watch: deciding with policy none (monitor-only) (the job's own) and monitors "
        f"{path('production_monitoring.yaml')} (--monitors)",
        "megatron_resilience watch: inactivity threshold 1200 s (inactivity_threshold_seconds of --monitors), "
        "instead of 300 s"]


# --- monitor-only ---------------------------------------------------------------------------------------------

def test_monitor_only_classifies_and_records_and_never_requeues(tmp_path):
    """That tool's default without a restart file: RestartPolicyPlugin(policy=None) with its monitoring file."""
    settings = plugin_settings(None, path("production_monitoring.yaml"))
    assert (settings["policy"], settings["monitor_only"]) == (None, True)
    with_policy_ = corpus_decisions(tmp_path / "p", plugin_settings(path("transient_policy.yaml"),
                                                                    path("production_monitoring.yaml")))
    for interface, got in (("plugin", corpus_decisions(tmp_path / "m", settings)),
                           ("cli", corpus_decisions(tmp_path / "c", cli_settings(None,
                                                                                 path("production_monitoring.yaml"))))):
        assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in with_policy_.items()}, interface
        assert {d for _, d in got.values()} == {"record"}, (interface, got)  # recorded, never requeued


# --- rules that can never fire, requeues without a budget (issue 27) ----------------------------------------------

NEVER_FIRES = "name: p\nmax_restarts: {crash: 2}\nrules:\n  - match: {error_type: [user_cancel]}\n    action: requeue\n"
NO_BUDGET = "name: p\nmax_restarts: {crash: 2}\nrules:\n  - match: {error_type: [nccl_timeout]}\n    action: requeue\n"
PARTLY = ("name: p\nmax_restarts: {crash: 2}\nrules:\n  - match: {error_type: [nccl_error, nccl_timeout, preempted]}\n"
          "    action: requeue\n")
REJECTED = {
    "never": (NEVER_FIRES, "rules[0] (match {'error_type': ['user_cancel']}, action requeue): can never fire "
                           "(user_cancel: a person's scancel is never retried); remove the rule"),
    "budget": (NO_BUDGET, "rules[0] (match {'error_type': ['nccl_timeout']}, action requeue): requeues without a "
                          "budget: nccl_timeout (mode stall) but max_restarts.stall is 0, so the first such failure "
                          "stops the job; give max_restarts.stall a number > 0, or make the rule stop"),
}


@pytest.mark.parametrize("kind", sorted(REJECTED))
def test_plugin_rejects_a_rule_that_can_never_fire_or_requeue_at_submit_time(tmp_path, kind):
    from megatron_resilience.plugins import RestartPolicyPlugin

    text, message = REJECTED[kind]
    file = tmp_path / "p.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as err:
        RestartPolicyPlugin(policy=str(file))
    assert str(err.value) == f"{file}: {message}"


def test_plugin_warns_naming_the_rule_when_part_of_it_cannot_work(tmp_path, caplog):
    from megatron_resilience.plugins import RestartPolicyPlugin

    file = tmp_path / "p.yaml"
    file.write_text(PARTLY)
    caplog.set_level(logging.INFO, logger="megatron_resilience.jobs")
    RestartPolicyPlugin(policy=str(file))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    rule = f"{file}: rules[0] (match {{'error_type': ['nccl_error', 'nccl_timeout', 'preempted']}}, action " \
           "requeue)"
    assert f"{rule}: preempted never reach a rule (a preemption is always requeued without spending a retry)" in said
    assert f"{rule}: nccl_timeout (mode stall) cannot be requeued: max_restarts.stall is 0" in said


@pytest.mark.parametrize("kind", sorted(REJECTED))
def test_cli_rejects_a_rule_that_can_never_fire_or_requeue(tmp_path, kind):
    text, message = REJECTED[kind]
    file = tmp_path / "p.yaml"
    file.write_text(text)
    code, out, err = nemo("--factory", "gpt_126m", "--dryrun", "run.executor=slurm", "run.executor.account=acct",
                          "run.plugins=restart_policy", f"run.plugins.policy={file}")
    assert code == 1
    assert err == f"Error: {file}: {message}\n", err


@pytest.mark.parametrize("kind", sorted(REJECTED))
def test_watcher_rejects_a_rule_that_can_never_fire_or_requeue(tmp_path, kind, capsys):
    """``python -m megatron_resilience.watch ... --policy FILE`` (its main, in this process)."""
    from megatron_resilience.watch.cli import main

    text, message = REJECTED[kind]
    file = tmp_path / "p.yaml"
    file.write_text(text)
    cfg = JobLevelConfig(job_name="gpt", job_dir=str(tmp_path), ledger=str(tmp_path / "job_ledger.jsonl"),
                         finished_flag=str(tmp_path / "f"), policy=load_policy("default").to_dict())
    config = tmp_path / "gpt_job_level.json"
    config.write_text(cfg.to_json())
    assert main(["--config", str(config), "--job-id", "1", "--once", "--policy", str(file)]) == 2
    assert capsys.readouterr().out == f"megatron_resilience watch: {file}: {message}\n"
