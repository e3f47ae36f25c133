"""The loss's checks under Megatron-Core's rerun state machine, and what the trainer says of their outcome.

The checks are Megatron-LM's ``pretrain_gpt`` ones (NaN, Inf, and optionally a spiky loss), with one difference in
``fatal``, argued in :func:`fatal_check`: after the suspicious step moved to other hardware, a result this GPU does
not reproduce lets the run train on (``rerun.continue_after_persistent_error``) instead of waiting for a person.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import torch

from megatron_resilience.config import PretrainConfig

log = logging.getLogger(__name__)

SPIKY_LOSS_FACTOR = 10  # Megatron-LM's threshold: a loss 10x the largest seen so far is "spiky"


def validate_loss(config: PretrainConfig, loss: torch.Tensor) -> None:
    """Hand this micro-batch's loss to the rerun state machine's checks (a no-op while its mode is disabled)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    rerun = get_rerun_state_machine()
    if config.rerun.check_for_nan_in_loss:
        rerun.validate_result(result=loss, rejection_func=torch.isnan,
                              message="found NaN in local forward loss calculation", tolerance=0.0,
                              fatal=fatal_check(config, rerun, bool(torch.isnan(loss))))
        rerun.validate_result(result=loss, rejection_func=torch.isinf,
                              message="found Inf in local forward loss calculation", tolerance=0.0,
                              fatal=fatal_check(config, rerun, bool(torch.isinf(loss))))
    if config.rerun.check_for_spiky_loss:
        rerun.validate_result(
            result=loss,
            rejection_func=partial(rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)


def fatal_check(config: PretrainConfig, rerun: Any, rejected: bool) -> bool:
    """Megatron-Core's ``fatal`` for a NaN/Inf check: true (Megatron-LM's choice) but in one case.

    Re-running the suspicious step from its checkpoint after a move (``RERUNNING_FROM_CHECKPOINT``), a result that
    passes the check here means the GPU that computed the NaN/Inf computed wrong (Megatron: "not reproducible on a
    different GPU", "Possible persistent error"), and the job has left that GPU (exit 16 was requeued without its
    node). Fatal, Megatron exits 17 and the run waits for a person; not fatal, it keeps this GPU's result
    ("Continuing normal execution because failed validation was not fatal") and the optimizer steps on it, so the
    step is trained as an uninterrupted run trains it. A result rejected here too (reproduced on another GPU: the
    data or the code, not the chip) stays fatal: exit 17. Every earlier stage stays fatal, so the GPU that computed
    the NaN never trains on: its in-place re-run decides between exit 16 and 17 as in Megatron-LM.
    """
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunState

    injected = rerun.error_injector.injected_error_type  # rerun.error_injection_*: decides, not the true result
    if injected is not None:
        rejected = injected != RerunDiagnostic.PERSISTENT_ERROR
    continuing = config.rerun.continue_after_persistent_error and not rejected
    return not (continuing and rerun.state == RerunState.RERUNNING_FROM_CHECKPOINT)


def report_rerun_outcome(rerun: Any, *, diagnosing: bool, step: int, should_exit: bool) -> None:
    """After a step re-run from its checkpoint that goes on training: say on the rank that saw the bad result which
    GPU computed wrong (Megatron's own lines name this one, not the one it distrusts)."""
    if not diagnosing or should_exit or rerun.suspicious_node is None:
        return
    log.warning("rerun state machine: step %d: the NaN/Inf of node %s, device %s is not reproduced here (node %s): "
                "a persistent error on that GPU, which this job has left; this GPU's result is kept and training "
                "continues (rerun.continue_after_persistent_error=true)", step, rerun.suspicious_node,
                rerun.suspicious_device, os.uname()[1])
