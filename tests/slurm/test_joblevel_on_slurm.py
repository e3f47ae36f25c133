"""Issue 10 on the real cluster: why each attempt ended, the policy's decision, the ledger, the watcher.

Every job is the real trainer (``gpt_tiny``, 1 CPU rank) submitted through NeMo-Run's ``SlurmExecutor``
with our plugins, as from a login node; failures are the trainer's own fault injection
(``ft.simulated_fault_type=exception``: a CUDA OOM / NCCL watchdog timeout printed and exited like the
real thing) and Megatron-Core's rerun error injection. What is asserted comes from Slurm's records
(``sacct``), the ledger the batch scripts and the watcher wrote, and the trainer's metrics.

One module fixture submits every job at once and plays the watcher scenario (``watcher_scenario.py``:
a job whose batch shell is SIGKILLed, so nothing inside the job can decide, then watchers killed
mid-decision) from the moment the watched job is submitted. Issue 23: one job gets
SIGTERM in every process, its batch shell too, as real preemption with GraceTime (``scancel --signal=TERM
--full`` for the batch step, a plain ``scancel --signal=TERM`` for the job steps): the batch script waits for
the step, decides and requeues it without a retry, with no watcher.

A node set DOWN under a running two-node job (``test_node_down_is_recovered_by_the_watcher``) runs on the private
multi-node instance (``multinode_cluster``; the shared single-node cluster's node is never set DOWN): the job
goes to the ``faults`` partition and starts on its reserved node (the lowest ``Weight``) and one other (the batch
host); the reserved node is drained and set DOWN; Slurm ends the attempt NODE_FAIL and requeues it, the watcher
records it (node_fail) and excludes the node that went down, not the batch host that slurmstepd's line names,
and the job resumes from its checkpoint on two other nodes, ends COMPLETED, and its losses equal an
uninterrupted two-node run's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from resilience_support.agents import free_port

from megatron_resilience.upstream import import_nemo_run
from slurm.cluster import use_cluster, wait_for_job
from slurm.jobs import Job, submit, wait_until
from slurm.watcher_scenario import Watcher, watcher_scenario

run = import_nemo_run()

from megatron_resilience.jobs.ledger import Ledger  # noqa: E402
from megatron_resilience.jobs.monitors import load_monitors, scan  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin  # noqa: E402
from megatron_resilience.recipes import RECIPES  # noqa: E402

STEPS = 60
WATCHED_STEPS = 400
# The watched job must still train when its batch shell is killed: its scenario starts as soon as it is submitted,
# and its rank spins this much extra CPU work per step (no effect on the numbers): 400 tiny steps took 21 s under
# load, less than submitting the other jobs took.
WATCHED_SLOWED = {"straggler__simulated_straggler_rank": 0, "straggler__simulated_straggler_delay": 0.1}
SAVE = 10
BUDGET_POLICY = """\
name: one_crash_restart
description: exit 16 gets one restart, away from the node if another exists
max_restarts: {crash: 1, stall: 0, timeout: 0}
max_attempts_without_progress: 0
default_action: stop
rules:
  - match: {error_type: [rerun_resume]}
    action: requeue_excluding_nodes
