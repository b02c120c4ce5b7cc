"""Step 3: the budget arithmetic of a refusal, what could free room now, and the plan's
explained peaks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.locations import Location
from ..core.values import MaterializationState, ValueHandle
from ._facts import (
    Errors,
    capped,
    first,
    handle_of,
    is_a,
    label,
    location_of,
    make_step,
    size,
    truncate,
)
from .evidence import Evidence
from .report import DiagnosisStep

__all__ = ["step_3"]


def _kind_text(error: Mapping[str, Any], handle: ValueHandle | None, location: str) -> str:
    kind = error.get("kind", "materialization")
    what = error.get("what") or ""
    if kind == "reservation":
        return f"a MemoryReservation at {location} ({what})"
    if kind == "reconstruction":
        return (
            f"temporary reconstruction storage for {label(handle)} at its source location "
            f"{location} (the load passes through there before its destination)"
        )
    if kind == "budget":
        return f"a new budget for {location} below what it already charges"
    target = label(handle) if handle is not None else (what or "a value")
    return f"a new materialization of {target} at {location}" + (
        f" ({what})" if what and handle is not None else ""
    )


def _explanation(errors: Errors, evidence: Evidence | None) -> tuple[Mapping[str, Any] | None, str]:
    """The plan's explanation, and when it was made: the failed decision's (the state the
    controller decided against, which may differ from the state at the dump), else the
    dump's own ``manager.explain(plan)``."""
    for error in errors:
        decision = error.get("decision")
        if isinstance(decision, Mapping) and isinstance(decision.get("explanation"), Mapping):
            version = decision.get("expected_state_version")
            at = "" if version is None else f" (state v{version})"
            return decision["explanation"], f"at the decision{at}, explain(plan)"
    if evidence is not None and evidence.explanation is not None:
        return evidence.explanation, "explain(plan)"
    return None, "explain(plan)"


def _explanation_findings(
    explanation: Mapping[str, Any], shown: str | None, label: str = "explain(plan)"
) -> list[str]:
    """The explanation's verdict and, per location the plan charges, its predicted peak and
    what makes it up (``shown``: a message already printed, not repeated; ``label``: whose
    explanation it is)."""
    findings = []
    if explanation.get("feasible"):
        findings.append(f"{label}: feasible")
    else:
        phase = explanation.get("failed_phase")
        index = explanation.get("failed_action_index")
        where = "" if phase is None else f" at {phase}" + ("" if index is None else f" #{index}")
        reason = str(explanation.get("reason", ""))
        repeated = shown is not None and shown in reason
        findings.append(f"{label}: infeasible{where}" + ("" if repeated else f" ({reason})"))
    peaks = explanation.get("predicted_peak_bytes") or {}
    ledger = explanation.get("ledger") or {}
    for loc, peak in peaks.items():
        entry = ledger.get(loc) if isinstance(ledger, Mapping) else None
        if not isinstance(entry, Mapping):
            findings.append(f"predicted peak at {loc}: {size(peak)}")
            continue
        budget = entry.get("budget_bytes")
        if budget is None and peak == entry.get("start_bytes"):
            continue  # no budget and the plan adds nothing there: nothing to reconcile
        findings.append(
            f"predicted peak at {loc}: {size(peak)} against {size(budget)} = resident "
            f"{size(entry.get('resident_bytes'))} + reserved {size(entry.get('reserved_bytes'))}"
            f" + incoming {size(entry.get('destination_bytes'))} + moving out "
            f"{size(entry.get('transfer_overlap_bytes'))} + reconstruction "
            f"{size(entry.get('reconstruction_bytes'))} (it started at "
            f"{size(entry.get('start_bytes'))}, reclaim freed {size(entry.get('reclaimed_bytes'))}"
            f", peak at {entry.get('peak_at')})"
        )
    reached = explanation.get("reached_peak_bytes") or {}
    if not explanation.get("feasible") and reached and reached != peaks:
        findings.append(
            "reached before failing: "
            + ", ".join(f"{loc} {size(n)}" for loc, n in reached.items() if n)
        )
    return findings


