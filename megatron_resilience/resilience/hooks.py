"""``ResilienceHooks``: the training loop's hook points, wired to FT sections, faults, preemption, stragglers.

The loop (``runtime/loop.py``) calls these on every rank in the same order:

    with hooks.setup_section(): ... init, build, load ...
    hooks.after_setup(state)
    reason = hooks.stop_requested(state)                  # a signal during setup: stop before step 1
    while not reason:
        with hooks.step_section(step): hooks.wrap_train_step(train_step)()
        with hooks.checkpoint_section(): save(...)        # periodic saves
        reason = hooks.after_step(state)                  # agreed by all ranks
    hooks.record_stop(state, reason, ...)                 # stop_reason.json before the save at the stop
    with hooks.checkpoint_section(): save(...)
    hooks.on_exit(state, reason or "finished", ...)

``after_step`` does one small all-reduce per step, [exit signal seen, straggler
stop wanted, first signal time] (none when neither feature is on); a signal wins
over a straggler.
The wall-time limit (``train.exit_duration_in_mins``) is the loop's own check.
``on_exit`` is where completion is marked: rank 0 touches
``$FAULT_TOL_FINISHED_FLAG_FILE`` for "finished" (and for rerun exit 17, see
``exit_codes``), never for a preemption, so the job is requeued and resumes.

``<run_dir>/stop_reason.json`` (rank 0) says how the process ended: ``reason``,
``step``, ``exit_code``, ``finished``, and ``checkpoint_step`` (the newest complete
checkpoint, where the next attempt resumes), ``lost_steps`` (steps of this
attempt it must redo), ``checkpoint_at_stop`` and ``signal`` (name, time, during
what). For a graceful stop it is written as soon as the ranks agree, *before*
the checkpoint at the stop is saved, with ``checkpoint_at_stop: "pending"``: if
the launcher kills the ranks before that save is durable, the file still says
"stopped by a signal, resume from checkpoint_step", so the job is requeued and
the lost steps are on record.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from megatron_resilience import upstream
from megatron_resilience.config.pretrain import PretrainConfig
from megatron_resilience.resilience import exit_codes
from megatron_resilience.resilience.fault_tolerance import FaultTolerance
from megatron_resilience.resilience.log import get_logger
from megatron_resilience.resilience.preemption import DataloaderWorkerInit, handler_for
from megatron_resilience.resilience.simulated_fault import SimulatedFault
from megatron_resilience.resilience.stop_reason import STOP_REASON_FILE, write_stop_reason
from megatron_resilience.resilience.straggler import StragglerDetection
from megatron_resilience.runtime import collectives
from megatron_resilience.runtime.hooks import TrainingHooks
from megatron_resilience.runtime.state import TrainState

FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"
__all__ = ["FINISHED_FLAG_ENV", "STOP_REASON_FILE", "ResilienceHooks", "build_hooks"]


class ResilienceHooks(TrainingHooks):
    def __init__(self, config: PretrainConfig, *, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.log = get_logger("hooks", rank)
        ckpt = config.checkpoint
        self.ft = FaultTolerance(config.ft, rank=rank, save_dir=ckpt.save, load_dir=ckpt.load_dir,
                                 async_save=ckpt.async_save,
                                 keep_connection=config.inprocess.enabled) if config.ft.enabled else None
        self.fault = SimulatedFault(config.ft, rank=rank, world_size=world_size)
        train = config.train
        self.signals = handler_for(train.exit_signal, rank=rank) if train.exit_signal_handler else None
        self._stop_record: dict | None = None  # the `signal` record of metrics.jsonl, once the ranks agreed
        self.straggler = StragglerDetection(config.straggler, rank=rank, world_size=world_size)
        self.last_step = 0
        self.start_step = 0
        self._closed = False
        # Called after every step, eval pass and save: in-process restart's progress ping (resilience/inprocess.py)
        self.progress: Callable[[], None] = lambda: None

    # --- setup ----------------------------------------------------------------------------------------------

    @contextmanager
    def setup_section(self) -> Iterator[None]:
        if self.signals is not None:
            self.signals.install()
        if self.ft is not None:
            self.ft.start()
        yield

    def after_setup(self, state: TrainState) -> None:
        self.start_step = self.last_step = state.step
        if self.ft is not None:
            self.ft.end_setup(loaded_checkpoint=state.step > 0)
        self.straggler.start()
        self.fault.arm(state.step, model=state.model)

    def dataloader_worker_init(self, worker_id: int) -> None:
        """In each DataLoader worker: with train.exit_signal_handler_for_dataloader, ignore the exit signal so
        Slurm's signal to the whole process tree does not kill the workers before the main process has saved."""
        train = self.config.train
        if train.exit_signal_handler and train.exit_signal_handler_for_dataloader:
            DataloaderWorkerInit(train.exit_signal)(worker_id)

    # --- steps ----------------------------------------------------------------------------------------------

    @contextmanager
    def step_section(self, step: int) -> Iterator[None]:
        section = self.ft.step() if self.ft is not None else _null()
        self._phase(f"step {step}", step - 1)
        with section:
            self.fault.at_step_start(step)
            yield
        self.progress()
        self.last_step = step
        self._phase(f"after step {step}", step)

    def wrap_train_step(self, train_step: Callable[[], Any]) -> Callable[[], Any]:
        return self.straggler.wrap(train_step)

    @contextmanager
    def eval_section(self) -> Iterator[None]:
        yield
        self.progress()
        if self.ft is not None:
            self.ft.after_eval()

    @contextmanager
    def checkpoint_section(self) -> Iterator[None]:
        section = self.ft.checkpointing() if self.ft is not None else _null()
        self._phase(f"checkpoint save of step {self.last_step}", self.last_step)
        with section:
            self.fault.in_checkpointing(self.last_step)
            yield
        self.progress()
        self._phase(f"after step {self.last_step}", self.last_step)

    def stop_requested(self, state: TrainState) -> str | None:
        """Before the first step: the exit signal came at the end of setup (agreed by all ranks): stop untrained."""
        # from here on a signal is agreed on, not acted on alone
        self._phase(f"end of setup (step {state.step})", state.step)
        if self.signals is None:
            return None
        return self._agree(state, straggler_stop=False, before_training=True)

    def after_step(self, state: TrainState) -> str | None:
        self.last_step = state.step
        straggler_stop = self.straggler.after_step(state.step)
        if self.signals is None and not self.straggler.active:
            return None  # nothing to agree on: no collective
        return self._agree(state, straggler_stop=straggler_stop, before_training=False)

    def signal_before_save(self, state: TrainState) -> str | None:
        if self.signals is None:
            return None  # nothing to agree on: no collective
        return self._agree(state, straggler_stop=False, before_training=False)

    def _agree(self, state: TrainState, *, straggler_stop: bool, before_training: bool) -> str | None:
        """One all-reduce: [signal seen, straggler stop, -first signal time] (max over ranks)."""
        signals = self.signals
        signal_seen = signals is not None and signals.received
        first = signals.received_at if signal_seen else None
        signal_flag, straggler_flag, minus_first = collectives.all_reduce_max(
            [float(signal_seen), float(straggler_stop), -first if first is not None else -float("inf")])
        reason = (exit_codes.REASON_SIGNAL if signal_flag else
                  exit_codes.REASON_STRAGGLER if straggler_flag else None)
        if reason == exit_codes.REASON_SIGNAL:
            if signal_seen:
                signals.report()  # one line per rank: which signal, when, during what
            else:
                self.log.warning(f"stopping with the other ranks: {signals.signal_name} was not delivered to "
                                 "this rank")
            self._stop_record = {**signals.describe(), "first_received_time": -minus_first, "step": state.step,
                                 "before_training": before_training}
        if reason is not None and self.rank == 0:
            why = (f"{self.config.train.exit_signal} received" if reason == exit_codes.REASON_SIGNAL
                   else "straggler detected with straggler.stop_if_detected=true")
            if before_training:
                self.log.warning(f"stopping before training (at step {state.step}): {why} during setup; nothing "
                                 "to save, exiting 0 (training not finished: the job should be requeued and resume)")
            else:
                self.log.warning(f"stopping after step {state.step}: {why}; saving a checkpoint and exiting 0 "
                                 "(training not finished: the job should be requeued and resume)")
        return reason

    def take_records(self) -> list[tuple[str, dict]]:
        return self.straggler.take_records()

    def stop_record(self) -> tuple[str, dict] | None:
        if self._stop_record is None:
            return None
        return "signal", dict(self._stop_record)

    def record_stop(self, state: TrainState, reason: str, *, checkpoint_step: int | None,
                    checkpoint_at_stop: str) -> None:
        """Rank 0: stop_reason.json for a stop that is under way (rewritten by on_exit)."""
        if self.rank == 0:
            reason = exit_codes.normalize_reason(reason)
            self._write_stop_reason(state, reason, exit_codes.exit_code_for(reason), checkpoint_step=checkpoint_step,
                                    checkpoint_at_stop=checkpoint_at_stop)

    # --- the end --------------------------------------------------------------------------------------------

    def on_failure(self, err: BaseException) -> None:
        """A signal from now on is ft_launcher tearing down the group after this rank's own failure (a lost peer):
        counted, never recorded as a stop (stop_reason.json would say "stopped on a signal, exit 0")."""
        if self.signals is not None:
            self.signals.mark_failed(err)

    def on_exit(self, state: TrainState, reason: str, *, checkpoint_step: int | None = None,
                checkpoint_at_stop: str | None = None) -> None:
        """Every rank, once. Ends FT monitoring (learning final timeouts), marks completion, restores handlers."""
        if self._closed:
            return
        self._closed = True
        self._phase("exit", None)
        reason = exit_codes.normalize_reason(reason)
        code = exit_codes.exit_code_for(reason)
        if self.ft is not None:
            if exit_codes.stops_in_job_restarts(reason):
                self._ask_launcher_to_shut_down(reason)
            self.ft.shutdown(update_timeouts=True)
        self.straggler.shutdown()
        if self.signals is not None:
            self.signals.report()  # e.g. a signal during the last save, or a second one
            self.signals.restore()
        if self.rank == 0:
            self._write_stop_reason(state, reason, code, checkpoint_step=checkpoint_step,
                                    checkpoint_at_stop=checkpoint_at_stop)
            if exit_codes.marks_finished(reason):
                self._touch_finished_flag(reason)
            self.log.info(f"training ended: reason={reason} step={state.step} exit_code={code}")

    def _ask_launcher_to_shut_down(self, reason: str) -> None:
        client = self.ft.client if self.ft is not None else None
        if client is None or os.environ.get("LOCAL_RANK", "0") != "0":
            return
        ft = upstream.import_fault_tolerance()
        try:
            client.send_workload_control_request(
                ft.WorkloadControlRequest(ft.WorkloadAction.ShutdownWorkload, f"{reason}: do not restart"))
            self.log.warning(f"{reason}: asked ft_launcher not to restart the workers")
        except Exception as err:  # noqa: BLE001 - best effort; the exit code still says it
            self.log.warning(f"{reason}: could not ask ft_launcher to shut down: {err}")

    def _touch_finished_flag(self, reason: str) -> None:
        path = os.environ.get(FINISHED_FLAG_ENV)
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a"):
            pass
        self.log.info(f"marked the job as not to be requeued ({reason}): touched {path}")

    def _phase(self, what: str, completed_step: int | None) -> None:
        if self.signals is not None:
            self.signals.phase, self.signals.completed_step = what, completed_step

    def _write_stop_reason(self, state: TrainState, reason: str, code: int, *, checkpoint_step: int | None = None,
                           checkpoint_at_stop: str | None = None) -> None:
        record = {"reason": reason, "step": state.step, "exit_code": code,
                  "finished": reason == exit_codes.REASON_FINISHED,
                  "checkpoint_step": checkpoint_step, "lost_steps": state.step - (checkpoint_step or 0)}
        if checkpoint_at_stop is not None:
            record["checkpoint_at_stop"] = checkpoint_at_stop
        signals = getattr(self, "signals", None)
        if signals is not None and signals.received:
            record["signal"] = signals.describe()
        write_stop_reason(self.config.run_dir, record)


@contextmanager
def _null() -> Iterator[None]:
    yield


def build_hooks(config: PretrainConfig, *, rank: int, world_size: int) -> TrainingHooks:
    """The hooks pretrain.py passes to the loop: resilience as configured (a no-op where it is off)."""
    return ResilienceHooks(config, rank=rank, world_size=world_size)
