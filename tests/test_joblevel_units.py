"""Job-level room, unit by unit: policy/monitor files rejected before submission, nemo_run's own rule, the ledger,
the simulated failures of the trainer as the classifier sees them, and the plugin's checks. A long run's chain of
decisions: ``test_joblevel_long_run.py``; what a line means before it decides: ``test_joblevel_evidence_order.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from joblevel_chain import cls

from megatron_resilience.config import ConfigError, FaultToleranceConfig
from megatron_resilience.jobs.classifier import AttemptEvidence, classify
from megatron_resilience.jobs.decision import decide_like_nemo_run
from megatron_resilience.jobs.monitors import load_monitors, scan
from megatron_resilience.jobs.policies import load_policy, preset_names
from megatron_resilience.records.ledger import Ledger

# --- bad policy and monitor files are rejected with the file, the key and the allowed values --------------------

GOOD_POLICY = """\
name: mine
max_restarts: {crash: 1, stall: 1, timeout: 0}
default_action: stop
rules:
  - match: {error_type: [nccl_timeout]}
    action: requeue
"""


@pytest.mark.parametrize("edit, message", [
    (lambda t: t + "max_retries: 3\n", "max_retries: unknown key; allowed keys: ['name', 'description', 'monitors',"),
    (lambda t: t.replace("crash: 1", "crash: -1"), "max_restarts.crash: must be an integer >= 0, got -1"),
    (lambda t: t.replace("stall: 1", "hang: 1"), "max_restarts.hang: unknown mode; allowed: ['crash', 'stall', "
                                                 "'timeout']"),
    (lambda t: t.replace("[nccl_timeout]", "[nccl_hiccup]"), "rules[0].match.error_type: unknown error type "
                                                             "'nccl_hiccup'; must be one of this package's error "
                                                             "types ['finished', 'preempted',"),
    (lambda t: t.replace("action: requeue", "action: retry"), "rules[0].action: must be one of ['requeue', "
                                                              "'requeue_excluding_nodes', 'stop'], got 'retry'"),
    (lambda t: t.replace("{error_type:", "{errortype:"), "rules[0].match.errortype: unknown key; allowed keys: "
                                                         "['error_type', 'subsystem', 'signal', 'mode', 'monitor']"),
    (lambda t: t.replace("default_action: stop", "default_action: maybe"), "default_action: must be one of "
                                                                           "['requeue', 'stop'], got 'maybe'"),
    (lambda t: t + "exclude_error_types: [oomm]\n", "exclude_error_types: unknown error type 'oomm'; must be one "
                                                    "of this package's error types ['finished',"),
    (lambda t: t.replace("{error_type: [nccl_timeout]}", "{signal: [SIGFOO]}"), "rules[0].match.signal: must be "
                                                                                "one of ['SIGABRT',"),
])
def test_bad_policy_file_names_file_key_and_allowed_values(tmp_path, edit, message):
    path = tmp_path / "policy.yaml"
    path.write_text(edit(GOOD_POLICY))
    with pytest.raises(ConfigError) as err:
        load_policy(str(path))
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


def test_good_policy_file_loads(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD_POLICY)
    policy = load_policy(str(path))
    assert (policy.name, policy.max_restarts, policy.action_for("nccl_timeout", "communication", None)[0]) == \
        ("mine", {"crash": 1, "stall": 1, "timeout": 0}, "requeue")


GOOD_MONITORS = """\
name: extra
include: [megatron_basic]
monitors:
  - name: my_lustre
    error_type: communication_error
    severity: fatal
    pattern: 'LustreError: .* (?P<host>\\S+) .*timed out'
