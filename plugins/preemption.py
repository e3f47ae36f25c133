"""PreemptionPlugin: stop gracefully (checkpoint, exit 0) on a signal the scheduler sends before the time limit.

What ``setup`` does. Executor side, the same for every task:

* SlurmExecutor: ``#SBATCH --signal=<signal>@<preempt_time>`` (the ``signal`` executor field). Without
  ``B:`` Slurm signals the job steps, and under proctrack/cgroup only the direct children of
  slurmstepd: python for a ``run.Partial`` without launcher, torchrun/ft_launcher (which forward the
  signal to their workers) with one, and for a ``run.Script`` whatever the script line starts;
  and torchrun is told to wait ``preempt_time`` seconds (not 30) before it SIGKILLs the ranks;
* other executors have no scheduler signal (``executors.py``): a log line says so, the rest applies;
* with a launcher, the signal must be one it forwards to the ranks (``upstream.LAUNCHER_FORWARDED_SIGNALS``);
* nsys requested on the launcher or the task is turned off with a warning (nsys would be the process
  that receives the signal).

Task side (``task_settings``), only with ``enable_exit_handler=True`` (with False the task is left alone,
as Megatron-Bridge does): our trainer gets ``train.exit_signal_handler``, ``train.exit_signal`` and
``train.exit_signal_handler_for_dataloader``, and an inline script's trainer line becomes
``exec python -m megatron_resilience ...`` (bash would otherwise swallow the signal and python be
SIGKILLed); a Megatron-LM or Megatron-Bridge script (or any script, with ``script_args_converter_fn``)
gets the converted ``PreemptionPluginScriptArgs``; a Megatron-Bridge Partial ``config.train``'s exit
handler fields; a NeMo 2.0 Partial NeMo's ``PreemptionCallback(sig=...)`` in ``trainer.callbacks`` (or the
``callbacks`` given, NeMo's own field); anything else one warning.

``executor.signal`` already set by the user is compared by what Slurm makes of it (``TERM@60``, ``15@60``
and ``SIGTERM@60`` are one request: ``config/slurm_signal.py``); only a different request is a conflict.

Requeue (SlurmExecutor): nemo_run's plain sbatch script requeues only on a non-zero exit (while retries
remain), and a preempted trainer exits 0 (torchrun, forwarding the signal, then exits 1). The job-level
decision block (``batch_decision``) requeues the job when the trainer reported a stop on a signal in
``<run_dir>/stop_reason.json`` (or logged receiving it) without spending a failure retry, and never
when it touched ``$FAULT_TOL_FINISHED_FLAG_FILE`` (touched when training finished).
"""

from __future__ import annotations

import logging
import signal as _signal
from dataclasses import dataclass
from typing import Any, Callable

from megatron_resilience.config import CATCHABLE_SIGNALS, ConfigError, TrainingConfig
from megatron_resilience.config.slurm_signal import same_slurm_signal
from megatron_resilience.config.slurm_time import slurm_time_seconds
from megatron_resilience.config.training import PREEMPTION_NOTICE_PROVIDERS
from megatron_resilience.config.validate import check_int, check_positive, fail
from megatron_resilience.jobs.preemption_margin import preempt_time_warning
from megatron_resilience.plugins import batch_decision, megatron_lm_flags
from megatron_resilience.plugins._executor import (
    check_signal_reaches_trainer,
    claim,
    disable_nsys,
    remember_preemption_signal,
    set_env,
)
from megatron_resilience.plugins.batch_decision import uses_ft_launcher
from megatron_resilience.plugins.executors import executor_profile
from megatron_resilience.plugins.script_args import PreemptionPluginScriptArgs
from megatron_resilience.plugins.task_check import check_task
from megatron_resilience.plugins.task_settings import (
    TrainerTarget,
    append_script_args,
    remember_finished_evidence,
    trainer_target,
    warn_unknown_trainer,
)
from megatron_resilience.records.names import STOP_REASON_FILE
from megatron_resilience.tasks import partial_trainers
from megatron_resilience.upstream import TORCHRUN_SHUTDOWN_TIMEOUT_ENV, import_nemo_run

run = import_nemo_run()
log = logging.getLogger("megatron_resilience.plugins")

NAME = "PreemptionPlugin"
# Written by the trainer's rank 0 into run_dir at exit (megatron_resilience.resilience.hooks.STOP_REASON_FILE;
# not imported: that module needs torch). Its format is checked against the trainer's writer in the tests.


def _signal_name(key: str, value: Any) -> str:
    """``value`` as the name the trainer and Slurm are given: our ``"SIGINT"``, or NeMo's ``signal.SIGINT`` (a
    ``signal.Signals`` member, whose plain ``str`` would be ``"Signals.SIGINT"``) or its number."""
    name = value
    if isinstance(value, int) and not isinstance(value, bool):
        name = _signal.Signals(value).name if value in {s.value for s in _signal.Signals} else None
    if not isinstance(name, str) or name not in CATCHABLE_SIGNALS:
        fail(key, f"must be one of {list(CATCHABLE_SIGNALS)}", value)  # or their signal.Signals members
    return name


