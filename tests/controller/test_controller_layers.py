"""The controller's layers: the search is pure (no asyncio, no torch, no runtime); only
``controller.py`` awaits, and it reaches the manager through its public surface, not by import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "aresidency" / "controller"
PURE = ["index.py", "policy.py", "requests.py", "search.py"]


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = "." * node.level
            names.add(prefix + (node.module or ""))
    return names


@pytest.mark.parametrize("name", PURE)
def test_the_search_modules_are_pure(name: str) -> None:
    found = imports(PACKAGE / name)
    bad = sorted(
        n
        for n in found
        if n.split(".")[0] in ("asyncio", "anyio", "torch", "threading")
        or n.startswith(("..runtime", "..backends", "..integrations"))
    )
    assert not bad, f"{name} imports {bad}"


def test_the_controller_does_not_import_the_runtime() -> None:
    found = imports(PACKAGE / "controller.py")
    assert not [n for n in found if n.startswith(("..runtime", "..backends", "torch"))]
