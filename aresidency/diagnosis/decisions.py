"""Steps 5 and 6: a controller decision's evidence (or its search bound), and the changes that
made a decision stale."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..core.trace import Transition
from ._facts import (
    Errors,
    action_text,
    first,
    found_a_plan,
    handle_of,
    label,
    make_step,
    size,
    sub_items,
    truncate,
)
from .classify import TRANSITION_CATEGORIES
from .evidence import Evidence
from .report import DiagnosisStep

__all__ = ["step_5", "step_6"]

# The reason of a request the search found infeasible (controller.search._infeasible_reason);
# any other "request ..." reason is the request's validation refusing it before a search.
_SEARCHED = re.compile(r"request (?:'[^']*'|\"[^\"]*\") is infeasible\b")


def step_5(errors: Errors, evidence: Evidence | None) -> DiagnosisStep | None:
    """A controller decision's evidence, a search limit's bound, or a controller's
    infeasibility verdict."""
    findings: list[str] = []
    data: dict[str, Any] = {}
    action: str | None = None
    limit = first(errors, "ResidencySearchLimitError")
    decision = next((e["decision"] for e in errors if isinstance(e.get("decision"), Mapping)), None)
    if limit is not None:
        findings.append(
            f"search for request {limit.get('request_name')!r} stopped at its bound: "
            f"state_limit={limit.get('state_limit')}, explored_states="
            f"{limit.get('explored_states')} ({limit.get('detail')})"
        )
        if found_a_plan(limit):
            findings.append(
                "a feasible plan was found before the bound (the best so far above), but "
                "whether it is the cheapest is unknown, so the search made no decision: this "
                "is not a verdict of infeasibility"
            )
        else:
            findings.append("feasibility is unknown: this is not proof that no placement exists")
        data.update(
            request_name=limit.get("request_name"),
            state_limit=limit.get("state_limit"),
            explored_states=limit.get("explored_states"),
            detail=limit.get("detail"),
            plan_found=found_a_plan(limit),
        )
        action = (
            "confirm the request and its fallback graph are intended, then reduce unneeded "
            "alternatives or raise search_state_limit"
        )
    if isinstance(decision, Mapping):
        request = decision.get("request") or {}
        findings.append(
            f"decision for request {request.get('name')!r} derived at state version "
            f"{decision.get('expected_state_version')}: explored_states="
            f"{decision.get('explored_states')} (bounded search work, not an eviction count "
            "or a score)"
        )
        placements = decision.get("placements") or []
        if placements:
            rows = []
            for placement in placements:
                if isinstance(placement, Mapping):
                    requirement = placement.get("requirement") or {}
                    rank = placement.get("fallback_rank", 0)
                    mark = "" if not rank else f" (fallback #{rank})"
                    rows.append(
                        f"{label(handle_of(requirement.get('handle')))} @ "
                        f"{placement.get('location')}{mark}"
                    )
            findings.append("placements: " + "; ".join(rows))
        evictions = [e for e in decision.get("evictions") or () if isinstance(e, Mapping)]
        rows = []
        for eviction in evictions:
            destination = eviction.get("destination")
            goes = "dropped" if destination is None else f"-> {destination}"
            rows.append(
                f"evicts {label(handle_of(eviction.get('handle')))} @ {eviction.get('location')}"
                f" {size(eviction.get('charge_bytes'))} {goes}: {eviction.get('reason')}"
            )
        findings.extend(truncate(rows) if rows else ["no evictions"])
        plan = decision.get("plan") or {}
        if isinstance(plan, Mapping):
            for phase in ("reclaim", "reserve", "enter", "exit"):
                items = plan.get(phase) or []
                if items:
                    findings.append(f"plan.{phase}: " + ", ".join(action_text(a) for a in items))
        explanation = decision.get("explanation") or {}
        peaks = explanation.get("predicted_peak_bytes") if isinstance(explanation, Mapping) else {}
        if peaks:
            findings.append(
                "predicted peaks: " + ", ".join(f"{loc} {size(n)}" for loc, n in peaks.items())
            )
        data.update(
            request=request.get("name"),
            expected_state_version=decision.get("expected_state_version"),
            explored_states=decision.get("explored_states"),
            evictions=evictions,
            placements=placements,
            predicted_peak_bytes=peaks or {},
        )
    if limit is None and decision is None:
        plan_error = first(errors, "ResidencyPlanError")
        reason = "" if plan_error is None else str(plan_error.get("reason", ""))
        if plan_error is None or not reason.startswith("request "):
            return None
        if _SEARCHED.match(reason):
            findings.append(
                "the controller's search (exhaustive within its bound) found the request "
                f"infeasible for the current state: {reason}"
            )
            action = (
                "review the request's requirements and fallbacks against the budgets and "
                "protections; derive a fresh decision once the state changed"
            )
        else:
            # Refused by the request's validation: no search ran, and no change of the state
            # or of a budget would make this request admissible.
            findings.append(f"the controller refused the request before any search: {reason}")
            data["searched"] = False
            action = (
                "correct the request as the reason says (step 2 checks each requirement); "
                "it is invalid whatever the state"
            )
    return make_step(5, findings, data, action)


def step_6(errors: Errors, evidence: Evidence | None) -> DiagnosisStep | None:
    """The versions of a stale decision and the transitions that came in between."""
    stale = first(errors, "ResidencyStaleStateError")
    if stale is None:
        return None
    expected = int(stale.get("expected_version", 0))
    actual = int(stale.get("actual_version", 0))
    gap = max(0, actual - expected)
    findings = [
        f"the decision expected state version {expected}; the manager was at {actual}: {gap} "
        "transition(s) came in between, and the scope changed nothing"
    ]
    data: dict[str, Any] = {"expected_version": expected, "actual_version": actual}
    if evidence is None:
        findings.append("the intervening transitions need the manager's trace (pass manager=)")
    else:
        between: tuple[Transition, ...] = evidence.trace.between(expected, actual)
        categories = Counter(TRANSITION_CATEGORIES.get(t.kind, t.kind) for t in between)
        if between:
            findings.append(
                "what changed: "
                + ", ".join(f"{category} x{count}" for category, count in categories.items())
            )
            findings.extend(sub_items([str(t) for t in between]))
        missing = gap - len(between)
        if missing > 0:
            findings.append(
                f"the trace no longer holds {missing} of them (disabled, or overwritten: raise "
                "trace_capacity to keep them)"
            )
        if evidence.snapshot.state_version > actual:
            findings.append(
                f"the state has moved on since, to version {evidence.snapshot.state_version}"
            )
        data.update(
            intervening=[t.to_dict() for t in between],
            categories=dict(categories),
            missing=max(0, missing),
        )
    action = (
        "if the request still holds, derive a new decision (controller.decide(request)) and "
        "review its evidence; never replay the old one, its victims and peaks may have changed"
    )
    return make_step(6, findings, data, action)
