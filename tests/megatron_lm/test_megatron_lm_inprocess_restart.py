"""Megatron-LM's ``--inprocess-restart`` on megatron-core 0.19.2: why the plugins refuse it (issue 32).

Runs one after the other, each a ``run.run`` of ``local_driver.py`` (the LocalExecutor under ft_launcher 0.7.0,
FaultTolerancePlugin + PreemptionPlugin + RestartPolicyPlugin, 2 ranks, gloo), where 0.19.2 is the megatron-core
installed:

* ``FaultTolerancePlugin(inprocess_restart=True)`` on ``pretrain_gpt.py``: refused before anything starts, naming
  the field, the release, the upstream causes and what to use instead (``plugins/megatron_lm_flags.py``);
* the same trainer given ``--inprocess-restart`` in its own arguments (refused too: the plugins' refusal is switched
  off in this test's driver, to show what it protects from), through ``raise_in_process.py``: rank 1 raises inside
  step 8, after the checkpoint of step 5. The in-process wrapper catches it and restarts ``pretrain`` on both
  ranks, and every restart iteration fails at once:
  with the FT package the plugin switches on (``--enable-ft-package``), with ``AssertionError('rank monitor client
  is already initialized.')`` (Megatron-LM shuts its FT client down only when ``pretrain`` returns); with
  ``enable_ft_package=False``, with ``AssertionError('args is not initialized.')`` (the finalize destroyed the
  arguments that its ``pretrain_gpt.py`` shape parses once, before the wrapper: Megatron-LM PR #4225, 0.18.0 on).
  Neither resumes, and the wrapper would restart forever (no release passes ``--inprocess-max-iterations`` on): the
  test ends the run after two restart iterations.

``raise_in_process.py`` says what stands in for the GPU (the wrapper's CUDA-only finalize thread, its NVML health
checks, NCCL's abort of a collective in flight: a 10 s gloo timeout); nothing of Megatron-LM's is changed. Run with
``make test-megatron-lm`` (needs ``.venv-newest``).
"""

from __future__ import annotations

import glob
import os
import re
import signal
import time

import local_driver
import psutil
import pytest
from megatron_lm_run import HERE, NEWEST, SCRIPT, iteration_losses, tiny_gpt_args

pytestmark = pytest.mark.slow

TRAIN_ITERS, SAVE_INTERVAL, RAISE_AT = 12, 5, 8
FAILS_WITH = {True: "AssertionError('rank monitor client is already initialized.')",  # enable_ft_package
              False: "AssertionError('args is not initialized.')"}
FN_EX = re.compile(r"rank=(\d) fn_ex: (.*)$", re.M)
REFUSAL = (
    "FaultTolerancePlugin.inprocess_restart: no in-process restart iteration of Megatron-LM can run here: with "
    "--enable-ft-package (enable_ft_package=True) each one fails in Megatron-LM's ft_integration.setup with "
    "'AssertionError: rank monitor client is already initialized.'")
ARGS_REASON = ("with megatron-core 0.19.2 (installed where the job is submitted) each one fails with "
               "'AssertionError: args is not initialized.'")


def _newest_or_fail() -> None:
    if not os.path.isdir(os.path.join(NEWEST, "megatron", "training")):
        pytest.fail(f"{NEWEST} has no megatron.training: run scripts/newest/install.sh .venv-newest (make does)")


def _combined_log(home, name: str) -> str:
    paths = glob.glob(str(home / "experiments" / name / "*" / name / "**" / "combined.log"), recursive=True)
    if not paths:
        return ""
    with open(paths[0], errors="replace") as f:
        return f.read()


def test_the_plugins_refuse_inprocess_restart_before_anything_starts(tmp_path):
    _newest_or_fail()
    proc, home = local_driver.start(tmp_path, "refused", SCRIPT, tiny_gpt_args(
        train_iters=TRAIN_ITERS, save=str(tmp_path / "ckpt"), save_interval=SAVE_INTERVAL),
        ft={"inprocess_restart": True})
    code = proc.wait(timeout=300)
    driver = (tmp_path / "refused.driver.log").read_text(errors="replace")
    assert code == 1, driver[-3000:]
    assert f"ConfigError: {REFUSAL}" in driver and ARGS_REASON in driver, driver[-3000:]
    assert "name it: FaultTolerancePlugin(megatron_core_version='0.17.0')" in driver
    assert _combined_log(home, "refused") == "" and not os.path.exists(tmp_path / "ckpt")  # no rank ever ran


def _end(proc) -> None:
    """The driver and everything it started (the local scheduler starts ft_launcher in a session of its own)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.mark.parametrize("ft", [True, False], ids=["enable_ft_package", "no_ft_package"])
def test_no_restart_iteration_of_megatron_lm_0_19_resumes(tmp_path, ft):
    _newest_or_fail()
    ckpt = str(tmp_path / "ckpt")
    args = tiny_gpt_args(train_iters=TRAIN_ITERS, save=ckpt, save_interval=SAVE_INTERVAL, extra=(
        "--ckpt-format", "torch", "--inprocess-restart", "--inprocess-granularity", "rank"))
    proc, home = local_driver.start(tmp_path, "inprocess", os.path.join(HERE, "raise_in_process.py"), args,
                                    env={"RAISE_AT_STEP": str(RAISE_AT), "RAISE_RANK": "1", "GLOO_TIMEOUT_S": "10",
                                         "TORCH_CPP_LOG_LEVEL": "error"},
                                    ft={"num_in_job_restarts": 0, "enable_ft_package": ft}, new_session=True,
                                    without_inprocess_refusal=True)
    fails_with = FAILS_WITH[ft]
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if _combined_log(home, "inprocess").count(f"fn_ex: {fails_with}") >= 4:  # two restart iterations
                break
            time.sleep(1)
    finally:
        _end(proc)
    log = _combined_log(home, "inprocess")
    assert log.count(f"fn_ex: {fails_with}") >= 4, log[-5000:]
    listed = re.search(r" enable_ft_package \.+ (True|False)$", log, re.M)  # Megatron-LM's own argument listing
    assert listed is not None and listed.group(1) == str(ft), log[-3000:]
    failures = FN_EX.findall(log)
    # the fault, once, in rank 1 inside step 8; rank 0 was in a collective with it, freed by the gloo timeout (NCCL's
    # abort on a GPU); after that only the one error, on both ranks, in every restart iteration
    assert failures[0] == ("1", "RuntimeError('injected at step 8')"), failures[:4]
    assert failures[1][0] == "0" and "Timed out waiting 10000ms" in failures[1][1], failures[:4]
    assert {rank for rank, _ in failures[2:]} == {"0", "1"}
    assert all(error == fails_with for _, error in failures[2:]), failures
    # a checkpoint to resume from existed, and no restart iteration got that far
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(SAVE_INTERVAL)
    assert sorted(iteration_losses(log)) == list(range(1, RAISE_AT)), sorted(iteration_losses(log))
    assert "successfully loaded checkpoint" not in log
