"""Every rank and trainer fault kind of chaos, injected for real into the real trainer and then classified.

The Slurm short form (``tests/slurm/test_chaos_on_slurm.py``) covers ``gpu_xid``, ``preempt`` and ``node_down``;
here the other kinds go end to end without Slurm: the real trainer (2 CPU ranks) under the real ft_launcher, a
job id in its environment as Slurm would set, and chaos's own code for the injection — the part that runs on the
node (``chaos/on_node.inject``: the kind's lines into the rank's stderr, then its signal) for ``gpu_xid``,
``gpu_ecc``, ``python_bug`` and ``rank_hang``, and ``chaos/inject.inject`` for ``nan`` (the trigger file the trainer
honours with ``rerun.accept_chaos_nan``). Only the ``srun --overlap`` wrapper that carries the injection onto a
Slurm node is left out (it needs Slurm; the short form runs it). The fault ends a cycle, ft_launcher restarts the
workers, the run finishes (``nan``: exit 16, which asks for other hardware, so no in-job restart: the fault ends
the attempt); then the attempt's log and records go through the batch trap's code (``attempts.end_attempt``) and
the fault's cycle's ending must be the kind's expected error type.
"""

from __future__ import annotations

import shutil

import pytest
from resilience_support.launch import launch, wait_for
from test_joblevel_corpus import case, lay_out

from megatron_resilience.chaos import on_node
from megatron_resilience.chaos.faults import FAULTS
from megatron_resilience.chaos.inject import inject
from megatron_resilience.jobs.attempt_end import end_attempt
from megatron_resilience.jobs.decision import Cluster

pytestmark = pytest.mark.slow

KINDS = ("gpu_xid", "gpu_ecc", "python_bug", "rank_hang", "nan")
WAIT = 900
BASE = ["train.max_steps=40", "checkpoint.save_interval=10", "rerun.rerun_mode=validate_results",
        "rerun.accept_chaos_nan=true"]
STEP_TIMEOUT = 20.0  # rank_hang: ft_launcher's step section ends the stopped rank (far above a healthy step here)


def _run(root, kind: str, job: str):
    run = launch(root / kind, BASE + ["train.log_interval=1", "straggler.simulated_straggler_rank=0",
                                      "straggler.simulated_straggler_delay=0.1"], max_restarts=1,
                 timeouts={"step": STEP_TIMEOUT} if kind == "rank_hang" else None,
                 env={"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": "0", "LOGLEVEL": "INFO"})  # as nemo_run renders
    wait_for(lambda: run.proc.poll() is not None or "megatron_resilience.metrics: step 5/" in run.log(),
             timeout=WAIT, interval=0.2, what=f"{kind}: step 5")
    spec = FAULTS[kind]
    if spec.where == "rank":
        result = on_node.inject(job, kind, node=None, seed=1)
    else:
        result = inject(spec, job=job, restart=0, nodes=["localhost"], node="localhost", seed=1,
                        run_dir=str(run.run_dir))
    run.wait(WAIT)
    return run, result


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("chaos_kinds")
    with ThreadPoolExecutor(max_workers=len(KINDS)) as pool:
        futures = {kind: pool.submit(_run, root, kind, str(9100 + i)) for i, kind in enumerate(KINDS)}
        return {kind: f.result() for kind, f in futures.items()}, root


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_injected_is_classified_as_expected(injected, kind):
    runs, root = injected
    run, result = runs[kind]
    log = run.log()
    assert result["ok"], result
    if kind == "nan":  # exit 16 asks for other hardware: no in-job restart (the same allocation is the same GPU)
        assert run.returncode != 0 and log.count("exiting with code 16") == 1, log[-4000:]
        assert "rerun:16: asked ft_launcher not to restart the workers" in log
    else:  # the fault cost one in-job restart; the run finished
        assert run.returncode == 0 and run.stop_reason()["reason"] == "finished", log[-4000:]
    c = case(None, exit_code=0, expect={}, decisions=())
    cfg, ledger = lay_out(root / f"{kind}_job", c, "megatron_transient")
    job = str(9100 + KINDS.index(kind))
    ledger.append({"kind": "attempt_start", "job_id": job, "slurm_restart": 0, "resubmission": 0,
                   "nodes": "node-01", "time": 0.0, "batch_log_offset": 0})
    shutil.copy(run.log_path, f"{cfg.job_dir}/log-acct.gpt_{job}_0.out")
    shutil.copy(run.run_dir / "metrics.jsonl", cfg.metrics)
    shutil.copy(run.run_dir / "stop_reason.json", cfg.stop_reason)
    ending = end_attempt(cfg, ledger, job_id=job, restart=0, exit_code=run.returncode,
                         slurm_state="COMPLETED" if run.returncode == 0 else "FAILED", by="batch", retries=3,
                         cluster_info=Cluster(nodes=["node-01", "spare-1"], partition="batch"), node_info={})
    cycles = ending.record["cycles"]
    if kind == "nan":  # one cycle, ended by the fault: the attempt's ending (the job-level decision moves it elsewhere)
        assert len(cycles) == 1, cycles
        assert ending.classification.error_type in FAULTS[kind].expected, ending.classification
        return
    assert len(cycles) == 2, cycles
    assert cycles[0]["ended"]["error_type"] in FAULTS[kind].expected, (cycles[0], log[-3000:])  # the fault's cycle
