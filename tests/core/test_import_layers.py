"""The pure model stays pure: aresidency/core imports neither asyncio nor torch.cuda, and
nothing from the layers above it (docs/architecture.md, "layers")."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Found by path, not by importing the package (whose __init__ loads the runtime).
CORE = Path(__file__).resolve().parents[2] / "aresidency" / "core"
MODULES = sorted(CORE.glob("*.py"))
FORBIDDEN = ("asyncio", "anyio", "trio", "uvloop", "torch.cuda")
UPPER_LAYERS = ("runtime", "backends", "controller", "integrations")


def _imports(path: Path) -> set[str]:
    """Every module an ``import``/``from ... import`` in the file names, anywhere in it
    (top level, functions, TYPE_CHECKING blocks), resolved to absolute names."""
    package = "aresidency.core"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _forbidden(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_core_package_has_the_expected_modules():
    names = {path.stem for path in MODULES}
    assert {"locations", "errors", "state", "plans", "snapshot", "trace"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_imports_neither_asyncio_nor_torch_cuda(path):
    bad = sorted(name for name in _imports(path) if _forbidden(name, FORBIDDEN))
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_never_touches_torch_cuda_by_attribute(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            assert not (isinstance(node.value, ast.Name) and node.value.id == "torch"), (
                f"{path.name}:{node.lineno} uses torch.cuda"
            )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_imports_nothing_from_the_layers_above(path):
    upper = tuple(f"aresidency.{layer}" for layer in UPPER_LAYERS)
    bad = sorted(name for name in _imports(path) if _forbidden(name, upper))
    bad += sorted(name for name in _imports(path) if name in ("aresidency", "aresidency."))
    assert not bad, f"{path.name} imports {bad}"


def test_importing_the_core_alone_loads_no_asyncio_and_no_torch_cuda():
    # A fresh interpreter (pytest itself has asyncio loaded). The package's own __init__ may
    # import the runtime, so the core is loaded under a bare parent package to see what the
    # core alone pulls in.
    script = f"""
import json, sys, types
parent = types.ModuleType("aresidency")
parent.__path__ = [{str(CORE.parent)!r}]
sys.modules["aresidency"] = parent
import aresidency.core
import aresidency.core.locations, aresidency.core.errors, aresidency.core.state
import aresidency.core.plans, aresidency.core.snapshot, aresidency.core.trace
print(json.dumps(sorted(sys.modules)))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert "aresidency.core.state" in loaded
    # (importing torch at all would load torch.cuda: the core is device-free)
    bad = sorted(name for name in loaded if _forbidden(name, FORBIDDEN))
    assert not bad, f"the core pulled in {bad}"
    upper = sorted(
        name for name in loaded if _forbidden(name, tuple(f"aresidency.{x}" for x in UPPER_LAYERS))
    )
    assert not upper, f"the core pulled in {upper}"
