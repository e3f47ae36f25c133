"""One Weights & Biases run per training run, across in-job restarts and requeues.

Its id is made once and kept in ``wandb_run_id`` next to the checkpoints (``checkpoint.save``, else
``run_dir``); every (re)start calls ``wandb.init(id=..., resume="allow")``, so an online run continues the
same run. Offline (``WANDB_MODE=offline``, the usual case on clusters without internet) each (re)start
writes its own ``<wandb_save_dir>/wandb/offline-run-<time>-<id>`` folder with that id, and
``wandb sync --id <id> <folders>`` uploads them into the one run, in order of start time. Steps only grow
across the folders (``series.py`` leaves recomputed steps out), which W&B requires: it drops a step below
its current one. A point whose step is below the run's current step (an async save that became durable a
few steps later) is logged at the current step.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Iterable

from megatron_resilience.dashboards.series import Point

log = logging.getLogger(__name__)

ID_FILE = "wandb_run_id"
INSTALL_HINT = "pip install 'megatron-resilience[wandb]' (or pip install wandb)"


def import_wandb():
    try:
        import wandb
    except ImportError as err:
        raise ImportError(f"logger.wandb_project needs the wandb package: {INSTALL_HINT} ({err})") from None
    return wandb


def stable_run_id(folder: str) -> str:
    """The run's W&B id: read from ``folder/wandb_run_id``, or made and written there (atomically) once."""
    path = os.path.join(folder, ID_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            found = f.read().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    os.makedirs(folder, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def _settings(wandb: Any) -> Any:
    """console="off": W&B would otherwise wrap rank 0's stdout/stderr, which the job-level tools read. The
    ``.wandb`` file is flushed every second (W&B's default is 15 s), so a rank killed mid-run loses at most that
    much of it, as ``metrics.jsonl`` and the event files lose nothing written; releases without that setting
    keep their own interval."""
    try:
        return wandb.Settings(console="off", silent=True, x_transaction_log_flush_interval=1.0)
    except Exception:  # noqa: BLE001 - an older wandb without the field
        return wandb.Settings(console="off", silent=True)


IN_USE_WAIT_S = 120.0  # how long a restart waits for the previous process's W&B service to let go of the run


def _init_when_free(wandb: Any, retries: list[dict[str, Any]], **kwargs: Any) -> Any:
    """``wandb.init``, waiting while the run id is still held by the W&B service of the process this one replaces.

    After an in-job restart a service that outlives the killed worker still holds the run for a moment:
    ``wandb.init(id=...)`` then raises "run ID ... is in use", which would turn a restart into a crash. Any other
    error is raised at once. Each try that failed is appended to ``retries`` (the trainer records them in
    ``metrics.jsonl`` as ``retry`` records: a retry on error text is never silent)."""
    deadline = time.monotonic() + IN_USE_WAIT_S
    while True:
        try:
            return wandb.init(**kwargs)
        except Exception as err:  # noqa: BLE001 - wandb's own error classes move between releases
            if "is in use" not in str(err) or time.monotonic() > deadline:
                raise
            retries.append({"what": "wandb.init", "why": str(err).splitlines()[0][:300], "time": time.time()})
            log.warning("wandb: run %s is still held by the previous process's W&B service; retrying in 2 s (%s)",
                        kwargs.get("id"), err)
            time.sleep(2.0)


class WandbRun:
    def __init__(self, *, project: str, entity: str | None, name: str, save_dir: str, id_folder: str,
                 config: dict[str, Any]) -> None:
        wandb = import_wandb()
        # Our own W&B service, never one inherited from the launching process (a notebook or test runner that used
        # wandb sets WANDB_SERVICE): that service outlives a killed worker still holding the run, and the restarted
        # group could never resume it ("run ID ... is in use", seen in CI).
        os.environ.pop("WANDB_SERVICE", None)
        os.makedirs(save_dir, exist_ok=True)
        self.run_id = stable_run_id(id_folder)
        self.retries: list[dict[str, Any]] = []
        self.run = _init_when_free(wandb, self.retries, project=project, entity=entity, name=name, id=self.run_id,
                                   resume="allow", dir=save_dir, config=config, settings=_settings(wandb))
        self.current = -1

    def write(self, points: Iterable[Point]) -> None:
        row: dict[str, Any] = {}
        step = self.current
        for point in points:
            if point.step > step and row:  # a new row: flush the one being built
                self.run.log(row, step=step)
                row = {}
            step = max(step, point.step)
            row[point.tag] = point.value
        if row:
            self.run.log(row, step=step)
        self.current = step

    def close(self) -> None:
        self.run.finish()
