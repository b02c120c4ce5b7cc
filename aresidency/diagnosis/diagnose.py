"""``diagnose(error, manager=None)``: the troubleshooting walk for one error, evidence filled in.

The report is built from the error's ``to_dict`` and the manager's
:class:`~aresidency.diagnosis.evidence.Evidence` (snapshot, trace, lease owners), the same two
things ``manager.dump`` writes; :func:`diagnose_dump` builds it from such a file, so a live
diagnosis and one read back later print the same report.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..core.errors import exception_to_dict
from .evidence import Evidence, collect, read_dump
from .report import DiagnosisReport
from .steps import walk

__all__ = ["build_report", "diagnose", "diagnose_dump"]

# The order in which steps' actions are preferred as the report's next action: the most
# specific evidence first.
_ACTION_ORDER = (6, 4, 2, 3, 5, 7, 8)
# For these types the step that names the first corrective action.
_PRIMARY_STEP = {
    "ResidencyBudgetError": 3,
    "ResidencyInUseError": 4,
    "ResidencyUnavailableError": 2,
    "ResidencySearchLimitError": 5,
    "ResidencyStaleStateError": 6,
    "ResidencyPlanExecutionError": 7,
}


def build_report(error: Mapping[str, Any] | None, evidence: Evidence | None) -> DiagnosisReport:
    """The report for ``error`` (its ``to_dict``; ``None`` for a state-only dump) with
    ``evidence`` (``None``: only what the error carries)."""
    steps = walk(error, evidence)
    by_number = {step.number: step for step in steps}
    error_type = None if error is None else str(error.get("type"))
    preferred = _PRIMARY_STEP.get(error_type or "")
    order = ((preferred,) if preferred is not None else ()) + _ACTION_ORDER
    endpoint = by_number.get(2)
    if endpoint is not None and endpoint.evidence.get("belongs") is False:
        # The error names a handle of another manager: every "now" fact of this manager's
        # state is beside the point, so the endpoint's action comes first.
        order = (2, *order)
    actions = [by_number[n].action for n in order if n in by_number]
    next_action = next((a for a in actions if a), "nothing failed: read the state above")
    if error_type == "ResidencyPlanExecutionError":
        cause_action = next(
            (by_number[n].action for n in (3, 4, 2) if n in by_number and by_number[n].action),
            None,
        )
        if cause_action:
            next_action = f"{next_action}; about the cause: {cause_action}"
    message = "no error was recorded" if error is None else str(error.get("message", ""))
    return DiagnosisReport(
        error_type=error_type,
        message=message,
        manager_id=None if evidence is None else evidence.snapshot.manager_id,
        state_version=None if evidence is None else evidence.snapshot.state_version,
        steps=tuple(steps),
        next_action=next_action,
        error=None if error is None else dict(error),
    )


def diagnose(error: BaseException, manager: Any = None) -> DiagnosisReport:
    """Walk the troubleshooting steps for ``error`` with the evidence filled in.

    With ``manager`` (running or closed) the report reads its snapshot, trace and lease owners,
    taken now in one synchronous step (on the manager's loop thread while it runs; the host
    waits for nothing), and, for an error raised at a scope's entry, ``explain`` of its plan
    against the current state. With ``manager=None`` it uses only what the error carries.
    Call it as soon as the error is caught: later changes to the state are not the failure's.
    ``str(report)`` is for people, ``report.to_dict()`` for logs."""
    if not isinstance(error, BaseException):
        raise TypeError(
            f"diagnose takes the exception that was raised, got {error!r} ({type(error).__name__})"
        )
    from ..runtime.manager import ResidencyManager

    if manager is not None and not isinstance(manager, ResidencyManager):
        raise TypeError(
            f"diagnose's second argument is the ResidencyManager (or None), got "
            f"{type(manager).__name__}; for a saved state use manager.dump and diagnose_dump"
        )
    evidence = None if manager is None else collect(manager, error)
    return build_report(exception_to_dict(error), evidence)


def diagnose_dump(path: str | os.PathLike[str]) -> DiagnosisReport:
    """The report for a file ``manager.dump`` wrote (``ValueError`` for a file that is not
    one)."""
    error, evidence = read_dump(path)
    return build_report(error, evidence)
