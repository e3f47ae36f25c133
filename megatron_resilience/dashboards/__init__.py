"""Where Megatron users look: the run's metrics and resilience events on TensorBoard and W&B.

Fed by the one writer of ``metrics.jsonl`` (``runtime/metrics.py``, rank 0): each record becomes chart
points (:mod:`.series`; Megatron-LM's TFLOP/s per GPU from the model's shape, :mod:`.flops`) written to
TensorBoard event files (:mod:`.tensorboard`) and a W&B run (:mod:`.wandb_run`). Importing this package is
cheap: tensorboard and wandb load when a sink opens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from typing import Any

from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.config.logger import DEFAULT_TENSORBOARD_DIR
from megatron_resilience.dashboards.flops import flops_per_token
from megatron_resilience.dashboards.series import Point, Series

log = logging.getLogger("megatron_resilience.dashboards")
__all__ = ["DashboardSink", "Point", "Series", "check_installed", "open_sink"]


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def check_installed(config: PretrainConfig) -> list[str]:
    """Before torch loads: a dashboard the user asked for whose package is missing is a ConfigError naming the
    key and what to install. The default TensorBoard folder, without tensorboard installed, is only a note
    (returned, for the log): event files are an optional extra."""
    from megatron_resilience.dashboards.tensorboard import INSTALL_HINT as TB_HINT
    from megatron_resilience.dashboards.wandb_run import INSTALL_HINT as WB_HINT

    notes = []
    tb = config.logger.tensorboard_dir
    if tb is not None and _missing("tensorboard"):
        if tb != DEFAULT_TENSORBOARD_DIR:
            raise ConfigError(f"logger.tensorboard_dir: TensorBoard event files need the tensorboard package, which "
                              f"is not installed: {TB_HINT}; or set logger.tensorboard_dir=null, got {tb!r}")
        notes.append(f"no TensorBoard event files: the tensorboard package is not installed ({TB_HINT}); "
                     "logger.tensorboard_dir=null silences this note")
    if config.logger.wandb_project is not None and _missing("wandb"):
        raise ConfigError(f"logger.wandb_project: W&B logging needs the wandb package, which is not installed: "
                          f"{WB_HINT}; or set logger.wandb_project=null, got {config.logger.wandb_project!r}")
    return notes


class DashboardSink:
    """``MetricsLogger``'s sink: every record -> :class:`Series` points -> TensorBoard and/or W&B.

    A dashboard that fails mid-run (a full disk, W&B's service gone) logs one warning and is dropped:
    training and ``metrics.jsonl`` go on."""

    def __init__(self, writers: dict[str, Any], *, flops_per_token: float | None = None) -> None:
        self.series = Series(flops_per_token=flops_per_token)
        self.writers = writers

    def retries(self) -> list[dict[str, Any]]:
        """The tries a writer made again on an error it waits out (``wandb.init`` while the run is in use)."""
        return [r for w in self.writers.values() for r in getattr(w, "retries", [])]

    def write(self, record: dict[str, Any]) -> None:
        points = self.series.points(record)
        if not points:
            return
        for name, writer in list(self.writers.items()):
            try:
                writer.write(points)
            except Exception as err:  # noqa: BLE001 - a dashboard never stops training
                log.warning("%s: writing failed, no more points go there this attempt (%s: %s)", name,
                            type(err).__name__, err)
                self.writers.pop(name)

    def close(self) -> None:
        for name, writer in self.writers.items():
            try:
                writer.close()
            except Exception as err:  # noqa: BLE001
                log.warning("%s: closing failed (%s: %s)", name, type(err).__name__, err)
        self.writers = {}


def where(config: PretrainConfig) -> dict[str, Any]:
    """The ``dashboards`` field of a ``start`` record: where this run's TensorBoard and W&B files go."""
    out: dict[str, Any] = {}
    tb = config.logger.tensorboard_path(config.run_dir)
    if tb is not None and not _missing("tensorboard"):
        out["tensorboard"] = os.path.abspath(tb)
    wb = config.logger.wandb_path(config.run_dir)
    if wb is not None:
        out["wandb"] = {"dir": os.path.abspath(wb), "project": config.logger.wandb_project,
                        "id_file": os.path.abspath(os.path.join(config.checkpoint.save or config.run_dir,
                                                                "wandb_run_id"))}
    return out


def open_sink(config: PretrainConfig) -> DashboardSink | None:
    """Rank 0: the sink for this (re)start, or None when no dashboard is on."""
    from megatron_resilience.dashboards.tensorboard import EventWriter
    from megatron_resilience.dashboards.wandb_run import WandbRun

    writers: dict[str, Any] = {}
    tb = config.logger.tensorboard_path(config.run_dir)
    if tb is not None and not _missing("tensorboard"):
        writers["tensorboard"] = EventWriter(tb)
    lg = config.logger
    if lg.wandb_project is not None:
        writers["wandb"] = WandbRun(project=lg.wandb_project, entity=lg.wandb_entity,
                                    name=lg.wandb_exp_name or os.path.basename(os.path.abspath(config.run_dir)),
                                    save_dir=lg.wandb_path(config.run_dir),
                                    id_folder=config.checkpoint.save or config.run_dir,
                                    config=dataclasses.asdict(config))
    return DashboardSink(writers, flops_per_token=flops_per_token(config.model)) if writers else None
