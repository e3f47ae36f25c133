"""RestartPolicyPlugin: decide per attempt whether a Slurm job continues, from why it ended — and keep a ledger.

    RestartPolicyPlugin(policy="megatron_transient")                      # a preset
    RestartPolicyPlugin(policy="/home/me/policy.yaml", monitors=["megatron_basic", "/home/me/extra.yaml"])

Without this plugin the batch script follows nemo_run's requeue rule (``executor.retries``), with
preemptions never counted as failures, ft_launcher's "do not restart" exit code and a person's
``scancel`` honoured, and the ledger written all the same. With it, the policy decides: which error
types are restarted, how often per mode (crash / stall / timeout) over the whole chain of attempts,
when a restart loop without progress stops, which nodes are excluded. ``executor.retries`` (and
``FaultTolerancePlugin.num_job_retries_on_failure``) no longer decide the requeue then; a log line
says so. In-job restarts by ft_launcher (``num_in_job_restarts``) are unchanged.

Policy and monitor files are loaded and checked here, before anything is submitted (unknown keys,
regexes that do not compile, unknown error types, negative retries: the error names the file and
the key), and rendered into the job's sbatch script. On a ``LocalExecutor`` there is no batch
script: the files are checked and a log line says that nothing decides between attempts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_resilience.config._validate import check_int, check_positive, fail
from megatron_resilience.jobs.jobconfig import resolve
from megatron_resilience.plugins import batch_decision
from megatron_resilience.plugins._executor import claim
from megatron_resilience.plugins._task import our_trainer_editor
from megatron_resilience.plugins.executors import executor_profile
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()
log = logging.getLogger("megatron_resilience.plugins")

NAME = "RestartPolicyPlugin"


@dataclass(kw_only=True)
class RestartPolicyPlugin(run.Plugin):
    """Selective job-level restarts. ``policy``/``monitors``: preset names or YAML file paths.

    ``monitors`` None: the policy file's own ``monitors``. ``finished_grace_seconds`` and
    ``inactivity_threshold`` are for the watcher (``nemo megatron_resilience watch``): cancel a job
    whose trainer finished but which still runs after the grace period; treat a job without log or
    metrics progress for that many seconds as stalled (None: off; use it when FT is off).
    """

    policy: str = "megatron_transient"
    monitors: Any = None  # str | list[str] | None
    finished_grace_seconds: float = 300.0
    inactivity_threshold: float | None = None
    max_log_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or not self.policy:
            fail(f"{NAME}.policy", "must be a policy preset name or a YAML file path", self.policy)
        monitors = self.monitors
        if monitors is not None and not isinstance(monitors, str) and not (
                isinstance(monitors, (list, tuple)) and monitors and all(isinstance(m, str) for m in monitors)):
            fail(f"{NAME}.monitors", "must be None, a monitor preset name / YAML file path, or a list of them",
                 monitors)
        check_positive(f"{NAME}.finished_grace_seconds", self.finished_grace_seconds)
        check_positive(f"{NAME}.inactivity_threshold", self.inactivity_threshold, allow_none=True)
        check_int(f"{NAME}.max_log_bytes", self.max_log_bytes, minimum=4096)
        self.settings()  # every policy / monitor file is checked now, before submission

    def settings(self) -> dict[str, Any]:
        """The resolved policy and monitors (and the watcher's settings) as rendered into the job."""
        monitors = list(self.monitors) if isinstance(self.monitors, (list, tuple)) else self.monitors
        policy, monitor_specs = resolve(self.policy, monitors)
        return {"policy": policy, "monitors": monitor_specs,
                "finished_grace_seconds": float(self.finished_grace_seconds),
                "inactivity_threshold": self.inactivity_threshold, "max_log_bytes": self.max_log_bytes}

    def setup(self, task: Any, executor: Any) -> None:
        profile = executor_profile(executor, NAME)
        claim(executor, NAME)
        settings = self.settings()
        policy = settings["policy"]
        budgets = ", ".join(f"{m} {n}" for m, n in policy["max_restarts"].items())
        if not profile.is_slurm:
            log.info("%s: policy %s checked; %s has no batch script, so nothing decides between attempts "
                     "(ft_launcher's in-job restarts still apply)", NAME, policy["name"], profile.name)
            return
        batch_decision.remember_policy(executor, settings)
        batch_decision.install(executor, our_trainer_editor(task, NAME))
        log.info("%s: job-level restarts decided by policy %s (restarts per mode: %s; never restarted: %s); "
                 "executor.retries=%r (TORCHX_MAX_RETRIES) no longer decides the requeue", NAME, policy["name"],
                 budgets, ", ".join(policy["exclude_error_types"]) or "-", executor.retries)
