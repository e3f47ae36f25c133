"""A preemption signal while an asynchronous interval save is still in flight, forced, not hoped for.

The writer of the step-10 save is held on purpose (``checkpoint.simulated_slow_save``: the forked writer waits
after writing, before it reports done, on the job's first attempt only), and the signal goes to every rank of the
real trainer under the real ft_launcher (2 CPU ranks) as soon as rank 0 logged that save as scheduled: the stop's
save (``runtime/loop.save_at_stop``) finds it pending every time.

- pending: the stop waits for the held save, commits it, then saves the signal's own step; both are complete,
  ``stop_reason.json`` says "saved" at that step, and the next attempt resumes there and finishes with every step
  exactly once and the losses of an uninterrupted run;
- the same pending case with Megatron-FSDP (``parallel.data_parallel_strategy=megatron_fsdp``), whose async
  saves are torch distributed checkpoint writes of its DTensors (``fsdp_dtensor``), not dist_checkpointing's;
- failed: the held save's folder is removed while its writer waits (a lost file system, a full disk), so its commit
  fails: the stop stands (exit 0, stop_reason "failed" with the step it resumes from), each rank says so once,
  and the next attempt starts from the last complete checkpoint (none: step 0) and finishes.
"""

from __future__ import annotations

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from resilience_support.launch import launch, run_to_end, wait_for

pytestmark = pytest.mark.slow

STEPS = 30
BASE = [f"train.max_steps={STEPS}", "checkpoint.async_save=true", "checkpoint.save_interval=10",
        "train.exit_signal_handler=true", "parallel.use_distributed_optimizer=true"]
HELD = 8.0  # the step-10 writer's wait: seconds the signal lands inside
# rank 1 waits in every step (no CPU, no number changed): the signal after step 12 lands well inside the hold
SLOW_STEPS = ["straggler.simulated_straggler_rank=1", "straggler.simulated_straggler_delay=0.3",
              "straggler.simulated_straggler_mode=wait"]
# Megatron-FSDP in place of DDP's distributed optimizer (batch sizes as tests/test_megatron_fsdp.py: DP 2 x 4)
FSDP = [f"train.max_steps={STEPS}", "checkpoint.async_save=true", "checkpoint.save_interval=10",
        "train.exit_signal_handler=true", "parallel.data_parallel_strategy=megatron_fsdp",
        "train.global_batch_size=8", "train.micro_batch_size=4"]
WAIT = 900
SCHEDULED = "checkpoint: scheduled async save of step 10"


def _signalled(root, name: str, *, remove_held: bool, base=BASE):
    first = launch(root / name, base + SLOW_STEPS + [f"checkpoint.simulated_slow_save={HELD}"], max_restarts=0)
    wait_for(lambda: first.proc.poll() is not None or SCHEDULED in first.log(), timeout=WAIT, interval=0.05,
             what="the step-10 async save")
    if remove_held:
        shutil.rmtree(first.ckpt / "iter_0000010.tmp", ignore_errors=True)
    wait_for(lambda: first.proc.poll() is not None or "step 12/" in first.log(), timeout=WAIT, interval=0.05,
             what="step 12")
    for pid, _ in first.worker_pids().values():
        os.kill(pid, signal.SIGTERM)
    first.wait(WAIT)
    first.extra.update(stop=first.stop_reason(), checkpoints=first.checkpoint_steps(), log=first.log())
    second = launch(root / name, base, max_restarts=0)  # the requeued attempt (no hold: not the first attempt)
    second.wait(WAIT)
    return first, second


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("signal_async")
    with ThreadPoolExecutor(max_workers=3) as pool:
        ref = pool.submit(run_to_end, root / "ref", BASE, timeout=WAIT, max_restarts=0)
        pending = pool.submit(_signalled, root, "pending", remove_held=False)
        failed = pool.submit(_signalled, root, "failed", remove_held=True)
        fsdp_ref = pool.submit(run_to_end, root / "fsdp_ref", FSDP, timeout=WAIT, max_restarts=0)
        fsdp = pool.submit(_signalled, root, "fsdp_pending", remove_held=False, base=FSDP)
        return {"ref": ref.result(), "pending": pending.result(), "failed": failed.result(),
                "fsdp_ref": fsdp_ref.result(), "fsdp_pending": fsdp.result()}


def _in_order(log: str, *needles: str) -> list[int]:
    at, out = 0, []
    for needle in needles:
        at = log.index(needle, at)
        out.append(at)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "megatron_fsdp"])
def test_pending_save_is_committed_then_the_signals_step_is_saved(runs, strategy):
    first, second = runs["pending" if strategy == "ddp" else "fsdp_pending"]
    ref = runs["ref" if strategy == "ddp" else "fsdp_ref"]
    stop = first.extra["stop"]
    assert first.returncode == 0, first.extra["log"][-4000:]
    s = stop["step"]
    assert (stop["reason"], stop["checkpoint_at_stop"], stop["checkpoint_step"]) == ("signal", "saved", s), stop
    assert 12 <= s < STEPS
    log = first.extra["log"]
    # the signal came while the step-10 writer was held; the stop committed it before saving its own step
    _in_order(log, SCHEDULED, f"stopping after step {s}: SIGTERM received", "committed ", "iter_0000010",
              f"saved step {s} (signal)")
    assert first.extra["checkpoints"] == sorted({10, s}) and not list(first.ckpt.glob("*.tmp"))
    assert second.returncode == 0 and f"setup: resumed at step {s}" in second.log()
    assert [r["step"] for r in second.train_records(last_per_step=False)] == list(range(1, STEPS + 1))
    assert second.losses() == ref.losses()
    if strategy == "megatron_fsdp":  # what was saved is Megatron-FSDP's own format
        assert '"sharded_backend": "fsdp_dtensor"' in (first.ckpt / "iter_0000010" / "metadata.json").read_text()


def test_failed_pending_save_leaves_the_stop_standing_and_the_next_attempt_starts_from_what_is_complete(runs):
    first, second = runs["failed"]
    stop = first.extra["stop"]
    log = first.extra["log"]
    assert first.returncode == 0, log[-4000:]
    assert (stop["reason"], stop["checkpoint_at_stop"], stop["checkpoint_step"]) == ("signal", "failed", None), stop
    assert log.count("checkpoint at the stop (step ") == 2  # once per rank
    assert "failed; the next attempt resumes from step None" in log
    assert first.extra["checkpoints"] == []
    assert second.returncode == 0 and "setup: starting at step 0" in second.log()
    assert second.stop_reason()["reason"] == "finished"
    assert second.losses() == runs["ref"].losses()
