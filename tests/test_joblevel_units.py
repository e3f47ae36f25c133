"""Job-level room, unit by unit: policy/monitor files rejected before submission, decisions over a chain of
attempts (budgets per mode, restart loops without progress, node exclusion), the ledger, the simulated
failures of the trainer as the classifier sees them, and the plugin's checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_resilience.config import ConfigError, FaultToleranceConfig
from megatron_resilience.jobs import taxonomy
from megatron_resilience.jobs.classifier import AttemptEvidence, Classification, classify
from megatron_resilience.jobs.decision import Cluster, decide, decide_like_nemo_run
from megatron_resilience.jobs.ledger import Ledger
from megatron_resilience.jobs.monitors import load_monitors, scan
from megatron_resilience.jobs.policies import load_policy, preset_names

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


# --- decisions over a chain of attempts -----------------------------------------------------------------------

def cls(error_type: str, hosts=(), evidence=()) -> Classification:
    kind = taxonomy.BY_NAME[error_type]
    return Classification(error_type=error_type, subsystem=kind.subsystem, severity="fatal", mode=kind.mode,
                          source="log", reason="", hosts=list(hosts), evidence=list(evidence))


def chain(policy_name: str, endings: list[tuple[str, dict]], cluster: Cluster | None = None):
    """Decide attempt after attempt, recording each as the trap does; returns the decisions."""
    policy, history, out = load_policy(policy_name), [], []
    for error_type, extra in endings:
        c = cls(error_type, extra.pop("hosts", ()), extra.pop("evidence", ()))
        current = {"classification": c.to_dict(), "nodes": extra.pop("nodes", ["n1"]), **extra}
        d = decide(c, policy, history, current, cluster or Cluster(nodes=["n1", "n2", "n3"], partition="p"))
        out.append(d)
        history.append({**current, "decision": d.to_dict()})
        if d.final:
            break
    return out


LONG_RUN_KINDS = ["node_fail", "xid_error", "nccl_timeout", "hang"]


@pytest.mark.parametrize("policy", ["default", "megatron_transient", "megatron_aggressive"])
def test_forty_failures_of_a_run_that_keeps_advancing_are_all_requeued(policy):
    """A weeks-long run's chain (Llama 3 405B met 466 interruptions in 54 days): node failures, Xids, NCCL
    timeouts and hangs, each attempt 500 steps further. Budgets count failures without progress, so none is
    spent twice: counting every failure, the same chain stopped after 4 (default), 5 (transient), 9 (aggressive)."""
    endings = [(kind, {"resumed_from": 500 * i, "checkpoint_step": 500 * (i + 1), "hosts": [f"n{i % 3 + 1}"],
                       "evidence": [f"line {i} of {kind}"]})
               for i, kind in enumerate(LONG_RUN_KINDS * 10)]
    decisions = chain(policy, endings)
    assert [d.action for d in decisions] == ["requeue"] * 40 and not any(d.final for d in decisions)
    full = load_policy(policy).max_restarts
    assert all(d.budget_left == {**full, d.spent: full[d.spent] - 1} for d in decisions), decisions
    assert all(d.repeats_without_progress == 1 for d in decisions)


@pytest.mark.parametrize("policy", ["default", "megatron_transient", "megatron_aggressive"])
def test_the_same_failure_three_times_without_progress_stops_naming_it(policy):
    """Recurrences are counted by fingerprint (type, node, first line with numbers masked): the watchdog's
    timestamps and sequence numbers differ each time, the failure does not."""
    line = "[rank0]:[E1128 10:0{i}:12.{i}] Watchdog caught collective operation timeout: SeqNum={i}{i}, Timeout=600000"
    endings = [("nccl_timeout", {"resumed_from": 500, "checkpoint_step": 500, "hosts": ["n2"],
                                 "evidence": [line.format(i=i)]}) for i in range(1, 6)]
    decisions = chain(policy, endings)
    assert [d.action for d in decisions] == ["requeue", "requeue", "stop"]
    assert [d.repeats_without_progress for d in decisions] == [1, 2, 3]
    assert decisions[-1].outcome == "no_progress"
    assert decisions[-1].reason == (
        "the same failure 3 times in a row without advancing the checkpoint: nccl_timeout @ n2: [rankN]:[EN N:N:N.N] "
        "Watchdog caught collective operation timeout: SeqNum=N, Timeout=N")
    assert decisions[-1].fingerprint in decisions[-1].reason  # the basis of the stop is on the ledger record


def test_an_advance_resets_the_count_of_a_recurring_failure():
    same = {"hosts": ["n2"], "evidence": ["NCCL watchdog timeout"]}
    stuck, advanced = {"resumed_from": 500, "checkpoint_step": 500}, {"resumed_from": 500, "checkpoint_step": 700}
    decisions = chain("megatron_aggressive", [("nccl_timeout", {**same, **stuck}), ("nccl_timeout", {**same, **stuck}),
                                              ("nccl_timeout", {**same, **advanced}),
                                              ("nccl_timeout", {**same, "resumed_from": 700, "checkpoint_step": 700})])
    assert [(d.action, d.repeats_without_progress) for d in decisions] == [("requeue", 1), ("requeue", 2),
                                                                          ("requeue", 1), ("requeue", 2)]


def test_budgets_count_the_failures_since_the_last_progress_per_mode():
    """Different failures with no progress seen (these attempts left no records) spend their mode's budget, and
    nothing refills it; a mode that runs out ends the chain."""
    decisions = chain("default", [("nccl_timeout", {}), ("hang", {}), ("watchdog_timeout", {})])
    assert [(d.action, d.spent, d.budget_left) for d in decisions] == [
        ("requeue", "stall", {"crash": 2, "stall": 1, "timeout": 2}),
        ("requeue", "stall", {"crash": 2, "stall": 0, "timeout": 2}),
        ("stop", None, {"crash": 2, "stall": 0, "timeout": 2}),
    ]
    assert decisions[-1].outcome == "budget_exhausted"
    assert decisions[-1].reason == ("retry budget exhausted: 2 of 2 stall restart(s) used since the run last "
                                    "advanced its checkpoint (watchdog_timeout, policy default); last failure "
                                    "watchdog_timeout @ -")
    # the first failure after an advance is free again: the attempt that advanced refilled every budget
    refilled = chain("default", [("nccl_timeout", {}), ("hang", {"resumed_from": 0, "checkpoint_step": 10}),
                                 ("watchdog_timeout", {"resumed_from": 10, "checkpoint_step": 10})])
    assert [d.budget_left["stall"] for d in refilled] == [1, 1, 1] and refilled[-1].action == "requeue"
    # megatron_conservative asks for a person
    exhausted = chain("megatron_conservative", [("node_fail", {}), ("node_fail", {})])
    assert [d.action for d in exhausted] == ["requeue", "stop"] and exhausted[-1].outcome == "budget_exhausted"


def test_preemptions_between_failures_spend_nothing():
    decisions = chain("megatron_conservative", [("node_fail", {}), ("preempted", {}), ("system_cancel", {}),
                                                ("node_fail", {})])
    assert [(d.action, d.spent) for d in decisions] == [("requeue", "crash"), ("requeue", None), ("requeue", None),
                                                       ("stop", None)]


def test_a_restart_loop_without_progress_stops():
    # every restart resumes from the checkpoint at step 20 and dies before saving another, a different way each time
    stuck = {"resumed_from": 20, "checkpoint_step": 20, "last_step": 24}
    kinds = ["nccl_error", "hang", "nccl_error", "hang", "nccl_error", "hang"]
    decisions = chain("megatron_aggressive", [("nccl_error", {"resumed_from": 0, "checkpoint_step": 20,
                                                              "last_step": 24})] + [(k, dict(stuck)) for k in kinds])
    assert [d.action for d in decisions] == ["requeue"] * 4 + ["stop"]
    assert decisions[-1].outcome == "no_progress" and decisions[-1].attempts_without_progress == 4
    assert "4 failed attempt(s) in a row did not advance the checkpoint" in decisions[-1].reason
    assert decisions[-1].reason.endswith("last failure hang @ -")


def test_repeated_hardware_errors_on_one_host_exclude_it_and_an_impossible_exclusion_is_not_applied():
    decisions = chain("megatron_transient", [("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"]}),
                                             ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"]})])
    assert [d.exclude_applied for d in decisions] == [[], ["n2"]]  # exclude_nodes_after: 2
    only = chain("megatron_transient", [("xid_error", {"hosts": ["n1.cluster.local"], "nodes": ["n1"]})],
                 cluster=Cluster(nodes=["n1"], partition="p"))
    assert only[0].action == "requeue" and only[0].exclude_requested == ["n1"] and only[0].exclude_applied == []
    assert only[0].exclude_not_applied.startswith("excluding n1 would leave 0 usable node(s) in partition p (n1) "
                                                  "and the job needs 1")
    down = chain("megatron_transient", [("xid_error", {"hosts": ["n1"], "nodes": ["n1"]})],
                 cluster=Cluster(nodes=["n1", "n2"], unusable=["n2"], partition="p"))
    assert down[0].exclude_applied == [] and "would leave 0 usable node(s)" in down[0].exclude_not_applied


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
    code = ("import sys, megatron_resilience.jobs.batch_exit, megatron_resilience.jobs.report; "
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


# --- Xid codes (jobs/xid_codes.py, from NVIDIA's Xid catalog) -------------------------------------------------------

@pytest.mark.parametrize("code, severity, points_at, host_role", [
    ("63", "info", "handled", "reporter"),  # row remapping recorded: the driver handled it
    ("64", "warning", "machine", "hardware"),  # a retirement that could not be recorded: the machine, not fatal
    ("31", "warning", "application", "reporter"),  # a page fault: usually the application's
    ("79", "fatal", "machine", "hardware"),  # fell off the bus
    ("95", "fatal", "machine", "hardware"),  # uncontained ECC error
    ("999", "fatal", "machine", "hardware"),  # not in the table: read as every Xid was before it
])
def test_an_xid_line_takes_its_codes_severity_and_blames_its_node_only_for_the_machine(code, severity, points_at,
                                                                                       host_role):
    from megatron_resilience.jobs.attribution import mentions
    from megatron_resilience.jobs.monitors import load_monitors, scan
    from megatron_resilience.jobs.xid_codes import xid_code

    line = f"nid002: [  219.470994] NVRM: Xid (PCI:0000:07:00): {code}, pid=1896, an event"
    [signal] = [s for s in scan([("log", line)], load_monitors(["megatron_nccl"])) if s.monitor == "xid_kernel"]
    assert (signal.error_type, signal.severity, signal.fields["xid"], signal.fields["xid_points_at"]) == (
        "xid_error", severity, code, points_at)
    assert signal.fields["xid_meaning"] == xid_code(code).meaning
    assert [(m.node, m.role) for m in mentions([signal], ["nid001", "nid002"])] == [("nid002", host_role)]


# --- evidence in time order (jobs/time_order.py) ---------------------------------------------------------------------

@pytest.mark.parametrize("line, expected", [
    ("[rank0]:[E1128 10:02:11.123456 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught", (11, 28, 36131.123456)),
    ("[2026-11-28 10:02:11,880] [ERROR] [ft_launcher5120@nid001] failed (exitcode: 1)", (11, 28, 36131.88)),
    ("2026-11-28T10:02:11.5+00:00 NVRM: Xid (PCI:0000:38:00): 79", (11, 28, 36131.5)),
    ("Nov  8 10:02:11 worker4 kernel: [  219.470994] NVRM: Xid (PCI:0000:07:00): 48", (11, 8, 36131.0)),
    ("[rank9]: ValueError: bad batch shape (4, 2047)", None),
])
def test_time_stamps_of_each_format(line, expected):
    from megatron_resilience.jobs.time_order import stamp

    assert stamp(line) == (pytest.approx(expected) if expected else None)


def test_a_peer_symptom_after_another_ranks_failure_is_a_consequence_by_stamp_or_by_place():
    from megatron_resilience.jobs.monitors import load_monitors, scan
    from megatron_resilience.jobs.time_order import later_symptoms

    watchdog = ("[rank0]:[E1128 10:12:02.1 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=4411, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
                "600081 milliseconds before timing out.")
    bug = "[rank9]: ValueError: bad batch shape (4, 2047)"
    monitors = load_monitors(["megatron_production"])

    def symptoms(*sourced):
        signals = [s for s in scan(list(sourced), monitors) if s.severity in ("fatal", "error")]
        return [s.error_type for s in later_symptoms(signals)]

    assert symptoms(("log:a", bug), ("log:a", watchdog)) == ["nccl_timeout"]  # after it in one log
    assert symptoms(("log:a", watchdog), ("log:a", bug)) == []  # the mirror: the timeout came first
    assert symptoms(("log:a", bug), ("log:b", watchdog)) == []  # two files, one stamp: no order, the type decides
    xid = "Nov 28 10:02:11 nid002 kernel: NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus."
    assert symptoms(("log:a", watchdog), ("log:b", xid)) == ["nccl_timeout"]  # two files, both stamped: by time
    assert symptoms(("log:a", watchdog.replace("10:12", "09:12")), ("log:b", xid)) == []
    assert symptoms(("log:a", "[rank0]: ValueError: x"), ("log:a", watchdog)) == []  # the same rank's own


# --- exclusions over a weeks-long run -----------------------------------------------------------------------------

DAY = 24 * 3600.0


def test_an_exclusion_is_lifted_two_weeks_after_it_was_last_asked_for_and_the_pool_does_not_shrink_for_ever():
    """A node repaired during a weeks-long run comes back: after EXCLUSION_LOOKBACK_S (14 days) with no new
    attribution its exclusion ends (the job's ExcNodeList is rewritten without it), and it is said on the record."""
    from megatron_resilience.jobs.decision import EXCLUSION_LOOKBACK_S

    assert EXCLUSION_LOOKBACK_S == 14 * DAY
    t0 = 1_800_000_000.0
    decisions = chain("megatron_aggressive", [
        ("xid_error", {"hosts": ["n2"], "nodes": ["n2"], "end": t0, "resumed_from": 0, "checkpoint_step": 500}),
        ("xid_error", {"hosts": ["n3"], "nodes": ["n3"], "end": t0 + 3 * DAY, "resumed_from": 500,
                       "checkpoint_step": 900}),
        ("node_fail", {"nodes": ["n1", "n4"], "end": t0 + 15 * DAY, "resumed_from": 900, "checkpoint_step": 1500}),
        ("node_fail", {"nodes": ["n1", "n4"], "end": t0 + 18 * DAY, "resumed_from": 1500, "checkpoint_step": 2000}),
    ], cluster=Cluster(nodes=["n1", "n2", "n3", "n4", "n5"], partition="p"))
    assert [(d.exclude_applied, d.exclude_lifted) for d in decisions] == [
        (["n2"], []), (["n2", "n3"], []),
        (["n3"], ["n2"]),  # n2: last asked for 15 days ago; n3: 12 days ago, still standing
        ([], ["n3"]),  # n3: 15 days: the job's ExcNodeList is emptied
    ]
    assert "exclusion of n2 lifted (asked for last more than 14 days ago; ExcNodeList=n3)" in decisions[2].message()


def test_hardware_attributions_older_than_two_weeks_do_not_add_up_to_an_exclusion():
    t0 = 1_800_000_000.0
    apart = chain("megatron_transient", [  # exclude_nodes_after: 2
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0, "resumed_from": 0, "checkpoint_step": 10}),
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0 + 15 * DAY, "resumed_from": 10,
                        "checkpoint_step": 20})])
    close = chain("megatron_transient", [
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0, "resumed_from": 0, "checkpoint_step": 10}),
        ("nccl_error", {"hosts": ["n2"], "nodes": ["n1", "n2"], "end": t0 + 13 * DAY, "resumed_from": 10,
                        "checkpoint_step": 20})])
    assert [d.exclude_applied for d in apart] == [[], []]
    assert [d.exclude_applied for d in close] == [[], ["n2"]]
