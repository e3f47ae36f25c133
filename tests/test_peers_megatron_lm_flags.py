"""The flags that make the plugins treat a ``run.Script`` as Megatron-LM's are Megatron-LM's own.

``tasks/trainer_detect.py`` gives a script Megatron-LM's flags (``--enable-ft-package``, ...) only when its
arguments carry one of ``MEGATRON_LM_FLAGS``, never on its name alone: a flag there that Megatron-LM's parser does
not know could send Megatron-LM flags to another trainer (Bridge hands them to Hydra: ``OverridesError`` on every
rank, restart and requeue). Megatron-LM's parser (megatron-core 0.19.2's ``megatron/training/arguments.py``,
``tests/peers.py``) judges each one; Bridge's example scripts' own ``--debug``, which the name rule accepts, is not
one of Megatron-LM's.
"""

from __future__ import annotations

import peers

from megatron_resilience.tasks.trainer_detect import BRIDGE_LAUNCHER_FLAGS, BRIDGE_SCRIPT_FLAGS, MEGATRON_LM_FLAGS


def test_every_megatron_lm_flag_is_known_to_megatron_lms_parser_and_no_bridge_flag_is():
    flags = [*MEGATRON_LM_FLAGS, *BRIDGE_LAUNCHER_FLAGS, *BRIDGE_SCRIPT_FLAGS]
    results = dict(zip(flags, peers.megatron_lm_parse([[flag] for flag in flags])))
    # a known flag is parsed (store_true) or asks for its value; an unknown one is left over
    known = {flag for flag, r in results.items()
             if r.get("unknown") == [] or r.get("error", "").startswith(f"argument {flag}: expected")}
    assert known == set(MEGATRON_LM_FLAGS), results
    assert {flag: results[flag]["unknown"] for flag in (*BRIDGE_LAUNCHER_FLAGS, *BRIDGE_SCRIPT_FLAGS)} == {
        flag: [flag] for flag in (*BRIDGE_LAUNCHER_FLAGS, *BRIDGE_SCRIPT_FLAGS)}
