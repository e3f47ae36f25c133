"""Silent data corruption on the real multi-node cluster: the run leaves the chip, and another node confirms it.

Each node of the multi-node instance is a slurmd with a host name of its own (``scripts/slurm/start.sh`` starts it
in a UTS namespace named after the node), so Megatron-Core's rerun state machine, which tells hardware apart by
host name and GPU index, sees another machine after a move, as on a real cluster. ``benchmarks/chaos.py`` runs as
a user would run it with one fault, ``nan`` (a rank's loss turns NaN while the trigger names that attempt: a chip
that corrupts its results), two ranks, ``RestartPolicyPlugin(megatron_transient)``, the watcher and the chaos
stream, and an uninterrupted reference on the default cluster.

Asserted from Megatron's and the trainer's own lines and the job's records: the first attempt re-ran the step on
its node, reproduced the NaN, saved and exited 16, and told ft_launcher not to restart in the job (the same
allocation is the same GPU); the job-level decision classified ``rerun_resume`` and excluded that node; the next
attempt ran on another node (another host name), re-ran the step from that checkpoint and found the result not
reproducible on a different GPU: Megatron's "Possible persistent error", which the trainer treats as not fatal
(``rerun.continue_after_persistent_error``, the default): the step keeps that GPU's result and the run finishes in
that attempt, every step's loss bitwise equal to the uninterrupted run's. Never how long anything took.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from slurm.chaos_benchmark import run_benchmark

HERE = os.path.dirname(os.path.abspath(__file__))
MIX = os.path.join(HERE, "chaos_sdc_mix.yaml")
MTBF, STEPS = 3, 150


@pytest.fixture(scope="module")
def sdc(multinode_cluster, slurm_cluster, slurm_tmp):
    out = os.path.join(slurm_tmp, "chaos_sdc")
    got = run_benchmark("chaos.py", multinode_cluster, out, [
        "--intervals", "young_daly", "--mix", MIX, "--seed", "1", "--mtbf", str(MTBF), "--max-count", "1",
        "--steps", str(STEPS), "--step-delay", "0.05", "--job-minutes", "15", "--ranks-per-node", "2"])
    run, chaos_log = got["run"], got["chaos_log"]
    [reference] = got["data"]["references"].values()
    attempt_logs = {}  # Slurm restart count -> that attempt's log (nemo_run's log-..._<job>_<restart>.out)
    for name in glob.glob(os.path.join(out, "**", f"*_{run['job']}_*.out"), recursive=True):
        with open(name, errors="replace") as f:
            attempt_logs[int(re.search(r"_(\d+)\.out$", name).group(1))] = f.read()
    return {"run": run, "chaos_log": chaos_log, "logs": attempt_logs, "cluster": multinode_cluster,
            "stdout": got["stdout"], "reference_dir": reference["run_dir"]}


def test_the_nan_is_classified_and_its_node_excluded(sdc):
    run = sdc["run"]
    [row] = run["report"]["injected"]["injections"]
    assert (row["fault"], row["classified"]) == ("nan", "rerun_resume"), (row, sdc["chaos_log"])
    assert row["exclusion_requested"] == [row["node"]] and row["node"] in run["report"]["injected"]["excluded_nodes"]
    assert row["kind"] == "job" and row["attempt"] == 0  # ended the first attempt: no in-job restart before it


def test_megatron_moved_the_step_to_another_host_and_found_it_not_reproducible(sdc):
    first, second = sdc["logs"][0], sdc["logs"][1]
    node = sdc["run"]["report"]["injected"]["injections"][0]["node"]
    # attempt 0, on the node chaos poisoned: the NaN reproduced on the same GPU, the step's checkpoint, exit 16
    assert re.search(rf"Rank \d, node {node}, device 0, iteration #\d+: First rerun: unexpected result is "
                     r"reproducible within the tolerance", first), first[-4000:]
    assert re.search(r"checkpoint: saved step \d+ \(rerun state machine, exit code 16\)", first), first[-4000:]
    assert "rerun:16: asked ft_launcher not to restart the workers" in first
    assert first.count("FT: connected to the rank monitor") == 1  # no in-job restart: the same allocation, same GPU
    # attempt 1, on another host: the step re-run from that checkpoint gives another result: the chip was bad
    assert "Getting RerunStateMachine state from checkpoint. Will rerun step." in second, second[-4000:]
    assert "Got rescheduled on the same GPU" not in second
    assert "Second rerun: unexpected result is not reproducible on a different GPU" in second, second[-4000:]
    other = re.search(r"Rank \d, node (\S+), device 0, iteration #\d+: Possible persistent error", second)
    assert other and other.group(1) != node, (node, second[-4000:])
    assert "Continuing normal execution because failed validation was not fatal" in second
    assert re.search(rf"rerun state machine: step \d+: the NaN/Inf of node {node}, device 0 is not reproduced here "
                     rf"\(node {other.group(1)}\): a persistent error on that GPU", second), second[-4000:]


def test_the_run_trains_on_after_the_diagnosis_and_finishes_exact(sdc):
    run = sdc["run"]
    assert run["final"] == "training finished after 2 attempt(s)", sdc["chaos_log"] + sdc["stdout"][-4000:]
    assert "rerun state machine: exiting with code 17" not in sdc["logs"][1]
    mine, ref = _losses(run["run_dir"]), _losses(sdc["reference_dir"])
    assert mine and max(mine) == STEPS and mine == ref, (mine, ref)  # the re-run step too


def _losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "train"}
