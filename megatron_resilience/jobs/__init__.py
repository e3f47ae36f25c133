"""The job-level room: why each Slurm attempt ended, whether the run continues, and a ledger of every attempt.

Runs on the login node (plugins at submit time, the watcher, the report) and inside the batch
script (its EXIT trap); never imports torch or megatron. Modules, one idea each:

- :mod:`.monitors`   regex monitors over logs (YAML presets in ``presets/monitors/``) -> signals;
- :mod:`.policies`   restart policies (YAML presets in ``presets/policies/``);
- :mod:`.foreign_monitors`, :mod:`.foreign_policy` that tool's files (SlurmLogMonitor, per-mode policies),
  translated once at load; :mod:`.policy_checks` rules that can never fire, requeues without a budget;
- :mod:`.classifier` one classification per attempt from stop reason, NVRx, Slurm and log signals;
- :mod:`.root_cause` the first rank to fail decides, its peers' communication errors are consequences;
- :mod:`.attribution` which node failed: every host the evidence names, its role, the one(s) blamed;
- :mod:`.decision`   the policy's decision (or nemo_run's rule) with budgets, progress and node exclusion;
- :mod:`.evidence`   reading an attempt's logs, metrics, cycle-info files;
- :mod:`.attempt_end` classify + decide + the ledger record of one ended attempt;
- :mod:`.jobconfig`  the job-level config the plugins render into the sbatch script;
- :mod:`.batch_exit` the batch script's EXIT trap (the watcher, :mod:`megatron_resilience.watch`, takes the same
  decision from outside the job);
- :mod:`.node_exclusion` which nodes a requeue avoids; :mod:`.requeue_size` how many nodes a requeue of a job
  with a node range asks for; :mod:`.shared_node_history` attributions shared by runs.

The error types themselves (their facts, Xid codes, the foreign tool's names) are
:mod:`megatron_resilience.failures`'. What a run cost is :mod:`megatron_resilience.goodput`'s; what happened,
as a report, :mod:`megatron_resilience.report`'s.
"""
