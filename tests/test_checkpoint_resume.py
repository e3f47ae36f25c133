"""Exact resume under torchrun: DP=2 on CPU, 20 steps straight == 10 steps, exit, resume for 10, bitwise.

Real torchrun, real Megatron-Core trainer and dist_checkpointing; only the GPU is absent.
"""

from __future__ import annotations

import os

import pytest

_COMMON = ("train.log_interval=1", "optim.lr_decay_steps=20", "checkpoint.save_interval=5")


def _launch(run_dir: str, *overrides: str):
    from conftest import start_torchrun

    return start_torchrun(2, [f"run_dir={run_dir}", f"checkpoint.save={run_dir}/ckpt", *_COMMON, *overrides])


def _finish(launch) -> str:
    proc = launch.wait(timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc.stdout


@pytest.mark.slow
def test_exact_resume_dp2(tmp_path):
    """The issue's proof: DP=2 on CPU, 20 steps straight == 10 steps, exit, resume, 10 more, bitwise.

    The straight run also saves asynchronously with keep_last_n=2, so the same comparison shows
    that async and sync saves write identical checkpoints and that retention works under torchrun.
    """
    from conftest import read_checkpoint, read_metrics, tree_equal

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    first = _launch(straight, "train.max_steps=20", "checkpoint.async_save=true", "checkpoint.keep_last_n=2")
    part_log = _finish(_launch(resumed, "train.max_steps=10"))  # concurrently with the straight run
    assert f"checkpoint: committed {resumed}/ckpt/iter_0000010" in part_log
    second = _launch(resumed, "train.max_steps=20")
    straight_log, resumed_log = _finish(first), _finish(second)

    assert f"checkpoint: resumed from {resumed}/ckpt/iter_0000010 (step 10, consumed_samples 80)" in resumed_log
    starts = [r for r in read_metrics(resumed, kind=None) if r["kind"] == "start"]
    assert [(s["step"], s["resumed"]) for s in starts] == [(0, False), (10, True)]
    losses = {r["step"]: r["loss"] for r in read_metrics(straight)}
    resumed_losses = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert sorted(losses) == sorted(resumed_losses) == list(range(1, 21))
    assert [resumed_losses[s] for s in range(1, 21)] == [losses[s] for s in range(1, 21)]  # bitwise floats
    assert losses[20] < losses[1]

    assert sorted(os.listdir(f"{straight}/ckpt")) == [
        "iter_0000015", "iter_0000020", "latest_checkpointed_iteration.txt"]
    assert "keep_last_n=2 removed" in straight_log and "scheduled async save of step 20" in straight_log
    assert sorted(os.listdir(f"{resumed}/ckpt")) == [
        "iter_0000005", "iter_0000010", "iter_0000015", "iter_0000020", "latest_checkpointed_iteration.txt"]
    final = read_checkpoint(f"{straight}/ckpt/iter_0000020", tmp_path / "straight.pt")
    final_resumed = read_checkpoint(f"{resumed}/ckpt/iter_0000020", tmp_path / "resumed.pt")
    weights = [k for k in final["sharded"] if k.startswith("decoder.") or k.startswith("embedding.")]
    assert len(weights) > 20 and any(k.startswith("optimizer.state.exp_avg.") for k in final["sharded"])
    assert sorted(k for k in final["sharded"] if k.startswith("rng_state")) == ["rng_state/shard_0_2",
                                                                                "rng_state/shard_1_2"]
    assert tree_equal(final["sharded"], final_resumed["sharded"])  # weights, Adam moments, per-rank RNG states
    assert tree_equal(final["common"], final_resumed["common"])  # step, consumed samples, scheduler, param groups
    assert final["common"]["step"] == 20 and final["common"]["consumed_samples"] == 160
