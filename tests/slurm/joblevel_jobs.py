"""The job-level Slurm tests' jobs: ``gpt_tiny`` on one CPU rank per node, one LR schedule for every length (losses
compare across ``max_steps``), and what they read back (ledger records, Slurm's attempt states)."""

from __future__ import annotations

import os

from megatron_resilience.recipes import RECIPES
from megatron_resilience.records.ledger import Ledger
from slurm.jobs import Job

STEPS = 60
WATCHED_STEPS = 400
SAVE = 10


def tiny(root: str, name: str, *, max_steps: int = STEPS, save_interval: int = SAVE, num_nodes: int = 1, **edits):
    task = RECIPES["gpt_tiny"](dir=root, name=name, num_nodes=num_nodes, num_gpus_per_node=1)
    task.train.max_steps = max_steps
    task.checkpoint.save_interval = save_interval
    task.checkpoint.async_save = False  # no checkpoint writer process: fewer processes on a loaded machine
    task.optim.lr_decay_steps = WATCHED_STEPS  # one LR schedule for every job: losses compare across max_steps
    for key, value in edits.items():
        section, field = key.split("__")
        setattr(getattr(task, section), field, value)
    return task


def ledger(job: Job, kind: str | None = None) -> list[dict]:
    return Ledger(os.path.join(job.run_dir, "job_ledger.jsonl")).records(kind)


def states(job: Job) -> list[str]:
    return [a["State"].split()[0] for a in job.attempts()]