def step_3(errors: Errors, evidence: Evidence | None) -> DiagnosisStep | None:
    """The budget arithmetic of the first budget error in the chain (or of the plan's
    explanation), what could free room there now, and what the request is."""
    budget = first(errors, "ResidencyBudgetError")
    explanation, explained_at = _explanation(errors, evidence)
    if budget is None and (explanation is None or is_a(errors[0], "ResidencyStaleStateError")):
        return None
    findings: list[str] = []
    data: dict[str, Any] = {}
    action: str | None = None
    if budget is not None:
        handle = handle_of(budget.get("handle"))
        loc_text = str(budget.get("location"))
        location = location_of(loc_text)
        used = int(budget.get("used_bytes", 0))
        reserved = int(budget.get("reserved_bytes", 0))
        requested = int(budget.get("requested_bytes", 0))
        limit = budget.get("budget_bytes")
        current = used + reserved
        peak = current + requested
        missing = 0 if limit is None else max(0, peak - int(limit))
        waiting = int(budget.get("waiting_scopes") or 0)
        findings.append("what was asked: " + _kind_text(budget, handle, loc_text))
        verdict = (
            f"admissible by the budget, but {waiting} scope(s) wait for room at {loc_text} "
            "ahead of it (first come, first served) and it cannot wait its turn"
            if waiting and not missing
            else f"not admissible, {size(missing)} missing"
        )
        findings.append(
            f"at {loc_text}: used {size(used)} + reserved {size(reserved)} = charged "
            f"{size(current)}; + requested {size(requested)} = new peak {size(peak)} against a "
            f"budget of {size(limit)}: {verdict}"
        )
        if budget.get("in_simulation"):
            findings.append(
                "these numbers are explain's simulated state partway through the plan (the "
                "charges the plan's earlier actions would have made), not the manager's state"
            )
        data.update(
            location=loc_text,
            kind=budget.get("kind", "materialization"),
            handle=None if handle is None else handle.to_dict(),
            budget_bytes=limit,
            used_bytes=used,
            reserved_bytes=reserved,
            current_bytes=current,
            requested_bytes=requested,
            new_peak_bytes=peak,
            missing_bytes=missing,
            in_simulation=bool(budget.get("in_simulation")),
            waiting_scopes=waiting,
        )
        kind = budget.get("kind", "materialization")
        action = (
            f"free {size(missing)} at {loc_text} (release or move values nobody protects, end "
            "reservations), or raise its budget only if the complete measured peak and the "
            "unmanaged headroom support it"
        )

        if kind == "reconstruction":
            action = (
                f"the value is rebuilt through {loc_text}, which must hold a temporary copy: "
                f"free {size(missing)} there (or load it straight into {loc_text} first), or "
                "raise that budget only if the measured peak supports it"
            )
        if kind == "budget":
            # set_budget below the charge: budget_bytes is the refused new budget, nothing was
            # requested, and the budget in force is another one. What must fit is the current
            # charge under the new budget, not a request under the old one.
            action = (
                f"free {size(missing)} at {loc_text} (release or move values nobody protects, "
                "end reservations) before lowering its budget to "
                f"{size(limit)}, or set a budget no lower than what it charges"
            )
            if evidence is not None and location is not None and limit is not None:
                action = _budget_room_now(evidence, location, int(limit), findings, data) or action
        elif evidence is not None and location is not None:
            # What must fit beside the current charge: the request itself for a direct
            # operation's live check; for one from explain's simulation, or one of a plan's
            # actions or reservations (the evidence then explains the plan against the current
            # state), what the whole plan adds at its peak: the one request alone fitting now
            # does not make the plan fit.
            need: int | None = requested
            if budget.get("in_simulation") or evidence.explanation is not None:
                need = None
                now = evidence.snapshot.locations.get(location)
                current_plan = evidence.explanation
                plan_peak = _plan_peak(current_plan, loc_text)
                if plan_peak is not None and now is not None:
                    need = plan_peak - now.charged_bytes
                    over = "" if limit is None else f", {size(plan_peak - int(limit))} over budget"
                    findings.append(
                        f"explained against the current state, the whole plan would peak at "
                        f"{size(plan_peak)} at {loc_text}{over}"
                    )
            action = _room_now(evidence, location, need, findings, data) or action
        if waiting and not missing:  # room or not, the queue refuses it again
            action = (
                "use a form that waits (await manager.materialize or manager.move, or a scope "
                f"whose plan reserves the bytes), which takes its turn behind the {waiting} "
                "waiting scope(s), or retry once they are admitted"
            )
        if limit is not None and requested > int(limit) and kind != "budget":
            # Larger than the whole budget: no freeing of room there can admit it.
            findings.append(
                f"requested {size(requested)} is more than the whole budget of {size(limit)} "
                f"at {loc_text}: it would not fit even with nothing else charged there"
            )
            data["never_fits"] = True
            action = (
                f"it can never fit under this budget: raise the budget at {loc_text} to at "
                f"least {size(requested)} (only if the complete measured peak and the "
                "unmanaged headroom support it), or make what is requested smaller"
            )
    if explanation is not None:
        shown = None if budget is None else budget.get("message")
        findings.extend(_explanation_findings(explanation, shown, explained_at))
        data["explanation"] = {
            key: explanation.get(key)
            for key in (
                "feasible",
                "reason",
                "predicted_peak_bytes",
                "reached_peak_bytes",
                "failed_phase",
                "failed_action_index",
                "transient",
            )
        }
        if explanation.get("transient") and errors and errors[0].get("hold_and_wait"):
            # Transient for the state, but what stands in the way ends only when the waiting
            # task goes on: the scope was refused (hold and wait), never to be admitted.
            findings.append(
                "only transient state blocks it, but the waiting task holds it itself (its own "
                "scopes, leases or holds), or tasks waiting for each other's room do: waiting "
                "would never end (hold and wait); end those first, or put these values in one "
                "plan"
            )
        elif explanation.get("transient"):
            findings.append(
                "only transient state blocks it (leases, holds, pending events, transfers in "
                "flight, others' reservations): waiting could admit it"
            )
    return make_step(3, findings, data, action)


