"""Which trainer a ``run.Script`` runs, from what its arguments say; the script's name only as a last hint.

A wrong guess is worse than none: a Megatron-Bridge script given Megatron-LM flags hands them to Hydra,
which raises ``OverridesError`` on every rank, restart and requeue. So, in order of trust:

1. Megatron-Bridge launcher flags: ``--config-file`` / ``--config_file`` (its example recipe scripts,
   ``examples/recipes/*/pretrain_*.py``), ``--recipe`` (``scripts/training/run_recipe.py`` and the older
   ``scripts/training/pretrain_gpt.py``) -> Bridge;
2. Megatron-LM's own flags (``--micro-batch-size``, ``--train-iters``, ... from its argument parser) -> Megatron-LM;
3. Hydra-style overrides (``a.b=c``, ``+a.b=c``, ``++a.b=c``, ``~a.b``) -> Bridge;
4. the script lives in a checkout of either project (a path component ``Megatron-Bridge`` / ``megatron/bridge``,
   or ``Megatron-LM``) -> that project;
5. the name ``pretrain_*.py`` -> Megatron-LM, but only when no argument contradicts it (every argument is a
   ``--flag`` or its value);
6. anything else: not recognised (the plugins add nothing and say what the trainer must do itself).
"""

from __future__ import annotations

import os
import re
from typing import Any

BRIDGE_LAUNCHER_FLAGS = ("--config-file", "--config_file", "--recipe")
# Flags every Megatron-LM pretraining command line carries (megatron/training/arguments.py).
MEGATRON_LM_FLAGS = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size", "--global-batch-size",
    "--train-iters", "--train-samples", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
    "--max-position-embeddings", "--tokenizer-type", "--data-path", "--enable-ft-package", "--exit-signal-handler",
)
_HYDRA = re.compile(r"^(\+{0,2}[A-Za-z_]\w*(\.\w+)+=|~[A-Za-z_]\w*(\.\w+)+(=|$))")  # a.b=c, +a.b=c, ~a.b
_BRIDGE_DIR = re.compile(r"^megatron[-_]?bridge$", re.I)
_MEGATRON_LM_DIR = re.compile(r"^megatron[-_]?lm$", re.I)
_PRETRAIN = re.compile(r"pretrain_\w+\.py")


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def _checkout(path: str) -> str | None:
    parts = [p for p in re.split(r"[/\\]", path) if p]
    if any(_BRIDGE_DIR.match(p) for p in parts) or "megatron/bridge" in path or path.startswith("megatron.bridge"):
        return "bridge"
    if any(_MEGATRON_LM_DIR.match(p) for p in parts):
        return "megatron_lm"
    return None


def _flags_only(args: list[str]) -> bool:
    """Every argument is a ``--flag`` (``--flag=value``) or the value after one."""
    previous_flag = False
    for arg in args:
        if arg.startswith("--"):
            previous_flag = "=" not in arg
        elif previous_flag:
            previous_flag = False
        else:
            return False
    return True


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
    script = os.path.basename(path)
    if _PRETRAIN.fullmatch(script) and _flags_only(args):
        return "megatron_lm", f"Megatron-LM command line (script name {script}, no argument says otherwise)"
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
    """(checkpoint save dir, load dir, train_iters) of a Megatron-LM or Bridge command line (None: not given)."""
    if kind == "megatron_lm":
        return (next(iter(flag_values(args, "--save")), None), next(iter(flag_values(args, "--load")), None),
                _last_int(flag_values(args, "--train-iters")))
    save = override_values(args, "checkpoint.save") or flag_values(args, "--save_dir")
    load = override_values(args, "checkpoint.load") or flag_values(args, "--load_dir")
    iters = override_values(args, "train.train_iters") or flag_values(args, "--max_steps", "-ms")
    return (save[-1] if save else None), (load[-1] if load else None), _last_int(iters)


__all__ = ["BRIDGE_LAUNCHER_FLAGS", "MEGATRON_LM_FLAGS", "detect_script_trainer", "flag_values", "flag_values_all",
           "override_values", "script_run_facts"]