"""
def tiny(root: str, name: str, *, max_steps: int = STEPS, save_interval: int = SAVE, num_nodes: int = 1, **edits):
    task = RECIPES["gpt_tiny"](dir=root, name=name, num_nodes=num_nodes, num_gpus_per_node=1)
    task.train.max_steps = max_steps
    task.checkpoint.save_interval = save_interval
    task.checkpoint.async_save = False  # no checkpoint writer process: fewer processes on a loaded machine
    task.optim.lr_decay_steps = WATCHED_STEPS  # one LR schedule for every job: losses compare across max_steps
    for key, value in edits.items():
        section, field = key.split("__")
        setattr(getattr(task, section), field, value)
    return task


def fault(kind: str, step: int) -> dict:
    return dict(ft__simulate_fault=True, ft__simulated_fault_type="exception", ft__simulated_fault_exception=kind,
                ft__simulated_fault_rank=0, ft__simulated_fault_step=step)


def ledger(job: Job, kind: str | None = None) -> list[dict]:
    return Ledger(os.path.join(job.run_dir, "job_ledger.jsonl")).records(kind)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, nemorun_home, slurm_tmp):
    root = os.path.join(slurm_tmp, "joblevel")
    os.makedirs(root, exist_ok=True)
    budget = os.path.join(root, "one_crash_restart.yaml")
    with open(budget, "w") as f:
        f.write(BUDGET_POLICY)
    js: dict[str, Job] = {}
    t0 = time.monotonic()

    def job(name, plugins, launcher=None, **task_kw):
        task = tiny(root, f"jl_{name}", **task_kw)
        executor = slurm_cluster.executor(time="00:30:00", ntasks_per_node=1, launcher=launcher)
        js[name] = submit(f"jl_{name}", task, executor, plugins, run_dir=task.run_dir)

    transient = [PreemptionPlugin(), RestartPolicyPlugin(policy="megatron_transient")]
    job("watched", transient, max_steps=WATCHED_STEPS, **WATCHED_SLOWED)
    scenario: dict = {}

    def watch_scenario() -> None:  # from its first checkpoint on, while the other jobs are submitted
        try:
            scenario.update(watcher_scenario(js["watched"], slurm_cluster, os.path.join(root, "watch"),
                                            first_checkpoint=SAVE))
        except BaseException as err:  # noqa: BLE001 - raised by the fixture below
            scenario["error"] = err

    scenario_thread = threading.Thread(target=watch_scenario, daemon=True)
    scenario_thread.start()
    job("ref", transient)
    job("oom", transient, **fault("cuda_oom", 5))
    job("nccl", [FaultTolerancePlugin(num_in_job_restarts=0, num_job_retries_on_failure=0), *transient],
        **fault("nccl_timeout", 15))
    job("rerun_17", transient, max_steps=12, save_interval=4, rerun__rerun_mode="validate_results",
        rerun__error_injection_rate=8, rerun__error_injection_type="transient_error")
    job("rerun_16", [PreemptionPlugin(), RestartPolicyPlugin(policy=budget)], max_steps=12, save_interval=4,
        rerun__rerun_mode="validate_results", rerun__error_injection_rate=8,
        rerun__error_injection_type="persistent_error")
    job("cancelled", [PreemptionPlugin(), RestartPolicyPlugin(policy="megatron_aggressive")])
    job("fullterm", transient)
    full: dict = {}
    fullterm = threading.Thread(target=signal_job_when_training, args=(js["fullterm"], full, 5), daemon=True)
    fullterm.start()

    wait_until(lambda: js["cancelled"].last_step() >= 3, timeout=900, interval=0.2, what="cancelled to train")
    subprocess.run(["scancel", js["cancelled"].slurm_id], check=True)  # a person's scancel
    fullterm.join(timeout=1200)
    scenario_thread.join(timeout=3000)
    if "error" in scenario:
        raise scenario["error"]
    finals = {n: wait_for_job(j.slurm_id, timeout=1200) for n, j in js.items() if n != "watched"}
    once = subprocess.run([sys.executable, "-m", "megatron_resilience.watch", js["cancelled"].run_dir, "--once"],
                          env=slurm_cluster.env, capture_output=True, text=True, timeout=300)
    print(f"\njob-level Slurm jobs done in {time.monotonic() - t0:.0f} s")
    return {"jobs": js, "finals": finals, "scenario": scenario, "cancel_watch": once, "full": full}


def signal_job_when_training(job: Job, sent: dict, after_step: int) -> None:
    """For a thread: SIGTERM to every process of the job, the batch shell included, as real preemption with
    GraceTime does, once the first attempt trained ``after_step`` steps. On Slurm 22.05 ``scancel --signal=TERM
    --full`` reaches the batch step only (its shell and the ``srun`` client; measured: the job step's process gets
    nothing), so the job steps get theirs from a plain ``scancel --signal=TERM`` right after."""
    try:
        wait_until(lambda: job.last_step() >= after_step, timeout=900, interval=0.2, what=f"{job.name} to train")
        subprocess.run(["scancel", "--signal=TERM", "--full", job.slurm_id], check=True, capture_output=True)
        subprocess.run(["scancel", "--signal=TERM", job.slurm_id], check=True, capture_output=True)
        sent["time"] = time.time()
    except Exception as err:  # noqa: BLE001 - reported by the test
        sent["error"] = err


def states(job: Job) -> list[str]:
    return [a["State"].split()[0] for a in job.attempts()]


def test_oom_style_failure_is_not_retried(jobs):
    job = jobs["jobs"]["oom"]
    assert states(job) == ["FAILED"], job.describe()
    [attempt] = ledger(job, "attempt")
    cls, decision = attempt["classification"], attempt["decision"]
    assert (cls["error_type"], cls["source"], cls["fields"]["alloc"], decision["action"]) == \
        ("cuda_oom", "log", "2.00 GiB", "stop"), attempt
    assert any("torch.OutOfMemoryError: CUDA out of memory" in line for line in cls["evidence"])
    [final] = ledger(job, "final")
    assert final["outcome"] == "stopped" and final["message"].startswith(
        "NOT restarted after 1 attempt(s): cuda_oom is not restarted: cuda_oom is in exclude_error_types of policy "
        "megatron_transient"), final


def test_nccl_timeout_style_failure_is_requeued_and_finishes_with_equal_losses(jobs):
    js = jobs["jobs"]
    job, ref = js["nccl"], js["ref"]
    assert states(job) == ["REQUEUED", "COMPLETED"], job.describe()
    first, second = ledger(job, "attempt")
    assert (first["classification"]["error_type"], first["classification"]["signal"],
            first["decision"]["action"], first["decision"]["spent"]) == \
        ("nccl_timeout", "SIGABRT", "requeue", "stall"), first
    assert first["decision"]["budget_left"] == {"crash": 3, "stall": 1, "timeout": 1}
    assert (second["classification"]["error_type"], second["decision"]["outcome"]) == ("finished", "finished")
    assert job.starts() == [0, SAVE], job.describe()  # the fault at step 15: resumed from the step-10 checkpoint
    assert sorted(ref.losses()) == list(range(1, STEPS + 1)), ref.describe()
    assert job.losses() == ref.losses()
    assert second["resumed_from"] == SAVE and second["recomputed_steps"] == 14 - SAVE


def test_rerun_exit_17_stops(jobs):
    job = jobs["jobs"]["rerun_17"]
    assert states(job) == ["FAILED"], job.describe()
    [attempt] = ledger(job, "attempt")
    assert (attempt["exit_code"], attempt["classification"]["error_type"], attempt["decision"]["action"]) == \
        (17, "rerun_failed_validation", "stop")
    assert job.attempts()[0]["ExitCode"] == "17:0"


def test_rerun_exit_16_is_requeued_with_the_exclusion_recorded_and_the_budget_then_stops_it(jobs):
    job = jobs["jobs"]["rerun_16"]
    assert states(job) == ["REQUEUED", "FAILED"], job.describe()
    first, second = ledger(job, "attempt")
    d = first["decision"]
    assert (first["classification"]["error_type"], d["action"]) == ("rerun_resume", "requeue"), first
    assert d["exclude_requested"] == first["nodes"] and len(first["nodes"]) == 1, first
    partition_nodes = subprocess.check_output(["sinfo", "-h", "-N", "-o", "%N"], text=True).split()
    if len(set(partition_nodes)) == 1:  # the only node: recorded, not applied, and the job was not stranded
        assert d["exclude_applied"] == [] and "would leave 0 usable node(s)" in d["exclude_not_applied"], d
    else:
        assert d["exclude_applied"] == first["nodes"] and first["nodes"] != second["nodes"], d
    assert (second["classification"]["error_type"], second["decision"]["outcome"]) == ("rerun_resume",
                                                                                     "budget_exhausted")
    [final] = ledger(job, "final")
    assert final["message"] == ("NOT restarted after 2 attempt(s): retry budget exhausted: 1 of 1 crash restart(s) "
                                "used (rerun_resume, policy one_crash_restart) (last ending: rerun_resume, last step "
                                f"{second['last_step']}, newest checkpoint {second['checkpoint_step']})"), final
    assert final["message"] in job.log()  # the batch script said it


def test_a_persons_scancel_is_never_retried(jobs):
    job = jobs["jobs"]["cancelled"]
    assert states(job) == ["CANCELLED"], job.describe()
    attempts = ledger(job, "attempt")
    # the EXIT trap had Slurm's KillWait to record it; the watcher records it otherwise
    assert [a["classification"]["error_type"] for a in attempts] == ["user_cancel"], attempts
    assert [f["outcome"] for f in ledger(job, "final")] == ["cancelled"]
    # captured from this real job: slurmstepd's own line, as the always-on monitors read it (issue 23, section 3)
    found = [s for s in scan([("log", line) for line in job.log().splitlines()], load_monitors([]))
             if s.monitor == "slurm_cancelled_by_user" and s.fields["job"] == job.slurm_id]
    assert found, job.describe()
    # (a slurmd of a MULTIPLE_SLURMD build names its stepd "slurmstepd-<node>")
    assert re.fullmatch(rf"slurmstepd(-\S+)?: error: \*\*\* JOB {job.slurm_id} ON \S+ CANCELLED AT \S+ \*\*\*",
                        found[0].line), found[0].line
    assert found[0].fields["batch_host"] == attempts[0]["nodes"][0]
    assert not [i for i in ledger(job, "intent") if i["action"] in ("requeue", "sbatch")]
    assert jobs["cancel_watch"].returncode == 0, jobs["cancel_watch"].stdout


def test_signal_to_the_whole_job_batch_shell_included_is_a_free_requeue_without_a_watcher(jobs):
    """Issue 23: ``scancel --signal=TERM --full`` reaches the batch shell too. It waits for the step (the trainer
    saves and exits 0), decides itself — a preemption, requeued without spending a retry — and the requeued job
    resumes from that checkpoint with the uninterrupted run's losses. No watcher runs for this job."""
    js = jobs["jobs"]
    job, ref = js["fullterm"], js["ref"]
    assert "time" in jobs["full"], jobs["full"]
    assert states(job) == ["REQUEUED", "COMPLETED"], job.describe()
    first, second = ledger(job, "attempt")
    assert (first["by"], first["batch_signal"], first["classification"]["error_type"],
            first["classification"]["source"], first["decision"]["action"], first["decision"]["spent"]) == \
        ("batch", "SIGTERM", "preempted", "stop_reason", "requeue", None), json.dumps(first)
    assert first["decision"]["budget_left"] == {"crash": 3, "stall": 2, "timeout": 1}
    assert "megatron_resilience: the batch shell received SIGTERM (preemption, scancel --full); the job step has " \
           "ended: deciding" in job.log()
    assert [(i["action"], i["by"]) for i in ledger(job, "intent")] == [("requeue", "batch")]
    assert (second["by"], second["classification"]["error_type"], second["decision"]["outcome"]) == \
        ("batch", "finished", "finished")
    starts = job.starts()
    assert len(starts) == 2 and starts[0] == 0 and starts[1] == first["checkpoint_step"] >= 5, job.describe()
    assert job.losses() == ref.losses(), job.describe()


