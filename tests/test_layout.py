"""The package's layering, read from the source (``ast``; nothing is imported): DEVELOPERS.md's Layout table as
data, and every import checked against it.

- a room imports only the rooms its row names (at module level, or only inside functions: the imports that run
  when a function is called, on the node that calls it), and a row names only rooms below it (rows before it);
- ``runtime/`` never imports ``resilience`` or ``trainer`` (the orchestrator sits above both);
- no import cycle among the modules of any room (lazy imports included: the report/timeline circle of issue 27);
- the login-node rooms never import torch or megatron at module level; ``config``/``goodput`` are stdlib only,
  ``jobs`` never imports torch, megatron or nemo_run at all (the batch script's EXIT trap imports it);
- the table in DEVELOPERS.md says the same as :data:`MAY_IMPORT`.

Each failure names the file, the line, the import and the rule it broke. ``if TYPE_CHECKING:`` blocks never run
and are skipped. Other tests prove the same at run time for a few entry points (``test_import_light.py``).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "megatron_resilience"
FOLDERS = {PKG: os.path.join(ROOT, PKG), f"{PKG}.plugins": os.path.join(ROOT, "plugins"),
           f"{PKG}.recipes": os.path.join(ROOT, "recipes")}

# room: (what it may import at module level, what it may import only inside functions). An entry is a room, or
# "room.module" for that module only. The rows of DEVELOPERS.md's Layout table, from the bottom of the stack up:
# a row names only rooms of rows before it.
MAY_IMPORT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "records": ((), ()),
    "config": (("records",), ()),
    "goodput": (("records",), ()),
    "failures": (("records", "config"), ()),
    "upstream": (("records", "config"), ()),
    "dashboards": (("records", "config"), ()),
    "jobs": (("records", "config", "failures", "upstream", "goodput"), ()),
    "chaos": (("records", "config", "failures", "jobs"), ()),
    "report": (("records", "config", "goodput", "jobs"), ("dashboards",)),
    "watch": (("records", "config", "jobs"), ()),
    "tasks": (("records", "config", "upstream"), ()),
    "plugins": (("records", "config", "failures", "upstream", "jobs", "tasks"), ()),
    "runtime": (("records", "config", "upstream", "goodput", "dashboards"), ()),
    "checkpointing": (("records", "config", "upstream", "goodput", "runtime"), ()),
    "resilience": (("records", "config", "upstream", "runtime"), ()),
    "trainer": (("records", "config", "upstream", "dashboards", "runtime", "checkpointing", "resilience"), ()),
    "entry": (("records", "config"), ("upstream", "plugins.submit_check", "trainer")),
    "recipes": (("records", "config", "upstream", "entry", "tasks", "plugins"), ("jobs", "chaos", "report", "watch")),
    "__main__": (("records", "config"), ("recipes", "trainer")),
    "__init__": (("records", "config", "entry"), ()),
}
HEAVY = ("torch", "megatron")
STDLIB_ONLY = ("records", "config", "goodput", "failures")
NEVER = {"jobs": ("torch", "megatron", "nemo_run")}  # not even inside a function
LOGIN_NODE = ("records", "failures", "jobs", "config", "goodput", "dashboards", "upstream", "tasks", "plugins",
              "recipes", "entry", "chaos", "report", "watch", "__main__", "__init__")
NOT_AT_MODULE_LEVEL = {room: HEAVY for room in LOGIN_NODE}
# nemo_run through upstream.import_nemo_run() only
NOT_AT_MODULE_LEVEL.update({room: HEAVY + ("nemo_run",) for room in ("tasks", "plugins", "recipes")})


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: str  # its file, relative to the repository
    line: int
    target: str  # the imported module (a submodule when ``from pkg import submodule``)
    lazy: bool  # inside a function

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.target}" + (" (in a function)" * self.lazy)


def modules() -> dict[str, str]:
    """Module name -> file, for the package and the two folders installed into it (``pyproject.toml``)."""
    out = {}
    for prefix, folder in FOLDERS.items():
        for here, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for file in (f for f in files if f.endswith(".py")):
                parts = os.path.relpath(os.path.join(here, file), folder)[:-3].split(os.sep)
                out[".".join([prefix] + [p for p in parts if p != "__init__"])] = os.path.join(here, file)
    return out


MODULES = modules()


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def imports_of(module: str, path: str) -> list[Import]:
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    rel, found = os.path.relpath(path, ROOT), []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module != "__future__":
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    base = ".".join(parent + ([child.module] if child.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names]
            found.extend(Import(module, rel, child.lineno, t, inner) for t in dict.fromkeys(targets))
            visit(child, inner)

    visit(tree, False)
    return found


IMPORTS = [imp for module, path in sorted(MODULES.items()) for imp in imports_of(module, path)]


def room(module: str) -> str:
    """``megatron_resilience.report.run_report`` -> ``jobs``; the package's own ``__init__`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def ours(imp: Import) -> bool:
    return imp.target.split(".")[0] == PKG


def allowed(entries: tuple[str, ...], target: str) -> bool:
    rest = target.split(".", 1)[1] if "." in target else "__init__"
    return any(rest == e or rest.startswith(e + ".") for e in entries)


