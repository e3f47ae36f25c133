"""Issue 25, section 1: a checkpoint written at one data-parallel size resumes at another, and the training stays
the same. The real trainer on CPU (gloo), tiny GPT, global batch 16 = micro-batch 4 x DP x micro-batches per rank.

Every run below is played by one pool of 4 processes (``resilience_support/phases.py``): each run is the real
``run_pretraining`` as rank r of its own world (4, 2 or 1 ranks, a fresh process group and rendezvous per run);
the pool only saves the imports of a launcher per run. Chains, each started from a checkpoint of the previous run
copied into a fresh folder (what the next attempt of a job finds):

* ``distopt`` (distributed optimizer on) and ``ddp`` (off): an uninterrupted DP=4 run of 12 steps saving every 3
  (the reference), then DP=2 from its step 3 to step 6, DP=1 from there to step 9, DP=4 again to step 12;
* ``tp2``: TP=2 x DP=2 for 6 steps saving at 3 (the reference), then TP=2 x DP=1 from step 3 to 6.

Before each resumed run a probe loads the same checkpoint at the new size with the trainer's own setup and saves
what it loaded, at once: every model and optimizer tensor equals the checkpoint it came from, bit for bit (the
distributed optimizer's ``dp_reshardable`` buckets included, except the stretches of padding between parameters,
which upstream fills with uninitialized memory at every save); only the per-rank RNG states, the world size and the
recorded layout belong to the new size. The refusals: another TP size, another DP with ``train.global_batch_size``
unset (the batch would follow DP), and a DP that does not divide the global batch. Those tests are ``slow`` (the
pool); the last test calls ``reshard.check_resume`` alone: a DP that cannot carry the checkpoint's global batch.

Tolerance (``LOSS_TOLERANCE``): each step reads the same 16 samples at every size, and the learning rate and step
count continue, so the only difference is the order in which float32 gradients are summed (an all-reduce over 4
ranks vs accumulation over 4 micro-batches): a few float32 roundings (relative 6e-8 each) per gradient element per
step, which Adam carries into the weights. Measured: at most 2.4e-7 on losses near 6.4 over 9 resumed steps (on
0.16.1 and 0.19.2). 2e-5 leaves a wide margin for other machines' summation and is still far below what a real
mistake does: neighbouring steps' losses differ by 0.03 or more, so a skipped or repeated batch, a reset optimizer
state or a changed learning rate shows. Learning rates and consumed samples are compared exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_checkpoint, read_metrics, tree_equal

from megatron_resilience.checkpointing import reshard

POOL = 4
GBS = ["train.global_batch_size=16", "train.micro_batch_size=4"]
LOSS_TOLERANCE = 2e-5
CHAINS = {  # name: (overrides, reference world, [(world, from step, to step), ...])
    "distopt": (["parallel.use_distributed_optimizer=true"], 4, [(2, 3, 6), (1, 6, 9), (4, 9, 12)]),
    "ddp": (["parallel.use_distributed_optimizer=false"], 4, [(2, 3, 6), (1, 6, 9), (4, 9, 12)]),
    "tp2": (["parallel.tensor_model_parallel_size=2", "parallel.use_distributed_optimizer=true"], 4, [(2, 3, 6)]),
}


def _plan(root: Path) -> list[dict]:
    phases = []

    def phase(name, world, overrides, **extra):
        phases.append({"name": name, "world": world, "overrides": [f"run_dir={root / name}", *overrides], **extra})

    for chain, (overrides, ref_world, segments) in CHAINS.items():
        last = segments[-1][2]
        ref = f"{chain}_ref"
        phase(ref, ref_world, [*GBS, *overrides, f"train.max_steps={last}", "checkpoint.save_interval=3",
                               f"checkpoint.save={root / ref / 'ckpt'}"])
        source = ref
        for world, start, end in segments:
            run, probe = f"{chain}_dp{world}_from{start}", f"{chain}_probe_dp{world}_from{start}"
            phase(probe, world, [*GBS, *overrides, f"train.max_steps={last}", f"checkpoint.load={root / run / 'ckpt'}",
                                 f"checkpoint.save={root / probe / 'ckpt'}"], probe=True,
                  copy=[str(root / source / "ckpt"), start, str(root / run / "ckpt")])
            phase(run, world, [*GBS, *overrides, f"train.max_steps={end}", "checkpoint.save_interval=3",
                               f"checkpoint.save={root / run / 'ckpt'}"])
            source = run
    # Refusals, from the tp2 reference's step-3 checkpoint and the distopt reference's.
    phase("refuse_tp", 2, [*GBS, "parallel.use_distributed_optimizer=true", "train.max_steps=6",
                           f"checkpoint.save={root / 'refuse_tp' / 'ckpt'}"],
          copy=[str(root / "tp2_ref" / "ckpt"), 3, str(root / "refuse_tp" / "ckpt")])
    phase("refuse_gbs", 2, ["train.micro_batch_size=4", "parallel.use_distributed_optimizer=true", "train.max_steps=6",
                            f"checkpoint.save={root / 'refuse_gbs' / 'ckpt'}"],
          copy=[str(root / "distopt_ref" / "ckpt"), 3, str(root / "refuse_gbs" / "ckpt")])
    phase("refuse_dp3", 3, [*GBS, "train.max_steps=6", f"checkpoint.load={root / 'distopt_ref' / 'ckpt'}"])
    return phases


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic_reshard")
    plan = root / "plan.json"
    plan.write_text(json.dumps({"root": str(root), "phases": _plan(root)}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = [open(root / f"process{i}.log", "w") for i in range(POOL)]
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "resilience_support" / "phases.py"), str(plan),
                               str(i)], cwd=REPO, env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                              start_new_session=True) for i in range(POOL)]
    deadline = time.monotonic() + 1500
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
            p.wait()
        for f in logs:
            f.close()
    text = {i: (root / f"process{i}.log").read_text(errors="replace") for i in range(POOL)}
    bad = {i: p.returncode for i, p in enumerate(procs) if p.returncode != 0}
    assert not bad, f"pool processes failed {bad}:\n" + "\n".join(f"--- process {i}\n{text[i][-5000:]}" for i in bad)
    return {"root": root, "log": text}


def _losses(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir)}


def _start(run_dir: Path) -> dict:
    [start] = [r for r in read_metrics(run_dir, None) if r.get("kind") == "start"]
    return start


@pytest.mark.slow
@pytest.mark.parametrize("chain", list(CHAINS))
def test_losses_after_each_change_of_dp_size_match_the_uninterrupted_run(pool, chain):
    root = pool["root"]
    overrides, ref_world, segments = CHAINS[chain]
    ref = _losses(root / f"{chain}_ref")
    tp = 2 if chain == "tp2" else 1
    assert sorted(ref) == list(range(1, segments[-1][2] + 1))
    assert _start(root / f"{chain}_ref")["dp"] == ref_world // tp
    for world, start, end in segments:
        run = root / f"{chain}_dp{world}_from{start}"
        got = _losses(run)
        assert sorted(got) == list(range(start + 1, end + 1)), (run, sorted(got))
        record = _start(run)
        assert (record["step"], record["resumed_from"], record["world_size"], record["tp"], record["dp"]) == \
            (start, start, world, tp, world // tp)
        for step, r in got.items():
            assert abs(r["loss"] - ref[step]["loss"]) <= LOSS_TOLERANCE, (chain, world, step, r["loss"],
                                                                          ref[step]["loss"])
            assert (r["lr"], r["consumed_samples"]) == (ref[step]["lr"], ref[step]["consumed_samples"]), (step, r)
    log = pool["log"][0]
    for world, start, _ in segments:
        micro = 16 // (4 * (world // tp))
        assert f"re-sharded over {world // tp} data-parallel rank(s)" in log
        assert f"global batch 16 = {micro} micro-batches x 4 x dp {world // tp}" in log


@pytest.mark.slow
@pytest.mark.parametrize("chain", list(CHAINS))
def test_model_and_optimizer_load_bitwise_at_the_new_size(pool, chain, tmp_path):
    root = pool["root"]
    _, ref_world, segments = CHAINS[chain]
    before = ref_world
    for world, start, _ in segments:
        source = root / f"{chain}_dp{world}_from{start}" / "ckpt" / f"iter_{start:07d}"
        probe = root / f"{chain}_probe_dp{world}_from{start}" / "ckpt" / f"iter_{start:07d}"
        saved = read_checkpoint(source, tmp_path / "saved.pt")
        loaded = read_checkpoint(probe, tmp_path / "loaded.pt")
        rng = {k for k in saved["sharded"] if k.startswith("rng_state/")}
        assert len(rng) == before and len({k for k in loaded["sharded"] if k.startswith("rng_state/")}) == world
        tensors = {k for k in saved["sharded"] if k not in rng}
        assert tensors == {k for k in loaded["sharded"] if not k.startswith("rng_state/")}
        assert any(k.startswith("optimizer.") for k in tensors) and any(k.endswith(".weight") for k in tensors)
        padding = _padding(probe.parent)
        for key in tensors:
            a, b = saved["sharded"][key], loaded["sharded"][key]
            if key in padding:  # the distributed optimizer's padding between parameters holds uninitialized memory
                keep = torch.ones(a.shape, dtype=torch.bool)
                for start, length in padding[key]:
                    keep[start:start + length] = False
                assert keep.sum() > 0.9 * keep.numel(), (key, padding[key])
                a, b = a[keep], b[keep]
            assert tree_equal(a, b), (chain, world, key)
        common = {k: v for k, v in saved["common"].items() if k not in ("world_size", "layout")}
        assert tree_equal(common, {k: v for k, v in loaded["common"].items() if k not in ("world_size", "layout")})
        assert (saved["common"]["world_size"], loaded["common"]["world_size"]) == (before, world)
        assert loaded["common"]["layout"]["data_parallel_size"] == world // (2 if chain == "tp2" else 1)
        before = world


def _padding(folder: Path) -> dict[str, list[tuple[int, int]]]:
    """Bucket key -> (offset, length) stretches that hold no parameter (written by the probe, every rank)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for path in folder.glob("padding*.json"):
        for key, start, length in json.loads(path.read_text()):
            out.setdefault(key, []).append((start, length))
    return out


