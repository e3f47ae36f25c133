"""megatron_resilience: resilient Megatron-Core GPT pretraining for NeMo-Run and Slurm.

Three import paths, three moments:
- ``megatron_resilience.plugins``: NeMo-Run plugins, on the login node at submit time;
- ``megatron_resilience.recipes``: Fiddle recipes and CLI factories, on the login node;
- ``megatron_resilience.runtime`` / ``.resilience``: the trainer, on compute nodes.
Importing this package, its config, plugins or recipes never imports torch or megatron.
"""

from megatron_resilience.config import PretrainConfig
from megatron_resilience.entry import pretrain

__all__ = ["PretrainConfig", "pretrain"]
__version__ = "0.1.0"
