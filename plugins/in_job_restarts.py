"""How often ft_launcher restarts the worker group inside one allocation (its ``--max-restarts``), by default.

A fixed count per allocation is a budget that a weeks-long run spends on *progress*: Llama 3 405B met an
interruption every ~3 hours, so an allocation of a day meets several, each recovered and followed by new
checkpoints. Where ft_launcher can tell progress from a loop, the count is not what should end the in-job chain:

* nvidia-resiliency-ext >= 0.6 tracks progress (``max_no_progress_cycles``, 2 by default, reading the checkpoint
  tracker file the plugin points it at): a worker group that does not get past the same checkpoint is not
  restarted again, and the job-level decision takes the attempt (its failure, its node). There the default is
  ``IN_JOB_RESTARTS_WHILE_PROGRESS_IS_TRACKED``: high enough that only the progress tracker and the allocation's
  time limit end the chain.
* Without progress tracking (0.4.x, or the tracker turned off, or no checkpoint tracker to read) the count is the
  only in-job guard against a loop, so it stays ``IN_JOB_RESTARTS_COUNTED`` (NeMo's and Megatron-Bridge's
  default). A spent count is not the end of the run: ft_launcher exits, and the batch script's decision requeues an
  advancing run with its budget of failures-without-progress refilled (docs/job-level.md), at the cost of a new
  allocation.

An explicit ``num_in_job_restarts`` is always used as given.
"""

from __future__ import annotations

import logging

from megatron_resilience.upstream.launcher import version_text

log = logging.getLogger("megatron_resilience.plugins")

NAME = "FaultTolerancePlugin"
IN_JOB_RESTARTS_COUNTED = 3
IN_JOB_RESTARTS_WHILE_PROGRESS_IS_TRACKED = 1000


def resolve(requested: int | None, version: tuple[int, ...], iteration_file: str | None) -> int:
    """ft_launcher's ``--max-restarts`` for this job; logs where a default came from."""
    if requested is not None:
        return requested
    if iteration_file is not None:
        log.info("%s: num_in_job_restarts=None -> %d: ft_launcher (nvidia-resiliency-ext %s) tracks progress in %s, "
                 "so only cycles without a newer checkpoint end the in-job restarts (and the allocation's time "
                 "limit), not a count", NAME, IN_JOB_RESTARTS_WHILE_PROGRESS_IS_TRACKED, version_text(version),
                 iteration_file)
        return IN_JOB_RESTARTS_WHILE_PROGRESS_IS_TRACKED
    why = ("nvidia-resiliency-ext %s tracks no progress" % version_text(version) if version < (0, 6)
           else "ft_launcher's progress tracking is off or has no checkpoint tracker file to read")
    log.info("%s: num_in_job_restarts=None -> %d (%s); after the last one the batch script's decision requeues an "
             "advancing run with its budget refilled", NAME, IN_JOB_RESTARTS_COUNTED, why)
    return IN_JOB_RESTARTS_COUNTED