def _refusal(pool, name: str, ranks: int) -> str:
    messages = {(pool["root"] / f"{name}.exit{i}").read_text().strip() for i in range(ranks)}
    assert len(messages) == 1, messages
    return messages.pop()


@pytest.mark.slow
def test_another_tensor_parallel_size_is_refused_naming_both_layouts(pool):
    message = _refusal(pool, "refuse_tp", 2)
    assert message.startswith("megatron_resilience: parallel: the checkpoint ")
    assert ("was written with TP=2 x PP=1 x DP=2 (4 ranks), global batch 16 = 2 micro-batches x 4 x DP 2; this job "
            "has TP=1 x PP=1 x DP=2 (2 ranks), global batch 16 = 2 micro-batches x 4 x DP 2. Only the data-parallel "
            "size may change when resuming: set parallel.tensor_model_parallel_size=2") in message
    assert not (pool["root"] / "refuse_tp" / "metrics.jsonl").exists() or not read_metrics(pool["root"] / "refuse_tp")


@pytest.mark.slow
def test_a_global_batch_that_would_follow_the_dp_size_is_refused(pool):
    message = _refusal(pool, "refuse_gbs", 2)
    assert message.startswith("megatron_resilience: train.global_batch_size: the checkpoint ")
    assert ("was written with TP=1 x PP=1 x DP=4 (4 ranks), global batch 16 = 1 micro-batches x 4 x DP 4; unset, "
            "the global batch follows this job's size and would be 8 (TP=1 x PP=1 x DP=2 (2 ranks), global batch 8 = "
            "1 micro-batches x 4 x DP 2), another training. Set train.global_batch_size=16 to continue the same "
            "training at DP=2") in message