@dataclass(kw_only=True)
class PreemptionPlugin(run.Plugin):
    """Graceful exit on ``signal``, sent by Slurm ``preempt_time`` seconds before the job's time limit.

    The first fields and their defaults are Megatron-Bridge's; ``signal`` is ours (the trainer's
    ``train.exit_signal``: a name, or a ``signal.Signals`` member); ``sig`` is NeMo 2.0's name for it, accepted
    so a NeMo user's ``PreemptionPlugin(sig=signal.SIGINT)`` keeps working (it becomes ``signal``, logged);
    ``callbacks`` is NeMo 2.0's: ``run.Config`` callbacks merged into a NeMo task's ``trainer.callbacks`` instead
    of NeMo's ``PreemptionCallback``. ``cloud_notice`` ("aws", "gcp", "azure"): the
    trainer's local rank 0 of each node also polls that cloud's instance metadata service every
    ``cloud_notice_interval`` seconds for a spot/preemptible notice and treats one exactly like ``signal``
    (``train.preemption_notice``; ``cloud_notice_url`` replaces the metadata service's address, e.g. a proxy).
    Our trainer only.
    """

    preempt_time: int = 60
    enable_exit_handler: bool = True
    enable_exit_handler_for_data_loader: bool = False
    script_args_converter_fn: Callable[[PreemptionPluginScriptArgs], list[str]] | None = None
    signal: str = "SIGTERM"
    sig: Any = None
    callbacks: list[Any] | None = None
    cloud_notice: str | None = None
    cloud_notice_interval: float = 5.0
    cloud_notice_url: str | None = None

    def __post_init__(self) -> None:
        check_int(f"{NAME}.preempt_time", self.preempt_time, minimum=1)
        for name in ("enable_exit_handler", "enable_exit_handler_for_data_loader"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{NAME}.{name}", "must be true or false", getattr(self, name))
        self.signal = _signal_name(f"{NAME}.signal", self.signal)
        if self.sig is not None:  # NeMo 2.0's field: one setting under two names, so two values must agree
            sig = _signal_name(f"{NAME}.sig", self.sig)
            if self.signal not in ("SIGTERM", sig):
                raise ConfigError(f"{NAME}.sig: NeMo 2.0's name for {NAME}.signal; sig={sig!r} and "
                                  f"signal={self.signal!r} ask for two signals: set one of them")
            log.info("%s: sig=%s (NeMo 2.0's name) is signal=%r", NAME, sig, sig)
            self.signal, self.sig = sig, None
        if self.script_args_converter_fn is not None and not callable(self.script_args_converter_fn):
            fail(f"{NAME}.script_args_converter_fn", "must be a function of PreemptionPluginScriptArgs",
                 self.script_args_converter_fn)
        if self.callbacks is not None and (not isinstance(self.callbacks, (list, tuple)) or not all(
                hasattr(c, "__fn_or_cls__") for c in self.callbacks)):
            fail(f"{NAME}.callbacks", "must be a list of run.Config callbacks (NeMo 2.0's field), e.g. "
                 "[run.Config(PreemptionCallback, sig=signal.SIGTERM)]", self.callbacks)
        if self.cloud_notice is not None and self.cloud_notice not in PREEMPTION_NOTICE_PROVIDERS:
            fail(f"{NAME}.cloud_notice", f"must be one of {list(PREEMPTION_NOTICE_PROVIDERS)} or None",
                 self.cloud_notice)
        check_positive(f"{NAME}.cloud_notice_interval", self.cloud_notice_interval)
        if self.cloud_notice is not None and not self.enable_exit_handler:
            fail(f"{NAME}.enable_exit_handler", "must be true with cloud_notice (a notice acts as the signal the "
                 "trainer's exit handler stops on)", self.enable_exit_handler)
        if self.cloud_notice_url is not None:  # the trainer's own check, at submit time
            try:
                TrainingConfig(exit_signal_handler=True, preemption_notice="aws",
                               preemption_notice_url=self.cloud_notice_url)
            except ConfigError as err:
                raise ConfigError(str(err).replace("train.preemption_notice_url", f"{NAME}.cloud_notice_url")) \
                    from None

    def setup(self, task: Any, executor: Any) -> None:
        profile = executor_profile(executor, NAME)
        claim(executor, NAME)
        remember_preemption_signal(executor, self.signal)
        check_signal_reaches_trainer(executor, NAME)
        check_task(task, executor)  # the same submit-time check as preview() and the CLI
        target = trainer_target(task, NAME, self.script_args_converter_fn if self.enable_exit_handler else None)
        self._check_callbacks(target)
        editor = self._trainer_settings(target)
        disable_nsys(executor, editor, NAME, "nsys would be the process that receives the preemption signal, "
                     "not the trainer")
        if not profile.scheduler_signal:
            log.info("%s: %s has no scheduler signal before a time limit: none is configured; the trainer saves a "
                     "checkpoint and exits 0 when it receives %s (e.g. when the platform stops the job)", NAME,
                     profile.name, self.signal)
            return

        limit = slurm_time_seconds(executor.time)
        if limit is not None and self.preempt_time >= limit:
            raise ConfigError(f"{NAME}.preempt_time: must be below the executor's time limit "
                              f"executor.time={executor.time!r} ({limit} s), got {self.preempt_time}")
        value = f"{self.signal}@{self.preempt_time}"
        for key, existing in (("executor.signal", executor.signal),
                              ("executor.additional_parameters['signal']",
                               (executor.additional_parameters or {}).get("signal"))):
            if existing is not None and not same_slurm_signal(existing, value, key):
                raise ConfigError(f"conflicting settings: {key}={existing!r} but {NAME} needs {value!r}; "
                                  f"set signal and preempt_time on the {NAME} only")
        if executor.signal is None or not same_slurm_signal(executor.signal, value):
            log.info("%s: executor.signal: %r -> %r (#SBATCH --signal=%s)", NAME, executor.signal, value, value)
            executor.signal = value
        if TORCHRUN_SHUTDOWN_TIMEOUT_ENV not in executor.env_vars:
            # torchrun SIGKILLs the ranks 30 s after forwarding the signal; give them the whole preempt_time
            # (ft_launcher already waits --term-timeout=1800 s; without a launcher the variable is unused).
            log.info("%s: executor.env_vars[%r] = %r (seconds torchrun waits for the ranks to save and exit)",
                     NAME, TORCHRUN_SHUTDOWN_TIMEOUT_ENV, str(self.preempt_time))
            set_env(executor, TORCHRUN_SHUTDOWN_TIMEOUT_ENV, str(self.preempt_time))
        editor = target.editor  # run_dir is read also with enable_exit_handler=False
        if editor is not None and editor.run_dir():
            warning = preempt_time_warning(self.preempt_time, editor.run_dir(), key=f"{NAME}.preempt_time")
            if warning:
                log.warning("%s", warning)
        if editor is not None and not uses_ft_launcher(executor.launcher) and not editor.run_dir():
            raise ConfigError(f"{NAME}: the task sets no run_dir; the trainer reports why it stopped in "
                              f"<run_dir>/{STOP_REASON_FILE}, which decides the requeue after a preemption")
        remember_finished_evidence(executor, target)
        batch_decision.install(executor, editor)

    def _check_callbacks(self, target: TrainerTarget) -> None:
        if self.callbacks is not None and target.nemo is None:
            raise ConfigError(f"{NAME}.callbacks: NeMo 2.0's field, merged into the trainer.callbacks of a NeMo "
                              f"run.Partial (llm.pretrain with trainer=run.Config(Trainer, ...)); this task has no "
                              f"Lightning trainer. Leave callbacks=None: the plugin sets the exit handler itself")

    def _trainer_settings(self, target: TrainerTarget) -> Any:
        """The exit handler in the trainer; returns our trainer's editor (None for any other trainer)."""
        if not self.enable_exit_handler:
            log.info("%s: enable_exit_handler=False: the task is left as it is (its own signal handling applies)",
                     NAME)
            return None
        if target.editor is not None:
            editor = target.editor
            editor.set("train.exit_signal_handler", True, "enable_exit_handler")
            editor.set("train.exit_signal", self.signal, "signal")
            editor.set("train.exit_signal_handler_for_dataloader", self.enable_exit_handler_for_data_loader,
                       "enable_exit_handler_for_data_loader")
            editor.make_trainer_direct_task()
            if self.cloud_notice is not None:
                editor.set("train.preemption_notice", self.cloud_notice, "cloud_notice")
                editor.set("train.preemption_notice_interval", float(self.cloud_notice_interval),
                           "cloud_notice_interval")
                if self.cloud_notice_url is not None:
                    editor.set("train.preemption_notice_url", self.cloud_notice_url, "cloud_notice_url")
            return editor
        if self.cloud_notice is not None:
            raise ConfigError(f"{NAME}.cloud_notice={self.cloud_notice!r}: only megatron_resilience's trainer polls "
                              "the instance metadata service; this task runs another trainer (set cloud_notice=None)")
        if target.nemo is not None:
            callbacks = self.callbacks or [partial_trainers.callback_config(
                partial_trainers.NEMO_PREEMPTION_CALLBACK, NAME, sig=int(getattr(_signal, self.signal)))]
            partial_trainers.merge_callbacks(target.nemo, list(callbacks), NAME)
        elif target.bridge is not None:
            partial_trainers.configure_bridge_exit_handler(
                target.bridge, for_data_loader=self.enable_exit_handler_for_data_loader, signal_name=self.signal,
                plugin=NAME)
        elif target.converter is not None:
            append_script_args(target, NAME, PreemptionPluginScriptArgs(
                enable_exit_handler=True, enable_exit_handler_for_data_loader=self.enable_exit_handler_for_data_loader,
                exit_signal=self.signal))
            megatron_lm_flags.ensure_load(target, NAME)  # a requeue after the signal resumes from --load only
            megatron_lm_flags.warn_save_at_signal(target, NAME)
        else:
            warn_unknown_trainer(target, NAME, f"save a checkpoint and exit 0 when it receives {self.signal} "
                                 f"(enable_exit_handler)")
        return None