"""


@pytest.mark.parametrize("edit, message", [
    (lambda t: t + "    regex: x\n", "monitors[0] (my_lustre).regex: unknown key; allowed keys: ['name', "
                                     "'error_type', 'severity', 'pattern', 'unless', 'subsystem', 'extract_groups']"),
    (lambda t: t.replace("timed out'", "timed out('"), "monitors[0] (my_lustre).pattern: not a valid regular "
                                                       "expression (missing ), unterminated subpattern"),
    (lambda t: t.replace("communication_error", "lustre_error"), "monitors[0] (my_lustre).error_type: unknown error "
                                                                 "type 'lustre_error'; must be one of this package's "
                                                                 "error types ['finished',"),
    (lambda t: t.replace("severity: fatal", "severity: critical"), "monitors[0] (my_lustre).severity: must be "
                                                                   "one of ['info', 'warning', 'error', 'fatal']"),
    (lambda t: t.replace("[megatron_basic]", "[megatron_everything]"), "monitors: must be a preset name "),
    (lambda t: t + "extra: 1\n", "extra: unknown key; allowed keys: ['name', 'description', 'include', 'monitors']"),
])
def test_bad_monitor_file_names_file_key_and_allowed_values(tmp_path, edit, message):
    path = tmp_path / "monitors.yaml"
    path.write_text(edit(GOOD_MONITORS))
    with pytest.raises(ConfigError) as err:
        load_monitors([str(path)])
    text = str(err.value)
    assert text.startswith(f"{path}: {message}") or (message.startswith("monitors: must") and text.startswith(
        "monitors: must be a preset name ['megatron_basic', 'megatron_nccl', 'megatron_production', "
        "'megatron_stall_detection'] or a YAML file path, got 'megatron_everything'")), text


def test_every_preset_loads_and_production_is_the_union():
    assert preset_names() == ["default", "megatron_aggressive", "megatron_conservative", "megatron_transient"]
    names = {m: {x.name for x in load_monitors([m])} for m in ("megatron_basic", "megatron_nccl",
                                                                "megatron_stall_detection", "megatron_production")}
    assert names["megatron_production"] == names["megatron_basic"] | names["megatron_nccl"] | \
        names["megatron_stall_detection"]
    for name in preset_names():
        assert load_policy(name).name == name


def test_plugin_rejects_bad_files_before_submission(tmp_path):
    from megatron_resilience.plugins import RestartPolicyPlugin

    bad = tmp_path / "p.yaml"
    bad.write_text(GOOD_POLICY.replace("crash: 1", "crash: -2"))
    with pytest.raises(ConfigError, match=r"p\.yaml: max_restarts\.crash: must be an integer >= 0, got -2"):
        RestartPolicyPlugin(policy=str(bad))
    with pytest.raises(ConfigError, match=r"policy: must be a preset name \['default', 'megatron_aggressive', "
                                          r"'megatron_conservative', 'megatron_transient'\] or a YAML file path"):
        RestartPolicyPlugin(policy="transient")
    with pytest.raises(ConfigError, match=r"RestartPolicyPlugin.monitors: must be None, a monitor preset name"):
        RestartPolicyPlugin(monitors=[1])


# --- nemo_run's own rule (no policy) ----------------------------------------------------------------------------

def test_nemo_run_rule_counts_failures_in_a_row_and_never_preemptions():
    history = []
    out = []
    for error_type in ("python_exception", "preempted", "python_exception", "python_exception"):
        c = cls(error_type)
        d = decide_like_nemo_run(c, history, retries=2, ft=True, finished_flag=False)
        out.append((d.action, d.outcome))
        history.append({"classification": c.to_dict(), "decision": d.to_dict()})
    assert out == [("requeue", None), ("requeue", None), ("requeue", None), ("stop", "budget_exhausted")]


# --- the ledger ------------------------------------------------------------------------------------------------

def test_ledger_write_ahead_and_torn_lines(tmp_path):
    ledger = Ledger(str(tmp_path / "l.jsonl"))
    ok, out = ledger.perform("probe", ["true"], by="test")
    assert ok and ledger.pending_intents() == []
    ledger.append({"kind": "intent", "id": "x1", "action": "sbatch"})  # a writer died after its intent
    with open(ledger.path, "a") as f:
        f.write('{"kind": "attempt", "tor')  # and a torn line
    assert [i["id"] for i in ledger.pending_intents()] == ["x1"]
    assert [r["kind"] for r in ledger.records()] == ["intent", "outcome", "intent"]
    ok, out = ledger.perform("probe", [sys.executable, "-c", "import sys; print('no'); sys.exit(3)"], by="test")
    assert (ok, out) == (False, "no")


# --- the trainer's simulated failures, as the classifier sees them -----------------------------------------------

DIE = textwrap.dedent("""
    import os, sys, socket
    import torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron_resilience.resilience.simulated_fault import die_like_the_real_thing
    die_like_the_real_thing(sys.argv[1], rank=0, step=7)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind, exit_code, error_type, signal", [
    ("cuda_oom", 1, "cuda_oom", None),
    ("nccl_timeout", -6, "nccl_timeout", "SIGABRT"),
    ("nccl_error", 1, "nccl_error", None),
])
def test_simulated_exceptions_die_like_the_real_thing(kind, exit_code, error_type, signal):
    proc = subprocess.run([sys.executable, "-c", DIE, kind], capture_output=True, text=True, timeout=300)
    assert proc.returncode == exit_code, proc.stderr[-2000:]
    lines = [("log", line) for line in proc.stderr.splitlines()]
    code = 128 - exit_code if exit_code < 0 else exit_code  # as the launcher reports a signalled worker
    got = classify(AttemptEvidence(exit_code=code, signals=scan(lines, load_monitors(["megatron_production"]))))
    assert (got.error_type, got.source, got.signal) == (error_type, "log", signal)


