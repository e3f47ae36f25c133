"""Every Slurm job's own port block on its nodes (``megatron_resilience/config/ports.py``), rendered by the plugins.

nemo_run renders ft_launcher's rendezvous at ``$head_node_ip:29500`` for every job: two jobs sharing a node share
that port, and the second job's agent silently joins the first job's store (torch's c10d rendezvous falls back
to being a client when it cannot host) until that job ends and takes the store with it. The batch script
exports ``MEGATRON_RESILIENCE_JOB_PORT`` = the job's block (from ``SLURM_JOB_ID``, the arithmetic the trainer
uses), and the rendezvous is rendered at ``$head_node_ip:$MEGATRON_RESILIENCE_JOB_PORT`` (the block's first
port); the trainer's stores take the next ones. A port the user set on the launcher, or a block the user set
in ``executor.env_vars``, is kept.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_resilience.config.ports import JOB_PORT_ENV, slurm_block_base_shell
from megatron_resilience.plugins._executor import set_env

log = logging.getLogger("megatron_resilience.plugins")

NEMO_RUN_DEFAULT_RDZV_PORT = 29500


def install(executor: Any, profile: Any, plugin: str) -> None:
    if not profile.port_block:
        return
    if JOB_PORT_ENV not in executor.env_vars:
        set_env(executor, JOB_PORT_ENV, slurm_block_base_shell())
        log.info("%s: executor.env_vars[%r] = %r: the job's own port block (rendezvous, process-group store, "
                 "in-process store), outside the kernel's ephemeral range", plugin, JOB_PORT_ENV,
                 slurm_block_base_shell())
    launcher = executor.launcher
    port = getattr(launcher, "rdzv_port", None)
    if port == NEMO_RUN_DEFAULT_RDZV_PORT:
        launcher.rdzv_port = f"${{{JOB_PORT_ENV}}}"
        log.info("%s: executor.launcher.rdzv_port: %d -> $%s (nemo_run's fixed port is shared by every job on the "
                 "head node)", plugin, NEMO_RUN_DEFAULT_RDZV_PORT, JOB_PORT_ENV)
    elif port is not None:
        log.info("%s: executor.launcher.rdzv_port=%s kept (set by the user)", plugin, port)
