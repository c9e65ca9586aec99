"""The package layering of TrainMover, and a checker that reads every import of a source tree.

Each *unit* is a package (``trainmover_ext.control``) or a top-level module
(``trainmover_ext.errors``) of ours. :data:`LAYERS` orders them from the bottom up: a unit may
import units of lower layers only. Imports inside functions and under ``TYPE_CHECKING`` count the
same as the ones at the top of a file, since a late import is still a dependency.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

LAYERS: list[tuple[str, ...]] = [
    ("nccl_delta", "trainmover_training"),  # the communicator; the training layer on megatron-core
    ("trainmover_ext.errors",),  # the one error tree (re-exports the two layers below)
    (
        "trainmover_ext.fsutil",
        "trainmover_ext.netutil",
        "trainmover_ext.logconfig",
        "trainmover_ext.patches",
        "trainmover_ext.deadline",
    ),
    ("trainmover_ext.kv",),
    ("trainmover_ext.etcd",),
    ("trainmover_ext.control",),
    ("trainmover_ext.metrics",),
    ("trainmover_ext.launch",),
    ("trainmover_ext.runtime",),
    ("trainmover_ext.config",),
    ("trainmover_ext.sandbox",),
    ("trainmover_ext.migration",),
    ("trainmover_ext.hooks", "trainmover_ext.simulate", "trainmover_ext.timeline_plot"),
    ("trainmover_ext.cli", "trainmover_ext"),  # the `trainmover` command, over every subcommand
]
"""Bottom to top. Units of one layer must not import each other either."""

SOURCES = {
    "nccl_delta": "nccl_delta",
    "trainmover_training": "trainmover_training",
    "trainmover_ext": "trainmover_ext",
    "patches": "trainmover_ext.patches",
}
"""Source folder in the repository -> the module name it is installed as."""


@dataclass(frozen=True)
class Import:
    importer: str  # unit
    imported: str  # unit
    where: str  # path:line


def unit_of(module: str) -> str | None:
    """The unit a module belongs to, or None for a module that is not ours."""
    parts = module.split(".")
    if parts[0] == "nccl_delta":
        return "nccl_delta"
    if parts[0] == "trainmover_training":
        return "trainmover_training"
    if parts[0] == "trainmover_ext":
        return "trainmover_ext" if len(parts) == 1 else "trainmover_ext." + parts[1]
    return None


def _module_name(rel_path: str) -> str:
    for folder, name in SOURCES.items():
        if rel_path == folder + ".py" or rel_path.startswith(folder + "/"):
            rest = rel_path[len(folder) : -3].replace("/", ".")
            return (name + rest).removesuffix(".__init__")
    raise ValueError(rel_path)


def imports(root: str) -> list[Import]:
    """Every import between two different units in the tree at ``root``."""
    found = []
    for folder in SOURCES:
        for dirpath, _dirs, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                me = _module_name(rel)
                package = me if name == "__init__.py" else me.rpartition(".")[0]
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), filename=rel)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        targets = [alias.name for alias in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        base = node.module or ""
                        if node.level:
                            parts = package.split(".")
                            parts = parts[: len(parts) - (node.level - 1)]
                            base = ".".join(parts + ([base] if base else []))
                        targets = [base] if node.module else [f"{base}.{alias.name}" for alias in node.names]
                    else:
                        continue
                    for target in targets:
                        a, b = unit_of(me), unit_of(target)
                        if a and b and a != b:
                            found.append(Import(a, b, f"{rel}:{node.lineno}"))
    return found


def layer_of(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise KeyError(unit)


def violations(root: str) -> list[str]:
    """One line per import that goes up or sideways, per unit missing from :data:`LAYERS`, and per
    cycle between units; empty for a tree that keeps the rules."""
    out = []
    edges: dict[str, set[str]] = {}
    for imp in imports(root):
        edges.setdefault(imp.importer, set()).add(imp.imported)
        try:
            lo, hi = layer_of(imp.importer), layer_of(imp.imported)
        except KeyError as exc:
            out.append(f"{imp.where}: unit {exc.args[0]} is in no layer: add it to LAYERS in tests/support/layering.py")
            continue
        if hi >= lo:
            way = "sideways" if hi == lo else "upward"
            out.append(f"{imp.where}: {imp.importer} imports {imp.imported} ({way}: layer {lo} -> {hi})")
    out.extend(f"cycle: {' -> '.join(c)}" for c in cycles(edges))
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit, each as a closed walk of its units."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found
