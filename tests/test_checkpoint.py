"""Checkpoints: exact save -> load round trip, cut-off saves skipped, retention, async visibility
(the torchrun DP=2 exact-resume proof is tests/test_checkpoint_resume.py).

The scenarios run in ONE subprocess (world size 1, gloo, real Megatron-Core GPT
+ DDP + optimizer + scheduler on CPU through ``cpu_compat``), because
``cpu_compat.install()`` and Megatron's parallel state are process-wide and must
not leak into other tests. This file is also that subprocess's script
(``python tests/test_checkpoint.py <workdir>``); it writes ``result.json``,
which the tests below assert on, together with the warnings it logged.
Nothing is mocked: only the GPU is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- the worker (runs in the subprocess) --------------------------------------------------------------------------


def _build(seed: int, *, lr_decay_steps: int = 20, distributed_optimizer: bool = False):
    """Tiny GPT in Megatron DDP + Megatron Adam + scheduler, as the training loop builds them."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_resilience.runtime.state import TrainState

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tconfig = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                                hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=True)
    gpt = GPTModel(config=tconfig, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=1024,
                   max_sequence_length=64)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=distributed_optimizer)
    ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=gpt)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01,
                                                       clip_grad=1.0, use_distributed_optimizer=distributed_optimizer),
                                       [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                        lr_decay_steps=lr_decay_steps, lr_decay_style="cosine", start_wd=0.01,
                                        end_wd=0.01, wd_incr_steps=lr_decay_steps, wd_incr_style="constant")
    return TrainState(model=[ddp], optimizer=optimizer, scheduler=scheduler)


def _train_step(state) -> float:
    """One optimizer step on a batch drawn from the global RNGs (so a wrong RNG restore changes the loss)."""
    import numpy as np
    import torch
    from megatron.core.distributed import finalize_model_grads

    ddp = state.model[0]
    tokens = torch.from_numpy(np.random.randint(0, 1024, size=(4, 65)))
    position_ids = torch.arange(64).unsqueeze(0).expand(4, -1)
    mask = torch.tril(torch.ones(1, 1, 64, 64)) < 0.5
    ddp.zero_grad_buffer()
    state.optimizer.zero_grad()
    loss = ddp(tokens[:, :-1], position_ids, mask, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    ok, _, _ = state.optimizer.step()
    assert ok
    state.scheduler.step(increment=1)
    state.step += 1
    state.consumed_samples += 4
    return loss.item()


def _snapshot(state) -> dict:
    import torch

    params = {n: p.detach().clone() for n, p in state.model[0].module.named_parameters()}
    inners = [o.optimizer for o in getattr(state.optimizer, "chained_optimizers", [state.optimizer])]
    moments = {f"{j}.{i}.{k}": v.clone()  # Adam exp_avg, exp_avg_sq and step of every (main) parameter
               for j, inner in enumerate(inners)
               for i, p in enumerate(p for g in inner.param_groups for p in g["params"])
               for k, v in inner.state[p].items() if torch.is_tensor(v)}
    return {"params": params, "moments": moments, "scheduler": state.scheduler.state_dict(),
            "lr": [g["lr"] for g in state.optimizer.param_groups], "step": state.step,
            "consumed_samples": state.consumed_samples, "extra": dict(state.extra)}


def _same(a: dict, b: dict) -> list[str]:
    """Names of everything that differs between two snapshots (bitwise for tensors)."""
    import torch

    diff = [k for k in ("scheduler", "lr", "step", "consumed_samples", "extra") if a[k] != b[k]]
    for group in ("params", "moments"):
        if a[group].keys() != b[group].keys():
            diff.append(f"{group}: keys")
        diff += [f"{group}.{n}" for n in a[group] if n in b[group] and not torch.equal(a[group][n], b[group][n])]
    return diff


def _rng_draws() -> list:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(3).tolist()
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.cuda.get_rng_state()[:8].tolist(),
            tracked]


