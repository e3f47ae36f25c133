"""Read back what the dashboards wrote, with each tool's own reader: TensorBoard's event file loader, and W&B's
``wandb leet inspect --json`` for the offline ``run-<id>.wandb`` files (wandb 0.31 ships no Python reader; its Go
reader checks each chunk's checksum and reports corrupt data, which fails the test).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time


def read_tensorboard(logdir: str) -> dict[str, list[tuple[int, float | str]]]:
    """{tag: [(step, value), ...]} in the order TensorBoard reads the folder's event files (their names)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out: dict[str, list[tuple[int, float | str]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    item = value.simple_value
                elif value.metadata.plugin_data.plugin_name == "text":
                    item = value.tensor.string_val[0].decode()
                else:  # the loader turns simple values into tensors (TensorBoard's data model)
                    item = value.tensor.float_val[0] if value.tensor.float_val else value.tensor.string_val[0].decode()
                out.setdefault(value.tag, []).append((event.step, item))
    return out


def read_wandb_offline(save_dir: str, *, rows: int | None = None, timeout: float = 120.0) -> list[dict]:
    """Every offline run folder under ``save_dir/wandb`` in start order: {"id", "project", "name", "rows"}.

    W&B's service writes the files in the background (also after ``finish()`` returned, and for a killed
    attempt until it notices): with ``rows``, wait until that many history rows were written in all."""
    deadline = time.monotonic() + timeout
    while True:
        runs = _read_wandb_offline(save_dir)
        if rows is None or sum(len(r["rows"]) for r in runs) >= rows or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def _read_wandb_offline(save_dir: str) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        run = {"folder": os.path.basename(os.path.dirname(path)), "rows": []}
        for record in wandb_records(path):
            if record["type"] == "run":
                run.update(id=record["run"].get("run_id"), project=record["run"].get("project"),
                           name=record["run"].get("display_name"))
            elif record["type"] == "history":
                run["rows"].append(dict(record["history"].get("item") or {}))
        runs.append(run)
    return runs


def wandb_records(path: str) -> list[dict]:
    """The records of one ``.wandb`` file as W&B's own reader gives them (``wandb leet inspect --json``), which
    checks every chunk's checksum: a corrupt chunk is an assertion error here, never a silently shorter run."""
    wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
    proc = subprocess.run([wandb, "leet", "inspect", "--json", path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "corrupt" not in proc.stdout + proc.stderr, (path, proc.stderr[-2000:])
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
