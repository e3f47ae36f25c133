"""``fatal`` for the loss's NaN/Inf checks (runtime/loss_checks.py), on Megatron-Core's real rerun state machine.

Not fatal only while a step moved to other hardware is re-run from its checkpoint and passes the check here (with
``rerun.continue_after_persistent_error``); the full course, with the real launcher and a second host name, is
tests/test_sdc_continues.py.
"""

from __future__ import annotations

import pytest

from megatron_resilience.config import PretrainConfig, RerunConfig
from megatron_resilience.runtime.loss_checks import fatal_check


def _config(tmp_path, **rerun) -> PretrainConfig:
    return PretrainConfig(run_dir=str(tmp_path), rerun=RerunConfig(rerun_mode="validate_results", **rerun))


@pytest.mark.parametrize("state", ["NOT_RUNNING_YET", "INITIAL_RUN", "RERUNNING_IN_PLACE",
                                   "WILL_RERUN_FROM_CHECKPOINT", "RERUNNING_AGAIN_FROM_CHECKPOINT"])
@pytest.mark.parametrize("rejected", [False, True])
def test_every_stage_but_the_re_run_elsewhere_stays_fatal(machine, tmp_path, state, rejected):
    from megatron.core.rerun_state_machine import RerunState

    machine.state = RerunState[state]
    assert fatal_check(_config(tmp_path), machine, rejected) is True


def test_re_run_elsewhere_not_reproduced_is_not_fatal_unless_switched_off(machine, tmp_path):
    from megatron.core.rerun_state_machine import RerunState

    machine.state = RerunState.RERUNNING_FROM_CHECKPOINT
    assert fatal_check(_config(tmp_path), machine, rejected=False) is False
    assert fatal_check(_config(tmp_path), machine, rejected=True) is True  # reproduced on another GPU: exit 17
    off = _config(tmp_path, continue_after_persistent_error=False)
    assert fatal_check(off, machine, rejected=False) is True  # Megatron-LM's behaviour


@pytest.mark.parametrize(("injected", "fatal"), [("PERSISTENT_ERROR", False), ("CORRECT_RESULT", True),
                                                 ("TRANSIENT_ERROR", True)])
def test_an_injected_error_decides_as_the_injector_says(machine, tmp_path, injected, fatal):
    """``rerun.error_injection_*`` fakes the diagnosis without changing the loss: its type, not the true (finite)
    result, says whether the other GPU reproduced it."""
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunState

    machine.state = RerunState.RERUNNING_FROM_CHECKPOINT
    machine.error_injector.injected_error_type = RerunDiagnostic[injected]
    assert fatal_check(_config(tmp_path), machine, rejected=False) is fatal
