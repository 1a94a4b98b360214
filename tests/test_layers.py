"""Imports only run down the layers: models <- tree <- budget, drafters <- verify <- engine <-
compose <- bench <- train, with the leaf helpers below all and the CLI error wrapper on top.
A module may import its own package and any lower layer, never a higher one or a peer."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

LAYERS = {
    "files": 0, "sampling": 0,
    "models": 1,
    "tree": 2,
    "budget": 3, "drafters": 3,
    "verify": 4, "recorder": 4,
    "engine": 5,
    "compose": 6,
    "bench": 7,
    "train": 8,
    "errors": 9,
}


def unit(module: str) -> str:
    """bastion.bench.runner -> bench; bastion.engine -> engine."""
    return module.split(".")[1]


def bastion_imports(path) -> list[tuple[int, str]]:
    """(line, module) of every `bastion.*` import in a file, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "bastion" else [f"bastion.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names if n.startswith("bastion.")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("bastion.")]
    return found


def upward_imports(package) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        if module.count(".") == 0 or module.endswith("__init__") and module.count(".") == 1:
            continue  # the package's own __init__
        mine = unit(module)
        for line, imported in bastion_imports(path):
            theirs = unit(imported)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {imported} ({theirs} is not below {mine})")
    return problems


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in (ROOT / "bastion").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert units == set(LAYERS), "give every new module or package of bastion/ its layer in LAYERS"


def test_no_import_runs_up_a_layer():
    assert upward_imports(ROOT / "bastion") == []


def test_the_check_sees_an_upward_import(tmp_path):
    package = tmp_path / "bastion"
    (package / "tree").mkdir(parents=True)
    (package / "tree" / "chain.py").write_text("def f():\n    from bastion.drafters.base import Drafter\n")
    (package / "engine.py").write_text("from bastion.verify import verify_greedy\n")
    assert upward_imports(package) == ["bastion/tree/chain.py:2 imports bastion.drafters.base (drafters is not below tree)"]


@pytest.mark.parametrize("module", ["bastion.bench.runner", "bastion.engine"])
def test_unit_names(module):
    assert unit(module) in LAYERS
