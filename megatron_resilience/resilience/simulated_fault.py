"""Simulated faults, so users can check that their launcher/Slurm setup recovers before a real fault does.

``rank_killed`` SIGKILLs the rank; ``rank_hung`` SIGSTOPs it (the process stays
alive but silent, which only the FT rank monitor's timeouts can detect and
end); ``random`` picks one of the two. ``rank_stalled`` stops the rank's progress
while it stays alive and responsive (a wait in Python that never ends, as a rank
polling for a peer that never answers): the in-process restart's soft timeout
interrupts it and every rank restarts in-process; without in-process restart FT's
section timeout ends it like a hang. ``nan`` corrupts one weight of the rank's model to NaN (silent data
corruption): its loss is NaN and the rerun state machine's NaN check rejects it (``rerun.rerun_mode=disabled``:
the rank raises; an in-process restart restores the weights from a checkpoint). ``exception`` makes the rank die the way
a real failure kills it, with the same output, so the job-level classifier
sees what it would see on a cluster (``ft.simulated_fault_exception``):
``cuda_oom`` raises ``torch.OutOfMemoryError`` with PyTorch's message (uncaught:
torch.distributed's excepthook prints it with the ``[rankN]:`` prefix, exit 1);
``nccl_timeout`` prints the ProcessGroupNCCL watchdog's timeout lines and aborts
(SIGABRT), as the watchdog does; ``nccl_error`` raises ``DistBackendError`` with
an NCCL error message. The faulty rank is ``ft.simulated_fault_rank`` or, when
unset, one drawn by rank 0 and broadcast.

When: with ``ft.simulated_fault_step`` at the start of that step (section
``step``) or inside the first checkpoint save at or after it (section
``checkpointing``); otherwise ``simulated_fault_base_delay`` + up to 1 s of jitter
after setup, from a timer thread.

A fault fires only on the job's first attempt: ``TORCHELASTIC_RESTART_COUNT``
(ft_launcher's in-job restarts), ``SLURM_RESTART_COUNT`` (requeues) and
``MEGATRON_RESILIENCE_INPROCESS_RESTART`` (in-process restarts) must all be 0, and
a step fault also needs the run to start before that step. Otherwise the restarted
job would resume before step k, hit the fault again, and loop until its restarts ran
out instead of proving that it recovers. With ``ft.simulated_fault_repeat`` it fires
on every attempt instead, ``simulated_fault_step`` steps after the step the attempt
resumed from: a failure that recurs (retry budgets, restart loops).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

from megatron_resilience.config.resilience import FaultToleranceConfig
from megatron_resilience.resilience.log import get_logger
from megatron_resilience.runtime import collectives


def restart_counts() -> tuple[int, int, int]:
    """(in-job restarts by ft_launcher/torchrun, Slurm requeues + resubmissions by the job-level watcher,
    in-process restarts)."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
            + int(os.environ.get("MEGATRON_RESILIENCE_RESUBMISSION", "0") or 0),
            int(os.environ.get("MEGATRON_RESILIENCE_INPROCESS_RESTART", "0") or 0))


