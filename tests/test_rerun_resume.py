"""Which saved rerun state machine states a resumed job takes over (no process group needed).

The full round trip (exit 16 -> checkpoint -> in-job restart -> RERUNNING_FROM_CHECKPOINT) is proven with the
real ft_launcher in tests/test_resilience_faults.py (test 6); these cover the cases that run never reaches.
"""

from __future__ import annotations

import logging

from megatron_resilience.checkpointing import state_dict as checkpoint_state


def _saved(state):
    from megatron.core.rerun_state_machine import RerunMode

    return {checkpoint_state.RERUN_KEY: {"mode": RerunMode.VALIDATE_RESULTS, "state": state, "current_iteration": 3}}


def test_nothing_saved_or_loaded_without_a_rerun_state_machine():
    from megatron.core import rerun_state_machine
    from megatron.core.rerun_state_machine import RerunState

    assert rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None
    assert checkpoint_state.rerun_state_to_save() is None
    assert checkpoint_state._rerun_template(_saved(RerunState.WILL_RERUN_FROM_CHECKPOINT)) is None
    assert rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None  # not created implicitly


def test_between_steps_nothing_is_saved_and_old_checkpoints_resume_normally(machine):
    from megatron.core.rerun_state_machine import RerunState

    assert machine.state == RerunState.NOT_RUNNING_YET
    assert checkpoint_state.rerun_state_to_save() is None  # interval/signal checkpoints: no rerun state
    assert checkpoint_state._rerun_template({}) is None
    assert checkpoint_state._rerun_template(_saved(RerunState.NOT_RUNNING_YET)) is None


def test_exit_17_state_is_kept_for_examination_but_not_resumed(machine, caplog):
    from megatron.core.rerun_state_machine import RerunState

    with caplog.at_level(logging.WARNING, logger="megatron_resilience.checkpointing.state_dict"):
        assert checkpoint_state._rerun_template(_saved(RerunState.RERUNNING_IN_PLACE)) is None
    assert caplog.messages == ["checkpoint: rerun state machine state RERUNNING_IN_PLACE saved for examination "
                               "only; not resumed, the step is trained again"]
    assert machine.state == RerunState.NOT_RUNNING_YET
