"""Where rank 0's metrics also go: TensorBoard event files and Weights & Biases (keys as Megatron-Bridge's
``LoggerConfig`` names them: ``logger.tensorboard_dir``, ``logger.wandb_project``, ...).

Both are fed by the one writer of ``metrics.jsonl`` (``runtime/metrics.py``); what they show is
``megatron_resilience/dashboards/series.py``. Relative paths are under ``run_dir``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_resilience.config.validate import check_types, fail

DEFAULT_TENSORBOARD_DIR = "tensorboard"


@dataclass(kw_only=True)
class LoggerConfig:
    # TensorBoard event files; relative -> under run_dir; None -> no event files.
    tensorboard_dir: str | None = DEFAULT_TENSORBOARD_DIR
    wandb_project: str | None = None  # None -> no W&B run
    wandb_entity: str | None = None  # W&B team or user; None -> the logged-in default
    wandb_exp_name: str | None = None  # W&B run name; None -> the run_dir's folder name
    # Where W&B writes its run folder (wandb/offline-run-*); relative -> under run_dir; None -> run_dir.
    wandb_save_dir: str | None = None

    def __post_init__(self) -> None:
        check_types(self, "logger")
        for name in ("tensorboard_dir", "wandb_project", "wandb_entity", "wandb_exp_name", "wandb_save_dir"):
            if getattr(self, name) == "":
                fail(f"logger.{name}", "must be a non-empty string or null", "")
        for name in ("wandb_entity", "wandb_exp_name", "wandb_save_dir"):
            if getattr(self, name) is not None and self.wandb_project is None:
                fail("logger.wandb_project", f"must be set when logger.{name} is set", None)

    def tensorboard_path(self, run_dir: str) -> str | None:
        return None if self.tensorboard_dir is None else os.path.join(run_dir, self.tensorboard_dir)

    def wandb_path(self, run_dir: str) -> str | None:
        if self.wandb_project is None:
            return None
        return run_dir if self.wandb_save_dir is None else os.path.join(run_dir, self.wandb_save_dir)
