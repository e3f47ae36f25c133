"""RestartPolicyPlugin: decide per attempt whether a Slurm job continues, from why it ended — and keep a ledger.

    RestartPolicyPlugin(policy="megatron_transient")                      # a preset
    RestartPolicyPlugin(policy="/home/me/policy.yaml", monitors=["megatron_basic", "/home/me/extra.yaml"])
    RestartPolicyPlugin(policy=None, monitors="/home/me/monitoring.yaml") # monitor-only: record, never requeue

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

Files of the log-monitoring tool this room was modelled on (per-mode ``policies`` with
``SelectiveRestartPolicy``; ``class_name: SlurmLogMonitor`` with ``log_signals``) are accepted as they
are and translated once, at load; the log says what each of their keys became. ``policy=None`` is
monitor-only, that tool's default without a restart file: every attempt is classified and recorded
in the ledger, and nothing requeues the job (neither a policy nor nemo_run's ``executor.retries``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_resilience.config.validate import check_int, check_positive, fail
from megatron_resilience.jobs.jobconfig import resolve, watcher_settings
from megatron_resilience.plugins import batch_decision
from megatron_resilience.plugins._executor import claim
from megatron_resilience.plugins.executors import executor_profile
from megatron_resilience.tasks.our_trainer import our_trainer_editor
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()
log = logging.getLogger("megatron_resilience.plugins")

NAME = "RestartPolicyPlugin"


@dataclass(kw_only=True)
class RestartPolicyPlugin(run.Plugin):
    """Selective job-level restarts. ``policy``/``monitors``: preset names or YAML file paths.

    ``node_history_dir``: an absolute folder on the cluster's shared filesystem that several runs name: a node's
    hardware failures in any of them count towards its exclusion (the policy's ``exclude_nodes_after``), so a lemon
    found by one run is avoided by the next. None: each run counts its own.

    ``monitors`` None: the policy file's own ``monitors``. ``finished_grace_seconds`` and
    ``inactivity_threshold`` are for the watcher (``nemo megatron_resilience watch``): cancel a job
    whose trainer finished but which still runs after the grace period; treat a job without log or
    metrics progress for that many seconds as stalled (None: off; use it when FT is off).
    """

    policy: str | None = "megatron_transient"  # None: monitor-only
    monitors: Any = None  # str | list[str] | None
    finished_grace_seconds: float = 300.0
    inactivity_threshold: float | None = None
    max_log_bytes: int = 8 << 20
    node_history_dir: str | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and (not isinstance(self.policy, str) or not self.policy):
            fail(f"{NAME}.policy", "must be a policy preset name or a YAML file path (or None: monitor-only)",
                 self.policy)
        monitors = self.monitors
        if monitors is not None and not isinstance(monitors, str) and not (
                isinstance(monitors, (list, tuple)) and monitors and all(isinstance(m, str) for m in monitors)):
            fail(f"{NAME}.monitors", "must be None, a monitor preset name / YAML file path, or a list of them",
                 monitors)
        check_positive(f"{NAME}.finished_grace_seconds", self.finished_grace_seconds)
        check_positive(f"{NAME}.inactivity_threshold", self.inactivity_threshold, allow_none=True)
        check_int(f"{NAME}.max_log_bytes", self.max_log_bytes, minimum=4096)
        if self.node_history_dir is not None and (not isinstance(self.node_history_dir, str)
                                                  or not self.node_history_dir.startswith("/")):
            fail(f"{NAME}.node_history_dir", "must be None or an absolute path on the cluster's shared filesystem "
                 "(the same folder for every run that shares what it learns about nodes)", self.node_history_dir)
        self.settings()  # every policy / monitor file is checked now, before submission

    def settings(self) -> dict[str, Any]:
        """The resolved policy and monitors (and the watcher's settings) as rendered into the job."""
        monitors = list(self.monitors) if isinstance(self.monitors, (list, tuple)) else self.monitors
        policy, monitor_specs = resolve(self.policy, monitors)
        inactivity = self.inactivity_threshold
        if inactivity is None:  # a foreign monitoring file's inactivity_threshold_seconds
            inactivity = watcher_settings(self.policy, monitors).get("inactivity_threshold")
        return {"policy": policy, "monitors": monitor_specs, "monitor_only": self.policy is None,
                "finished_grace_seconds": float(self.finished_grace_seconds),
                "inactivity_threshold": inactivity, "max_log_bytes": self.max_log_bytes,
                **({"node_history_dir": self.node_history_dir} if self.node_history_dir else {})}

    def setup(self, task: Any, executor: Any) -> None:
        profile = executor_profile(executor, NAME)
        claim(executor, NAME)
        settings = self.settings()
        policy = settings["policy"]
        if policy is None:
            if profile.batch_script:
                batch_decision.remember_policy(executor, settings)
                batch_decision.install(executor, our_trainer_editor(task, NAME))
            log.info("%s: monitor-only (policy=None): every attempt is classified and recorded in the ledger; "
                     "nothing requeues the job (executor.retries=%r no longer does either)%s", NAME,
                     executor.retries, "" if profile.batch_script else f"; {profile.name} has no batch script")
            return
        budgets = ", ".join(f"{m} {n}" for m, n in policy["max_restarts"].items())
        if not profile.batch_script:
            log.info("%s: policy %s checked; %s has no batch script, so nothing decides between attempts "
                     "(ft_launcher's in-job restarts still apply)", NAME, policy["name"], profile.name)
            return
        batch_decision.remember_policy(executor, settings)
        batch_decision.install(executor, our_trainer_editor(task, NAME))
        log.info("%s: job-level restarts decided by policy %s (restarts per mode: %s; never restarted: %s); "
                 "executor.retries=%r (TORCHX_MAX_RETRIES) no longer decides the requeue", NAME, policy["name"],
                 budgets, ", ".join(policy["exclude_error_types"]) or "-", executor.retries)
