"""Shared test helpers: launch the real trainer under torchrun and read its metrics.

Use from any test module (pytest puts ``tests/`` on ``sys.path``)::

    from conftest import read_metrics, run_torchrun, start_torchrun

    proc = run_torchrun(2, [f"run_dir={tmp_path}", "train.max_steps=20"])   # waits; CompletedProcess
    assert proc.returncode == 0, proc.stdout[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path)]

- ``run_torchrun(nproc, overrides, env=None, timeout=300)``: ``torchrun --standalone
  --nproc-per-node=N -m megatron_resilience <overrides>``; returns a ``CompletedProcess`` whose
  ``stdout`` holds stdout and stderr of the launcher and all ranks (text). On timeout the whole
  process group is killed and the test fails with the output's tail.
- ``start_torchrun(...)`` -> :class:`Launch`: the same without waiting, so several launches run
  concurrently; ``launch.wait(timeout)`` returns the ``CompletedProcess``.
- ``read_metrics(run_dir, kind="train")``: records of ``<run_dir>/metrics.jsonl`` (last record
  per step, sorted by step); ``kind=None`` returns every record in file order.
- ``read_checkpoint(iter_dir, scratch_file)``: every tensor and object of a dist checkpoint, read
  without a process group; ``tree_equal(a, b)``: exact equality of such trees (dtypes included).

Launches default to 1 OpenMP thread per rank (as torchrun does for N > 1) so a 1-process
reference run computes exactly like each rank of a 2-process run.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_resilience.runtime.metrics import read_metrics as _read_metrics  # noqa: E402  (no torch import)

TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# Nothing in the suite talks to a network: W&B runs offline (its files are read back from disk) and quietly, here
# and in every process a test starts (they inherit this environment). Forced, not defaulted: a developer's
# WANDB_MODE=online must not reach wandb.ai from a test.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A NeMo-Run ``Experiment`` (``run.run``, the CLI, dry runs) replaces the root logger's handlers with a
    RichHandler when created, and its ``__del__`` removes whatever handler is first on the root logger
    (nemo_run 0.11.1). In one test process that would strip pytest's capture handlers from a later test,
    whenever the garbage collector gets to the experiment. So a test that touched the root handlers has its
    experiments collected now and the handlers put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    if root.handlers != handlers or root.level != level:
        gc.collect()
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture
def machine():
    """Megatron-Core's real rerun state machine (VALIDATE_RESULTS), destroyed after the test (no process group)."""
    from megatron.core.rerun_state_machine import (
        RerunMode,
        destroy_rerun_state_machine,
        get_rerun_state_machine,
        initialize_rerun_state_machine,
    )

    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    yield get_rerun_state_machine()
    destroy_rerun_state_machine()


def pytest_report_header(config):
    """Which upstream stack this run tests (the main lane, or the newest lane on PYTHONPATH)."""
    from megatron_resilience.upstream import installed_versions

    return "upstream: " + ", ".join(f"{name}=={version}" for name, version in installed_versions().items())


class Launch:
    """A running torchrun; output goes to a temporary file so pipes never fill up."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self._out = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"{' '.join(self.args)} did not finish in {timeout}s; output tail:\n"
                                 f"{self._read()[-4000:]}") from None
        out = self._read()
        self._out.close()
        return subprocess.CompletedProcess(self.args, code, stdout=out, stderr="")

    def _read(self) -> str:
        self._out.flush()
        self._out.seek(0)
        return self._out.read()


def start_torchrun(nproc: int, overrides: Sequence[str], env: dict[str, str] | None = None) -> Launch:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    args = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "megatron_resilience", *overrides]
    return Launch(args, full_env)


def run_torchrun(nproc: int, overrides: Sequence[str], env: dict[str, str] | None = None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
    return start_torchrun(nproc, overrides, env).wait(timeout)


def read_metrics(run_dir: str | os.PathLike, kind: str | None = "train") -> list[dict]:
    return _read_metrics(str(run_dir), kind)


def read_checkpoint(path: str | os.PathLike, scratch: str | os.PathLike) -> dict:
    """``{"sharded": ..., "common": ...}`` of a dist checkpoint, read without a process group through ``scratch``
    (a file path; torch's DCP-to-torch.save converter reassembles shards). The common state (step, scheduler, data
    position) is ``common.pt`` up to megatron-core 0.16 and one object inside the shards from 0.17 on."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(scratch))
    sharded = torch.load(scratch, weights_only=False)
    common_file = os.path.join(path, "common.pt")
    if os.path.exists(common_file):
        common = torch.load(common_file, weights_only=False)
    else:
        [key] = [k for k in sharded if k.startswith("common_state/")]
        [common] = sharded.pop(key)
    return {"sharded": sharded, "common": common}


def tree_equal(a, b) -> bool:
    """Exact equality of nested dicts/lists of tensors, arrays and plain values (tensors: dtype and bits)."""
    import numpy as np
    import torch

    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(tree_equal(x, y) for x, y in zip(a, b))
    return a == b
