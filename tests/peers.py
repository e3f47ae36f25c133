"""The peers' real code, loaded for the compatibility tests: Megatron-Bridge 0.6.2, NeMo 2.0 sources, Megatron-LM.

``scripts/peers/install.sh`` puts megatron-bridge's wheel, the Hydra parser's dependencies and NeMo's plugin
sources into ``.venv-peers/`` (:func:`ensure` runs it once when missing, so a fresh clone works).

Megatron-Bridge's package ``__init__`` imports every model bridge (Transformer Engine, which is CUDA only,
``transformers``, ``datasets``...), so :func:`bridge_modules` registers its packages as empty namespaces
pointing at the unpacked wheel and imports the modules the tests need one by one: the real files run, only
the package ``__init__`` files are skipped. :func:`class_fields` reads a dataclass's fields from a source file
with ``ast`` (for ``ConfigContainer`` and friends, whose module cannot import here).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO / ".venv-peers"
BRIDGE = PEERS / "bridge"
NEMO = PEERS / "nemo"
NEWEST = REPO / ".venv-newest"
BRIDGE_PACKAGES = ("megatron.bridge", "megatron.bridge.recipes", "megatron.bridge.training",
                   "megatron.bridge.training.utils", "megatron.bridge.utils")


@functools.lru_cache(maxsize=None)
def ensure() -> Path:
    if not (PEERS / ".installed").exists():
        subprocess.run([str(REPO / "scripts/peers/install.sh")], cwd=REPO, check=True, capture_output=True)
    return PEERS


def ensure_newest() -> Path:
    """megatron-core 0.19.2 (whose wheel ships Megatron-LM's ``megatron/training/arguments.py``)."""
    if not (NEWEST / ".installed").exists():
        subprocess.run([str(REPO / "scripts/newest/install.sh")], cwd=REPO, check=True, capture_output=True)
    return NEWEST


@contextlib.contextmanager
def bridge_modules(*names: str) -> Iterator[dict[str, types.ModuleType]]:
    """Megatron-Bridge's real modules ``names`` (e.g. ``megatron.bridge.recipes.run_plugins``), for the block."""
    ensure()
    hydra = str(PEERS / "hydra")
    saved_path = list(sys.path)
    before = set(sys.modules)
    saved = {name: sys.modules.get(name) for name in BRIDGE_PACKAGES}
    sys.path.insert(0, hydra)
    for package in BRIDGE_PACKAGES:
        module = types.ModuleType(package)
        module.__path__ = [str(BRIDGE.joinpath(*package.split(".")))]
        sys.modules[package] = module
    try:
        yield {name: importlib.import_module(name) for name in names}
    finally:
        for name in set(sys.modules) - before:
            if name.startswith(("megatron.bridge", "hydra", "omegaconf", "antlr4")):
                del sys.modules[name]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.path[:] = saved_path


def _literal(node: ast.AST | None) -> object:
    if node is None:
        return "<required>"
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field":  # dataclasses.field(default=...)
        keywords = {k.arg: k.value for k in node.keywords}
        return _literal(keywords["default"]) if "default" in keywords else "<factory>"
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def class_fields(path: Path, name: str) -> dict[str, object]:
    """{field: default} of dataclass ``name`` in source file ``path`` (a default that is no literal: its source)."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {stmt.target.id: _literal(stmt.value) for stmt in cls.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}


def init_parameters(path: Path, cls_name: str | None, fn_name: str = "__init__") -> dict[str, object]:
    """{parameter: default} of ``cls_name.fn_name`` (or the module-level function when cls_name is None)."""
    tree = ast.parse(path.read_text())
    scope = tree if cls_name is None else next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    fn = next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == fn_name)
    args = fn.args.posonlyargs + fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    out = {a.arg: _literal(d) for a, d in zip(args, defaults) if a.arg != "self"}
    out.update({a.arg: _literal(d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults)})
    return out


def megatron_lm_parse(command_lines: list[list[str]], extra_fields: tuple[str, ...] = ()) -> list[dict]:
    """Megatron-LM's own argument parser (megatron-core 0.19.2's ``megatron/training/arguments.py``) on each
    command line, in one subprocess; each result is the parsed namespace's relevant fields (and ``extra_fields``)
    or ``{"error": ...}``.

    Python 3.11 lacks ``typing.override`` (3.12), which ``megatron.training`` imports: the subprocess adds
    ``typing_extensions.override``, the backport with the same behaviour."""
    import json

    ensure_newest()
    code = r"""
import argparse, json, sys, typing, typing_extensions
typing.override = typing_extensions.override
from megatron.training.arguments import add_megatron_arguments
out = []
request = json.load(sys.stdin)
wanted = ("enable_ft_package", "calc_ft_timeouts", "exit_signal_handler", "exit_signal",
          "exit_signal_handler_for_dataloader", "train_iters", "save", "load", "micro_batch_size",
          "tensor_model_parallel_size", *request["extra"])
for argv in request["argvs"]:
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False))
    try:
        ns, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as err:
        out.append({"error": str(err)}); continue
    out.append({"unknown": unknown, **{k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
               for k, v in vars(ns).items() if k in wanted}})
print("PARSED " + json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": str(NEWEST)}
    request = json.dumps({"argvs": command_lines, "extra": list(extra_fields)})
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], input=request, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PARSED ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("PARSED "):])


def bridge_hydra(probe: str, cases: list) -> list[dict]:
    """Run ``probe`` (Python that reads JSON ``cases`` on stdin, puts Megatron-Bridge's Hydra parser to work through
    :func:`bridge_modules` and prints ``HYDRA <json>``) in a fresh interpreter with megatron-core 0.19.2 and the
    parser's dependencies on its path and ``tests/`` as ``sys.argv[1]``; the JSON it printed.

    Why shared: tests/test_peers_bridge.py (FT and preemption overrides) and tests/test_peers_inprocess.py (in-process
    restart overrides) ask Bridge's parser about different sections the same way."""
    import json

    ensure()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ensure_newest()), str(PEERS / "hydra")])}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", probe, os.path.dirname(__file__)],
                          input=json.dumps(cases), env=env, capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("HYDRA ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("HYDRA "):])