def test_watcher_killed_between_deciding_and_submitting_leaves_exactly_one_live_job(jobs):
    js, s = jobs["jobs"], jobs["scenario"]
    job, ref = js["watched"], js["ref"]
    assert (s["first"]["JobState"], s["first"]["ExitCode"]) == ("FAILED", "0:9"), job.describe()
    assert max(s["counts"]) == 1 and s["counts"][-1] == 0, (s["counts"], s["seen"])
    assert s["last"]["JobState"] == "COMPLETED", s
    assert s["w3"].returncode == 0, s["w3"].stdout + s["w3"].stderr
    [attempt_a, attempt_b] = ledger(job, "attempt")
    assert (attempt_a["by"], attempt_a["classification"]["error_type"], attempt_a["decision"]["action"]) == \
        ("watcher", "batch_lost", "requeue"), attempt_a
    assert (attempt_b["by"], attempt_b["job_id"], attempt_b["classification"]["error_type"]) == \
        ("batch", s["second"], "finished")
    intents = [(i["action"], i["by"]) for i in ledger(job, "intent")]
    assert intents == [("requeue", "watcher"), ("sbatch", "watcher"), ("sbatch", "watcher")], intents
    outcomes = [(o["action"], o["ok"], o.get("new_job_id")) for o in ledger(job, "outcome")]
    assert outcomes == [("requeue", False, None), ("sbatch", False, None), ("sbatch", True, s["second"])], outcomes
    assert "adopted live job" in ledger(job, "outcome")[-1]["output"]
    [final] = ledger(job, "final")
    assert final["outcome"] == "finished"
    assert job.starts()[0] == 0 and job.starts()[1] >= SAVE, job.describe()
    losses = job.losses()
    assert sorted(losses) == list(range(1, WATCHED_STEPS + 1)), job.describe()
    assert {s: losses[s] for s in ref.losses()} == ref.losses()  # the reference's steps: 1..STEPS


