"""``pretrain_gpt.py`` (beside this file) with a signal sent at a chosen step, once per run.

A fault at an exact step makes a run's lost work known before it starts. ``KILL_RANK_AT_STEP=13`` with
``KILL_RANK=1`` kills rank 1 (SIGKILL) inside step 13's forward pass of the launcher's first worker group
(``TORCHELASTIC_RESTART_COUNT`` 0), so the steps after the last save up to 12 are lost, and the restarted group does
not kill itself again. ``KILL_SIGNAL=SIGTERM KILL_TARGET=launcher``: that rank sends SIGTERM to its launcher
instead (ft_launcher forwards it to every rank, as it does Slurm's ``--signal``), so Megatron-LM's exit-signal
handler saves and exits at the next step it checks. Megatron-LM's own fault injector (``--fault-injector-*``) cannot
do this: it is armed again at its start iteration in every restarted process, so a resumed run passing that step
again would be killed forever.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pretrain_gpt  # noqa: E402  (installs the CPU layer before megatron.training is imported)
from megatron.training import get_args  # noqa: E402

_forward_step = pretrain_gpt.forward_step
_sent = []


def forward_step(data_iterator, model, return_schedule_plan=False):
    step = get_args().curr_iteration + 1  # Megatron-LM sets curr_iteration to the steps done before this one
    if (not _sent and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and os.environ.get("RANK") == os.environ.get("KILL_RANK", "1")
            and step == int(os.environ["KILL_RANK_AT_STEP"])):
        _sent.append(step)
        target = os.getppid() if os.environ.get("KILL_TARGET") == "launcher" else os.getpid()
        os.kill(target, getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))
    return _forward_step(data_iterator, model, return_schedule_plan)


pretrain_gpt.forward_step = forward_step  # main() looks it up when it calls pretrain

if __name__ == "__main__":
    pretrain_gpt.main()
