"""Every error this package raises on a compute node is classified as its own error type, never ``unknown``/``killed``.

Each message is produced by the product code that raises it (not typed here): the store's bind and connect errors
from ``runtime/job_store.py`` on a real port held by this test, the checkpoint refusals from the checkpoint manager's
own wording through the trainer's entry, a config error from the trainer's early checks. Each is laid out as a
rank's output in an attempt's log (a torch.distributed excepthook line, ``[rank0]: RuntimeError: ...``, or the
trainer's ``SystemExit`` line) and run through the same code the batch script's EXIT trap runs
(``attempts.end_attempt``), with every preset policy: the error type and each policy's action are asserted.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import pytest
from test_joblevel_corpus import case, encode, lay_out

from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _store_error(*, host: bool) -> str:
    """The message ``job_store`` raises when the port is held (host) or nobody listens on it (client)."""
    import torch

    from megatron_resilience.runtime import job_store

    timeout = datetime.timedelta(seconds=2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        if not host:
            held.close()
        with pytest.raises(RuntimeError) as raised:
            job_store.host_or_connect("127.0.0.1", port, rank=0 if host else 1, world_size=2, timeout=timeout,
                                      what="process-group store")
    assert torch  # imported for the store
    return str(raised.value)


def _trainer_exit(tmp_path, overrides: list[str]) -> str:
    """The last line the trainer prints when it refuses to start (a single process, no launcher)."""
    proc = subprocess.run([sys.executable, "-m", "megatron_resilience", f"run_dir={tmp_path / 'run'}",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


def _classify(tmp_path, line: str, policy: str) -> tuple[str, str]:
    (tmp_path / "step.log").write_text(f"[2026-11-28 10:00:00,000] [rank 0] megatron_resilience: setup\n{line}\n")
    c = case(str(tmp_path / "step.log"), exit_code=1, expect={}, decisions=())
    cfg, ledger = lay_out(tmp_path / policy, c, policy)
    ending = end_attempt(cfg, ledger, job_id="77", restart=0, exit_code=1, slurm_state="FAILED", by="batch",
                         retries=3, cluster_info=Cluster(nodes=["node-01", "spare-1", "spare-2"], partition="batch"),
                         node_info={})
    return ending.classification.error_type, encode(ending.decision, ending.classification)


def test_the_messages_are_the_products_own(tmp_path):
    assert "cannot bind port" in _store_error(host=True) and "in use by pid" in _store_error(host=True)
    assert "cannot reach rank 0's store at 127.0.0.1:" in _store_error(host=False)


POLICIES = ("default", "megatron_transient", "megatron_aggressive", "megatron_conservative")
EXPECTED = {  # error type, then each policy's action on a first attempt
    "port_in_use": ("requeue", "requeue", "requeue", "stop"),  # "requeue": restarted, a retry spent
    "store_unreachable": ("requeue", "requeue", "requeue", "stop"),
    "checkpoint_refused": ("stop", "stop", "stop", "stop"),
    "config_rejected": ("stop", "stop", "stop", "stop"),
}


def _messages(tmp_path) -> dict[str, str]:
    empty = tmp_path / "empty"
    empty.mkdir()
    return {
        "port_in_use": f"[rank0]: RuntimeError: {_store_error(host=True)}",
        "store_unreachable": f"[rank1]: RuntimeError: {_store_error(host=False)}",
        "checkpoint_refused": _trainer_exit(tmp_path, [f"checkpoint.load={empty}", "train.max_steps=2"]),
        "config_rejected": _trainer_exit(tmp_path, ["train.max_steps=2", "train.micro_batch_size=3",
                                                    "train.global_batch_size=4"]),
    }


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    return _messages(tmp_path_factory.mktemp("own"))


@pytest.mark.parametrize("error_type", sorted(EXPECTED))
def test_each_own_error_is_its_own_type_under_every_policy(tmp_path, messages, error_type):
    got = [_classify(tmp_path, messages[error_type], policy) for policy in POLICIES]
    assert [t for t, _ in got] == [error_type] * len(POLICIES), messages[error_type]
    assert tuple(a for _, a in got) == EXPECTED[error_type]


def test_the_unreadable_checkpoints_message_is_its_own_type(tmp_path):
    """The refusal after every candidate failed to load (checkpoint manager), as a rank's excepthook prints it."""
    import inspect

    from megatron_resilience.checkpointing import manager as checkpoint

    assert "could be loaded" in inspect.getsource(checkpoint.CheckpointManager._load_latest)
    line = ("[rank0]: RuntimeError: checkpoint: none of the checkpoints under /lustre/run/ckpt could be loaded "
            "(tried ['iter_0000020']); the model may be partly overwritten")
    assert _classify(tmp_path, line, "megatron_transient") == ("checkpoint_refused", "stop")
