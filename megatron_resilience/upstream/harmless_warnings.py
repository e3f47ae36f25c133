"""Harmless upstream warnings, silenced by their exact text, so a healthy run's log shows what matters.

Every entry is a warning that upstream prints on every rank of every (re)start and that asks
nothing of the user (docs/trainer.md lists them). Matching is on the start of the message and
its category, never on a whole module, so a new warning from the same place still shows.

``PYTHONWARNINGS`` carries the first one to processes that import torch before our code
runs (nemo_run's runner, ft_launcher itself): the local executors set it.
"""

from __future__ import annotations

import re
import warnings

HARMLESS_WARNINGS = (
    # torch.cuda probes NVML through the deprecated `pynvml` package that nvidia-resiliency-ext installs.
    (FutureWarning, "The pynvml package is deprecated"),
    # megatron-core without Transformer Engine / Apex (CPU, or a GPU image without them) uses its local kernels.
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed"),
    # megatron-core's own TransformerConfig default (cuda_graph_scope) triggers its deprecation notice.
    (UserWarning, "full scope is deprecated"),
    # dist_checkpointing's torch strategy calls torch APIs torch has deprecated; loading works.
    (FutureWarning, "`load_state_dict` is deprecated"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
)

PYTHONWARNINGS = "ignore:The pynvml package is deprecated:FutureWarning"


def silence_harmless_warnings() -> None:
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)  # matched at the start