@pytest.mark.parametrize("env, start_step, repeat, fire_step", [
    ({}, 0, False, 7),
    ({"SLURM_RESTART_COUNT": "1"}, 0, False, None),  # only the first attempt...
    ({"MEGATRON_RESILIENCE_RESUBMISSION": "1"}, 0, False, None),  # (a watcher's resubmission is a later attempt)
    ({"SLURM_RESTART_COUNT": "2"}, 20, True, 27),  # ...unless it repeats: k steps after each resume
    ({"TORCHELASTIC_RESTART_COUNT": "1"}, 10, True, 17),
])
def test_simulated_fault_attempts(monkeypatch, env, start_step, repeat, fire_step):
    from megatron_resilience.resilience.simulated_fault import SimulatedFault

    for key in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "MEGATRON_RESILIENCE_RESUBMISSION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fault = SimulatedFault(FaultToleranceConfig(simulate_fault=True, simulated_fault_type="exception",
                                                simulated_fault_exception="nccl_timeout", simulated_fault_rank=0,
                                                simulated_fault_step=7, simulated_fault_repeat=repeat),
                           rank=0, world_size=1)
    fault.arm(start_step)
    assert (fault.armed, fault.fire_step if fault.armed else None) == (fire_step is not None, fire_step)
    if fault.armed:
        assert fault.kind == "exception:nccl_timeout"


@pytest.mark.parametrize("kwargs, message", [
    (dict(simulated_fault_type="exception"), "ft.simulated_fault_type: needs ft.simulated_fault_step to be set"),
    (dict(simulated_fault_repeat=True), "ft.simulated_fault_repeat: needs ft.simulated_fault_step to be set"),
    (dict(simulated_fault_exception="segfault", simulated_fault_step=3),
     "ft.simulated_fault_exception: must be one of ['cuda_oom', 'nccl_timeout', 'nccl_error'], got 'segfault'"),
])
def test_simulated_fault_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as err:
        FaultToleranceConfig(**kwargs)
    assert str(err.value).startswith(message)


def test_job_level_import_is_light():
    """The EXIT trap's import: no torch, no megatron, no nemo_run."""
    code = ("import sys, megatron_resilience.jobs.batch_exit, megatron_resilience.report.run_report; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'nemo_run')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_jobs_ledger_is_json_lines(tmp_path):
    ledger = Ledger(str(tmp_path / "x" / "l.jsonl"))
    ledger.append({"kind": "final", "outcome": "finished"})
    with open(ledger.path) as f:
        [line] = f.read().splitlines()
    assert json.loads(line)["kind"] == "final" and os.path.isdir(tmp_path / "x")


def test_slurm_step_states_are_evidence_of_this_attempt_only():
    """sacct's per-step verdict (rows as ``slurm.sacct_steps`` returns them): a step OOM-killed by slurmstepd decides
    a host OOM while the job still reads RUNNING; a lost node under a one-node step names it; steps of an earlier
    run of the job and steps that ended otherwise say nothing."""
    from megatron_resilience.jobs.evidence import step_state_signals

    def row(job_id, state, nodes, start):
        return {"JobID": job_id, "JobName": "python", "State": state, "ExitCode": "0:9", "NodeList": nodes,
                "start_time": start}

    steps = [row("43.1", "OUT_OF_MEMORY", "nid001", 900.0),  # the previous run (requeued since)
             row("43.0", "COMPLETED", "nid[001-002]", 1000.0), row("43.1", "OUT_OF_MEMORY", "nid[001-002]", 1001.0),
             row("43.2", "NODE_FAIL", "nid003", 1002.0), row("43.3", "NODE_FAIL", "nid[003-004]", 1003.0),
             row("43.4", "CANCELLED by 0", "nid003", 1004.0)]
    found = step_state_signals(steps, since=1000.2)
    assert [(s.error_type, s.fields) for s in found] == [
        ("cpu_oom", {"step": "43.1", "state": "OUT_OF_MEMORY"}),
        ("node_fail", {"step": "43.2", "state": "NODE_FAIL", "failed_node": "nid003"}),
        ("node_fail", {"step": "43.3", "state": "NODE_FAIL"})]
    assert found[0].line == "sacct: step 43.1 OUT_OF_MEMORY on nid[001-002] (exit code 0:9)"
    assert all((s.monitor, s.severity, s.source) == ("slurm_step_state", "fatal", "slurm") for s in found)
    cls = classify(AttemptEvidence(exit_code=137, slurm_state="RUNNING", signals=found[:1]))
    assert (cls.error_type, cls.mode) == ("cpu_oom", "crash")
