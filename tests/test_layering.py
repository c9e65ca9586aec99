"""The packages form the layered DAG of ``tests/support/layering.py`` (see CONTRIBUTING.md)."""

from __future__ import annotations

import os
import shutil

import pytest

from harness.jobs import REPO_ROOT
from support.layering import LAYERS, SOURCES, cycles, imports, violations


def test_the_tree_keeps_the_layers():
    assert violations(REPO_ROOT) == []
    # the checker saw the tree: the top imports the bottom
    assert any(i.importer == "trainmover_ext.migration" and i.imported == "nccl_delta" for i in imports(REPO_ROOT))


def test_nccl_delta_and_the_training_layer_import_nothing_of_ours():
    assert [i.where for i in imports(REPO_ROOT) if i.importer in LAYERS[0]] == []


def foreign_imports(folder: str) -> list[str]:
    """``file: module`` for each import in ``folder``'s Python files of TrainMover's runtime, training
    layer or test helpers."""
    import ast

    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            found += [
                f"{name}: {m}" for m in mods if m.startswith(("trainmover_ext", "trainmover_training", "helpers"))
            ]
    return found


def test_nccl_delta_tests_use_only_nccl_delta(tmp_path):
    """The communicator is tested on its own: its tests import nothing of TrainMover's runtime or
    training layer (their fork-and-store harness is torch only)."""
    assert foreign_imports(os.path.join(REPO_ROOT, "tests", "nccl_delta")) == []
    (tmp_path / "test_x.py").write_text("def test_x():\n    from trainmover_ext.errors import CommLinkError\n")
    assert foreign_imports(str(tmp_path)) == ["test_x.py: trainmover_ext.errors"]


def _copy(tmp_path) -> str:
    root = str(tmp_path / "tree")
    for folder in SOURCES:
        shutil.copytree(
            os.path.join(REPO_ROOT, folder), os.path.join(root, folder), ignore=shutil.ignore_patterns("__pycache__")
        )
    return root


@pytest.mark.parametrize(
    "where, line, expect",
    [
        (
            "trainmover_ext/kv/base.py",
            "    from trainmover_ext.migration import worker\n",
            "trainmover_ext.kv imports trainmover_ext.migration (upward",
        ),
        (
            "nccl_delta/ring.py",
            "from trainmover_ext.errors import CommLinkError\n",
            "nccl_delta imports trainmover_ext.errors (upward",
        ),
        ("trainmover_training/model.py", "from ...trainmover_ext.sandbox import compile\n", None),
        ("trainmover_ext/fsutil.py", "import trainmover_ext.netutil\n", "(sideways"),
        ("trainmover_ext/launch/cli.py", "from trainmover_ext.newthing import x\n", "is in no layer"),
    ],
)
def test_an_added_upward_import_is_caught(tmp_path, where, line, expect):
    root = _copy(tmp_path)
    path = os.path.join(root, where)
    with open(path) as f:
        text = f.read()
    if line.startswith("    "):  # inside a function: hidden imports count too
        line = "\n\ndef _late():\n" + line
    with open(path, "w") as f:
        f.write(text + "\n" + line)
    found = violations(root)
    assert found, f"no violation reported after adding {line.strip()!r} to {where}"
    assert any(where in v for v in found)
    if expect:
        assert any(expect in v for v in found), found


def test_a_cycle_is_named():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
