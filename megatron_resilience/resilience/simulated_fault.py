"""Simulated faults, so users can check that their launcher/Slurm setup recovers before a real fault does.

``rank_killed`` SIGKILLs the rank; ``rank_hung`` SIGSTOPs it (the process stays
alive but silent, which only the FT rank monitor's timeouts can detect and
end); ``random`` picks one of the two. The faulty rank is
``ft.simulated_fault_rank`` or, when unset, one drawn by rank 0 and broadcast.

When: with ``ft.simulated_fault_step`` at the start of that step (section
``step``) or inside the first checkpoint save at or after it (section
``checkpointing``); otherwise ``simulated_fault_base_delay`` + up to 1 s of jitter
after setup, from a timer thread.

A fault fires only on the job's first attempt: ``TORCHELASTIC_RESTART_COUNT``
(ft_launcher's in-job restarts) and ``SLURM_RESTART_COUNT`` (requeues) must both
be 0, and a step fault also needs the run to start before that step. Otherwise
the restarted job would resume before step k, hit the fault again, and loop until
its restarts ran out instead of proving that it recovers.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

from megatron_resilience.config.resilience import FaultToleranceConfig
from megatron_resilience.resilience import _dist
from megatron_resilience.resilience.log import get_logger


def restart_counts() -> tuple[int, int]:
    """(in-job restarts by ft_launcher/torchrun, Slurm requeues) of this process's job."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))


class SimulatedFault:
    def __init__(self, cfg: FaultToleranceConfig, *, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.log = get_logger("simulated_fault", rank)
        self.armed = False
        self.kind: str | None = None
        self.target: int | None = None

    def arm(self, start_step: int) -> None:
        """After setup (collective when the rank is drawn at random): decide whether and where to fire."""
        if not self.cfg.simulate_fault:
            return
        target = self.cfg.simulated_fault_rank
        if target is None:
            target = _dist.broadcast_int(random.randrange(self.world_size) if self.rank == 0 else -1)
        self.target = target
        if target >= self.world_size:
            self.log.warning(f"ft.simulated_fault_rank={target} is not a rank of this job "
                             f"(world size {self.world_size}): no fault is simulated")
            return
        in_job, requeues = restart_counts()
        step = self.cfg.simulated_fault_step
        if in_job or requeues:
            reason = f"this is a restart (in-job restarts={in_job}, requeues={requeues})"
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
        if self.armed and self.cfg.simulated_fault_section == "step" and step == self.cfg.simulated_fault_step:
            self.fire(f"at the start of step {step}")

    def in_checkpointing(self, last_step: int) -> None:
        if (self.armed and self.cfg.simulated_fault_section == "checkpointing"
                and self.cfg.simulated_fault_step is not None and last_step >= self.cfg.simulated_fault_step):
            self.fire(f"inside the checkpoint save after step {last_step}")

    def _fire_later(self, delay: float) -> None:
        threading.Event().wait(delay)
        self.fire(f"{delay:.2f}s after setup")

    def fire(self, when: str) -> None:
        self.armed = False
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        banner = f"SIMULATED FAULT at {stamp}: {self.kind} on rank {self.rank} (pid {os.getpid()}) {when}"
        print(f"\n#### {banner} ####\n", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSTOP if self.kind == "rank_hung" else signal.SIGKILL)