class SimulatedFault:
    def __init__(self, cfg: FaultToleranceConfig, *, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.log = get_logger("simulated_fault", rank)
        self.armed = False
        self.kind: str | None = None
        self.target: int | None = None
        self.fire_step: int | None = cfg.simulated_fault_step

    def arm(self, start_step: int, model=None) -> None:
        """After setup (collective when the rank is drawn at random): decide whether and where to fire."""
        self.model = model  # the ``nan`` fault corrupts one of its weights
        if not self.cfg.simulate_fault:
            return
        target = self.cfg.simulated_fault_rank
        if target is None:
            target = collectives.broadcast_int(random.randrange(self.world_size) if self.rank == 0 else -1)
        self.target = target
        if target >= self.world_size:
            self.log.warning(f"ft.simulated_fault_rank={target} is not a rank of this job "
                             f"(world size {self.world_size}): no fault is simulated")
            return
        in_job, requeues, inprocess = restart_counts()
        step = self.cfg.simulated_fault_step
        if self.cfg.simulated_fault_repeat:
            step = self.fire_step = start_step + step
            reason = None
        elif in_job or requeues or inprocess:
            reason = (f"this is a restart (in-job restarts={in_job}, requeues={requeues}"
                      f"{f', in-process restarts={inprocess}' if inprocess else ''})")
        elif step is not None and start_step >= step:
            reason = f"the run resumes after step {start_step}, past ft.simulated_fault_step={step}"
        else:
            reason = None
        if reason is not None:
            if self.rank == 0:
                self.log.info(f"simulated fault not armed: {reason}; faults fire only on a job's first attempt")
            return
        if self.rank != target:
            return
        kind = self.cfg.simulated_fault_type
        self.kind = random.choice(["rank_hung", "rank_killed"]) if kind == "random" else kind
        if self.kind == "exception":
            self.kind = f"exception:{self.cfg.simulated_fault_exception}"
        self.armed = True
        if step is None:
            delay = self.cfg.simulated_fault_base_delay + random.random()
            self.log.info(f"simulated fault armed: {self.kind} in {delay:.2f}s")
            threading.Thread(target=self._fire_later, args=(delay,), daemon=True,
                             name="simulated-fault").start()
        else:
            self.log.info(f"simulated fault armed: {self.kind} in section {self.cfg.simulated_fault_section} "
                          f"at step {step}")

    def at_step_start(self, step: int) -> None:
        if self.armed and self.cfg.simulated_fault_section == "step" and step == self.fire_step:
            self.fire(f"at the start of step {step}", step=step)

    def in_checkpointing(self, last_step: int) -> None:
        if (self.armed and self.cfg.simulated_fault_section == "checkpointing"
                and self.fire_step is not None and last_step >= self.fire_step):
            self.fire(f"inside the checkpoint save after step {last_step}", step=last_step)

    def _fire_later(self, delay: float) -> None:
        threading.Event().wait(delay)
        self.fire(f"{delay:.2f}s after setup")

    def fire(self, when: str, step: int = 0) -> None:
        self.armed = False
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        banner = f"SIMULATED FAULT at {stamp}: {self.kind} on rank {self.rank} (pid {os.getpid()}) {when}"
        print(f"\n#### {banner} ####\n", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.kind.startswith("exception:"):
            die_like_the_real_thing(self.kind.split(":", 1)[1], rank=self.rank, step=step)
        if self.kind == "nan":
            import torch

            param = next(p for chunk in self.model for p in chunk.parameters())
            with torch.no_grad():
                param.view(-1)[0] = float("nan")
            return
        if self.kind == "rank_stalled":
            while True:  # alive, responsive, and never done: only a timeout ends it
                time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGSTOP if self.kind == "rank_hung" else signal.SIGKILL)


def die_like_the_real_thing(kind: str, *, rank: int, step: int) -> None:
    """End this rank as a real CUDA OOM / NCCL watchdog timeout / NCCL error ends it (same output, same exit)."""
    import torch

    if kind == "cuda_oom":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
            "1.17 GiB is free. Including non-PyTorch memory, this process has 77.93 GiB memory in use. Of the "
            "allocated memory 74.02 GiB is allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    if kind == "nccl_error":
        raise torch.distributed.DistBackendError(
            "NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
            "remote process exited or there was a network error, NCCL version 2.21.5")
    # nccl_timeout: ProcessGroupNCCL's watchdog thread logs the timed-out collective, then takes the process down
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
    work = (f"WorkNCCL(SeqNum={max(1, step) * 4}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
            "ran for 600042 milliseconds before timing out.")
    prefix = f"[rank{rank}]:[E{stamp}.{time.time_ns() % 10**9:09d} ProcessGroupNCCL.cpp"
    sys.stderr.write(
        f"{prefix}:616] [Rank {rank}] Watchdog caught collective operation timeout: {work}\n"
        f"{prefix}:630] [Rank {rank}] Some NCCL operations have failed or timed out. Due to the asynchronous nature "
        "of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.\n"
        f"{prefix}:636] [Rank {rank}] To avoid data inconsistency, we are taking the entire process down.\n"
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        f"  what():  [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group watchdog thread terminated with "
        f"exception: [Rank {rank}] Watchdog caught collective operation timeout: {work}\n")
    sys.stderr.flush()
    os.abort()
