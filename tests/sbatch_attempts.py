"""The rendered sbatch script run as Slurm would run it, attempt after attempt, under stubs for what cannot run here.

Shared by the modules that prove the batch script's job-level decisions (tests/test_plugins_sbatch_logic.py, its
EXIT trap's decision and ledger; tests/test_plugins_sbatch_exclusions.py, its node exclusions), so that both run the
very same script, stubs and attempt loop. ``render`` builds the script with ``preview`` (our plugins and nemo_run's
own templates); ``run_attempts`` runs it under bash once per attempt with ``SLURM_RESTART_COUNT`` incremented, and
with stubs for ``srun`` (the job step: fails, finishes, is preempted, writes a corpus log, ... as the plan says),
``scontrol`` (records requeues and exclusions; ``show job`` reports the job state a case needs) and ``sinfo`` (the
partition's nodes; ``DRAINED`` names those shown drained).
"""

from __future__ import annotations

import os
import subprocess
import sys

CORPUS = os.path.join(os.path.dirname(__file__), "joblevel_corpus")
REQUEUED = ["requeue 42"]

SRUN_STUB = r"""#!/bin/bash
case "$*" in *hostname*) echo 127.0.0.1; exit 0;; esac
[ -n "$SRUN_CALLS" ] && echo "$$ $(ps -o sid= -p $$ | tr -d ' ') $*" >> "$SRUN_CALLS"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--output" ] && out="$a"; prev="$a"; done
out="${out//%j/$SLURM_JOB_ID}"
action=$(echo "$PLAN" | cut -d' ' -f$(( ${SLURM_RESTART_COUNT:-0} + 1 )))
reason() { cp "$STOP_REASONS/$1.json" "$RUN_DIR/stop_reason.json"; }
case "$action" in
  fail) exit 1;;
  finish) reason finished; touch "$FAULT_TOL_FINISHED_FLAG_FILE"; exit 0;;
  preempt) reason signal; exit 0;;      # ft_launcher: every rank saved and exited 0
  preempt1) reason signal; exit 1;;     # torchrun exits 1 after forwarding the signal
  fullterm) kill -TERM $PPID; sleep 1; reason signal; exit 0;;  # scancel --full: the batch shell is signalled too
  fullterm_killed) kill -TERM $PPID; sleep 1; exit 143;;          # ... and the step ended without saving
  rerun17) reason rerun17; touch "$FAULT_TOL_FINISHED_FLAG_FILE"; exit 17;;
  rerun16) reason rerun16; cp "$CORPUS/rerun_16.log" "$out"; exit 16;;
  oom) cp "$CORPUS/cuda_oom.log" "$out"; exit 1;;
  nccl) cp "$CORPUS/nccl_timeout.log" "$out"; exit 1;;
  norestart) cp "$CORPUS/nvrx_no_restart.log" "$out"; exit 93;;
esac
echo "no plan for attempt ${SLURM_RESTART_COUNT:-0}" >&2; exit 99
"""
SCONTROL_STUB = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") echo "${SLURM_JOB_NODELIST//,/ }" | tr ' ' '\n'; exit 0;;
  "-o show"|"show job") echo "JobId=$SLURM_JOB_ID JobName=gpt JobState=${JOB_STATE:-RUNNING} Partition=batch"; exit 0;;
