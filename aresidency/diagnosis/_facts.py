"""Small readers shared by the diagnosis steps: sizes, handles, locations and error dicts.

The steps read an error's ``to_dict`` (so that a live error and one read back from a dump give
the same report); these helpers turn its JSON-able fields back into handles and locations and
print sizes as ``torch.cuda.memory_summary`` does, beside the exact byte count.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.snapshot import ValueSnapshot
from ..core.trace import Transition
from ..core.values import MaterializationState, ValueHandle
from .evidence import Evidence, transition_from_dict
from .report import STEP_TITLES, SUB_ITEM, DiagnosisStep

__all__ = [
    "PARENTS",
    "found_a_plan",
    "Errors",
    "MAX_EVIDENCE_ITEMS",
    "action_text",
    "capped",
    "error_fields",
    "first",
    "make_step",
    "value_of",
    "where",
    "chain",
    "handle_of",
    "handles_in",
    "is_a",
    "label",
    "location_of",
    "size",
    "sub_items",
    "transitions_of",
    "truncate",
]

#: The hierarchy by name (the steps read dicts): each error type's parent.
PARENTS: Mapping[str, str] = {
    "ResidencyBudgetError": "ResidencyError",
    "ResidencyPlanError": "ResidencyError",
    "ResidencySearchLimitError": "ResidencyPlanError",
    "ResidencyStaleStateError": "ResidencyPlanError",
    "ResidencyInUseError": "ResidencyError",
    "ResidencyUnavailableError": "ResidencyError",
    "ResidencyPlanExecutionError": "ResidencyError",
}

#: The error chain the steps read: an error's ``to_dict`` and its nested causes.
Errors = Sequence[Mapping[str, Any]]

#: Lists longer than this are cut in the findings (the evidence keeps more: see below).
MAX_LINES = 20

#: Lists of values, leases or waits longer than this are cut in a step's evidence, with how
#: many were left out (``<key>_left_out``): a report is for logs (``report.to_dict()``), and a
#: manager holds any number of values; the snapshot (and a dump) has every one of them.
MAX_EVIDENCE_ITEMS = 64


def size(nbytes: Any) -> str:
    """``36864`` -> ``'36864 B (36 KiB)'`` (exact bytes, then torch's rounded form);
    ``None`` -> ``'no budget'``."""
    if nbytes is None:
        return "no budget"
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        return str(nbytes)
    text = format_nbytes(nbytes)
    exact = f"{nbytes} B"
    return exact if text == exact else f"{exact} ({text})"


def handle_of(data: Any) -> ValueHandle | None:
    """The handle a ``ValueHandle.to_dict`` described, or ``None``."""
    if isinstance(data, Mapping) and "value_id" in data and "manager_id" in data:
        return ValueHandle.from_dict(dict(data))
    return None


def location_of(data: Any) -> Location | None:
    if isinstance(data, str):
        try:
            return Location.parse(data)
        except ValueError:
            return None
    return None


def label(handle: ValueHandle | None) -> str:
    return "(no value)" if handle is None else str(handle)


def is_a(error: Mapping[str, Any] | None, name: str) -> bool:
    """Whether the error dict's type is ``name`` or a subclass of it."""
    current = None if error is None else error.get("type")
    while current is not None:
        if current == name:
            return True
        current = PARENTS.get(current)
    return False


def chain(error: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The error dict and its nested causes, outermost first. An exception group (a task
    group's) without a cause goes on with its member that is, or was caused by, an aresidency
    error (else its first member)."""
    out: list[Mapping[str, Any]] = []
    outermost = error
    while isinstance(error, Mapping) and len(out) < 16:
        out.append(error)
        following = error.get("cause")
        if following is None:
            following = _group_member(error)
        error = following
    exit_error = outermost.get("scope_exit_error") if isinstance(outermost, Mapping) else None
    if isinstance(exit_error, Mapping) and not any(_ours(e) for e in out):
        # A scope body's exception that is not ours, and the scope's exit failed too: the
        # exit failure (scope.exit_error) is the residency evidence it carries.
        out.extend(chain(exit_error)[: 16 - len(out)])
    return out


def _ours(error: Mapping[str, Any]) -> bool:
    return str(error.get("type", "")).startswith("Residency")


def _group_member(error: Mapping[str, Any]) -> Mapping[str, Any] | None:
    members = [m for m in error.get("exceptions") or () if isinstance(m, Mapping)]
    for member in members:
        if any(str(e.get("type", "")).startswith("Residency") for e in chain(member)):
            return member
    return members[0] if members else None


def first(errors: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((e for e in errors if is_a(e, name)), None)


def handles_in(data: Any) -> list[ValueHandle]:
    """Every handle named anywhere in a JSON-able structure, each once, in order."""
    found: dict[ValueHandle, None] = {}

    def walk(item: Any, depth: int) -> None:
        if depth > 12:
            return
        handle = handle_of(item)
        if handle is not None:
            found.setdefault(handle)
            return
        if isinstance(item, Mapping):
            for value in item.values():
                walk(value, depth + 1)
        elif isinstance(item, list):
            for value in item:
                walk(value, depth + 1)

    walk(data, 0)
    return list(found)


def transitions_of(report: Any) -> tuple[list[Transition], set[int]]:
    """The transitions of an ``ExecutionReport.to_dict`` and the seqs of those in effect."""
    if not isinstance(report, Mapping):
        return [], set()
    transitions = [transition_from_dict(t) for t in report.get("transitions", ())]
    in_effect = {int(seq) for seq in report.get("in_effect", ())}
    return transitions, in_effect


def capped(data: dict[str, Any], key: str, items: Sequence[Any]) -> None:
    """``data[key]``: the first :data:`MAX_EVIDENCE_ITEMS` of ``items``, and
    ``data[key + "_left_out"]``: how many more there were (only when some were)."""
    data[key] = list(items[:MAX_EVIDENCE_ITEMS])
    if len(items) > MAX_EVIDENCE_ITEMS:
        data[f"{key}_left_out"] = len(items) - MAX_EVIDENCE_ITEMS


def truncate(lines: Sequence[str], limit: int = MAX_LINES) -> Iterator[str]:
    """``lines``, cut after ``limit`` with a line saying how many more there are."""
    yield from lines[:limit]
    if len(lines) > limit:
        yield f"... and {len(lines) - limit} more (see the evidence)"


def sub_items(lines: Sequence[str], limit: int = MAX_LINES) -> Iterator[str]:
    """:func:`truncate`, each line marked as an item of the finding before it."""
    return (SUB_ITEM + line for line in truncate(lines, limit))


def make_step(
    number: int,
    findings: list[str],
    evidence: Mapping[str, Any],
    action: str | None = None,
) -> DiagnosisStep:
    return DiagnosisStep(number, STEP_TITLES[number], tuple(findings), dict(evidence), action)


def value_of(evidence: Evidence | None, handle: ValueHandle | None) -> ValueSnapshot | None:
    if evidence is None or handle is None:
        return None
    return evidence.snapshot.values.get(handle)


def where(value: ValueSnapshot) -> str:
    parts = []
    for record in value.materializations:
        state = "" if record.state is MaterializationState.RESIDENT else f" ({record.state.value})"
        parts.append(f"{record.location}{state}")
    return ", ".join(parts) or "nowhere"


def error_fields(error: Mapping[str, Any]) -> dict[str, Any]:
    """The error's scalar fields (what step 1 records; a field that repeats the message, as
    a plan error's ``reason`` does, is left out)."""
    skip = {"type", "message", "cause", "notes"}
    message = str(error.get("message", ""))
    out: dict[str, Any] = {}
    for key, value in error.items():
        if key in skip or isinstance(value, (Mapping, list)) or value is None:
            continue
        if isinstance(value, str) and len(value) > 40 and value in message:
            continue
        out[key] = value
    return out


def action_text(action: Any) -> str:
    """A plan entry (``to_jsonable`` form) as ``Move(w, cuda:0)``."""
    if not isinstance(action, Mapping):
        return str(action)
    kind = action.get("type", "action")
    if "nbytes" in action:
        nbytes = size(action.get("nbytes"))
        return f"{kind}({action.get('name')!r}, {action.get('location')}, {nbytes})"
    handle = handle_of(action.get("handle"))
    name = handle.name if handle is not None and handle.name else label(handle)
    return f"{kind}({name}, {action.get('location')})"


def found_a_plan(limit: Mapping[str, Any]) -> bool:
    """Whether a search limit error's search had found a feasible plan (``plan_found``; in a
    record written before that field existed, its detail names the best plan so far)."""
    found = limit.get("plan_found")
    if found is None:
        return "best plan so far" in str(limit.get("detail") or "")
    return bool(found)
