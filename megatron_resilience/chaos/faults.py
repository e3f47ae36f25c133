"""The faults chaos can inject into a running Slurm job, and what the job-level classifier should call each.

Each kind is what a real cause looks like from inside the job, made with what exists here:

- ``gpu_xid``: the GPU driver's Xid line (``NVRM: Xid (PCI:...): 79, ... GPU has fallen off the bus``) on a
  rank's output, then the rank dies (SIGKILL);
- ``gpu_ecc``: CUDA's uncorrectable ECC error raised in a rank (its error line on the rank's output), the
  rank dies;
- ``python_bug``: an uncaught Python exception in a rank (``[rankN]: ZeroDivisionError: ...``), the rank
  dies; a transient-only policy (megatron_transient) stops the run on it, by design;
- ``rank_hang``: a rank stops (SIGSTOP), silent like a rank stuck in a collective behind a dead link or an
  NCCL watchdog's peer: only a monitor's timeout (ft_launcher's sections, the watcher's inactivity) ends it;
- ``preempt``: the scheduler's preemption / maintenance warning, ``scancel --signal=TERM`` to the job's
  steps: the trainer saves and exits, the job is requeued;
- ``node_down``: the node fails: drained, then set DOWN (Slurm ends the attempt NODE_FAIL and requeues
  it; the watcher records it and excludes the node); chaos resumes the node after the repair time;
- ``nan``: silent data corruption: the loss turns NaN on one rank while the trigger file names the attempt
  (the trainer honours it with ``rerun.accept_chaos_nan=true``); Megatron's rerun state machine re-runs
  the step, sees it again, saves and exits 16 (resume elsewhere).

Rank-level kinds act on one rank process of the job through ``srun --jobid=JOB --overlap -w NODE`` (a step
inside the job's own allocation: nothing outside the job is touched); node and job kinds through
``scontrol``/``scancel`` on that job and node only.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_resilience.failures import taxonomy


@dataclass(frozen=True)
class FaultKind:
    name: str
    expected: tuple[str, ...]  # the error types the job-level classifier should call it
    where: str  # rank | node | job | trainer
    meaning: str
    lines: tuple[str, ...] = ()  # what the rank writes before it dies ({host}, {pid}, {rank})
    signal: str | None = None  # what the rank gets (rank kinds)

    @property
    def hardware(self) -> bool:
        """A fault of the machine (its expected types are machine failures: failures/taxonomy.py): the job-level
        decision should keep the job off the node."""
        return any(t in taxonomy.MACHINE_TYPES for t in self.expected)


FAULTS: dict[str, FaultKind] = {f.name: f for f in (
    FaultKind("gpu_xid", ("xid_error",), "rank", "a GPU falls off the bus (Xid 79) and its rank dies",
              lines=("{host} kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python, GPU has fallen off "
                     "the bus.",), signal="SIGKILL"),
    FaultKind("gpu_ecc", ("ecc_error",), "rank", "an uncorrectable HBM ECC error kills a rank",
              lines=("[rank{rank}]: Traceback (most recent call last):",
                     "[rank{rank}]: RuntimeError: CUDA error: uncorrectable ECC error encountered"), signal="SIGKILL"),
    FaultKind("python_bug", ("python_exception",), "rank", "an uncaught Python exception ends a rank",
              lines=("[rank{rank}]: Traceback (most recent call last):",
                     "[rank{rank}]: ZeroDivisionError: division by zero"), signal="SIGKILL"),
    FaultKind("rank_hang", ("hang",), "rank", "a rank stops making progress (a dead link, an NCCL peer)",
              signal="SIGSTOP"),
    FaultKind("preempt", ("preempted",), "job", "the scheduler warns of maintenance: save and requeue"),
    FaultKind("node_down", ("node_fail",), "node", "the node fails (power, board, CPU, memory, SSD)"),
    FaultKind("nan", ("rerun_resume",), "trainer", "silent data corruption: the loss turns NaN on one rank"),
)}


def fault(name: str) -> FaultKind:
    if name not in FAULTS:
        raise ValueError(f"unknown fault kind {name!r}; valid kinds: {sorted(FAULTS)}")
    return FAULTS[name]
