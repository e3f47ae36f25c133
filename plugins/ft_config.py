"""The FT YAML that ft_launcher reads, and where it lives at run time.

Why a file: nemo_run's ``run.FaultTolerance`` launcher has no field for section timeouts
(``rank_section_timeouts``, ``rank_out_of_section_timeout``), and nvidia-resiliency-ext only
accepts them as flags or in its config file. ft_launcher reads the file named by ``--ft-cfg-path``
or, since nemo_run gives us no way to add flags, by the ``PET_FT_CFG_PATH`` environment variable
(torch-elastic's ``PET_<dest>`` fallback; the name per version comes from ``upstream``).

Where the file lives:

* Slurm: the sbatch script writes it itself (a quoted heredoc in ``executor.setup_lines``) into the
  job directory on the cluster, at the path nemo_run already exports as ``FAULT_TOL_CFG_PATH``.
  The script is the one thing that certainly reaches the cluster (also through an SSH tunnel, and
  again on every requeue), and the job directory is on storage that all nodes share (the logs go
  there). Job steps read it as ``/nemo_run/<job>_ft_cfg.yml`` (the container mount; rewritten to the
  host path by nemo_run when there is no container). Nothing is written at submit time.
* Local: a content-addressed file under ``$NEMORUN_HOME/ft_configs/``, written at submit time
  (the experiment directory may not be created early: ``Experiment.dryrun`` requires it to be new).

Heartbeats vs sections (FACTS): section messages do not reset the heartbeat timer, so with
``ft.mode=sections`` the heartbeat timeouts are null (a sections-only workload would otherwise be
killed after ``initial_rank_heartbeat_timeout``); with ``ft.mode=heartbeats`` the section timeouts
are empty and the heartbeat timeouts apply.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from typing import Any

from megatron_resilience.plugins.shell_templates import render_shell

# Sections the trainer opens (megatron_resilience.resilience); nvidia-resiliency-ext 0.4 rejects a
# section missing from the config ("Unknown section"), so all of them are always listed.
SECTIONS = ("setup", "step", "checkpointing")
HEREDOC_TAG = "MEGATRON_RESILIENCE_FT_CFG"
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_.,/-]*")  # strings YAML reads back as the same string
_YAML_WORDS = re.compile(r"(?i)true|false|yes|no|on|off|null|y|n")


def _number(value: float | None) -> str:
    if value is None:
        return "null"
    return repr(float(value))


def ft_settings(plugin: Any, mode: str) -> dict[str, Any]:
    """The ``fault_tolerance:`` mapping for ``plugin`` (a FaultTolerancePlugin) and the trainer's ft.mode."""
    sections = mode == "sections"
    return {
        "workload_check_interval": float(plugin.workload_check_interval),
        "initial_rank_heartbeat_timeout": None if sections else float(plugin.initial_rank_heartbeat_timeout),
        "rank_heartbeat_timeout": None if sections else float(plugin.rank_heartbeat_timeout),
        "rank_section_timeouts": {
            "setup": plugin.setup_timeout, "step": plugin.step_timeout, "checkpointing": plugin.checkpointing_timeout,
        } if sections else {},
        "rank_out_of_section_timeout": plugin.out_of_section_timeout if sections else None,
        "rank_termination_signal": plugin.rank_termination_signal,
        "log_level": plugin.log_level,
    }


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        plain = _PLAIN.fullmatch(value) and not _YAML_WORDS.fullmatch(value)
        return value if plain else json.dumps(value)  # a JSON string is a YAML string
    return _number(value)


def render_yaml(settings: dict[str, Any]) -> str:
    """Deterministic YAML (golden files compare it byte for byte); nvidia-resiliency-ext parses it."""
    lines = ["fault_tolerance:"]
    for key, value in settings.items():
        if isinstance(value, dict):
            if not value:
                lines.append(f"  {key}: {{}}")
                continue
            lines.append(f"  {key}:")
            lines += [f"    {name}: {_number(timeout)}" for name, timeout in value.items()]
        else:
            lines.append(f"  {key}: {_scalar(value)}")
    return "\n".join(lines) + "\n"


def sbatch_block(host_path: str, yaml_text: str, host_dirs: list[str] = ()) -> str:
    """Lines for ``executor.setup_lines`` that write the YAML on the cluster when the job starts.

    ``host_dirs`` (directories ft_launcher writes to or checks: cycle info, per-cycle logs, a fresh run's
    checkpoint directory) are created first.
    """
    mkdir = f"mkdir -p {' '.join(shlex.quote(d) for d in host_dirs)}\n" if host_dirs else ""
    return (
        f"{mkdir}"
        "# ft_launcher reads its full config (incl. section timeouts) from this file via the env var below\n"
        f"cat > {shlex.quote(host_path)} <<'{HEREDOC_TAG}'\n"
        f"{yaml_text}"
        f"{HEREDOC_TAG}"
    )


def launcher_flags_block(flags: list[str], *, nnodes: str | None = None, keep_survivors: bool = False) -> str:
    """Lines for ``executor.setup_lines``: add ``flags`` to the ft_launcher command of the job's srun.

    nemo_run renders a fixed set of ft_launcher flags and has no field for others; ft_launcher reads some
    settings only from its command line. A shell function ``srun`` (defined after nemo_run's own srun
    calls of the setup, before the job step) inserts the flags right after the ``ft_launcher`` word of
    the srun command and runs the real srun, so the job step is exactly ``srun ... ft_launcher FLAGS ...``
    (under ``setsid -w`` when the job-level block sets ``megatron_resilience_srun_prefix``: the step in a session
    of its own, see plugins/batch_decision.py).

    ``nnodes`` (``FaultTolerancePlugin.min_nodes``): the value of ft_launcher's ``--nnodes`` instead of
    nemo_run's fixed node count, evaluated when the step starts (e.g. ``1:$SLURM_JOB_NUM_NODES``: an attempt
    resized by the job-level decision runs on the nodes it got). ``keep_survivors``: srun's
    ``--kill-on-bad-exit=0 --wait=0`` instead of nemo_run's ``=1`` / ``=60``, so a node whose agent died does
    not take the surviving agents down with it (they re-form the group at the smaller size). With ``nnodes`` the
    step also gets ``--ntasks=$SLURM_JOB_NUM_NODES``: after ``scontrol update NumNodes=1 NumTasks=1`` on a
    requeued 2-node job, Slurm 22.05 still starts the step with the submitted task count (measured on the local
    cluster: two agents on the one node, ``sacct`` NTasks 2, the second waiting in the rendezvous as a spare).
    """
    return render_shell("ft_launcher_flags.sh.j2", flags=shlex.join(flags), nnodes=nnodes,
                        keep_survivors=keep_survivors)


def pre_launch_lines(path: str, yaml_text: str) -> list[str]:
    """Commands (LeptonExecutor.pre_launch_commands) that write the YAML inside the job's container."""
    return [f"mkdir -p {shlex.quote(os.path.dirname(path))}",
            f"cat > {shlex.quote(path)} <<'{HEREDOC_TAG}'\n{yaml_text}{HEREDOC_TAG}"]


def write_local(home: str, yaml_text: str) -> str:
    """Write the YAML for a LocalExecutor job under ``home``; the path depends only on the content."""
    digest = hashlib.sha256(yaml_text.encode()).hexdigest()[:16]
    path = os.path.join(home, "ft_configs", f"ft_cfg_{digest}.yml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(yaml_text)
    os.replace(tmp, path)
    return path