def _budget_room_now(
    evidence: Evidence,
    location: Location,
    new_budget: int,
    findings: list[str],
    data: dict[str, Any],
) -> str | None:
    """For a refused ``set_budget``: the location now, judged against the refused new budget
    (what is charged there must fit under it) rather than against the budget in force."""
    record = evidence.snapshot.locations.get(location)
    if record is None:
        return None
    # _room_now with no request lists the record and what could be freed, and says nothing
    # about fitting: the verdict below is the new budget's.
    _room_now(evidence, location, None, findings, data)
    over = record.charged_bytes - new_budget
    data["new_budget_bytes"] = new_budget
    data["over_new_budget_bytes"] = max(0, over)
    if over <= 0:
        findings.append(
            f"{location} charges {size(record.charged_bytes)} now: the new budget of "
            f"{size(new_budget)} would fit in the current state"
        )
        return "the state changed since the failure and the new budget fits now: retry set_budget"
    findings.append(
        f"{location} charges {size(record.charged_bytes)} now: still {size(over)} over the new "
        f"budget of {size(new_budget)}"
    )
    freeable = int(data.get("freeable_bytes") or 0)
    candidates = data.get("candidates") or []
    if candidates and freeable >= over:
        names = ", ".join(e["name"] for e in candidates[:3])
        return (
            f"free {size(over)} at {location} before lowering its budget: release or move values "
            f"nobody protects there (largest first: {names}), or end reservations; or set a "
            "budget no lower than what it charges"
        )
    return None


def _plan_peak(explanation: Mapping[str, Any] | None, location: str) -> int | None:
    if explanation is None:
        return None
    peak = (explanation.get("predicted_peak_bytes") or {}).get(location)
    return peak if isinstance(peak, int) else None


def _room_now(
    evidence: Evidence,
    location: Location,
    requested: int | None,
    findings: list[str],
    data: dict[str, Any],
) -> str | None:
    """The location now: its record, what nobody protects there (could be freed), what is
    protected. ``requested``: the bytes that must fit beside the current charge (for a plan,
    what its peak needs above the budget, counted as room to free; ``None``: unknown).
    Returns a sharper action when the state shows one."""
    snap = evidence.snapshot
    record = snap.locations.get(location)
    if record is None:
        return None
    reservations = ", ".join(f"{name!r} {size(n)}" for name, n in record.reservations) or "none"
    findings.append(
        f"now at {location} (v{snap.state_version}): used {size(record.used_bytes)}, reserved "
        f"{size(record.reserved_bytes)}, peak {size(record.peak_bytes)}, budget "
        f"{size(record.budget_bytes)}; reservations: {reservations}"
    )
    free = None if record.budget_bytes is None else record.budget_bytes - record.charged_bytes
    candidates: list[dict[str, Any]] = []
    protected: list[dict[str, Any]] = []
    for value in snap.values.values():
        for mat in value.materializations:
            if mat.location != location:
                continue
            entry = {
                "handle": value.handle.to_dict(),
                "name": value.name,
                "charged_bytes": mat.charged_bytes,
                "state": mat.state.value,
            }
            if mat.protected:
                entry.update(
                    use_count=mat.use_count,
                    hold_count=mat.hold_count,
                    pending_event_count=mat.pending_event_count,
                )
                protected.append(entry)
            elif mat.state is MaterializationState.RESIDENT:
                others = [m for m in value.materializations if m.location != location]
                entry["how"] = "release" if others or value.has_source else "move"
                candidates.append(entry)
    candidates.sort(key=lambda e: (-e["charged_bytes"], e["name"]))
    freeable = sum(e["charged_bytes"] for e in candidates)
    data["now"] = record.to_dict()
    data["free_now_bytes"] = free
    capped(data, "candidates", candidates)  # largest first
    capped(data, "protected", protected)
    data["freeable_bytes"] = freeable  # of every candidate
    if candidates:
        how = {"release": "can be released", "move": "last copy: move it"}
        rows = [f"{e['name']} {size(e['charged_bytes'])} ({how[e['how']]})" for e in candidates]
        findings.append(
            f"nobody protects {len(candidates)} value(s) there, {size(freeable)} in all: "
            + "; ".join(truncate(rows, 8))
        )
    if protected:
        findings.append(
            f"{len(protected)} value(s) there are protected and cannot be removed now (step 4)"
        )
    if free is not None and requested is not None:
        if requested <= free:
            findings.append(
                f"{size(free)} is free there now: the request would fit in the current state"
            )
            return "the state changed since the failure and the request fits now: retry it"
        findings.append(f"{size(free)} is free there now; {size(requested - free)} short")
        if candidates and freeable >= requested - free:
            names = ", ".join(e["name"] for e in candidates[:3])
            return (
                f"free {size(requested - free)} at {location}: release or move values nobody "
                f"protects there (largest first: {names}), or end reservations; raise the "
                "budget only if the complete measured peak and unmanaged headroom support it"
            )
    return None
