"""torch FSDP2 (``parallel.data_parallel_strategy=torch_fsdp2``, issue 33): the real trainer on 2 CPU ranks (gloo)
trains with parameters, gradients and Adam state sharded, checkpoints in ``torch_dist``, and keeps the package's
guarantees. One module-scoped set of runs (the installed stack; ``make test-newest`` runs it on megatron-core 0.19):

* ``reference``: 12 steps under the real ft_launcher, a save every 4 steps;
* ``killed``: the same, saving asynchronously, plus node-local checkpoints every 3 steps; rank 1 killed at the
  start of step 10; ft_launcher restarts both ranks, they resume from the local checkpoint of step 9 (newer than the
  persistent one of step 8): every step's loss equals the reference's, bit for bit;
* ``preempted``: SIGTERM to both ranks after step 6 (``train.exit_signal_handler``): the save at the signal, exit 0,
  then a second launch resumes from that checkpoint: bitwise again;
* ``dp1``: the step-4 checkpoint (of the killed run, saved asynchronously before its kill) resumed on 1 rank
  (DP 2 -> 1, same global batch of 8), and ``dp2_again``: its step-8 checkpoint resumed on 2 ranks (DP 1 -> 2): the
  losses stay within ``DP_TOLERANCE`` of the reference's. Each step reads the same 8 samples; only
  the order in which float32 gradients are summed differs (a reduce-scatter over 2 ranks vs accumulation over 2
  micro-batches). 5e-7 relative is the bound measured in the issue; a skipped batch or a reset optimizer moves the
  loss by 1e-2 or more.

Real ft_launcher, torchrun, Megatron-Core's FSDP2 adapter and dist_checkpointing; only the GPU is absent.
"""

from __future__ import annotations

import re
import shutil

import pytest
from conftest import read_metrics, start_torchrun
from resilience_support.launch import launch, run_to_end, sigterm_ranks_after

pytestmark = pytest.mark.slow

FSDP2 = ["parallel.data_parallel_strategy=torch_fsdp2", "model.share_embeddings_and_output_weights=false"]
BASE = FSDP2 + ["train.max_steps=12", "checkpoint.save_interval=4", "train.global_batch_size=8",
                "train.micro_batch_size=4", "optim.lr_decay_steps=12", "train.log_interval=1"]
WAIT = 900  # per launch: the 2 cores are shared with other suites
DP_TOLERANCE = 5e-7  # relative, on each loss (module doc)
SLOW = ["straggler.simulated_straggler_rank=0", "straggler.simulated_straggler_delay=0.3"]  # time to send a signal


def _preempted(root, also):
    """The preempted run; ``also`` starts while its first launch runs (another launch to wait on together)."""
    overrides = BASE + SLOW + ["train.exit_signal_handler=true"]
    first = launch(root / "preempted", overrides, max_restarts=0)
    other = also()
    sigterm_ranks_after(first, 6, timeout=WAIT)
    saves = [(r["step"], r["reason"]) for r in first.records() if r["kind"] == "checkpoint"]
    first_log = first.log()
    second = launch(root / "preempted", BASE + ["train.exit_signal_handler=true"], max_restarts=0)
    second.wait(WAIT)
    return {"first_code": first.returncode, "saves": saves, "first_log": first_log, "run": second}, other


