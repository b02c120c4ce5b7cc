"""The report :func:`~aresidency.diagnose` returns: numbered steps of evidence and what to do.

A :class:`DiagnosisReport` is plain data: ``str(report)`` is the text people read (a section
per step), ``report.to_dict()`` the JSON-able form for logs, and :meth:`DiagnosisReport.render`
draws it with ``rich`` when that optional library is installed (``pip install
aresidency[diagnose]``), as ``python -m aresidency diagnose`` does on a terminal.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: A finding that starts with this belongs to the finding above it (a list under a heading);
#: the report prints it indented one level.
SUB_ITEM = "  "

__all__ = ["STEP_TITLES", "DiagnosisReport", "DiagnosisStep"]

#: The steps of a diagnosis, in the order they are walked.
STEP_TITLES: Mapping[int, str] = {
    1: "State captured",
    2: "Endpoint",
    3: "Budget arithmetic",
    4: "Protection",
    5: "Decision evidence",
    6: "Stale decision",
    7: "Partial execution",
    8: "Classification",
}

_WIDTH = 100


@dataclass(frozen=True, slots=True)
class DiagnosisStep:
    """One step: ``findings`` (sentences with the numbers filled in), ``evidence`` (the same
    facts as JSON-able data, for tests and logs) and ``action`` (what to do, if this step
    points at something)."""

    number: int
    title: str
    findings: tuple[str, ...]
    evidence: Mapping[str, Any] = field(default_factory=dict)
    action: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "title": self.title,
            "findings": list(self.findings),
            "evidence": dict(self.evidence),
            "action": self.action,
        }

    def text(self) -> str:
        lines = [f"Step {self.number}. {self.title}"]
        for finding in self.findings:
            # An item of the finding above it (a list under a heading) is indented one level.
            nested = finding.startswith(SUB_ITEM)
            first, rest = ("    - ", "      ") if nested else ("  - ", "    ")
            lines.extend(
                textwrap.wrap(finding.strip(), _WIDTH, initial_indent=first, subsequent_indent=rest)
                or [first.rstrip()]
            )
        if self.action:
            lines.extend(
                textwrap.wrap(
                    f"Do: {self.action}", _WIDTH, initial_indent="  ", subsequent_indent="    "
                )
            )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class DiagnosisReport:
    """What :func:`~aresidency.diagnose` found for one error.

    ``error_type`` and ``message`` are the error's (``None`` and a note for a dump without an
    error); ``manager_id`` and ``state_version`` say which state the evidence came from
    (``None`` when only the error was given); ``steps`` are ordered by number (those that do
    not apply to the error are left out); ``next_action`` is the first thing to do;
    ``error`` is the error's ``to_dict``."""

    error_type: str | None
    message: str
    manager_id: str | None
    state_version: int | None
    steps: tuple[DiagnosisStep, ...]
    next_action: str
    error: Mapping[str, Any] | None = None

    def step(self, number: int) -> DiagnosisStep:
        """The step with that number; ``LookupError`` naming the steps present."""
        for step in self.steps:
            if step.number == number:
                return step
        present = ", ".join(str(s.number) for s in self.steps)
        raise LookupError(f"this report has no step {number} (it has steps {present})")

    def has_step(self, number: int) -> bool:
        return any(step.number == number for step in self.steps)

    def _header(self) -> str:
        what = self.error_type or "no error"
        where = (
            f" (manager {self.manager_id} at state version {self.state_version})"
            if self.manager_id is not None
            else " (from the error alone)"
        )
        return f"aresidency diagnosis: {what}{where}"

    def __str__(self) -> str:
        parts = [self._header()]
        parts.extend(
            textwrap.wrap(self.message, _WIDTH, initial_indent="  ", subsequent_indent="  ")
        )
        for step in self.steps:
            parts.append("")
            parts.append(step.text())
        parts.append("")
        parts.extend(
            textwrap.wrap(f"Next action: {self.next_action}", _WIDTH, subsequent_indent="  ")
        )
        return "\n".join(parts)

    def __repr__(self) -> str:
        numbers = ",".join(str(s.number) for s in self.steps)
        return f"<DiagnosisReport {self.error_type or 'no error'} steps={numbers}>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "error_type": self.error_type,
            "message": self.message,
            "manager_id": self.manager_id,
            "state_version": self.state_version,
            "steps": [step.to_dict() for step in self.steps],
            "next_action": self.next_action,
            "error": None if self.error is None else dict(self.error),
        }

    def render(self, console: Any = None) -> None:
        """Print the report with ``rich`` (a panel per step) on ``console`` (a
        ``rich.console.Console``; a new one on standard output by default). ``ImportError``
        without ``rich``: print ``str(report)`` instead."""
        from rich.console import Console, Group
        from rich.markup import escape
        from rich.panel import Panel
        from rich.text import Text

        console = console if console is not None else Console()
        console.print(Text(self._header(), style="bold"))
        console.print(Text(self.message))
        for step in self.steps:
            body: list[Any] = [
                Text(("  - " if finding.startswith(SUB_ITEM) else "- ") + finding.strip())
                for finding in step.findings
            ]
            if step.action:
                body.append(Text.from_markup(f"[bold]Do:[/bold] {escape(step.action)}"))
            console.print(Panel(Group(*body), title=f"Step {step.number}. {step.title}"))
        console.print(Text.from_markup(f"[bold]Next action:[/bold] {escape(self.next_action)}"))
