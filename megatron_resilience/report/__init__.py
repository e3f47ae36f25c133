"""The report room: what happened to a run, read from the files it left (login node, after or during the run).

``python -m megatron_resilience.report RUN_DIR`` (or ``nemo megatron_resilience report``) prints the chain of
attempts, each attempt's and in-job cycle's ending, goodput and every badput cause, the optimum checkpoint
interval against the run's own costs, faults a chaos stream injected against what they were classified as, and a
PNG timeline. Modules:

- :mod:`.run_report` the report itself (``build``, ``format_report``); :mod:`.inputs` what it reads from the ledger,
  the logs and Slurm; :mod:`.injected` injected vs classified faults; :mod:`.node_history` the per-node table;
  :mod:`.throughput` each trainer start's throughput; :mod:`.timeline` the PNG; :mod:`.scalars` TensorBoard/W&B
  scalars of the report; :mod:`.cli` the command line.

The arithmetic (buckets, spans, Daly's optimum) is :mod:`megatron_resilience.goodput`'s; why an attempt ended
and what was decided is :mod:`megatron_resilience.jobs`'.
"""