def test_report_shows_the_chain(jobs):
    job = jobs["jobs"]["nccl"]
    out = subprocess.run([sys.executable, "-m", "megatron_resilience.report", job.run_dir, "--logs"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
    assert [r.split(" | ")[9].strip() for r in rows] == ["nccl_timeout (log)", "finished (stop_reason)"], out.stdout
    assert "goodput: " in out.stdout and os.path.exists(os.path.join(job.run_dir, "attempts_timeline.png"))
    assert f"==> attempt 0 (job {job.slurm_id}, restart 0)" in out.stdout  # every attempt's log, not only the first
    assert f"==> attempt 1 (job {job.slurm_id}, restart 1)" in out.stdout


def resume(node: str) -> None:
    """Bring the node back (a test took it down); fine if it is usable already."""
    proc = subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True,
                          text=True, timeout=60)
    state = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True,
                           timeout=60).stdout.split()
    assert proc.returncode == 0 or (state and state[0] in ("idle", "mixed", "allocated")), (proc.stderr, state)


def test_node_down_is_recovered_by_the_watcher(multinode_cluster, nemorun_home, slurm_tmp):
    """A node set DOWN under a running two-node job: Slurm ends the attempt NODE_FAIL and requeues it; nothing inside
    the job decides. The watcher records it (node_fail) and excludes the node that went down — not the batch host,
    which slurmstepd's "CANCELLED ... DUE TO NODE FAILURE" line names — and the job resumes on other nodes."""
    cluster = multinode_cluster
    assert cluster.fault_partition and cluster.fault_nodes, cluster
    node = cluster.fault_nodes[0]  # reserved: no other test's job runs there (scripts/slurm/multinode.env)
    root = os.path.join(slurm_tmp, "joblevel_node_down")
    os.makedirs(root, exist_ok=True)

    def plugins():
        return [PreemptionPlugin(), RestartPolicyPlugin(policy="megatron_transient")]

    def executor(c):
        # one torchrun per node, meeting at the head node on a port of its own (other jobs share this machine)
        return c.executor(time="00:30:00", nodes=2, ntasks_per_node=1, launcher=run.Torchrun(rdzv_port=free_port()))

    with use_cluster(cluster):
        ref_task = tiny(root, "jl_node_down_ref", max_steps=WATCHED_STEPS, num_nodes=2)
        ref = submit("jl_node_down_ref", ref_task, executor(cluster), plugins(), run_dir=ref_task.run_dir)
        task = tiny(root, "jl_node_down", max_steps=WATCHED_STEPS, num_nodes=2)
        # The faults partition spans every node; its reserved node has the lowest Weight, so the job starts there
        # and on one other node (scripts/slurm/render.sh); its next attempt may run on any two others.
        faults = dataclasses.replace(cluster, partition=cluster.fault_partition)
        job = submit("jl_node_down", task, executor(faults), plugins(), run_dir=task.run_dir)
        wait_until(lambda: SAVE in job.checkpoint_steps(), timeout=900, interval=0.2, what="the first checkpoint")
        info = job.info()
        first_nodes = subprocess.check_output(["scontrol", "show", "hostnames", info["NodeList"]], text=True).split()
        batch_host = info["BatchHost"]
        assert node in first_nodes and len(first_nodes) == 2 and batch_host != node, job.describe()
        watch_log = os.path.join(root, "watch.log")
        watcher = Watcher(job.run_dir, cluster.env, watch_log)
        try:
            # DRAIN first: this cluster's ReturnToService=2 brings a DOWN node back as soon as its (living) slurmd
            # registers again, a failed node would not; drained, it stays out until RESUME. Then DOWN: Slurm's
            # node-failure path (the attempt ends NODE_FAIL and the --requeue job is requeued at once).
            for state in ("DRAIN", "DOWN"):  # Reason mr-test*: scripts/slurm/start.sh leaves it so
                subprocess.run(["scontrol", "update", f"NodeName={node}", f"State={state}",
                                "Reason=mr-test-joblevel"], check=True)
            final = wait_for_job(job.slurm_id, timeout=1200)
            watcher.proc.wait(timeout=300)  # it ends with the chain
        finally:
            resume(node)
            if watcher.proc.poll() is None:
                watcher.kill()
            watcher.log.close()
        ref_final = wait_for_job(ref.slurm_id, timeout=1200)
        out = open(watch_log).read()
        assert final["JobState"] == "COMPLETED", f"{out}\n{job.describe()}"
        assert watcher.proc.returncode == 0, out
        assert ref_final["JobState"] == "COMPLETED", ref.describe()
        assert states(job) == ["NODE_FAIL", "COMPLETED"], job.describe()
        first, second = ledger(job, "attempt")
        cls, decision = first["classification"], first["decision"]
        assert (first["by"], cls["error_type"], decision["action"], decision["exclude_applied"]) == \
            ("watcher", "node_fail", "requeue", [node]), json.dumps(first)
        assert sorted(first["nodes"]) == sorted(first_nodes) and first["slurm_state"] == "NODE_FAIL", json.dumps(first)
        # every host the evidence named, and why the down node (not the batch host) was blamed
        roles = {(m["node"], m["role"]) for m in cls["host_evidence"]}
        assert (node, "failed") in roles and (batch_host, "failed") not in roles, cls["host_evidence"]
        assert cls["hosts"] == [node], cls
        # (drained, so still out of service when the watcher looks: DOWN+DRAIN, or IDLE+DRAIN once its slurmd is back)
        assert any(m["role"] == "failed" and re.match(rf"scontrol show node {node}: State=\S*DRAIN\S* "
                                                      r"Reason=mr-test-joblevel", m["line"])
                   for m in cls["host_evidence"]), cls["host_evidence"]
        # slurmstepd's real line, captured from this job: it names the batch host, as a batch host
        assert any(m["role"] == "batch_host" and m["node"] == batch_host and "DUE TO NODE FAILURE" in m["line"]
                   for m in cls["host_evidence"]), cls["host_evidence"]
        outcomes = [(o["action"], o["ok"]) for o in ledger(job, "outcome")]
        assert outcomes == [("exclude_nodes", True)], outcomes  # Slurm requeued it; the watcher only excludes
        assert (second["by"], second["classification"]["error_type"], second["slurm_restart"]) == \
            ("batch", "finished", 1), json.dumps(second)
        assert len(second["nodes"]) == 2 and node not in second["nodes"], json.dumps(second)
        [final_record] = ledger(job, "final")
        assert (final_record["outcome"], final_record["message"]) == ("finished", "training finished after 2 "
                                                                      "attempt(s)"), final_record
        starts = job.starts()  # resumed from the newest checkpoint (the trainer may save on Slurm's SIGTERM)
        assert len(starts) == 2 and starts[0] == 0 and starts[1] >= SAVE, job.describe()
        assert second["resumed_from"] == starts[1], json.dumps(second)
        assert sorted(ref.losses()) == list(range(1, WATCHED_STEPS + 1)), ref.describe()
        assert job.losses() == ref.losses(), job.describe()
        report = subprocess.run([sys.executable, "-m", "megatron_resilience.report", job.run_dir],
                                capture_output=True, text=True, timeout=300, env=cluster.env)
        table = report.stdout.split("per node:\n", 1)[1].split("\n\n", 1)[0]
        assert re.search(rf"^{node} +\| 0 +\| 0: node_fail +\| 0$", table, re.M), report.stdout
        assert re.search(rf"^{batch_host} +\| 0,1 +\| - +\| -$", table, re.M), report.stdout