@pytest.mark.slow
def test_a_dp_size_that_does_not_divide_the_global_batch_fails_before_torch_loads(pool):
    message = _refusal(pool, "refuse_dp3", 3)
    assert message == ("megatron_resilience: train.global_batch_size: must be a multiple of train.micro_batch_size * "
                       "data-parallel size = 4 * 3 = 12, got 16")


def test_a_dp_size_that_cannot_carry_the_checkpoints_global_batch_is_refused_naming_both_sizes():
    """The case the pool cannot show: ``train.global_batch_size`` unset at DP=3 (so 12 = 4 x 3 passes the check
    before torch loads) on a checkpoint of global batch 16 at DP=4. Advising ``train.global_batch_size=16`` would
    only lead to the refusal above, which no longer names the checkpoint's DP: the refusal names both sizes and
    the DP sizes that can continue (``reshard.check_resume``, what the trainer calls before reading tensors)."""
    saved = reshard.layout(world_size=4, tp=1, pp=1, dp=4, global_batch_size=16, micro_batch_size=4)
    current = reshard.layout(world_size=3, tp=1, pp=1, dp=3, global_batch_size=12, micro_batch_size=4)
    with pytest.raises(reshard.ReshardError) as refused:
        reshard.check_resume(saved, "/c/iter_0000012", current=current, global_batch_explicit=False)
    assert str(refused.value) == (
        "train.global_batch_size: the checkpoint /c/iter_0000012 was written with TP=1 x PP=1 x DP=4 (4 ranks), "
        "global batch 16 = 1 micro-batches x 4 x DP 4; this job's data-parallel size 3 (TP=1 x PP=1 x DP=3, 3 ranks) "
        "cannot continue its global batch 16: it is not a multiple of train.micro_batch_size * data-parallel size = "
        "4 * 3 = 12. Data-parallel sizes that can, with train.micro_batch_size=4: [1, 2, 4] (run on a node count "
        "that gives one); or set train.global_batch_size to a multiple of 12 (another training)")
    # DP=2 divides 16: the refusal is the one that names the value to set (the pool's refuse_gbs, end to end).
    halved = reshard.layout(world_size=2, tp=1, pp=1, dp=2, global_batch_size=8, micro_batch_size=4)
    with pytest.raises(reshard.ReshardError, match=r"Set train\.global_batch_size=16 to continue the same training "
                                                   r"at DP=2 \(or set the new size explicitly\)$"):
        reshard.check_resume(saved, "/c/iter_0000012", current=halved, global_batch_explicit=False)
    kept = reshard.layout(world_size=2, tp=1, pp=1, dp=2, global_batch_size=16, micro_batch_size=4)
    assert reshard.check_resume(saved, "/c/iter_0000012", current=kept, global_batch_explicit=True,
                                announce=False) == (
        "checkpoint: resuming /c/iter_0000012, written with TP=1 x PP=1 x DP=4 (4 ranks), global batch 16 = 1 "
        "micro-batches x 4 x DP 4, with TP=1 x PP=1 x DP=2 (2 ranks), global batch 16 = 2 micro-batches x 4 x DP 2: "
        "model and optimizer re-sharded over 2 data-parallel rank(s)")
