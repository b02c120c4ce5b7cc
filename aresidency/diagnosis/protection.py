"""Step 4: the leases, holds and pending events that protect a materialization, and the tasks
owning them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.locations import Location
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
    sub_items,
)
from .evidence import Evidence
from .report import DiagnosisStep

__all__ = ["step_4"]


def step_4(errors: Errors, evidence: Evidence | None) -> DiagnosisStep | None:
    """The protection counts and the tasks owning them, at the error and now."""
    in_use = first(errors, "ResidencyInUseError")
    budget = first(errors, "ResidencyBudgetError")
    findings: list[str] = []
    data: dict[str, Any] = {}
    action: str | None = None
    if in_use is not None:
        handle = handle_of(in_use.get("handle"))
        location = location_of(in_use.get("location"))
        counts = {
            key: int(in_use.get(key, 0))
            for key in ("use_count", "hold_count", "pending_event_count")
        }
        owners = [str(o) for o in in_use.get("owners") or ()]
        findings.append(
            f"cannot {in_use.get('operation', 'remove')} {label(handle)} at {location}: "
            f"use_count={counts['use_count']} (active leases), hold_count={counts['hold_count']} "
            f"(holds), pending_event_count={counts['pending_event_count']} (consumer events not "
            "yet complete)"
        )
        transfer = in_use.get("transfer")
        if transfer == "incoming":
            findings.append(
                f"a transfer is in flight: the copy into {location} was still arriving (state "
                "incoming); it is not a lease, a hold or a reader event"
            )
        elif transfer == "outgoing":
            findings.append(
                f"a transfer is in flight: a copy out of {location} was still running (state "
                "outgoing); it is not a lease, a hold or a reader event"
            )
        if owners:
            findings.append(
                "leases and holds owned by task(s): " + ", ".join(repr(o) for o in owners)
            )
        elif counts["use_count"] or counts["hold_count"]:
            findings.append("the error names no owning task (raised by the model directly)")
        data.update(
            handle=None if handle is None else handle.to_dict(),
            location=None if location is None else str(location),
            owners=owners,
            transfer=transfer,
            **counts,
        )
        # Which task owns which: the evidence's owners carry their kind; the error's are
        # names only, attributable to one kind when only that kind is counted.
        by_kind: dict[str, list[str]] | None = None
        if evidence is not None and handle is not None and location is not None:
            by_kind = {"lease": [], "hold": []}
            for owner in evidence.owners_of(handle, location):
                kind = "hold" if owner.kind == "hold" else "lease"
                if owner.task not in by_kind[kind]:
                    by_kind[kind].append(owner.task)

        def tasks_of(kind: str, alone: bool) -> str:
            names = by_kind[kind] if by_kind is not None else (owners if alone else [])
            return f" in task(s) {', '.join(repr(o) for o in names)}" if names else ""

        steps = []
        if counts["use_count"]:
            who = tasks_of("lease", not counts["hold_count"])
            steps.append(f"exit the lease{who} once every reader stream is registered")
        if counts["hold_count"]:
            steps.append(f"release the obsolete hold{tasks_of('hold', not counts['use_count'])}")
        if counts["pending_event_count"]:
            steps.append("wait for the consumer stream if the removal must happen now")
        if transfer in ("incoming", "outgoing"):
            steps.append(
                "await the transfer in flight (or cancel it) before the removal"
                if transfer == "incoming"
                else "await the transfer out of it before the removal"
            )
        steps.append("or defer the removal to a later decision")
        action = (
            "; ".join(steps)
            + ". Do not close the manager or discard the value to get past unknown readers"
        )
        if evidence is not None and handle is not None and location is not None:
            value = evidence.snapshot.values.get(handle)
            record = None
            if value is not None:
                record = next((m for m in value.materializations if m.location == location), None)
            now_owners = evidence.owners_of(handle, location)
            if record is None:
                findings.append(f"now: {label(handle)} has no materialization at {location}")
            else:
                findings.append(
                    f"now (v{evidence.snapshot.state_version}): use_count={record.use_count}, "
                    f"hold_count={record.hold_count}, "
                    f"pending_event_count={record.pending_event_count}"
                )
                state = record.state.value
                if state != "resident":
                    findings.append(
                        f"now its state there is {state}: a transfer is still in flight"
                    )
                    action = (
                        f"the materialization is still {state} (a transfer in flight): await "
                        "that transfer (or cancel it), then retry the removal, or defer it"
                    )
                elif not record.protected:
                    action = "nothing protects it any more: retry the removal"
            if now_owners:
                findings.append(
                    "held now by: " + ", ".join(f"{o.task!r} ({o.kind})" for o in now_owners)
                )
            data["now"] = None if record is None else record.to_dict()
            data["owners_now"] = [o.to_dict() for o in now_owners]
    elif budget is not None and evidence is not None:
        location = location_of(budget.get("location"))
        rows, held, _ = _protected_at(evidence, {location} if location is not None else set())
        if not rows:
            return None
        findings.append(f"protected at {location} (a controller will not evict these):")
        findings.extend(sub_items(rows))
        data["location"] = str(location)
        capped(data, "protected", held)
    elif evidence is not None and (refused := _refused_request(errors, evidence)) is not None:
        # The controller refused a request: what is protected where it needed room is what it
        # could not evict (it never waits for it), with the tasks owning those lifetimes.
        reason, locations = refused
        wanted = {
            loc
            for loc in locations
            if loc in evidence.snapshot.locations
            and evidence.snapshot.locations[loc].budget_bytes is not None
        }
        rows, held, tasks = _protected_at(evidence, wanted)
        if not rows:
            return None
        where = ", ".join(str(loc) for loc in sorted(wanted))
        findings.append(
            f"protected at the request's budgeted locations ({where}); the controller never "
            "evicts these and never waits for them:"
        )
        findings.extend(sub_items(rows))
        data["locations"] = sorted(str(loc) for loc in wanted)
        capped(data, "protected", held)
        if "because of protections" in reason:
            steps = []
            if tasks["lease"]:
                names = ", ".join(repr(t) for t in tasks["lease"])
                steps.append(f"exit the lease(s) in task(s) {names}")
            if tasks["hold"]:
                names = ", ".join(repr(t) for t in tasks["hold"])
                steps.append(f"release the obsolete hold(s) in task(s) {names}")
            if any(record["pending_event_count"] for record in held):
                steps.append("wait for the consumer streams of the pending events")
            action = (
                " and ".join(steps)
                + ", then derive a new decision (controller.decide(request)); or defer the "
                "request"
            )
    else:
        return None
    return make_step(4, findings, data, action)


def _protected_at(
    evidence: Evidence, locations: set[Location]
) -> tuple[list[str], list[dict[str, Any]], dict[str, list[str]]]:
    """The protected materializations at ``locations`` now, as rows and records, and the tasks
    owning their leases and holds by kind."""
    rows: list[str] = []
    held: list[dict[str, Any]] = []
    tasks: dict[str, list[str]] = {"lease": [], "hold": []}
    values = sorted(evidence.snapshot.values.values(), key=lambda v: v.handle.value_id)
    for value in values:
        for mat in value.materializations:
            if mat.location not in locations or not mat.protected:
                continue
            owners_now = evidence.owners_of(value.handle, mat.location)
            for owner in owners_now:
                kind = "hold" if owner.kind == "hold" else "lease"
                if owner.task not in tasks[kind]:
                    tasks[kind].append(owner.task)
            who = ", ".join(f"{o.task!r} ({o.kind})" for o in owners_now)
            at = f" @ {mat.location}" if len(locations) > 1 else ""
            rows.append(
                f"{value.name}{at} {size(mat.charged_bytes)}: use_count={mat.use_count}, "
                f"hold_count={mat.hold_count}, pending_event_count="
                f"{mat.pending_event_count}" + (f", held by {who}" if who else "")
            )
            held.append({**mat.to_dict(), "handle": value.handle.to_dict(), "owners": who or None})
    return rows, held, tasks


def _refused_request(errors: Errors, evidence: Evidence) -> tuple[str, set[Location]] | None:
    """For a request the controller refused (a ``ResidencyPlanError`` carrying it, no
    decision made): its reason, and every location it needs room at (each requirement's
    alternatives, the source_location a value is rebuilt through, its reservations')."""
    for error in errors:
        request = error.get("request")
        if not is_a(error, "ResidencyPlanError") or not isinstance(request, Mapping):
            continue
        if error.get("decision"):
            return None
        locations: set[Location] = set()
        for requirement in request.get("requirements") or ():
            if not isinstance(requirement, Mapping):
                continue
            for where in (requirement.get("location"), *(requirement.get("fallbacks") or ())):
                loc = location_of(where)
                if loc is not None:
                    locations.add(loc)
            handle = handle_of(requirement.get("handle"))
            value = None if handle is None else evidence.snapshot.values.get(handle)
            if value is not None and value.source_location is not None:
                locations.add(value.source_location)
        for reservation in request.get("reservations") or ():
            if isinstance(reservation, Mapping):
                loc = location_of(reservation.get("location"))
                if loc is not None:
                    locations.add(loc)
        return str(error.get("reason") or error.get("message") or ""), locations
    return None