def _resized(root, name, ranks, source_ckpt, step):
    """Starts a ``ranks``-rank run from ``source_ckpt``'s checkpoint of ``step`` (copied: what a next attempt finds)."""
    start = root / f"{name}_start"
    shutil.copytree(source_ckpt / f"iter_{step:07d}", start / f"iter_{step:07d}")
    (start / "latest_checkpointed_iteration.txt").write_text(str(step))
    run_dir = root / name
    return run_dir, start_torchrun(ranks, [f"run_dir={run_dir}", f"checkpoint.load={start}",
                                           f"checkpoint.save={run_dir}/ckpt", *BASE])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches at a time: reference beside killed; then preempted (two launches) beside dp1."""
    root = tmp_path_factory.mktemp("fsdp2")
    killed = launch(root / "killed", BASE + ["ft.simulate_fault=true", "ft.simulated_fault_type=rank_killed",
                                             "ft.simulated_fault_rank=1", "ft.simulated_fault_step=10",
                                             f"checkpoint.local_dir={root / 'killed' / 'local'}",
                                             "checkpoint.local_interval=3", "checkpoint.async_save=true"],
                    max_restarts=1)
    reference = run_to_end(root / "reference", BASE, max_restarts=0, timeout=WAIT)
    killed.wait(WAIT)
    preempted, (dp1_dir, dp1) = _preempted(root, lambda: _resized(root, "dp1", 1, killed.ckpt, 4))
    dp1_proc = dp1.wait(WAIT)
    back_dir, back = _resized(root, "dp2_again", 2, dp1_dir / "ckpt", 8)
    return {"reference": reference, "killed": killed, "preempted": preempted,
            "dp1": {"proc": dp1_proc, "run_dir": dp1_dir}, "dp2_again": {"proc": back.wait(WAIT), "run_dir": back_dir}}


def test_trains_sharded_and_saves_torch_dist(runs):
    ref = runs["reference"]
    assert ref.returncode == 0, ref.log()[-3000:]
    losses = ref.losses()
    assert sorted(losses) == list(range(1, 13)) and losses[12] < losses[1]
    assert ref.checkpoint_steps() == [4, 8, 12]
    metadata = (ref.ckpt / "iter_0000012" / "metadata.json").read_text()
    assert '"sharded_backend": "torch_dist"' in metadata


def test_a_rank_killed_under_ft_launcher_resumes_exact(runs):
    ref, run = runs["reference"], runs["killed"]
    assert run.returncode == 0, run.log()[-3000:]
    log = run.log()
    assert "rank_killed on rank 1" in log and "setup: resumed at step 9" in log
    assert "checkpoint: resumed from the local checkpoint (step 9, consumed_samples 72)" in log  # the node-local tier
    assert run.losses() == ref.losses()  # bitwise, every step


def test_the_save_at_sigterm_resumes_exact(runs):
    pre, ref = runs["preempted"], runs["reference"]
    assert pre["first_code"] == 0, pre["first_log"][-3000:]
    step, reason = pre["saves"][-1]
    assert 6 <= step < 12 and reason == "signal", pre["saves"]
    run = pre["run"]
    assert run.returncode == 0, run.log()[-3000:]
    assert f"setup: resumed at step {step}" in run.log()
    assert run.losses() == ref.losses()


def _within_bound(run: dict, ref: dict[int, float], steps: range, dp: int) -> None:
    assert run["proc"].returncode == 0, run["proc"].stdout[-3000:]
    assert f"dp={dp}" in run["proc"].stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(run["run_dir"])}
    assert sorted(losses) == list(steps)
    worst = max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in losses)
    assert worst <= DP_TOLERANCE, {s: (losses[s], ref[s]) for s in losses}


def test_dp2_checkpoint_resumes_at_dp1_and_back_within_the_bound(runs):
    """DP 2 -> 1 from an async-saved checkpoint (the killed run's step 4), then DP 1 -> 2 from the DP=1 run's step 8."""
    ref = runs["reference"].losses()
    _within_bound(runs["dp1"], ref, range(5, 13), 1)
    _within_bound(runs["dp2_again"], ref, range(9, 13), 2)


def test_the_model_line_counts_the_parameters_each_rank_holds(runs):
    """Rank 0 of 2 holds its FSDP2 shard of every parameter (at least half of the whole, padding aside), the single
    rank of the DP 1 run all of it; a DTensor's numel() would say the whole on both."""
    held = re.compile(r"model: GPT .*, (\d+) parameters held by this rank")
    whole = int(held.search(runs["dp1"]["proc"].stdout).group(1))
    shard = int(held.search(runs["reference"].log()).group(1))
    assert whole / 2 <= shard < whole, (shard, whole)


def test_a_checkpoint_resumes_only_under_the_strategy_it_was_saved_with(runs):
    """Refused before torch loads, naming the key, both strategies and what to do."""
    from megatron_resilience.config import CheckpointConfig, ConfigError, ModelConfig, PretrainConfig
    from megatron_resilience.runtime import model_shape

    ref = runs["reference"]
    assert '"data_parallel_strategy": "torch_fsdp2"' in (ref.ckpt / "iter_0000012" / "model_shape.json").read_text()
    config = PretrainConfig(run_dir=str(ref.run_dir), checkpoint=CheckpointConfig(save=str(ref.ckpt)),
                            model=ModelConfig(share_embeddings_and_output_weights=False))  # the same shape
    with pytest.raises(ConfigError) as err:
        model_shape.check_resume(config)
    assert str(err.value) == (
        f"parallel.data_parallel_strategy: must be 'torch_fsdp2' to resume from {ref.ckpt}/iter_0000012 (the strategy "
        "its tensors are sharded for; moving a checkpoint between strategies is not supported), got 'ddp'. To train "
        "with another strategy, give it its own checkpoint.save folder; the checkpoints there are valid, keep them")
