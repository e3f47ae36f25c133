"""The batch script's EXIT trap writes the job's whole ``ExcNodeList``: a node the scheduler drained is excluded
before the requeue, and the list is emptied (``ExcNodeList=``) when its last exclusion ends.

The rendered sbatch script runs under bash attempt after attempt, with stubs for ``srun``, ``scontrol`` and
``sinfo`` (``DRAINED`` names the nodes sinfo shows drained): see tests/sbatch_attempts.py.
"""

from __future__ import annotations

import json

from sbatch_attempts import ledger, render, run_attempts


def test_a_drained_node_is_excluded_at_the_requeue_and_the_list_is_emptied_when_it_is_usable_again(tmp_path):
    job = render(tmp_path, ft=False, policy="megatron_transient")
    first, _ = run_attempts(job, "nccl nccl finish", nodes="n1,n2", partition="n1,n2,n3", restarts=[0],
                            env_extra={"DRAINED": "n2"})
    rest, _ = run_attempts(job, "nccl nccl finish", nodes="n1,n3", partition="n1,n2,n3", restarts=[1, 2],
                           env_extra={"DRAINED": ""})
    assert [calls for _, calls in first + rest] == [
        ["requeue 42", "update JobId=42 ExcNodeList=n2"],
        ["requeue 42", "update JobId=42 ExcNodeList="],  # n2 idle again: its exclusion ends, the list is emptied
        [],
    ]
    attempts = ledger(job, "attempt")
    assert [a["decision"]["exclude_scheduler"] for a in attempts[:2]] == [{"n2": "drained"}, {}]
    assert [a["decision"]["exclude_lifted_why"] for a in attempts[:2]] == [
        {}, {"n2": "the scheduler shows it usable again"}]
    assert attempts[2]["decision"]["outcome"] == "finished"


def test_a_shared_node_history_folder_is_checked_at_submit_time_and_reaches_the_job(tmp_path):
    from megatron_resilience.config.validate import ConfigError
    from megatron_resilience.jobs.jobconfig import JobLevelConfig
    from megatron_resilience.plugins import RestartPolicyPlugin

    try:
        RestartPolicyPlugin(node_history_dir="team/nodes")
    except ConfigError as err:
        assert str(err).startswith("RestartPolicyPlugin.node_history_dir: must be None or an absolute path")
        assert "'team/nodes'" in str(err)
    else:
        raise AssertionError("a relative node_history_dir was accepted")
    folder = str(tmp_path / "team")
    settings = RestartPolicyPlugin(node_history_dir=folder).settings()
    assert settings["node_history_dir"] == folder and "node_history_dir" not in RestartPolicyPlugin().settings()
    base = {"job_name": "gpt", "job_dir": "/j", "ledger": "/r/job_ledger.jsonl", "finished_flag": "/j/f"}
    assert '"node_history_dir"' not in JobLevelConfig(**base).to_json()  # the job's JSON as without the feature
    cfg = JobLevelConfig(**base, node_history_dir=folder)
    assert JobLevelConfig.from_dict(json.loads(cfg.to_json())).node_history_dir == folder
