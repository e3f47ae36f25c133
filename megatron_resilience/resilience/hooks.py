"""``ResilienceHooks``: the training loop's hook points, wired to FT sections, faults, preemption, stragglers.

The loop (``runtime/loop.py``) calls these on every rank in the same order:

    with hooks.setup_section(): ... init, build, load ...
    hooks.after_setup(state)
    while ...:
        with hooks.step_section(step): hooks.wrap_train_step(train_step)()
        with hooks.checkpoint_section(): save(...)        # periodic saves
        reason = hooks.after_step(state)                  # agreed by all ranks
        if reason: with hooks.checkpoint_section(): save(...); break
    hooks.on_exit(state, reason or "finished")

``after_step`` does one small all-reduce per step, [exit signal seen, straggler
stop wanted] (none when neither feature is on); a signal wins over a straggler.
The wall-time limit (``train.exit_duration_in_mins``) is the loop's own check.
``on_exit`` is where completion is marked: rank 0 touches
``$FAULT_TOL_FINISHED_FLAG_FILE`` for "finished" (and for rerun exit 17, see
``exit_codes``), never for a preemption, so the job is requeued and resumes.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from megatron_resilience import upstream
from megatron_resilience.config.pretrain import PretrainConfig
from megatron_resilience.resilience import _dist, exit_codes
from megatron_resilience.resilience.fault_tolerance import FaultTolerance
from megatron_resilience.resilience.log import get_logger
from megatron_resilience.resilience.preemption import DataloaderWorkerInit, DistributedSignalHandler
from megatron_resilience.resilience.simulated_fault import SimulatedFault
from megatron_resilience.resilience.straggler import StragglerDetection
from megatron_resilience.runtime.hooks import TrainingHooks
from megatron_resilience.runtime.state import TrainState

FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"
STOP_REASON_FILE = "stop_reason.json"


class ResilienceHooks(TrainingHooks):
    def __init__(self, config: PretrainConfig, *, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.log = get_logger("hooks", rank)
        ckpt = config.checkpoint
        self.ft = FaultTolerance(config.ft, rank=rank, save_dir=ckpt.save, load_dir=ckpt.load_dir,
                                 async_save=ckpt.async_save) if config.ft.enabled else None
        self.fault = SimulatedFault(config.ft, rank=rank, world_size=world_size)
        train = config.train
        self.signals = DistributedSignalHandler(train.exit_signal, rank=rank) if train.exit_signal_handler else None
        self.straggler = StragglerDetection(config.straggler, rank=rank, world_size=world_size)
        self.last_step = 0
        self.start_step = 0
        self._closed = False

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
        self.fault.arm(state.step)

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
        with section:
            self.fault.at_step_start(step)
            yield
        self.last_step = step

    def wrap_train_step(self, train_step: Callable[[], Any]) -> Callable[[], Any]:
        return self.straggler.wrap(train_step)

    @contextmanager
    def eval_section(self) -> Iterator[None]:
        yield
        if self.ft is not None:
            self.ft.after_eval()

    @contextmanager
    def checkpoint_section(self) -> Iterator[None]:
        section = self.ft.checkpointing() if self.ft is not None else _null()
        with section:
            self.fault.in_checkpointing(self.last_step)
            yield

    def after_step(self, state: TrainState) -> str | None:
        self.last_step = state.step
        straggler_stop = self.straggler.after_step(state.step)
        signal_seen = self.signals is not None and self.signals.received
        if self.signals is None and not self.straggler.active:
            return None  # nothing to agree on: no collective
        signal_flag, straggler_flag = _dist.all_reduce_max([float(signal_seen), float(straggler_stop)])
        reason = (exit_codes.REASON_SIGNAL if signal_flag else
                  exit_codes.REASON_STRAGGLER if straggler_flag else None)
        if reason is not None and self.rank == 0:
            why = (f"{self.config.train.exit_signal} received" if reason == exit_codes.REASON_SIGNAL
                   else "straggler detected with straggler.stop_if_detected=true")
            self.log.warning(f"stopping after step {state.step}: {why}; saving a checkpoint and exiting 0 "
                             "(training not finished: the job should be requeued and resume)")
        return reason

    # --- the end --------------------------------------------------------------------------------------------

    def on_exit(self, state: TrainState, reason: str) -> None:
        """Every rank, once. Ends FT monitoring (learning final timeouts), marks completion, restores handlers."""
        if self._closed:
            return
        self._closed = True
        reason = exit_codes.normalize_reason(reason)
        code = exit_codes.exit_code_for(reason)
        if self.ft is not None:
            if exit_codes.stops_in_job_restarts(reason):
                self._ask_launcher_to_shut_down(reason)
            self.ft.shutdown(update_timeouts=True)
        self.straggler.shutdown()
        if self.signals is not None:
            self.signals.restore()
        if self.rank == 0:
            self._write_stop_reason(state, reason, code)
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

    def _write_stop_reason(self, state: TrainState, reason: str, code: int) -> None:
        run_dir = self.config.run_dir
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, STOP_REASON_FILE)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"reason": reason, "step": state.step, "exit_code": code,
                       "finished": reason == exit_codes.REASON_FINISHED}, f)
        os.replace(tmp, path)


@contextmanager
def _null() -> Iterator[None]:
    yield


def build_hooks(config: PretrainConfig, *, rank: int, world_size: int) -> TrainingHooks:
    """The hooks pretrain.py passes to the loop: resilience as configured (a no-op where it is off)."""
    return ResilienceHooks(config, rank=rank, world_size=world_size)
