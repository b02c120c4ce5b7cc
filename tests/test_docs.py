"""The documentation is findable and says nothing that is not there.

* every reference page users are sent to by title (from docs/troubleshooting.md's steps and
  its "See also") is linked from ``docs/index.md`` under that title, and the link leads to a
  file;
* every relative link in ``README.md`` and ``docs/**/*.md`` leads to a file in the repository;
* every dotted ``aresidency.X`` name they mention resolves (a module, or an attribute of one),
  or is a string the package itself uses as a name (a reservation's, such as
  ``aresidency.staging``);
* no page cites design notes that are not in the repository;
* the API pages name every structured field of the exceptions and every field of the snapshot
  and decision records (so a field added to the code without documentation fails here).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

import aresidency
import aresidency.controller
import aresidency.core.errors as errors

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
DOTTED = re.compile(r"\baresidency(?:\.[A-Za-z_][A-Za-z0-9_]*)+")

# The reference pages users are sent to by title, each with the page it must lead to.
REFERENCE_PAGES = {
    "Residency plans and execution internals": "docs/internals.md",
    "Residency lifetimes": "docs/lifetimes.md",
    "Automatic Residency tutorial": "docs/tutorial-automatic.md",
    "Explicit Residency tutorial": "docs/tutorial-explicit.md",
    "Automatic Example 14 source": "examples/14_automatic_decision_evidence.py",
    "ResidencySnapshot API": "docs/api/snapshot.md",
    "ResidencyDecision API": "docs/api/decision.md",
    "Residency exception API": "docs/api/exceptions.md",
}


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def _package_string_names() -> frozenset[str]:
    """String constants in the package's source that look like dotted aresidency names."""
    names: set[str] = set()
    for path in (ROOT / "aresidency").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(DOTTED.findall(node.value))
    return frozenset(names)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_pages_exist() -> None:
    names = {_page_id(path) for path in PAGES}
    for page in (
        "docs/index.md",
        "docs/tutorial-explicit.md",
        "docs/tutorial-automatic.md",
        "docs/lifetimes.md",
        "docs/internals.md",
        "docs/architecture.md",
        "docs/api/snapshot.md",
        "docs/api/decision.md",
        "docs/api/exceptions.md",
        "docs/api/manager.md",
    ):
        assert page in names, f"{page} is missing"


def test_every_reference_page_is_linked_from_the_index_under_its_title() -> None:
    index = ROOT / "docs" / "index.md"
    links = {text.strip("`*"): target for text, target in LINK.findall(index.read_text())}
    for title, page in REFERENCE_PAGES.items():
        assert title in links, f"docs/index.md has no link titled {title!r}"
        target = (index.parent / links[title].split("#")[0]).resolve()
        assert target == (ROOT / page).resolve(), f"{title!r} links to {links[title]}"
        assert target.is_file()


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_leads_to_a_file(page: Path) -> None:
    broken = []
    for _, target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{_page_id(page)} links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_dotted_aresidency_name_resolves(page: Path) -> None:
    names = set(DOTTED.findall(page.read_text()))
    bad = sorted(
        name for name in names if not _resolves(name) and name not in _package_string_names()
    )
    assert not bad, f"{_page_id(page)} names what does not exist: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_page_cites_notes_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    for name in ("DESIGN.md", "ANCHORS.md", "STYLE.md"):
        assert name not in text, f"{_page_id(page)} cites {name}, which is not in the repository"


def test_the_readme_no_longer_says_the_controller_never_waits() -> None:
    assert "controller never waits" not in (ROOT / "README.md").read_text()


def _documented(page: str) -> str:
    return (ROOT / "docs" / "api" / page).read_text()


def test_the_exception_page_names_every_structured_field() -> None:
    text = _documented("exceptions.md")
    for name in errors.__all__:
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, errors.ResidencyError):
            assert f"## {name}" in text or name == "ResidencyError", f"no section for {name}"
            for field in cls.FIELDS:
                assert f"`{field}`" in text, f"exceptions.md does not document {name}.{field}"
    assert "to_dict()" in text


@pytest.mark.parametrize(
    ("page", "names"),
    [
        (
            "snapshot.md",
            ("ResidencySnapshot", "LocationRecord", "ValueSnapshot", "MaterializationRecord"),
        ),
        ("decision.md", ("ResidencyDecision", "Eviction", "Placement")),
    ],
)
def test_the_record_pages_name_every_field(page: str, names: tuple[str, ...]) -> None:
    text = _documented(page)
    for name in names:
        cls = getattr(aresidency, name, None) or getattr(aresidency.controller, name)
        for field in dataclasses.fields(cls):
            if not field.name.startswith("_"):
                assert f"`{field.name}`" in text, f"{page} does not document {name}.{field.name}"
