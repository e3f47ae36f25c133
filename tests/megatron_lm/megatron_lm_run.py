"""What the lane's tests share about a run of the real Megatron-LM trainer (``pretrain_gpt.py`` beside this file).

* :func:`tiny_gpt_args`: Megatron-LM's own command line for a 2-layer GPT on CPU (gloo, ``--mock-data``,
  ``NullTokenizer``), dropout 0 so that a resumed run is bitwise the uninterrupted one (FACTS.md), and
  ``--num-workers 0``: with Megatron-LM's default 2 data-loader workers a rank whose training loop raised stayed
  alive after printing its traceback (seen here under ft_launcher 0.7.0 and torchrun), so its peer waited in a
  collective for gloo's 10-minute timeout instead of the launcher ending the group at once;
* :data:`ENV`: the environment its processes need here (the newest lane's packages, this checkout, the CPU layer's
  variables);
* :func:`iteration_losses`: the per-step ``lm loss`` of Megatron-LM's ``iteration`` log lines, as printed (Megatron-LM
  prints it with 7 significant digits: equal strings are equal losses at the precision the trainer reports them).
  A line may share its text line with the next print of another rank (``...nan iterations:   0 |[Rank 0] ...``);
  the pattern does not need a line of its own.
"""

from __future__ import annotations

import os
import re

import cpu_layer

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NEWEST = os.path.join(REPO, ".venv-newest")
SCRIPT = os.path.join(HERE, "pretrain_gpt.py")
ENV = {"PYTHONPATH": f"{REPO}:{NEWEST}", **cpu_layer.CPU_ENV, "OMP_NUM_THREADS": "1"}

# " [2026-11-29 01:16:10.971169] iteration        1/       6 | consumed samples: ... | lm loss: 6.964996E+00 | ..."
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?\| lm loss: ([0-9.E+-]+) \|")


def tiny_gpt_args(*, train_iters: int, save: str | None = None, load: str | None = None, save_interval: int = 5,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """Megatron-LM flags for the lane's tiny GPT (2 ranks x micro-batch 2 = global batch 4); every step logged."""
    args = [*cpu_layer.CPU_FLAGS,
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(train_iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
            "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--num-workers", "0"]
    if save is not None:
        args += ["--save", save, "--save-interval", str(save_interval)]
    if load is not None:
        args += ["--load", load]
    return args + list(extra)


def iteration_losses(text: str) -> dict[int, str]:
    """``{step: lm loss as printed}`` of every iteration line in ``text``; a step logged twice (a restart that
    repeats it) keeps its last value."""
    return {int(m.group(1)): m.group(3) for m in ITERATION.finditer(text)}


__all__ = ["ENV", "ITERATION", "NEWEST", "REPO", "SCRIPT", "iteration_losses", "tiny_gpt_args"]
