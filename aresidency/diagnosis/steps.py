"""The steps of a diagnosis, walked in order for one error.

Each step is a function ``step(errors, evidence)`` of its own module: it reads the error chain
(the error's ``to_dict`` and its nested causes, outermost first) and, when a manager's
:class:`~aresidency.diagnosis.evidence.Evidence` is at hand, its snapshot, trace and lease
owners; it returns a :class:`~aresidency.diagnosis.report.DiagnosisStep` with the numbers
filled in, or ``None`` when it does not apply to that error. Steps never raise on a missing
field: evidence from an old dump, or an error of another library, gives fewer findings.

=====  =================  ===============================================================
step   module             what it reads
=====  =================  ===============================================================
1      ``classify``       the state view and its trace coverage; the error's fields
2      ``endpoint``       the (handle, location) pair and the value's snapshot
3      ``budget``         the five byte fields, the room now, the plan's explained peaks
4      ``protection``     leases, holds and pending events, and the owning tasks
5      ``decisions``      a decision's evidence, a search bound, an infeasible request
6      ``decisions``      a stale decision's versions and the transitions in between
7      ``execution``      the failed entry, its cause, what stays in effect
8      ``classify``       what the error type means and the first thing to do
=====  =================  ===============================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._facts import Errors, chain
from .budget import step_3
from .classify import step_1, step_8
from .decisions import step_5, step_6
from .endpoint import step_2
from .evidence import Evidence
from .execution import step_7
from .protection import step_4
from .report import DiagnosisStep

__all__ = ["STEPS", "walk"]

#: Every step, in order.
STEPS: tuple[Callable[[Errors, Evidence | None], DiagnosisStep | None], ...] = (
    step_1,
    step_2,
    step_3,
    step_4,
    step_5,
    step_6,
    step_7,
    step_8,
)


def walk(error: Mapping[str, Any] | None, evidence: Evidence | None) -> list[DiagnosisStep]:
    """The steps that apply to ``error`` (``to_dict`` form) with ``evidence``, in order."""
    errors = chain(error)
    out = []
    for step in STEPS:
        result = step(errors, evidence)
        if result is not None:
            out.append(result)
    return out