def test_every_module_is_in_a_room_of_the_table():
    assert {room(m) for m in MODULES} <= set(MAY_IMPORT), sorted({room(m) for m in MODULES} - set(MAY_IMPORT))


def test_every_row_names_only_rooms_of_rows_before_it_so_nothing_imports_upwards():
    rows = list(MAY_IMPORT)
    upwards = [f"{r} may import {e}, a row after its own" for k, (r, (top, lazy)) in enumerate(MAY_IMPORT.items())
               for e in top + lazy if e.split(".")[0] not in rows[:k]]
    assert not upwards, "\n".join(upwards)
    assert rows.index("runtime") < rows.index("resilience") < rows.index("trainer")


def test_a_module_imports_only_the_rooms_its_row_names():
    broken = []
    for imp in filter(ours, IMPORTS):
        mine, theirs = room(imp.module), room(imp.target)
        top, lazy = MAY_IMPORT[mine]
        if theirs == mine or allowed(top, imp.target) or (imp.lazy and allowed(lazy, imp.target)):
            continue
        rule = (f"{mine} may import {', '.join(top) or 'nothing of ours'} at module level"
                + (f" and {', '.join(lazy)} only inside functions" if lazy else ""))
        broken.append(f"{imp.where()}: breaks \"{rule}\" (DEVELOPERS.md, Layout)")
    assert not broken, "\n".join(broken)


def test_runtime_never_imports_resilience_or_the_trainer():
    broken = [f"{imp.where()}: breaks \"runtime/ never imports resilience or trainer (the orchestrator sits above "
              f"both)\"" for imp in IMPORTS if room(imp.module) == "runtime" and ours(imp)
              and room(imp.target) in ("resilience", "trainer")]
    assert not broken, "\n".join(broken)


def test_no_import_cycle_among_the_modules_of_any_room():
    """Lazy imports included (the report/timeline circle of issue 27); a package's ``__init__`` that names its
    modules for the reader imports none of them."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in IMPORTS:
        if ours(imp) and room(imp.module) == room(imp.target):
            target = imp.target if imp.target in MODULES else imp.target.rpartition(".")[0]
            if target != imp.module and target in MODULES:
                edges.setdefault(imp.module, {}).setdefault(target, imp)
    cycles, state = [], {}

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                cycles.append(" -> ".join(cycle) + "  (" + "; ".join(
                    edges[a][b].where() for a, b in zip(cycle, cycle[1:])) + ")")
            elif nxt not in state:
                dfs(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            dfs(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_third_party_imports_keep_login_node_rooms_light():
    std = set(sys.stdlib_module_names)
    broken = []
    for imp in IMPORTS:
        mine, top = room(imp.module), imp.target.split(".")[0]
        if ours(imp):
            continue
        if mine in STDLIB_ONLY and top not in std:
            broken.append(f"{imp.where()}: breaks \"{mine} imports the standard library only\"")
        elif top in NEVER.get(mine, ()):
            broken.append(f"{imp.where()}: breaks \"{mine} never imports {', '.join(NEVER[mine])}\"")
        elif not imp.lazy and top in NOT_AT_MODULE_LEVEL.get(mine, ()):
            broken.append(f"{imp.where()}: breaks \"{mine} never imports {', '.join(NOT_AT_MODULE_LEVEL[mine])} at "
                          f"module level\"")
    assert not broken, "\n".join(broken)


def developers_table() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """DEVELOPERS.md's Layout rows: room -> (module level, only inside functions), from the backticked names."""
    text = open(os.path.join(ROOT, "DEVELOPERS.md")).read()
    section = text.split("## Layout", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines()[3:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = ["__init__" if n == PKG else n.removeprefix(f"{PKG}.") for n in re.findall(r"`([^`]+)`", cells[0])]
        top, lazy = (tuple(re.findall(r"`([\w.]+)`", c)) for c in cells[3:5])
        rows.update({name: (top, lazy) for name in names})
    return rows


def test_developers_md_layout_table_says_what_this_test_checks():
    assert list(developers_table().items()) == list(MAY_IMPORT.items())  # the same rows, in the same order


def test_the_feature_map_names_only_modules_that_exist_and_every_room_that_holds_a_feature():
    """DEVELOPERS.md's feature x moment map: one answer to "where is preemption?", kept true as modules move."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "DEVELOPERS.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Where is each feature, at each moment?", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`([\w/]+\.py)`", section)
    assert len(named) >= 40
    missing = [p for p in named if not any(os.path.exists(os.path.join(root, base, p))
                                           for base in ("", "megatron_resilience"))]
    assert not missing, f"DEVELOPERS.md's feature map names modules that do not exist: {missing}"
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    assert any(row.startswith("| preemption") for row in rows)


# No room holds more than this share of the product's lines: a room that grows past it answers more than one
# question and is cut by the question each part answers (issue 31; the same count as `wc -l` over its files).
MAX_ROOM_SHARE = 0.16


def test_no_room_holds_more_than_its_share_of_the_product():
    lines: dict[str, int] = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            lines[room(module)] = lines.get(room(module), 0) + sum(1 for _ in f)
    total = sum(lines.values())
    over = {name: f"{n / total:.1%}" for name, n in lines.items() if n > MAX_ROOM_SHARE * total}
    assert not over, f"rooms over {MAX_ROOM_SHARE:.0%} of the product's {total} lines: {over}"
