"""The package's shape, checked by reading its source (no import of the package needed):

* no module outside ``runtime/`` touches a private member of ``ResidencyManager``, and no
  module outside ``core/`` (and ``runtime/``, which owns the live state) touches a private
  member of ``ResidencyState``: other layers use the public doors;
* the controller's ``ManagerLike`` protocol declares public members only;
* no caller asks which backend it has (``backend.simulated``) or uses a backend's private
  member: what differs is a capability of the ``Backend`` interface;
* the modules import each other without cycles (``TYPE_CHECKING`` imports aside);
* no module is longer than about 600 lines without a reason written at its top;
* ``__all__`` names every public name of the package (what ``from aresidency import *`` gives).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[1] / "aresidency"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _private_members(path: Path, class_name: str) -> set[str]:
    """Names starting with one underscore that ``class_name`` defines or assigns on self."""
    names: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(sub.name)
                elif (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                    and isinstance(sub.ctx, ast.Store)
                ):
                    names.add(sub.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


MANAGER_PRIVATES = _private_members(PACKAGE / "runtime" / "manager.py", "ResidencyManager")
STATE_PRIVATES = _private_members(PACKAGE / "core" / "state.py", "ResidencyState")


def _attribute_uses(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr


def test_the_private_name_sets_are_found() -> None:
    # If these were empty the checks below would pass vacuously.
    assert {"_running", "_rt", "_state"} <= MANAGER_PRIVATES
    assert {"_values", "_locations", "_commit"} <= STATE_PRIVATES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_no_module_outside_the_runtime_touches_the_managers_privates(path: Path) -> None:
    name = _module_name(path)
    if name.startswith("aresidency.runtime"):
        return
    bad = [
        (line, attr)
        for line, attr in _attribute_uses(path)
        if attr in MANAGER_PRIVATES and not _defined_here(path, attr)
    ]
    assert not bad, f"{name} uses private members of ResidencyManager: {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_no_module_outside_core_and_runtime_touches_the_states_privates(path: Path) -> None:
    name = _module_name(path)
    if name.startswith(("aresidency.core", "aresidency.runtime")):
        return
    bad = [
        (line, attr)
        for line, attr in _attribute_uses(path)
        if attr in STATE_PRIVATES and not _defined_here(path, attr)
    ]
    assert not bad, f"{name} uses private members of ResidencyState: {bad}"


def _defined_here(path: Path, attr: str) -> bool:
    """Whether the module defines a member of that name itself (then ``self.<attr>`` is its
    own, not the manager's or the state's)."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            return True
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and node.attr == attr
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            return True
    return False


def test_the_checks_catch_a_module_that_climbs_in_through_the_window(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(manager):\n    return manager._rt.state\n")
    uses = [attr for _, attr in _attribute_uses(bad) if attr in MANAGER_PRIVATES]
    assert uses == ["_rt"]


def test_manager_like_declares_public_members_only() -> None:
    tree = _tree(PACKAGE / "controller" / "controller.py")
    protocol = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "ManagerLike"
    )
    members: list[str] = []
    for node in protocol.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.append(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.append(node.target.id)
    assert members, "ManagerLike declares nothing"
    assert [m for m in members if m.startswith("_")] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_no_caller_asks_which_backend_it_has(path: Path) -> None:
    name = _module_name(path)
    if name.startswith("aresidency.backends"):
        return
    asks = [line for line, attr in _attribute_uses(path) if attr == "simulated"]
    assert not asks, f"{name} asks backend.simulated at lines {asks}: use a capability"


def _runtime_imports(path: Path) -> set[str]:
    """The ``aresidency`` modules ``path`` imports when it runs (not under TYPE_CHECKING)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    tree = _tree(path)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                skipped.add(id(sub))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module.startswith("aresidency"):
                for alias in node.names:
                    candidate = f"{module}.{alias.name}"
                    out.add(candidate if candidate in NAMES else module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("aresidency"))
    return {m for m in out if m in NAMES and m != name}


NAMES = {_module_name(p) for p in MODULES}


def test_modules_import_each_other_without_cycles() -> None:
    graph = {_module_name(p): _runtime_imports(p) for p in MODULES}
    # A package's __init__ re-exports its modules; importing a sibling through the package
    # is what makes a cycle, so the edges into __init__ modules count as well.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    # Packages re-exporting their own modules form a harmless cycle with them (the __init__
    # imports the module; the module never imports the __init__ back): only cycles between
    # two modules, or through another package, count.
    real = [c for c in cycles if not _only_package_reexports(c, graph)]
    assert not real, f"import cycles: {real}"


def _only_package_reexports(component: list[str], graph: dict[str, set[str]]) -> bool:
    inits = {
        n for n in component if (PACKAGE.parent / n.replace(".", "/") / "__init__.py").exists()
    }
    modules = [n for n in component if n not in inits]
    return not any(target in modules for m in modules for target in graph[m])


LONG = 600


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_long_modules_say_why_at_the_top(path: Path) -> None:
    lines = path.read_text().splitlines()
    if len(lines) <= LONG:
        return
    docstring = ast.get_docstring(_tree(path)) or ""
    assert "Why this module is long" in docstring, (
        f"{_module_name(path)} has {len(lines)} lines: split it along its jobs, or say at its top "
        "why it is one module ('Why this module is long: ...')"
    )


@pytest.mark.anyio
async def test_worker_threads_compute_with_the_loop_threads_intra_op_thread_count() -> None:
    """Torch keeps the intra-op thread count per thread and trio reuses its worker threads
    across tests: the count is set once for the run (tests/conftest.py), so a worker thread
    (where shared calls and loads run) rounds a matmul as the loop's thread does."""
    assert await anyio.to_thread.run_sync(torch.get_num_threads) == torch.get_num_threads() == 1


def test_star_import_gives_every_public_name_of_the_package() -> None:
    """``from aresidency import *`` left out ``ModelPool`` and ``DeviceLoader`` (importable by
    name, but missing from ``__all__``)."""
    import types

    import aresidency

    public = {
        name
        for name in dir(aresidency)
        if not name.startswith("_") and not isinstance(getattr(aresidency, name), types.ModuleType)
    }
    assert public <= set(aresidency.__all__), sorted(public - set(aresidency.__all__))
    namespace: dict[str, object] = {}
    exec("from aresidency import *", namespace)
    assert {"ModelPool", "DeviceLoader", "ResidencyManager"} <= namespace.keys()
