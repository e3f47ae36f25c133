"""Chaos: a stream of realistic failures injected into a running Slurm job from outside it (login node, no torch).

    python -m megatron_resilience.chaos RUN_DIR --mtbf 120s --mix llama3 --seed 7
    nemo megatron_resilience chaos RUN_DIR mtbf=120s mix=llama3 seed=7

:mod:`.faults` (what can be injected and how it should be classified), :mod:`.mix` (which causes, with
which weights, from which source; ``mixes/``), :mod:`.runner` (the seeded, bounded loop and its ledger),
:mod:`.inject` and :mod:`.on_node` (the actions, inside the job's allocation). The report
(``python -m megatron_resilience.report RUN_DIR``) prints injected vs classified from the chaos ledger.
"""
