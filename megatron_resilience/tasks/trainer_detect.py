"""Which trainer a ``run.Script`` runs, from what its arguments say; the script's place and name only as hints.

A wrong guess is worse than none: a Megatron-Bridge script given Megatron-LM flags hands them to Hydra,
which raises ``OverridesError`` on every rank, restart and requeue (and Hydra overrides crash Megatron-LM's
or any argparse script the same way). So, in order of trust:

1. Megatron-Bridge launcher flags: ``--config-file`` / ``--config_file`` (its example recipe scripts,
   ``examples/recipes/*/pretrain_*.py``), ``--recipe`` (``scripts/training/run_recipe.py`` and the older
   ``scripts/training/pretrain_gpt.py``) -> Bridge;
2. Megatron-LM's own flags (``--micro-batch-size``, ``--train-iters``, ``--yaml-cfg``, ... from its argument
   parser, all known to megatron-core 0.19.2's) -> Megatron-LM: its ``pretrain_gpt.py`` cannot run without
   some of them, so they, not its name, identify it;
3. Hydra-style overrides (``a.b=c``, ``+a.b=c``, ``++a.b=c``, ``~a.b``) -> Bridge;
4. the script lives in a checkout of either project (a path component ``Megatron-Bridge`` / ``megatron/bridge``,
   or ``Megatron-LM``) -> that project;
5. Bridge's layout: a launcher where Bridge keeps them (``examples/recipes/<family>/{pretrain,finetune}_*.py``,
   ``scripts/training/`` and ``scripts/performance/``'s ``run_recipe.py``, ``run_script.py``,
   ``{pretrain,finetune}_*.py``) -> Bridge, whatever the arguments (Bridge's documented basic usage runs
   ``examples/recipes/llama/pretrain_llama3_8b.py`` with none: its default config file);
6. the name of one of Bridge's example recipe scripts (``pretrain_llama3_8b.py``, ``pretrain_qwen3_*.py``, ...,
   started from its own folder), only when no argument but Bridge's own ``--debug`` is given -> Bridge;
7. anything else, every inline script, and any ``pretrain_*.py`` whose arguments name no trainer (Megatron-LM's
   and Bridge's scripts share that name): not recognised, the plugins add nothing and say what the trainer must
   do itself.
"""

from __future__ import annotations

import os
import re
from typing import Any

BRIDGE_LAUNCHER_FLAGS = ("--config-file", "--config_file", "--recipe")
# Flags of Megatron-LM's argument parser (megatron/training/arguments.py) that its pretraining command lines carry;
# each one is known to megatron-core 0.19.2's parser. Bridge's scripts spell theirs in snake_case (--seq_length).
MEGATRON_LM_FLAGS = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size", "--global-batch-size",
    "--train-iters", "--train-samples", "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
    "--seq-length", "--max-position-embeddings", "--tokenizer-type", "--tokenizer-model", "--vocab-file",
    "--merge-file", "--data-path", "--mock-data", "--use-mcore-models", "--transformer-impl", "--yaml-cfg",
    "--enable-ft-package", "--calc-ft-timeouts", "--exit-signal-handler",
)
# Where Megatron-Bridge keeps its launchers (its repository, and so its container's /opt/Megatron-Bridge or
# /workspace): the example recipe scripts and the training / performance scripts.
_BRIDGE_LAYOUT = (
    re.compile(r"(?:^|/)(examples/recipes/)[^/]+/(?:pretrain|finetune)_\w+\.py$"),
    re.compile(r"(?:^|/)(scripts/(?:training|performance)/)(?:\w+/)?"
               r"(?:run_recipe|run_script|(?:pretrain|finetune)_\w+)\.py$"),
)
# Bridge's example recipe scripts by name (examples/recipes/llama/pretrain_llama3_8b.py, ...), and the one flag they
# take besides --config-file. Megatron-LM's scripts are pretrain_{gpt,bert,t5,mamba,vlm,...}.py: no overlap.
_BRIDGE_RECIPE_SCRIPT = re.compile(r"(?:pretrain|finetune)_(?:llama|qwen|nemotron|kimi)\w*\.py")
BRIDGE_SCRIPT_FLAGS = ("--debug",)
_HYDRA = re.compile(r"^(\+{0,2}[A-Za-z_]\w*(\.\w+)+=|~[A-Za-z_]\w*(\.\w+)+(=|$))")  # a.b=c, +a.b=c, ~a.b
_BRIDGE_DIR = re.compile(r"^megatron[-_]?bridge$", re.I)
_MEGATRON_LM_DIR = re.compile(r"^megatron[-_]?lm$", re.I)


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def _checkout(path: str) -> str | None:
    parts = [p for p in re.split(r"[/\\]", path) if p]
    if any(_BRIDGE_DIR.match(p) for p in parts) or "megatron/bridge" in path or path.startswith("megatron.bridge"):
        return "bridge"
    if any(_MEGATRON_LM_DIR.match(p) for p in parts):
        return "megatron_lm"
    return None


