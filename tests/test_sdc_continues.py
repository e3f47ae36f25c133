"""Silent data corruption diagnosed and left behind: the run trains on (``rerun.continue_after_persistent_error``).

The real trainer (2 CPU ranks, gloo) under the real ft_launcher, Megatron-Core's real rerun state machine, and the
chaos tool's NaN trigger (``rerun.accept_chaos_nan``): while ``chaos_nan.json`` names the attempt
(``SLURM_RESTART_COUNT``) and rank 1, rank 1's loss is NaN, as on a chip that corrupts its results.

1. attempt 0, on this machine: the NaN, re-run in place, NaN again: saved, exit 16 (resume on other hardware);
2. attempt 1 under another host name (a UTS namespace named ``localhost``, a name gloo can resolve: what a requeue
   without the node gives; the same host would only say "rescheduled on the same GPU"), from copies of the run
   folder after attempt 0:
   - the default: the step re-run from the checkpoint is not NaN here, Megatron's "Possible persistent error" is
     not fatal, the step keeps this GPU's result and the run finishes; every step's loss bitwise equal to an
     uninterrupted run's;
   - ``rerun.continue_after_persistent_error=false``: Megatron-LM's behaviour, exit 17 for a person;
   - the NaN again on the other host (the trigger names attempt 1 too: the data or the code, not the chip): exit
     17 whatever the setting, so a result that is really wrong never trains on.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from resilience_support.launch import launch, run_to_end, wait_for

pytestmark = pytest.mark.slow

WAIT = 900
HOST = socket.gethostname()
OTHER = "localhost"  # resolvable everywhere (an unresolvable name hangs gloo's setup)
STEPS = 10
BASE = [f"train.max_steps={STEPS}", "checkpoint.save_interval=2", "checkpoint.async_save=false",
        "rerun.rerun_mode=validate_results", "rerun.accept_chaos_nan=true",
        # steps slow enough to write the trigger mid-run (rank 0's extra compute; the losses are unchanged)
        "straggler.simulated_straggler_rank=0", "straggler.simulated_straggler_delay=0.3"]


def _trigger(run_dir, restart: int) -> None:
    (run_dir / "chaos_nan.json").write_text(json.dumps({"slurm_restart": str(restart), "in_job_restart": "0",
                                                        "rank": "1"}))


def _attempt(run_dir, overrides, restart: int, host: str | None):
    return launch(run_dir, BASE + overrides, max_restarts=0, host=host, env={"SLURM_RESTART_COUNT": str(restart)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdc")
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(run_to_end, root / "reference", BASE, max_restarts=0, timeout=WAIT)
        assert HOST != OTHER, f"this test needs a machine whose host name is not {OTHER!r}"
        first = _attempt(root / "first", [], 0, None)
        wait_for(lambda: any(r["kind"] == "train" and r["step"] >= 3 for r in _records(root / "first")),
                 timeout=WAIT, what="attempt 0 to train 3 steps")
        _trigger(root / "first", 0)
        first.wait(WAIT)
        second = {}
        for name, extra in (("continued", []), ("stopped", ["rerun.continue_after_persistent_error=false"]),
                            ("reproduced", [])):
            shutil.copytree(root / "first", root / name)
            if name == "reproduced":
                _trigger(root / name, 1)
            second[name] = _attempt(root / name, extra, 1, OTHER)
        for run in second.values():
            run.wait(WAIT)
        return {"reference": reference.result(), "first": first, **second}


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _second_part(run) -> str:
    """The launcher log of attempt 1 (the copies carry attempt 0's log before it)."""
    log = run.log()
    return log[log.rindex("rerun state machine: exiting with code 16") + 1:]


def test_attempt_0_reproduced_the_nan_on_its_gpu_and_exited_16(runs):
    first = runs["first"]
    log = first.log()
    assert first.returncode != 0 and first.stop_reason()["exit_code"] == 16, log[-3000:]
    assert re.search(rf"Rank 1, node {HOST}, device 0, iteration #\d+: First rerun: unexpected result is "
                     r"reproducible within the tolerance", log), log[-3000:]
    assert re.search(r"checkpoint: saved step \d+ \(rerun state machine, exit code 16\)", log)


def test_on_another_host_the_persistent_error_is_left_behind_and_the_run_finishes_exact(runs):
    run, ref = runs["continued"], runs["reference"]
    log = _second_part(run)
    assert run.returncode == 0, log[-4000:]
    assert "Getting RerunStateMachine state from checkpoint. Will rerun step." in log
    assert "Got rescheduled on the same GPU" not in log
    assert "Second rerun: unexpected result is not reproducible on a different GPU" in log, log[-4000:]
    assert re.search(rf"Rank 1, node {OTHER}, device 0, iteration #\d+: Possible persistent error", log)
    assert "Continuing normal execution because failed validation was not fatal" in log
    step = int(re.search(r"checkpoint: saved step (\d+) \(rerun state machine, exit code 16\)", run.log()).group(1))
    assert (f"rerun state machine: step {step + 1}: the NaN/Inf of node {HOST}, device 0 is not reproduced here "
            f"(node {OTHER}): a persistent error on that GPU, which this job has left; this GPU's result is kept and "
            "training continues (rerun.continue_after_persistent_error=true)") in log, log[-4000:]
    stop = run.stop_reason()
    assert (stop["reason"], stop["exit_code"], stop["step"]) == ("finished", 0, STEPS) and run.flag.exists()
    losses = run.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses == ref.losses()  # bitwise, the re-run step too


def test_without_the_setting_megatron_stops_for_a_person_with_17(runs):
    run = runs["stopped"]
    log = _second_part(run)
    assert "Possible persistent error" in log, log[-4000:]
    assert "Continuing normal execution" not in log
    stop = run.stop_reason()
    assert (stop["reason"], stop["exit_code"]) == ("rerun:17", 17) and run.returncode != 0


def test_a_nan_reproduced_on_the_other_host_still_stops_with_17(runs):
    run = runs["reproduced"]
    log = _second_part(run)
    assert "Second rerun: unexpected result is reproducible on a different GPU" in log, log[-4000:]
    assert "Continuing normal execution" not in log and "not reproduced here" not in log
    stop = run.stop_reason()
    assert (stop["reason"], stop["exit_code"]) == ("rerun:17", 17) and run.returncode != 0
