"""torch FSDP2 (``parallel.data_parallel_strategy=torch_fsdp2``, issue 33): the real trainer on 2 CPU ranks (gloo)
trains with parameters, gradients and Adam state sharded, checkpoints in ``torch_dist``, and keeps the package's
guarantees. One module-scoped set of runs (the installed stack; ``make test-newest`` runs it on megatron-core 0.19):

* ``reference``: 12 steps under the real ft_launcher, a save every 4 steps;
* ``killed``: the same with rank 1 killed at the start of step 10; ft_launcher restarts both ranks, they resume from
  step 8: every step's loss equals the reference's, bit for bit;
* ``preempted``: SIGTERM to both ranks after step 6 (``train.exit_signal_handler``): the save at the signal, exit 0,
  then a second launch resumes from that checkpoint: bitwise again;
* ``dp1``: the step-4 checkpoint (of the killed run, before its kill) resumed on 1 rank (DP 2 -> 1, same global
  batch of 8): the losses stay within ``DP_TOLERANCE`` of the reference's. Each step reads the same 8 samples; only
  the order in which float32 gradients are summed differs (a reduce-scatter over 2 ranks vs accumulation over 2
  micro-batches). 5e-7 relative is the bound measured in the issue; a skipped batch or a reset optimizer moves the
  loss by 1e-2 or more.

Real ft_launcher, torchrun, Megatron-Core's FSDP2 adapter and dist_checkpointing; only the GPU is absent.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from conftest import read_metrics, start_torchrun
from resilience_support.launch import launch, run_to_end, wait_for

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
    wait_for(lambda: (first.run_dir / "metrics.jsonl").exists() and len(first.train_records()) >= 6,
             timeout=WAIT, what="step 6")
    workers = first.worker_pids()
    assert sorted(workers) == [0, 1], workers
    for pid, _ in workers.values():
        os.kill(pid, signal.SIGTERM)
    first.wait(WAIT)
    saves = [(r["step"], r["reason"]) for r in first.records() if r["kind"] == "checkpoint"]
    first_log = first.log()
    second = launch(root / "preempted", BASE + ["train.exit_signal_handler=true"], max_restarts=0)
    second.wait(WAIT)
    return {"first_code": first.returncode, "saves": saves, "first_log": first_log, "run": second}, other


def _dp1(root, source):
    """Starts the 1-rank run from ``source``'s step-4 checkpoint (copied: what a next attempt finds)."""
    start = root / "dp1_start"
    shutil.copytree(source.ckpt / "iter_0000004", start / "iter_0000004")
    (start / "latest_checkpointed_iteration.txt").write_text("4")
    run_dir = root / "dp1"
    return run_dir, start_torchrun(1, [f"run_dir={run_dir}", f"checkpoint.load={start}",
                                       f"checkpoint.save={run_dir}/ckpt", *BASE])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches at a time: reference beside killed; then preempted (two launches) beside dp1."""
    root = tmp_path_factory.mktemp("fsdp2")
    killed = launch(root / "killed", BASE + ["ft.simulate_fault=true", "ft.simulated_fault_type=rank_killed",
                                             "ft.simulated_fault_rank=1", "ft.simulated_fault_step=10"],
                    max_restarts=1)
    reference = run_to_end(root / "reference", BASE, max_restarts=0, timeout=WAIT)
    killed.wait(WAIT)
    preempted, (dp1_dir, dp1) = _preempted(root, lambda: _dp1(root, killed))
    return {"reference": reference, "killed": killed, "preempted": preempted,
            "dp1": {"proc": dp1.wait(WAIT), "run_dir": dp1_dir}}


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
    assert "rank_killed on rank 1" in log and "setup: resumed at step 8" in log
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


def test_dp2_checkpoint_resumes_at_dp1_within_the_bound(runs):
    dp1, ref = runs["dp1"], runs["reference"].losses()
    assert dp1["proc"].returncode == 0, dp1["proc"].stdout[-3000:]
    assert "dp=1" in dp1["proc"].stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(dp1["run_dir"])}
    assert sorted(losses) == list(range(5, 13))
    worst = max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in losses)
    assert worst <= DP_TOLERANCE, {s: (losses[s], ref[s]) for s in losses}
