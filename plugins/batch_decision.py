"""The sbatch block that decides, when a Slurm attempt ends, whether the job continues (every plugin renders it).

nemo_run's templates end with their own requeue rule: the FT template requeues until the finished
flag exists or ``TORCHX_MAX_RETRIES`` attempts in a row failed, the plain template requeues a
non-zero exit while ``TORCHX_MAX_RETRIES > SLURM_RESTART_COUNT`` (so every preemption requeue spent
a failure retry). This block takes that decision over, in the setup lines (before the template's
own code runs):

* ``scontrol`` becomes a shell function for the rest of the script: the template's
  ``scontrol requeue $SLURM_JOB_ID`` is recorded and left to the decision; every other call runs as is;
* ``TORCHX_MAX_RETRIES`` is kept in ``megatron_resilience_nemo_run_retries`` and raised so the
  template's own failure limit (and its "limit reached" exit at the start of an attempt) never
  decides; a job whose chain was stopped exits at once instead (``<job>_job_level_stopped``);
* each attempt writes its job-level config JSON and an ``attempt_start`` ledger record;
* the batch shell survives the scheduler's signal: real preemption (``PreemptMode`` with ``GraceTime``) and
  ``scancel --signal=TERM --full`` signal every process of the job, the batch shell included, which would die
  at once and decide nothing while the trainer saves. A trap on TERM/INT/USR1/USR2 makes bash wait for the job
  step (bash runs a trap only after the foreground command returns), note the signal and go on to decide.
  ``srun`` becomes a shell function that starts the real one in a session of its own: the signal reaches the
  batch script's process group, and an ``srun`` that receives SIGTERM kills its step at once ("srun: forcing
  job termination", measured on Slurm 22.05) — before the trainer, which the step's own signal reached, saved;
* the EXIT trap runs ``python -m megatron_resilience.jobs.batch_exit`` (no torch): classify the
  attempt, decide (the ``RestartPolicyPlugin`` policy, else nemo_run's rule with preemptions never
  counted as failures and ft_launcher's "do not restart" exit code honoured), record, requeue
  (excluding nodes) or stop, and end the script with the right exit code (a failed last attempt is
  FAILED in ``sacct``, not COMPLETED). If that program fails, the trap logs it and falls back to
  nemo_run's own decision with the original ``TORCHX_MAX_RETRIES`` (and, without ft_launcher, the
  preemption requeue from ``stop_reason.json``): the decision never makes things worse.

``MEGATRON_RESILIENCE_PYTHON`` (default ``python3``) is the interpreter the trap runs; it must import
this package where the batch script runs (the login/batch host, not a container).
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from megatron_resilience.failures import taxonomy
from megatron_resilience.jobs.jobconfig import JobLevelConfig, ledger_path, resolve
from megatron_resilience.jobs.preemption_margin import preempt_time_of
from megatron_resilience.plugins import node_range
from megatron_resilience.plugins._executor import set_setup_block, slurm_job_file
from megatron_resilience.plugins.job_plan import plan_of
from megatron_resilience.plugins.shell_templates import render_shell
from megatron_resilience.plugins.task_settings import finished_evidence
from megatron_resilience.records.names import METRICS_FILE, STOP_REASON_FILE
from megatron_resilience.upstream import import_nemo_run

BLOCK = "job-level decision"
RETRIES_WITHOUT_LIMIT = 1000000
# Signals a scheduler sends the batch shell to stop a job (the trainer's exit_signal among them).
BATCH_SIGNALS = ("TERM", "INT", "USR1", "USR2")


def remember_policy(executor: Any, settings: dict[str, Any]) -> None:
    """RestartPolicyPlugin: the resolved policy/monitors and watcher settings, for whichever plugin renders last."""
    plan_of(executor).policy_settings = settings


def remember_no_restart_exit_code(executor: Any, code: int) -> None:
    """FaultTolerancePlugin: ft_launcher's "do not restart" exit code when the user changed it (default 93)."""
    plan_of(executor).no_restart_exit_code = code


def uses_ft_launcher(launcher: Any) -> bool:
    run = import_nemo_run()
    return launcher == "ft" or isinstance(launcher, run.FaultTolerance)


def job_level_config(executor: Any, editor: Any) -> JobLevelConfig:
    """The job-level config of this job (policy None without a RestartPolicyPlugin)."""
    settings = plan_of(executor).policy_settings
    if settings is None:
        policy, monitors = resolve(None, None)
        settings = {"policy": policy, "monitors": monitors}
    flag_host, _ = slurm_job_file(executor, f"{executor.job_name}_finished_flag")
    job_dir = os.path.dirname(flag_host)
    run_dir = editor.run_dir() if editor is not None else None  # None: a trainer other than ours
    checkpoint = editor.get("checkpoint.save") if run_dir is not None else None
    finished = finished_evidence(executor)  # any trainer's checkpoint dir and last step (jobs/finished.py)
    return JobLevelConfig(
        job_name=executor.job_name, job_dir=job_dir, ledger=ledger_path(run_dir, job_dir), finished_flag=flag_host,
        run_dir=run_dir, stop_reason=os.path.join(run_dir, STOP_REASON_FILE) if run_dir else None,
        metrics=os.path.join(run_dir, METRICS_FILE) if run_dir else None,
        checkpoint_dir=checkpoint if isinstance(checkpoint, str) else finished.get("checkpoint_dir"),
        train_iters=finished.get("train_iters"), ft=uses_ft_launcher(executor.launcher),
        no_restart_exit_code=plan_of(executor).no_restart_exit_code or taxonomy.NVRX_NO_RESTART_EXIT_CODE,
        cycle_info_dir=os.path.join(job_dir, "ft_cycle_info"),
        cycle_log_prefix=os.path.join(job_dir, "ft_cycle_logs", "cycle"),
        sbatch_script=os.path.join(executor.tunnel.job_dir, f"{executor.job_name}_sbatch.sh"),
        preempt_time=preempt_time_of(getattr(executor, "signal", None)),
        **(node_range.remembered(executor) or {}), **{k: v for k, v in settings.items() if k != "watch"})


def install(executor: Any, editor: Any) -> None:
    """(Re)render the decision block from everything the plugins recorded on this executor so far."""
    cfg = job_level_config(executor, editor)
    _, flag_step = slurm_job_file(executor, f"{executor.job_name}_finished_flag")
    set_setup_block(executor, BLOCK, render(cfg, flag_step=flag_step))


def render(cfg: JobLevelConfig, *, flag_step: str) -> str:
    """The decision block of the sbatch script (``templates/batch_decision.sh.j2``), every path shell-quoted."""
    q = shlex.quote
    return render_shell("batch_decision.sh.j2",
        ft=cfg.ft, flag_step=q(flag_step), flag=q(cfg.finished_flag), marker=q(cfg.stop_marker), config=q(cfg.path),
        ledger=q(cfg.ledger), stop_reason=q(cfg.stop_reason) if cfg.stop_reason else "",
        ledger_dir=q(os.path.dirname(cfg.ledger)), job_dir=q(cfg.job_dir),
        job_level_json=json.dumps(json.loads(cfg.to_json()), sort_keys=True, indent=1),
        batch_signals=BATCH_SIGNALS, retries_without_limit=RETRIES_WITHOUT_LIMIT)
