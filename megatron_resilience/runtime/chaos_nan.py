"""``rerun.accept_chaos_nan``: silent data corruption on demand, for ``python -m megatron_resilience.chaos``.

While ``<run_dir>/chaos_nan.json`` (written by the chaos tool) names this attempt (Slurm job id and restart,
the launcher's in-job restart) and this rank, the rank's loss is NaN. Megatron-Core's rerun state machine
(``rerun.rerun_mode=validate_results``) re-runs the step, sees the NaN again, saves and exits 16 ("resume on
other hardware"): what a GPU that corrupts its results looks like. The file is checked once per step and
only when the setting is on; another attempt (a requeue, an in-job restart) is never poisoned.
"""

from __future__ import annotations

import json
import os

from megatron_resilience.config import PretrainConfig

TRIGGER_FILE = "chaos_nan.json"  # megatron_resilience.chaos.inject.NAN_TRIGGER


def _this_attempt(rank: int) -> dict[str, str]:
    return {"job_id": os.environ.get("SLURM_JOB_ID", ""), "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "in_job_restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), "rank": str(rank)}


def poisoned(config: PretrainConfig, rank: int) -> bool:
    """Whether this step's loss on this rank is to be NaN (the chaos tool's trigger names this attempt and rank)."""
    if not config.rerun.accept_chaos_nan:
        return False
    try:
        with open(os.path.join(config.run_dir, TRIGGER_FILE), encoding="utf-8") as f:
            trigger = json.load(f)
    except (OSError, ValueError):
        return False
    here = _this_attempt(rank)
    return all(str(trigger.get(key, "0" if key != "job_id" else "")) == value for key, value in here.items())