def _bridge_layout(path: str) -> str | None:
    """The folder of Bridge's layout the script is in (``examples/recipes/``, ...), or None."""
    normal = path.replace("\\", "/")
    for pattern in _BRIDGE_LAYOUT:
        match = pattern.search(normal)
        if match:
            return match.group(1)
    return None


def detect_script_trainer(task: Any) -> tuple[str, str] | None:
    """("megatron_lm" | "bridge", why) for a path/module ``run.Script``; None when nothing says which trainer."""
    if getattr(task, "inline", None):
        return None
    args = [str(a) for a in task.args]
    path = str(task.path)
    launcher = [_flag(a) for a in args if _flag(a) in BRIDGE_LAUNCHER_FLAGS]
    if launcher:
        return "bridge", f"Megatron-Bridge launcher flags ({', '.join(dict.fromkeys(launcher))})"
    megatron_lm = [_flag(a) for a in args if _flag(a) in MEGATRON_LM_FLAGS]
    if megatron_lm:
        return "megatron_lm", f"Megatron-LM command line (flags {', '.join(megatron_lm[:3])})"
    hydra = [a.split("=")[0] for a in args if _HYDRA.match(a)]
    if hydra:
        return "bridge", f"Megatron-Bridge Hydra-style overrides ({', '.join(hydra[:3])})"
    checkout = _checkout(path)
    if checkout is not None:
        name = "Megatron-Bridge" if checkout == "bridge" else "Megatron-LM"
        return checkout, f"a script of a {name} checkout ({path})"
    folder = _bridge_layout(path)
    if folder is not None:
        return "bridge", f"a launcher in Megatron-Bridge's layout ({folder}: {path})"
    script = os.path.basename(path)
    if _BRIDGE_RECIPE_SCRIPT.fullmatch(script) and all(a in BRIDGE_SCRIPT_FLAGS for a in args):
        return "bridge", f"the name of a Megatron-Bridge example recipe script ({script}), no argument says otherwise"
    return None


# --- what the job-level decision needs to know about the run (jobs/finished.py) ---------------------------------


def flag_values(args: list[str], *flags: str) -> list[str]:
    """Values of ``--flag value`` / ``--flag=value`` for any of ``flags``, in order."""
    values = []
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name in flags:
            if sep:
                values.append(value)
            elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                values.append(args[i + 1])
    return values


def flag_values_all(args: list[str], flag: str) -> list[str]:
    """Every value after ``flag`` up to the next ``--flag`` (Megatron's ``--data-path 0.7 /a 0.3 /b``)."""
    values = []
    for i, arg in enumerate(args):
        if arg == flag:
            rest = args[i + 1:]
            end = next((k for k, a in enumerate(rest) if a.startswith("--")), len(rest))
            values += rest[:end]
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def override_values(args: list[str], key: str) -> list[str]:
    """Values of a Hydra-style override ``key=value`` (``+``/``++`` prefixes too), in order."""
    return [a.split("=", 1)[1] for a in args if "=" in a and a.lstrip("+").split("=", 1)[0] == key]


def _last_int(values: list[str]) -> int | None:
    return int(values[-1]) if values and values[-1].isdigit() else None


def script_run_facts(kind: str, args: list[str]) -> tuple[str | None, str | None, int | None]:
    """(checkpoint save dir, load dir, train_iters) of a Megatron-LM or Bridge command line (None: not given).

    Bridge's launchers (``scripts/training/run_recipe.py``, the example recipe scripts) take these as Hydra
    overrides (``checkpoint.save=``, ``checkpoint.load=``, ``train.train_iters=``); only its performance scripts
    (``scripts/performance/run_script.py`` / ``run_recipe.py``) have the flags ``--save_dir``, ``--load_dir`` and
    ``-ms``/``--max_steps``, and apply them after the overrides, so a flag wins over an override of the same
    setting (elsewhere the flag would not even parse: Bridge hands it to Hydra).
    """
    if kind == "megatron_lm":
        return (next(iter(flag_values(args, "--save")), None), next(iter(flag_values(args, "--load")), None),
                _last_int(flag_values(args, "--train-iters")))
    save = flag_values(args, "--save_dir") or override_values(args, "checkpoint.save")
    load = flag_values(args, "--load_dir") or override_values(args, "checkpoint.load")
    iters = flag_values(args, "--max_steps", "-ms") or override_values(args, "train.train_iters")
    return (save[-1] if save else None), (load[-1] if load else None), _last_int(iters)


__all__ = ["BRIDGE_LAUNCHER_FLAGS", "BRIDGE_SCRIPT_FLAGS", "MEGATRON_LM_FLAGS", "detect_script_trainer", "flag_values",
           "flag_values_all", "override_values", "script_run_facts"]
