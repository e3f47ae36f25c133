"""How a training process ends, and what each ending makes the launchers do.

This docstring is the documented table (docs/faults.md copies it). "In-job" is
ft_launcher restarting the worker group inside the Slurm job (``max_restarts``);
"job level" is the teardown of nemo_run's fault-tolerance sbatch script, which
runs ``scontrol requeue`` unless ``$FAULT_TOL_FINISHED_FLAG_FILE`` exists or the
failure limit is reached (``FaultTolerancePlugin`` sets ``executor.retries`` =
``num_job_retries_on_failure + 1``: a job whose every attempt fails runs 1 + N times).

| ending | trainer exit code | checkpoint | flag file | in-job (ft_launcher) | job level (sbatch) |
|---|---|---|---|---|---|
| finished (`train.max_steps` reached) | 0 | saved at the last step | touched by rank 0 | group succeeded, launcher exits 0 | not requeued |
| stopped with a checkpoint: exit signal (preemption), `train.exit_duration_in_mins`, straggler with `stop_if_detected` | 0 | saved at the current step | not touched | group succeeded, launcher exits 0 | requeued; recorded as a success, so no failure retry is spent |
| rerun: resume to disambiguate (`EXIT_CODE_RESUME_TO_DISAMBIGUATE`) | 16 | saved at the step before the suspicious one (or already there) | not touched | rank asks ft_launcher to shut down: no restart in the same allocation (the same GPU) | requeued (counts as a failure retry); under a restart policy without the node, where the next attempt re-runs the step |
| rerun: failed on result validation (`EXIT_CODE_FAILED_ON_RESULT_VALIDATION`) | 17 | saved when the state machine asks for one | touched by rank 0, with the reason in `run_dir/stop_reason.json` | rank asks ft_launcher to shut down (`WorkloadAction.ShutdownWorkload`): no restart, launcher exits non-zero | not requeued; the job ends FAILED |
| crash, killed or hung rank (detected by an FT timeout) | non-zero / signal | the last periodic one | not touched | worker group restarted up to `max_restarts`, then the launcher exits non-zero | requeued until the failure limit |

Why 17 touches the flag file: nemo_run's sbatch template decides about the
requeue only from that file, and a result that failed validation must be looked
at by a person, not retried. ``stop_reason.json`` tells the two apart.
"""

from __future__ import annotations

FINISHED = 0
STOPPED_WITH_CHECKPOINT = 0  # preempted / duration / straggler: the job comes back and resumes
RESUME_TO_DISAMBIGUATE = 16  # megatron.core.rerun_state_machine.EXIT_CODE_RESUME_TO_DISAMBIGUATE
FAILED_ON_RESULT_VALIDATION = 17  # megatron.core.rerun_state_machine.EXIT_CODE_FAILED_ON_RESULT_VALIDATION

# Stop reasons returned by TrainingHooks.after_step (agreed by all ranks) and passed to on_exit.
REASON_FINISHED = "finished"
REASON_SIGNAL = "signal"
REASON_STRAGGLER = "straggler"
REASON_DURATION = "duration"
STOP_REASONS = (REASON_SIGNAL, REASON_STRAGGLER, REASON_DURATION)


def rerun_reason(exit_code: int) -> str:
    """The on_exit reason the loop passes when the rerun state machine ends the run: "rerun:16" / "rerun:17"."""
    return f"rerun:{exit_code}"


def normalize_reason(reason: str) -> str:
    """A bare "rerun" (the loop did not say which code) gets its code from Megatron-Core's rerun state machine."""
    if reason != "rerun":
        return reason
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    state = get_rerun_state_machine().state
    resume = (RerunState.WILL_RERUN_FROM_CHECKPOINT, RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT)
    return rerun_reason(RESUME_TO_DISAMBIGUATE if state in resume else FAILED_ON_RESULT_VALIDATION)


def exit_code_for(reason: str) -> int:
    """The process exit code for an on_exit reason (see the table above)."""
    if reason == REASON_FINISHED or reason in STOP_REASONS:
        return 0
    if reason.startswith("rerun:"):
        return int(reason.split(":", 1)[1])
    raise ValueError(f"unknown stop reason {reason!r}; expected finished, {', '.join(STOP_REASONS)} or rerun:<code>")


def marks_finished(reason: str) -> bool:
    """Whether rank 0 touches $FAULT_TOL_FINISHED_FLAG_FILE (no job-level requeue) for this reason."""
    return reason == REASON_FINISHED or reason == rerun_reason(FAILED_ON_RESULT_VALIDATION)


def stops_in_job_restarts(reason: str) -> bool:
    """Whether the rank asks ft_launcher not to restart the worker group after it exits: on 17 (the result failed
    validation: nothing to restart) and on 16 (resume on other hardware: an in-job restart is the same allocation,
    whose re-run only says "rescheduled on the same GPU" and exits 16 again; the job-level decision requeues the job
    without the node)."""
    return reason in (rerun_reason(FAILED_ON_RESULT_VALIDATION), rerun_reason(RESUME_TO_DISAMBIGUATE))
