"""The watch room: what a job cannot see about itself, seen from the login node between and during attempts.

``python -m megatron_resilience.watch RUN_DIR`` (or ``nemo megatron_resilience watch``) follows a run's chain of
Slurm attempts: it records and decides an attempt the job could not record itself (its batch host lost, its trap
killed), resubmits when Slurm refuses a requeue, cancels a job that finished but still runs, and reconciles a
command it was killed in the middle of. The classification and the decision are the job-level room's
(:mod:`megatron_resilience.jobs`), the same the batch script's EXIT trap takes. Modules: :mod:`.watcher` the loop,
:mod:`.cli` the command line.
"""
