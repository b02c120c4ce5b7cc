"""The first and last steps: what state the evidence is from, and what the error means.

Step 1 records the state view (manager, version, the trace's coverage) and the error's own
fields; step 8 classifies the error type and says what to do first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.errors import LOAD_NOTE_PREFIX
from ..core.sizes import format_nbytes
from ._facts import (
    Errors,
    capped,
    chain,
    error_fields,
    found_a_plan,
    handles_in,
    make_step,
    sub_items,
)
from .evidence import Evidence
from .report import DiagnosisStep

__all__ = ["CLASSIFICATION", "TRANSITION_CATEGORIES", "step_1", "step_8"]


#: Per error type: what it means and the first thing to do (the classification step).
CLASSIFICATION: Mapping[str, tuple[str, str]] = {
    "ResidencyBudgetError": (
        "a direct materialization or reservation would take one location over its strict "
        "budget; nothing was charged",
        "reconcile the five byte fields and the missing headroom (step 3) before changing the "
        "budget",
    ),
    "ResidencyPlanError": (
        "the plan or request is invalid, or infeasible for the current state, before any of "
        "its actions began; nothing changed",
        "read the explanation, the endpoints, the budgets and the protections (steps 2 to 4)",
    ),
    "ResidencySearchLimitError": (
        "the controller's bounded search stopped at its state limit: feasibility is unknown, "
        "not disproved",
        "record the search evidence (step 5); simplify the request's alternatives, or justify "
        "a larger search_state_limit",
    ),
    "ResidencyStaleStateError": (
        "the decision was derived from an older state version; nothing changed",
        "identify the intervening change (step 6) and derive and review a new decision if the "
        "request still holds",
    ),
    "ResidencyInUseError": (
        "a lease, a hold or a pending consumer event protects the materialization a removal needs",
        "end the owning lifetime (step 4) or defer the removal",
    ),
    "ResidencyUnavailableError": (
        "a direct operation needs an endpoint or a source that is absent",
        "establish the exact endpoint, or a valid way to rebuild it, first (step 2)",
    ),
    "ResidencyPlanExecutionError": (
        "execution failed after preflight; what it committed before the failure stays",
        "read the phase, the failed entry, the cause and what stays in effect (step 7), then "
        "continue from a fresh snapshot",
    ),
}

#: What kind of change each transition kind is (for a stale decision's intervening changes).
TRANSITION_CATEGORIES: Mapping[str, str] = {
    "register": "ownership",
    "discard": "ownership",
    "copy_begin": "placement",
    "copy_commit": "placement",
    "copy_abort": "placement",
    "move_begin": "placement",
    "move_commit": "placement",
    "load_begin": "placement",
    "load_commit": "placement",
    "rebuild_temp": "placement",
    "rebuild_abort": "placement",
    "release": "placement",
    "invalidate": "placement",
    "reserve": "reservation",
    "unreserve": "reservation",
    "lease": "protection",
    "unlease": "protection",
    "hold": "protection",
    "unhold": "protection",
    "event_recorded": "protection",
    "event_reaped": "event reaping",
    "budget": "budget",
    "peak_reset": "peak reset",
}


def step_1(errors: Errors, evidence: Evidence | None) -> DiagnosisStep:
    """What state the evidence is from, how much history the trace keeps, what the error
    names."""
    findings: list[str] = []
    data: dict[str, Any] = {}
    error = errors[0] if errors else None
    if evidence is None:
        findings.append(
            "only the error was given: the manager's state is not known here; call "
            "diagnose(error, manager) while the manager exists, or diagnose a manager.dump file"
        )
    else:
        snap, trace = evidence.snapshot, evidence.trace
        findings.append(
            f"manager {snap.manager_id} at state version {snap.state_version}: "
            f"{len(snap.values)} value(s) over {len(snap.locations)} location(s), taken in one "
            "step with the trace"
        )
        kept = trace.transitions
        if not trace.enabled:
            findings.append(
                "the trace is disabled (trace_capacity=0): no history, only the current state"
            )
        else:
            span = f", versions {kept[0].state_version} to {kept[-1].state_version}" if kept else ""
            lost = (
                f"; {trace.overwritten} older transition(s) were overwritten"
                if trace.overwritten
                else "; nothing was overwritten"
            )
            findings.append(
                f"the trace keeps {len(kept)} transition(s) of capacity {trace.capacity}"
                f"{span}{lost}"
            )
        data.update(
            manager_id=snap.manager_id,
            state_version=snap.state_version,
            values=len(snap.values),
            locations=[str(loc) for loc in sorted(snap.locations)],
            trace={
                "enabled": trace.enabled,
                "capacity": trace.capacity,
                "kept": len(kept),
                "overwritten": trace.overwritten,
                "first_version": kept[0].state_version if kept else None,
                "last_version": kept[-1].state_version if kept else None,
            },
        )
        capped(data, "owners", [owner.to_dict() for owner in evidence.owners])
        capped(data, "room_waits", [wait.to_dict() for wait in evidence.room_waits])
        if evidence.room_waits:
            findings.append(
                f"{len(evidence.room_waits)} wait(s) for room registered: "
                + "; ".join(
                    f"task {w.task} waits for {w.what} ({format_nbytes(w.nbytes)} at {w.location})"
                    for w in evidence.room_waits
                )
            )
            if evidence.owners:
                # What a wait may be waiting on: who protects what now (a hang's other half).
                findings.append(f"{len(evidence.owners)} active lease(s) and hold(s) now:")
                findings.extend(
                    sub_items(
                        [
                            f"task {o.task!r}: {o.kind} on {o.handle} @ {o.location}"
                            for o in evidence.owners
                        ]
                    )
                )
    if error is not None:
        handles = handles_in(error)
        if handles:
            findings.append("values the error names: " + ", ".join(str(h) for h in handles))
        fields = error_fields(error)
        if fields:
            findings.append(
                "error fields: " + ", ".join(f"{key}={value}" for key, value in fields.items())
            )
        data["handles"] = [h.to_dict() for h in handles]
        data["fields"] = fields
        if evidence is not None:
            foreign = [h for h in handles if h.manager_id != evidence.snapshot.manager_id]
            if foreign:
                findings.append(
                    "handles of another manager: "
                    + ", ".join(f"{h} (of {h.manager_id})" for h in foreign)
                )
    else:
        findings.append("no error was recorded: this is the state only")
    return make_step(1, findings, data)


def step_8(errors: Errors, evidence: Evidence | None) -> DiagnosisStep:
    """What the error type means and the first thing to do about it."""
    error = errors[0] if errors else None
    name = None if error is None else str(error.get("type"))
    if name is not None and name in CLASSIFICATION:
        meaning, first_action = CLASSIFICATION[name]
        findings = [f"{name}: {meaning}"]
        if name == "ResidencySearchLimitError" and error is not None and found_a_plan(error):
            # The bound cut the search short after a feasible plan: only its cost is unknown.
            meaning = (
                "the controller's bounded search stopped at its state limit after it had found "
                "a feasible plan: whether that plan is the cheapest is unknown, so no decision "
                "was made"
            )
            findings = [f"{name}: {meaning}"]
        if name in ("ResidencySearchLimitError", "ResidencyStaleStateError"):
            findings.append(
                "a specialized ResidencyPlanError: catch it before ResidencyPlanError when its "
                "evidence needs different handling"
            )
        if name == "ResidencyBudgetError" and error is not None and error.get("kind") == "budget":
            # set_budget refused: not a request over the budget but a budget under the charge
            meaning = (
                "a new budget (set_budget) would be below what one location already charges; "
                "the budget was not changed"
            )
            first_action = (
                "reconcile the charge there with the new budget (step 3): free that much first, "
                "or keep a budget no lower than the charge"
            )
            findings = [f"{name}: {meaning}"]
        if name == "ResidencyInUseError" and error is not None and error.get("transfer"):
            findings.append(
                f"here a transfer in flight ({error.get('transfer')}) protects it, not a lease, "
                "a hold or a reader event: await the transfer (or cancel it) first"
            )
        if name == "ResidencyPlanExecutionError":
            findings.append(
                "a sibling of ResidencyPlanError, not a subclass: it always needs an analysis "
                "of the partial state"
            )
        exit_error = None if error is None else error.get("scope_exit_error")
        if isinstance(exit_error, Mapping):
            # The body's error is ours and stays primary; the exit's failure is evidence too.
            findings.append(
                f"the scope's exit failed too (scope.exit_error, a {exit_error.get('type')}): "
                "diagnose it on its own for what its exit committed"
            )
    elif name is None:
        meaning, first_action = "no error", "nothing failed: read the state above"
        findings = ["no error was recorded"]
    else:
        meaning = "not an aresidency error"
        first_action = "handle it as its own type; the manager's evidence is above"
        findings = [f"{name}: {meaning}"]
        notes = None if error is None else error.get("notes")
        for note in notes if isinstance(notes, list) else ():
            findings.append(f"its note: {note}")
            if str(note).startswith(LOAD_NOTE_PREFIX):
                # A source's load() failed while the runtime rebuilt a value: the source's error.
                first_action = (
                    "a value's source failed to load it (the note names the value, where it "
                    "was going and the source): fix what the source reads, or register the "
                    "value with a source that can load it; nothing was placed by that load"
                )
        # An exception group (what a task group raises) or an error raised from one of ours:
        # the aresidency error it carries is the one to classify.
        inner = next((e for e in errors[1:] if str(e.get("type")) in CLASSIFICATION), None)
        if inner is not None:
            inner_name = str(inner.get("type"))
            inner_meaning, first_action = CLASSIFICATION[inner_name]
            exit_error = None if error is None else error.get("scope_exit_error")
            if isinstance(exit_error, Mapping) and any(inner is e for e in chain(exit_error)):
                how = (
                    "as its scope's failed exit (scope.exit_error; the body's error stays primary)"
                )
            elif error is not None and "exceptions" in error:
                how = "in its group"
            else:
                how = "as its cause"
            findings.append(f"it carries a {inner_name} {how}: {inner_meaning}")
    data = {"type": name, "meaning": meaning, "first_action": first_action}
    return make_step(8, findings, data, first_action)
