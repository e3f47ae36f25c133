"""Checkpoints on the compute node: what goes into one, when to save, where it goes and what a resume reads.

- ``manager``: the persistent tier (dist_checkpointing on the shared filesystem): atomic saves, keep-last-N,
  keep-best, async saves, the resume's choice of the newest complete checkpoint;
- ``state_dict``: the trainer's state <-> Megatron's sharded state dict (exact resume);
- ``reshard``: which saved layouts a resume may read at another data-parallel size;
- ``tiers``: the node-local and in-memory tiers beside the persistent one, and the choice between them;
- ``interval``: the save interval the trainer chooses from the run's own costs (Daly's optimum).

The folder's layout on disk (``iter_N``, the tracker, completeness) belongs to ``records.checkpoint_layout``,
which every room reads; this room writes it.
"""