def _live_children() -> list[int]:
    """PIDs of this process's live child processes (a spawned helper would show up here)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as handle:
            pids += [int(p) for p in handle.read().split()]
    return sorted(p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z")


def _worker(workdir: str) -> None:
    import logging

    import torch

    from megatron_resilience.checkpointing.manager import CheckpointManager
    from megatron_resilience.config import CheckpointConfig
    from megatron_resilience.runtime import cpu_compat

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cpu_compat.install()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(create_gloo_process_groups=True)
    result: dict = {}

    # 1. Round trip, sync and async (and Megatron's distributed optimizer): a fresh model (other seed)
    #    restores everything bitwise.
    for mode in ("sync", "async", "distopt"):
        save = os.path.join(workdir, f"roundtrip_{mode}")
        config = CheckpointConfig(save=save, save_interval=3, async_save=mode == "async")
        state = _build(seed=1, distributed_optimizer=mode == "distopt")
        for _ in range(3):
            _train_step(state)
        state.extra["note"] = mode
        manager = CheckpointManager(config, run_dir=workdir)
        expected = _snapshot(state)
        children_before = _live_children()
        manager.save(state)
        if mode == "sync":  # the first save of this process: no helper process may be left running
            result["first_save"] = {"children_before": children_before, "children_after": _live_children(),
                                    "records": manager.take_durable()}
        save_seconds = manager.last_save_seconds
        visible_before_finalize = sorted(os.listdir(save))
        # Train on while an async write may still be in flight: the checkpoint must hold the step-3 state.
        expected_draws = _rng_draws()
        expected_losses = [_train_step(state) for _ in range(2)]
        manager.finalize()

        restored = _build(seed=2, distributed_optimizer=mode == "distopt")
        fresh = _snapshot(restored)
        manager = CheckpointManager(config, run_dir=workdir)
        loaded = manager.load_latest(restored)
        result[mode] = {
            "loaded": loaded, "latest_step": manager.latest_step,
            "differs_before_load": len(_same(expected, fresh)) > 0,
            "diff_after_load": _same(expected, _snapshot(restored)),
            "draws_equal": _rng_draws() == expected_draws,
            "losses": expected_losses, "losses_after_resume": [_train_step(restored) for _ in range(2)],
            "visible_before_finalize": visible_before_finalize, "visible_after": sorted(os.listdir(save)),
            "save_seconds": save_seconds, "load_seconds": manager.last_load_seconds,
        }

    # 2. Cut-off and damaged checkpoints are skipped; the newest complete one (step 4) is used.
    save = os.path.join(workdir, "damaged")
    config = CheckpointConfig(save=save, save_interval=2)
    state = _build(seed=3)
    manager = CheckpointManager(config, run_dir=workdir)
    for _ in range(12):
        _train_step(state)
        if state.step == 4:
            at_step_4 = _snapshot(state)
        if manager.should_save(state.step):
            manager.save(state)

    def path(step: int) -> str:
        return os.path.join(save, f"iter_{step:07d}")

    def truncate(name: str, size: int) -> None:
        with open(name, "r+b") as handle:
            handle.truncate(size)

    def shards(step: int) -> list[str]:
        return sorted(os.path.join(path(step), n) for n in os.listdir(path(step)) if n.endswith(".distcp"))

    os.rename(path(6), path(6) + ".tmp")  # cut off mid-write
    os.remove(os.path.join(path(8), "metadata.json"))  # dist_checkpointing's last file never written
    # The common state (step, scheduler, data position) is common.pt up to megatron-core 0.16 and an object
    # inside the torch_dist shards from 0.17 on: damage it where it is.
    legacy_common = os.path.exists(os.path.join(path(10), "common.pt"))
    for name in [os.path.join(path(10), "common.pt")] if legacy_common else shards(10):
        truncate(name, 100)  # unreadable common state
    largest = max(shards(12), key=os.path.getsize)  # passes the scan, but tensor data is cut off
    truncate(largest, 64 if legacy_common else os.path.getsize(largest) // 2)
    result["damaged_layout"] = {"legacy_common": legacy_common, "shards_12": len(shards(12))}
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("12\n")  # the tracker points at a broken checkpoint
    restored = _build(seed=4)
    manager = CheckpointManager(config, run_dir=workdir)
    result["damaged"] = {"loaded": manager.load_latest(restored), "latest_step": manager.latest_step,
                         "diff_after_load": _same(at_step_4, _snapshot(restored))}

    # 3. Nothing complete to load: False, state untouched.
    empty = os.path.join(workdir, "only_tmp")
    os.makedirs(os.path.join(empty, "iter_0000002.tmp"))
    manager = CheckpointManager(CheckpointConfig(save=empty), run_dir=workdir)
    result["nothing"] = {"loaded": manager.load_latest(restored), "step": restored.step}

    # 4. Retention: keep_last_n=2 over five saves keeps exactly the newest two; stale tmp dirs are cleaned.
    save = os.path.join(workdir, "retention")
    os.makedirs(os.path.join(save, "iter_0000099.tmp"))
    manager = CheckpointManager(CheckpointConfig(save=save, save_interval=1, keep_last_n=2), run_dir=workdir)
    state = _build(seed=5)
    for _ in range(5):
        _train_step(state)
        manager.save(state)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as handle:
        tracker = handle.read()
    result["retention"] = {"entries": sorted(os.listdir(save)), "tracker": tracker,
                           "latest_step": manager.latest_step}

    # 5. Saving the same step again replaces the checkpoint atomically.
    manager.save(state)
    result["resave"] = {"entries": sorted(os.listdir(save))}

    # 6. An async save that never finalised (process died) stays invisible.
    save = os.path.join(workdir, "async_crash")
    manager = CheckpointManager(CheckpointConfig(save=save, async_save=True), run_dir=workdir)
    manager.save(state)
    time.sleep(1.0)  # the forked writer finishes; nobody finalises (as if the trainer died)
    result["async_crash"] = {"entries": sorted(os.listdir(save))}
    restored = _build(seed=6)
    result["async_crash"]["loaded"] = CheckpointManager(CheckpointConfig(save=save), run_dir=workdir).load_latest(
        restored)
    manager.finalize()

    # 7. An async save is committed as soon as its write is done, by non-blocking polls alone (no next save,
    #    no finalize), and its record says when it started, how long it blocked, when it became durable.
    save = os.path.join(workdir, "async_poll")
    manager = CheckpointManager(CheckpointConfig(save=save, async_save=True), run_dir=workdir)
    manager.save(state, reason="interval")
    polls, deadline = 0, time.monotonic() + 300
    while manager.pending_steps and time.monotonic() < deadline:
        manager.maybe_finalize()  # never waits
        polls += 1
        time.sleep(0.02)
    result["async_poll"] = {"pending": manager.pending_steps, "entries": sorted(os.listdir(save)), "polls": polls,
                            "latest_step": manager.latest_step, "records": manager.take_durable()}
    manager.finalize()

    with open(os.path.join(workdir, "result.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


# --- the tests ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("ckpt"))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), workdir], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    with open(os.path.join(workdir, "result.json")) as handle:
        return json.load(handle), log, workdir


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "distopt"])
def test_round_trip_restores_everything_exactly(worker, mode):
    result = worker[0][mode]
    assert result["loaded"] is True and result["latest_step"] == 3
    assert result["differs_before_load"]  # the fresh model really was different
    assert result["diff_after_load"] == []  # weights, Adam moments, scheduler, lr, step, samples, extra
    assert result["draws_equal"]  # python, numpy, torch, "cuda" (CPU stand-in) and TP-tracker RNG
    assert result["losses_after_resume"] == result["losses"]  # bitwise: dropout + data draws continue exactly


@pytest.mark.slow
def test_async_save_is_invisible_until_finalised(worker):
    result = worker[0]["async"]
    assert result["visible_before_finalize"] == ["iter_0000003.tmp"]
    assert result["visible_after"] == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    crashed = worker[0]["async_crash"]
    assert crashed["entries"] == ["iter_0000005.tmp"] and crashed["loaded"] is False


@pytest.mark.slow
def test_cut_off_and_damaged_checkpoints_are_skipped(worker):
    result, log, workdir = worker
    damaged = result["damaged"]
    assert damaged["loaded"] is True and damaged["latest_step"] == 4
    assert damaged["diff_after_load"] == []
    root = os.path.join(workdir, "damaged")
    assert f"skipping {root}/iter_0000006.tmp: a save that never finished (cut off mid-write)" in log
    assert f"skipping {root}/iter_0000008: no metadata.json (the save did not finish)" in log
    assert f"skipping {root}/iter_0000010: unreadable common state" in log
    assert f"could not load {root}/iter_0000012" in log
    assert f"skipping {root}/iter_0000012 (unreadable on at least one rank); trying the previous one" in log
    assert f"{root}/latest_checkpointed_iteration.txt says 12 but the newest loadable checkpoint is iter_0000004" in log
    assert result["nothing"] == {"loaded": False, "step": 4}  # nothing loaded, state untouched


@pytest.mark.slow
def test_retention_keeps_exactly_keep_last_n(worker):
    result = worker[0]
    assert result["retention"]["entries"] == ["iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]
    assert result["retention"]["tracker"] == "5\n"
    assert result["retention"]["latest_step"] == 5
    assert result["resave"]["entries"] == ["iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]


@pytest.mark.slow
def test_first_save_starts_no_helper_process_and_is_recorded(worker):
    """Upstream starts a spawned Manager process on a process's first save (seconds of interpreter start and
    imports between a preemption signal and a durable checkpoint; killed by a forwarded SIGTERM). Ours: none."""
    first = worker[0]["first_save"]
    assert first["children_after"] == first["children_before"] == []
    (record,) = first["records"]
    assert (record["step"], record["reason"], record["async"], record["first_in_process"]) == (3, "interval", False,
                                                                                               True)
    assert record["bytes"] > 100_000  # the tiny GPT with Adam moments
    assert record["start_time"] <= record["durable_time"] and record["blocking_s"] >= 0
    assert record["lag_s"] == record["durable_time"] - record["start_time"]
    assert record["path"].endswith("roundtrip_sync/iter_0000003")


@pytest.mark.slow
def test_async_save_is_committed_by_polling_alone(worker):
    poll = worker[0]["async_poll"]
    assert poll["pending"] == [] and poll["latest_step"] == 5
    assert poll["entries"] == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    (record,) = poll["records"]
    assert (record["step"], record["async"], record["first_in_process"]) == (5, True, False)
    assert record["start_time"] + record["blocking_s"] <= record["durable_time"]  # blocked less than it took
    assert record["bytes"] > 100_000


def test_atomic_write_text(tmp_path):
    from megatron_resilience.records.checkpoint_layout import atomic_write_text

    target = tmp_path / "sub" / "state.json"
    atomic_write_text(str(target), "one")
    atomic_write_text(str(target), "two")
    assert target.read_text() == "two"
    assert os.listdir(target.parent) == ["state.json"]  # no temporary file left behind


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _worker(sys.argv[1])
