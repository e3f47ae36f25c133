"""What a NeMo-Run task runs, and its settings read and changed where that trainer keeps them: the login node's view
of the task, shared by the plugins (which change it) and the recipes' CLI (which reads it).

- :mod:`.our_trainer`: this package's trainer as a ``run.Partial`` of ``entry.pretrain`` or a ``run.Script`` of
  ``python -m megatron_resilience``: its config sections read and set, every change logged;
- :mod:`.trainer_detect`: which trainer a ``run.Script`` runs (Megatron-LM, Megatron-Bridge, ours), from what its
  arguments say;
- :mod:`.partial_trainers`: Megatron-Bridge's and NeMo 2.0's ``run.Partial`` tasks, their settings changed where
  those projects keep them.

Changes are logged on ``megatron_resilience.plugins``: the plugins make them, through these modules.

No torch, no megatron; nemo_run only through ``upstream.import_nemo_run()``.
"""
