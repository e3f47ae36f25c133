"""One process of a fixed pool that plays a sequence of trainer runs at changing world sizes, in-process.

    python tests/resilience_support/phases.py PLAN.json INDEX

``PLAN.json``: ``{"root": DIR, "phases": [{"name", "world", "overrides": [...], "probe": bool, "copy": [src,
step, dst] (optional)}, ...]}``. Process ``INDEX`` takes part in every phase whose ``world`` exceeds it, as rank
``INDEX`` of that world (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and a ``MASTER_PORT`` per
phase that process 0 publishes in ``<root>/<phase>.port``, exported as torchrun would), and skips the others; the
next phase's process group rendezvous is where the processes meet again. With ``copy``, process 0 first copies
checkpoint ``iter_<step>`` of ``src`` into ``dst`` with its tracker (what a resumed attempt finds; the others wait
for it at the rendezvous). A phase the trainer refuses (``SystemExit`` with a message) leaves
``<root>/<phase>.exit<INDEX>`` holding the message, and the next phase runs.

A run phase is the real trainer (``megatron_resilience.trainer.run_pretraining``) on its overrides, what
``python -m megatron_resilience`` does. A probe phase runs the trainer's own setup (process groups, model,
optimizer, the checkpoint load from ``checkpoint.load``) and saves the loaded state right away, at the same
step, into ``checkpoint.save``: what the load put into model and optimizer, on disk, for the test to compare
with the checkpoint it came from (``padding<rank>.json`` next to it: the stretches of the distributed
optimizer's buckets that hold no parameter, which upstream leaves uninitialized).

Why one pool instead of a launcher per run: each rank imports torch and Megatron-Core once (seconds of CPU
per process, on 2 cores) instead of once per run; the trainer leaves the process reusable (its teardown).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _probe(config) -> None:
    from megatron_resilience import trainer
    from megatron_resilience.resilience import build_hooks
    from megatron_resilience.runtime.launch_env import launch_env

    launch = launch_env()
    hooks = build_hooks(config, rank=launch.rank, world_size=launch.world_size)
    try:
        ctx = trainer._setup(config, hooks, time.monotonic())
        ctx.checkpoints.save(ctx.state, reason="probe")
        ctx.checkpoints.finalize()
        ctx.metrics.close()
        with open(os.path.join(config.checkpoint.save, f"padding{launch.rank}.json"), "w") as f:
            json.dump(_padding(ctx.state), f)
    finally:
        trainer._teardown()


def _copy(src: str, step: int, dst: str) -> None:
    name = f"iter_{step:07d}"
    os.makedirs(dst, exist_ok=True)
    shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{step}\n")


def _padding(state) -> list[list]:
    """[key, global offset, length] of every stretch of the distributed optimizer's ``dp_reshardable`` buckets
    that is padding between parameters, as this rank saves it: upstream writes ``torch.empty`` there
    (uninitialized memory, different in every save), so those stretches are not compared."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    from megatron_resilience.checkpointing import state_dict as checkpoint_state

    found = []

    def walk(node):
        if isinstance(node, dict):
            flag = node.get("padding")
            if isinstance(flag, LocalNonpersistentObject) and flag.obj is True:
                found.extend([v.key, v.global_offset[0], v.local_shape[0]] for v in node.values()
                             if isinstance(v, ShardedTensor))
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(checkpoint_state.build_sharded_state_dict(state, is_loading=False)["optimizer"])
    return found


def _port(root: str, phase: dict, index: int) -> int:
    """The phase's rendezvous port: process 0 takes a free one just before it listens there and publishes it (a
    port chosen long before would be taken by another socket on a busy machine now and then)."""
    path = os.path.join(root, f"{phase['name']}.port")
    if index == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with open(path + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(path + ".tmp", path)
        return port
    deadline = time.monotonic() + 1200
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process 0 never started phase {phase['name']}")
        time.sleep(0.1)
    with open(path) as f:
        return int(f.read())


def main(plan_path: str, index: int) -> None:
    from megatron_resilience.config.overrides import config_from_overrides
    from megatron_resilience.trainer import run_pretraining

    plan = json.loads(Path(plan_path).read_text())
    os.environ.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    for phase in plan["phases"]:
        if index >= phase["world"]:
            continue
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(phase["world"]),
                          LOCAL_WORLD_SIZE=str(phase["world"]), MASTER_PORT=str(_port(plan["root"], phase, index)))
        if index == 0 and phase.get("copy"):
            _copy(*phase["copy"])
        print(f"=== phase {phase['name']}: rank {index} of {phase['world']}", flush=True)
        try:
            config = config_from_overrides(phase["overrides"])
            _probe(config) if phase.get("probe") else run_pretraining(config)
        except SystemExit as stop:  # the trainer refused the run (a config error): recorded, the next phase runs
            if stop.code in (None, 0):
                continue
            with open(os.path.join(plan["root"], f"{phase['name']}.exit{index}"), "w") as f:
                f.write(f"{stop.code}\n")
            print(f"=== phase {phase['name']}: rank {index} exited: {stop.code}", flush=True)
    print(f"=== process {index}: all phases done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
