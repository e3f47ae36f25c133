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
import os
import shlex
from typing import Any

# Sections the trainer opens (megatron_resilience.resilience); nvidia-resiliency-ext 0.4 rejects a
# section missing from the config ("Unknown section"), so all of them are always listed.
SECTIONS = ("setup", "step", "checkpointing")
HEREDOC_TAG = "MEGATRON_RESILIENCE_FT_CFG"


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
        elif isinstance(value, str):
            lines.append(f"  {key}: {value}")
        else:
            lines.append(f"  {key}: {_number(value)}")
    return "\n".join(lines) + "\n"


def sbatch_block(host_path: str, yaml_text: str) -> str:
    """Lines for ``executor.setup_lines`` that write the YAML on the cluster when the job starts."""
    return (
        "# ft_launcher reads its full config (incl. section timeouts) from this file via the env var below\n"
        f"cat > {shlex.quote(host_path)} <<'{HEREDOC_TAG}'\n"
        f"{yaml_text}"
        f"{HEREDOC_TAG}"
    )


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
