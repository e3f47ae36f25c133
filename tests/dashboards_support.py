"""Read back what the dashboards wrote, with each tool's own reader: TensorBoard's event file loader, and the
records of W&B's offline ``run-<id>.wandb`` files decoded with W&B's own protobuf messages.

wandb 0.31 no longer ships a Python reader for its ``.wandb`` files (the Go ``wandb-core`` writes and syncs
them); their framing is LevelDB's log format (a 7-byte ``:W&B`` header, then 32 KiB blocks of records, each
with a 7-byte header: CRC-32C, length, type FULL/FIRST/MIDDLE/LAST), unpacked below in a few lines.
"""

from __future__ import annotations

import glob
import json
import os
import struct
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


def _wandb_records(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (_crc, length, kind) == (0, 0, 0):
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
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
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        run = {"folder": os.path.basename(os.path.dirname(path)), "rows": []}
        for raw in _wandb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
            elif kind == "history":
                run["rows"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                    for item in record.history.item})
        runs.append(run)
    return runs
