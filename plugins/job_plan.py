"""What the plugins of one job decided at submit time, in one typed record on the job's executor.

Plugins run one after another on the job's (cloned) executor, in the user's order, and a later plugin renders
what an earlier one decided (the job-level decision block needs the policy, ft_launcher's "do not restart" exit
code, the node range, ...). They share it through this one record instead of loose attributes: its fields are
the whole contract between plugins, written once. It is a plain attribute of the executor object, not a
dataclass field of nemo_run's, so it never reaches the serialized executor or the sbatch script.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_KEY = "_megatron_resilience_plan"


@dataclass
class JobPlan:
    # plugins that set this job up (a second plugin of the same kind is refused: _executor.claim)
    claims: list[str] = field(default_factory=list)
    # PreemptionPlugin.signal, checked against the launcher by whichever plugin runs last
    preemption_signal: str | None = None
    # RestartPolicyPlugin: the resolved policy, monitors and watcher settings (None: no such plugin)
    policy_settings: dict[str, Any] | None = None
    # FaultTolerancePlugin: ft_launcher's "do not restart" exit code when the user changed it (None: its default)
    no_restart_exit_code: int | None = None
    # FaultTolerancePlugin(min_nodes=...): min_nodes, nodes, ntasks_per_node for the job-level config (None: no range)
    node_range: dict[str, int] | None = None
    # a trainer other than ours: where the job-level decision finds whether it finished (jobs/finished.py)
    finished_evidence: dict[str, Any] = field(default_factory=dict)
    # the wall-time note was logged (once per job, however many plugins check the time)
    time_noted: bool = False


def plan_of(executor: Any) -> JobPlan:
    """This job's plan (created empty by the first plugin that asks)."""
    plan = executor.__dict__.get(_KEY)
    if plan is None:
        plan = executor.__dict__[_KEY] = JobPlan()
    return plan