esac
echo "$@" >> "$CALLS"
"""
SINFO_STUB = r"""#!/bin/bash
for n in ${PARTITION_NODES//,/ }; do case ",$DRAINED," in *,$n,*) echo "$n|drained";; *) echo "$n|idle";; esac; done
"""


def stop_reasons(folder) -> str:
    """The trainer's stop_reason.json for each ending, written by the trainer's own writer."""
    from types import SimpleNamespace

    from megatron_resilience.plugins.batch_decision import STOP_REASON_FILE as PLUGIN_STOP_REASON_FILE
    from megatron_resilience.resilience.hooks import STOP_REASON_FILE, ResilienceHooks

    assert PLUGIN_STOP_REASON_FILE == STOP_REASON_FILE
    for name, reason, code in (("finished", "finished", 0), ("signal", "signal", 0), ("rerun17", "rerun:17", 17),
                               ("rerun16", "rerun:16", 16)):
        scratch = folder / name
        ResilienceHooks._write_stop_reason(SimpleNamespace(config=SimpleNamespace(run_dir=str(scratch))),
                                           SimpleNamespace(step=10), reason, code)
        os.replace(scratch / STOP_REASON_FILE, folder / f"{name}.json")
    return str(folder)


def render(tmp_path, *, ft: bool, retries: int = 0, policy: str | None = None, preemption: bool = True,
           monitor_only: bool = False, ft_args: dict | None = None) -> dict:
    """The sbatch script of a gpt job (FT and/or preemption, optionally a RestartPolicyPlugin) and its folders."""
    from megatron_resilience.config import CheckpointConfig
    from megatron_resilience.entry import pretrain
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin, preview
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    cluster, run_dir = tmp_path / "cluster", tmp_path / "run"
    task = run.Partial(pretrain, run_dir=str(run_dir), checkpoint=run.Config(CheckpointConfig, save=str(run_dir / "c")))
    executor = run.SlurmExecutor(account="acct", partition="batch", nodes=1, ntasks_per_node=2, time="04:00:00",
                                 retries=retries, tunnel=run.LocalTunnel(job_dir=str(cluster)))
    plugins = ([FaultTolerancePlugin(num_job_retries_on_failure=retries, **(ft_args or {}))] if ft else []) + \
              ([PreemptionPlugin()] if preemption else []) + \
              ([RestartPolicyPlugin(policy=policy)] if policy else []) + \
              ([RestartPolicyPlugin(policy=None)] if monitor_only else [])
    script = preview(task, executor, plugins, name="gpt")
    job_dir = cluster / "gpt" / "gpt_preview" / "gpt"
    job_dir.mkdir(parents=True)
    # preview masks torchrun's random rendezvous id as "<random>" (a redirection to bash): put a number back
    return {"script": script.replace("--rdzv-id <random>", "--rdzv-id 1234"), "job_dir": str(job_dir),
            "run_dir": str(run_dir), "tmp": tmp_path}


def run_attempts(job: dict, plan: str, *, python: str = sys.executable, nodes: str = "localhost",
                 partition: str | None = None, job_state: str = "RUNNING", restarts=None, env_extra=None):
    """Run the batch script as Slurm would: again after each requeue. [(exit code, scontrol calls)], outputs."""
    tmp = job["tmp"]
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB), ("sinfo", SINFO_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    reasons = tmp / "reasons"
    reasons.mkdir(exist_ok=True)
    attempts, outputs = [], []
    for restart in (restarts or range(len(plan.split()))):
        calls = tmp / f"calls_{restart}"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "PLAN": plan, "CALLS": str(calls),
               "SLURM_JOB_NODELIST": nodes, "SLURM_JOB_PARTITION": "batch", "PARTITION_NODES": partition or nodes,
               "JOB_STATE": job_state, "RUN_DIR": job["run_dir"], "CORPUS": CORPUS,
               "STOP_REASONS": stop_reasons(reasons),
               "MEGATRON_RESILIENCE_PYTHON": python, **({"SLURM_RESTART_COUNT": str(restart)} if restart else {}),
               **(env_extra or {})}
        proc = subprocess.run(["bash", "-c", job["script"]], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 99, proc.stderr
        made = calls.read_text().splitlines() if calls.exists() else []
        attempts.append((proc.returncode, made))
        outputs.append(proc.stdout)  # the script's echo (set -v) and trace (set -x) go to stderr
        if "requeue 42" not in made:
            break
    return attempts, outputs


def ledger(job: dict, kind: str | None = None) -> list[dict]:
    from megatron_resilience.records.ledger import Ledger

    return Ledger(os.path.join(job["run_dir"], "job_ledger.jsonl")).records(kind)


def results(job: dict) -> list[str]:
    with open(os.path.join(job["job_dir"], "gpt_job_results")) as f:
        return f.read().splitlines()
