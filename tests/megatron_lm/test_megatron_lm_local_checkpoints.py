"""Node-local checkpoints through the plugins' flags, for Megatron-LM's real trainer (issue 32).

``FaultTolerancePlugin(local_checkpoint_dir=..., local_checkpoint_interval=3)`` on a ``run.Script`` of
``pretrain_gpt.py`` adds Megatron-LM's own flags (``--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir
DIR --non-persistent-save-interval 3``): its local checkpoint manager (nvidia-resiliency-ext 0.7.0's) writes each
rank's state to that folder every 3 steps. The persistent ``--save-interval`` is the run's length, so the only
copy a restart can resume from before the end is the local one. ``kill_rank_at_step.py`` kills rank 1 inside step 8
of the first worker group: ft_launcher restarts the group, Megatron-LM resumes from the local copy of step 6 (its
line names the ``--load`` folder even then) and finishes; every step's loss equals the uninterrupted run's as
printed, but step 8's, the restarted process's two-step mean (``test_megatron_lm_local.py``). The LocalExecutor
under ft_launcher 0.7.0, as ``test_megatron_lm_local.py``'s runs; nothing is mocked but the GPU (the CPU layer).
"""

from __future__ import annotations

import glob
import os
import re

import local_driver
import pytest
from megatron_lm_run import HERE, NEWEST, SCRIPT, iteration_losses, tiny_gpt_args

pytestmark = pytest.mark.slow

TRAIN_ITERS, LOCAL_INTERVAL, KILL_AT = 20, 3, 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not os.path.isdir(os.path.join(NEWEST, "megatron", "training")):
        pytest.fail(f"{NEWEST} has no megatron.training: run scripts/newest/install.sh .venv-newest (make does)")
    root = tmp_path_factory.mktemp("megatron_lm_local_ckpt")
    local_dir = str(root / "node_local")
    ckpt = {name: str(root / f"{name}_ckpt") for name in ("baseline", "local")}
    launched = {  # both at once: most of their time is imports and the final save
        "baseline": local_driver.start(root, "baseline", SCRIPT, tiny_gpt_args(
            train_iters=TRAIN_ITERS, save=ckpt["baseline"], save_interval=TRAIN_ITERS)),
        "local": local_driver.start(root, "local", os.path.join(HERE, "kill_rank_at_step.py"), tiny_gpt_args(
            train_iters=TRAIN_ITERS, save=ckpt["local"], save_interval=TRAIN_ITERS),
            env={"KILL_RANK_AT_STEP": str(KILL_AT), "KILL_RANK": "1"},
            ft={"local_checkpoint_dir": local_dir, "local_checkpoint_interval": LOCAL_INTERVAL}),
    }
    out = {}
    for name, (proc, home) in launched.items():
        code = proc.wait(timeout=1200)
        driver_log = (root / f"{name}.driver.log").read_text(errors="replace")
        (log_path,) = glob.glob(str(home / "experiments" / name / "*" / name / "**" / "combined.log"), recursive=True)
        with open(log_path, errors="replace") as f:
            out[name] = {"code": code, "log": f.read(), "driver": driver_log}
    out["ckpt"], out["local_dir"] = ckpt, local_dir
    return out


def test_the_plugins_add_megatron_lms_local_checkpoint_flags_and_it_writes_there(runs):
    log = runs["local"]["log"]
    assert runs["local"]["code"] == 0, runs["local"]["driver"][-4000:]
    # Megatron-LM's own argument listing: what it parsed from the flags the plugins added
    for name, value in (("non_persistent_ckpt_type", "local"), ("non_persistent_local_ckpt_dir", runs["local_dir"]),
                        ("non_persistent_save_interval", str(LOCAL_INTERVAL))):
        assert re.search(rf" {name} \.+ {re.escape(value)}$", log, re.M), (name, log[-3000:])
    saved = sorted({int(m) for m in re.findall(r"successfully saved local checkpoint from iteration +(\d+)", log)})
    assert saved == list(range(LOCAL_INTERVAL, TRAIN_ITERS, LOCAL_INTERVAL)), saved
    written = sorted(os.path.basename(p) for p in glob.glob(os.path.join(runs["local_dir"], "**", "*_local.pt"),
                                                            recursive=True))
    assert written == [f"iter_{18:07d}_0_local.pt", f"iter_{18:07d}_1_local.pt"], written  # the newest kept


def test_no_learned_timeout_ends_the_persistent_save_and_the_group_restarts_once(runs):
    """With node-local saves the plugin drops ``--calc-ft-timeouts`` (``plugins/megatron_lm_flags.py``): without
    that, Megatron-LM learned 0.67 s for its checkpointing section from the local saves and ended the step-20
    persistent save as hung, cycle after cycle."""
    log = runs["local"]["log"]
    assert re.search(r" calc_ft_timeouts \.+ False$", log, re.M) and re.search(r" enable_ft_package \.+ True$", log,
                                                                               re.M), log[-3000:]
    assert "FT: updating timeouts" not in log and "has been open for" not in log, log[-3000:]
    # the kill at step 8, and no other: one failed rank, one restart of the worker group
    assert len(re.findall(r"failed \(exitcode: ", log)) == 1 and log.count("will restart worker group") == 1, \
        log[-3000:]


def test_a_killed_rank_resumes_from_the_local_copy_and_matches_the_uninterrupted_losses(runs):
    log, baseline = runs["local"]["log"], runs["baseline"]["log"]
    assert runs["baseline"]["code"] == 0, runs["baseline"]["driver"][-4000:]
    # the only persistent save is the last one: the restarted group resumed from the local copy of step 6
    last_local = (KILL_AT - 1) // LOCAL_INTERVAL * LOCAL_INTERVAL
    assert f"successfully loaded checkpoint from {runs['ckpt']['local']} [ t 1/1, gtp_remat 1/1, p 1/1 ] at " \
           f"iteration {last_local}" in log, log[-4000:]
    with open(os.path.join(runs["ckpt"]["local"], "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == TRAIN_ITERS
    resumed, expected = iteration_losses(log), iteration_losses(baseline)
    assert sorted(resumed) == list(range(1, TRAIN_ITERS + 1))
    second = last_local + 2  # Megatron-LM's second iteration line in a process: the mean of its first two steps
    assert {k: v for k, v in resumed.items() if k != second} == {k: v for k, v in expected.items() if k != second}
    assert abs(float(resumed[second]) - (float(expected[second - 1]) + float(expected[second])) / 2) <= 1e-6
