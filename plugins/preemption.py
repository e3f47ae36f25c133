"""PreemptionPlugin: stop gracefully (checkpoint, exit 0) on a signal Slurm sends before the time limit.

What ``setup`` does:

* task: ``train.exit_signal_handler``, ``train.exit_signal`` and ``train.exit_signal_handler_for_dataloader``;
* SlurmExecutor: ``#SBATCH --signal=<signal>@<preempt_time>`` (the ``signal`` executor field). Without
  ``B:`` Slurm signals the job steps, and under proctrack/cgroup only the direct children of
  slurmstepd. Those are: python for a ``run.Partial`` without launcher, torchrun/ft_launcher (which
  forward the signal to their workers) with one, and for a ``run.Script`` whatever the script line
  starts, so an inline script's trainer line is turned into ``exec python -m megatron_resilience ...``
  (bash would otherwise swallow the signal and python be SIGKILLed);
* requeue: nemo_run's plain sbatch script requeues only on a non-zero exit (while retries remain), and
  a preempted trainer exits 0 (torchrun, forwarding the signal, then exits 1). Unless ft_launcher's
  sbatch teardown handles it (FaultTolerancePlugin), an EXIT trap requeues the job when the trainer
  reported a stop with a checkpoint in ``<run_dir>/stop_reason.json`` and did not touch
  ``$FAULT_TOL_FINISHED_FLAG_FILE`` (touched when training finished, nemo_run's FT template contract);
* LocalExecutor: the exit handler is enabled, and a log line says no scheduler signal is configured;
* nsys requested on the launcher or the task is turned off with a warning (nsys would be the process
  that receives the signal);
* with a launcher, the signal must be one it forwards to the ranks (``upstream.LAUNCHER_FORWARDED_SIGNALS``),
  and torchrun is told to wait ``preempt_time`` seconds (not 30) before it SIGKILLs them.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass
from typing import Any

from megatron_resilience.config import CATCHABLE_SIGNALS, ConfigError
from megatron_resilience.config._validate import check_int, fail
from megatron_resilience.upstream import TORCHRUN_SHUTDOWN_TIMEOUT_ENV, import_nemo_run
from megatron_resilience.plugins._executor import (
    check_signal_reaches_trainer, claim, disable_nsys, executor_kind, remember_preemption_signal, set_env,
    set_setup_block, slurm_job_file, slurm_time_seconds,
)
from megatron_resilience.plugins._task import task_editor

run = import_nemo_run()
log = logging.getLogger("megatron_resilience.plugins")

NAME = "PreemptionPlugin"
REQUEUE_BLOCK = "PreemptionPlugin requeue"
# Written by the trainer's rank 0 into run_dir at exit (megatron_resilience.resilience.hooks.STOP_REASON_FILE;
# not imported: that module needs torch). Its format is checked against the trainer's writer in the tests.
STOP_REASON_FILE = "stop_reason.json"


def _uses_ft_launcher(launcher: Any) -> bool:
    return launcher == "ft" or isinstance(launcher, run.FaultTolerance)


def requeue_block(flag_host: str, flag_step: str, stop_reason: str) -> str:
    """sbatch lines: skip a requeued run that already finished; requeue one that stopped early with a checkpoint.

    "Stopped early with a checkpoint" is what the trainer (rank 0) writes to ``<run_dir>/stop_reason.json``:
    ``"exit_code": 0, "finished": false`` (preemption signal, ``exit_duration_in_mins``, straggler stop).
    The step's exit code cannot tell: torchrun exits 1 after forwarding a signal even when every rank
    exited 0. A non-zero exit that nemo_run's template already requeued (``TORCHX_MAX_RETRIES`` left)
    is not requeued twice.
    """
    host, reason = shlex.quote(flag_host), shlex.quote(stop_reason)
    return (
        "# the trainer touches $FAULT_TOL_FINISHED_FLAG_FILE when training finished; when it stops early with a\n"
        "# checkpoint (preemption signal) its stop_reason.json says so, and then this job is requeued\n"
        f"export FAULT_TOL_FINISHED_FLAG_FILE={shlex.quote(flag_step)}\n"
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then\n'
        f'    if [ -f {host} ]; then echo "Training is finished"; exit 0; fi\n'
        "else\n"
        f"    rm -f {host}\n"
        "fi\n"
        f"rm -f {reason}\n"
        "megatron_resilience_requeue_if_stopped_early() {\n"
        f"    [ ! -f {host} ] && [ -f {reason} ] || return 0\n"
        f"    grep -Eq '\"exit_code\": ?0[,}}]' {reason} && grep -Eq '\"finished\": ?false' {reason} || return 0\n"
        '    if [ "${exitcode:-1}" != "0" ] && [ "$TORCHX_MAX_RETRIES" -gt "${SLURM_RESTART_COUNT:-0}" ]; then return 0; fi\n'
        f'    echo "Trainer stopped before finishing ($(cat {reason})): requeueing $SLURM_JOB_ID"\n'
        '    scontrol requeue "$SLURM_JOB_ID"\n'
        "}\n"
        "trap megatron_resilience_requeue_if_stopped_early EXIT"
    )


@dataclass(kw_only=True)
class PreemptionPlugin(run.Plugin):
    """Graceful exit on ``signal``, sent by Slurm ``preempt_time`` seconds before the job's time limit."""

    preempt_time: int = 60
    enable_exit_handler: bool = True
    enable_exit_handler_for_data_loader: bool = False
    signal: str = "SIGTERM"

    def __post_init__(self) -> None:
        check_int(f"{NAME}.preempt_time", self.preempt_time, minimum=1)
        for name in ("enable_exit_handler", "enable_exit_handler_for_data_loader"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{NAME}.{name}", "must be true or false", getattr(self, name))
        if self.signal not in CATCHABLE_SIGNALS:
            fail(f"{NAME}.signal", f"must be one of {list(CATCHABLE_SIGNALS)}", self.signal)

    def setup(self, task: Any, executor: Any) -> None:
        kind = executor_kind(executor, NAME)
        claim(executor, NAME)
        remember_preemption_signal(executor, self.signal)
        check_signal_reaches_trainer(executor, NAME)
        editor = task_editor(task, NAME)
        editor.set("train.exit_signal_handler", self.enable_exit_handler, "enable_exit_handler")
        editor.set("train.exit_signal", self.signal, "signal")
        editor.set("train.exit_signal_handler_for_dataloader", self.enable_exit_handler_for_data_loader,
                   "enable_exit_handler_for_data_loader")
        editor.make_trainer_direct_task()
        disable_nsys(executor, editor, NAME, "nsys would be the process that receives the preemption signal, "
                     "not the trainer")
        if kind != "slurm":
            log.info("%s: %s has no scheduler: no scheduler signal is configured; the trainer saves a checkpoint "
                     "and exits 0 when it receives %s", NAME, type(executor).__name__, self.signal)
            return

        limit = slurm_time_seconds(executor.time)
        if limit is not None and self.preempt_time >= limit:
            raise ConfigError(f"{NAME}.preempt_time: must be below the executor's time limit "
                              f"executor.time={executor.time!r} ({limit} s), got {self.preempt_time}")
        value = f"{self.signal}@{self.preempt_time}"
        for key, existing in (("executor.signal", executor.signal),
                              ("executor.additional_parameters['signal']",
                               (executor.additional_parameters or {}).get("signal"))):
            if existing is not None and existing != value:
                raise ConfigError(f"conflicting settings: {key}={existing!r} but {NAME} needs {value!r}; "
                                  f"set signal and preempt_time on the {NAME} only")
        if executor.signal != value:
            log.info("%s: executor.signal: %r -> %r (#SBATCH --signal=%s)", NAME, executor.signal, value, value)
            executor.signal = value
        if TORCHRUN_SHUTDOWN_TIMEOUT_ENV not in executor.env_vars:
            # torchrun SIGKILLs the ranks 30 s after forwarding the signal; give them the whole preempt_time
            # (ft_launcher already waits --term-timeout=1800 s; without a launcher the variable is unused).
            log.info("%s: executor.env_vars[%r] = %r (seconds torchrun waits for the ranks to save and exit)",
                     NAME, TORCHRUN_SHUTDOWN_TIMEOUT_ENV, str(self.preempt_time))
            set_env(executor, TORCHRUN_SHUTDOWN_TIMEOUT_ENV, str(self.preempt_time))
        if not _uses_ft_launcher(executor.launcher):
            run_dir = editor.run_dir()
            if not run_dir:
                raise ConfigError(f"{NAME}: the task sets no run_dir; the trainer reports why it stopped in "
                                  f"<run_dir>/{STOP_REASON_FILE}, which decides the requeue after a preemption")
            flag_host, flag_step = slurm_job_file(executor, f"{executor.job_name}_finished_flag")
            set_setup_block(executor, REQUEUE_BLOCK,
                            requeue_block(flag_host, flag_step, os.path.join(run_dir, STOP_REASON_FILE)))
