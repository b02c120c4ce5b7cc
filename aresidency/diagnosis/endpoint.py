"""Step 2: the exact (handle, location) endpoint of a failure, and the value behind it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..core.locations import Location
from ..core.values import ReplicaMode, ValueHandle
from ._facts import (
    Errors,
    handle_of,
    is_a,
    label,
    location_of,
    make_step,
    size,
    sub_items,
    value_of,
    where,
)
from .evidence import Evidence
from .report import DiagnosisStep

__all__ = ["step_2"]


def _endpoint(errors: Errors) -> tuple[ValueHandle | None, Location | None, Mapping[str, Any]]:
    """The (handle, location) pair the failure is about, and the error dict naming it."""
    for error in errors:
        handle = handle_of(error.get("handle"))
        if handle is not None:
            return handle, location_of(error.get("location")), error
        action = error.get("failed_action")
        if isinstance(action, Mapping) and handle_of(action.get("handle")) is not None:
            return handle_of(action.get("handle")), location_of(action.get("location")), error
    return None, None, errors[0] if errors else {}


def _requirements(errors: Errors) -> list[Mapping[str, Any]]:
    """The requirements of the request behind the failure: a decision's, or the one the
    controller refused (the error's ``request``: no decision was made)."""
    for error in errors:
        decision = error.get("decision")
        request = decision.get("request") if isinstance(decision, Mapping) else None
        if not isinstance(request, Mapping):
            request = error.get("request")
        if isinstance(request, Mapping):
            return [r for r in request.get("requirements", ()) if isinstance(r, Mapping)]
    return []


def step_2(errors: Errors, evidence: Evidence | None) -> DiagnosisStep | None:
    """The exact (handle, location) endpoint and the value's snapshot; a decision's
    requirements, each checked on its own."""
    handle, location, source = _endpoint(errors)
    requirements = _requirements(errors)
    if handle is None and not requirements:
        return None
    findings: list[str] = []
    data: dict[str, Any] = {}
    action: str | None = None
    unavailable = is_a(source, "ResidencyUnavailableError")
    # A rebuild's temporary charge is checked at the value's source location, on the way to
    # the endpoint: that location is where the load passes, not where the value was asked for.
    passing = is_a(source, "ResidencyBudgetError") and source.get("kind") == "reconstruction"
    if handle is not None:
        at = "" if location is None else f", {location}"
        if passing:
            findings.append(
                f"refused at ({label(handle)}{at}): {location} is the value's source_location, "
                f"where its rebuild holds a temporary copy on the way to the endpoint asked for "
                f"({source.get('what') or 'see the message'})"
            )
        else:
            findings.append(f"endpoint: ({label(handle)}{at})")
        data.update(handle=handle.to_dict(), location=None if location is None else str(location))
        data["through_source_location"] = passing
        if unavailable and source.get("detail"):
            findings.append(f"what was missing: {source['detail']}")
        if evidence is not None:
            snap = evidence.snapshot
            belongs = handle.manager_id == snap.manager_id
            value = snap.values.get(handle)
            data.update(belongs=belongs, in_state=value is not None)
            if not belongs:
                findings.append(
                    f"the handle belongs to manager {handle.manager_id}, not to this manager "
                    f"({snap.manager_id})"
                )
                action = (
                    f"use the handle with the manager that registered it ({handle.manager_id}), "
                    "and diagnose errors about it with that manager (this one's state is not "
                    "that value's)"
                )
            elif value is None:
                findings.append(
                    "the value is not in the state: it was discarded (or was never registered "
                    "by this manager)"
                )
                action = "register the tensor again to use it"
            else:
                source_text = (
                    f"reconstructible from its source through {value.source_location}"
                    if value.has_source
                    else "not reconstructible (no source)"
                )
                findings.append(
                    f"{label(handle)}: {value.replica_mode.value}, fixed charge "
                    f"{size(value.charge_bytes)}, {source_text}"
                )
                findings.append(f"materialized at: {where(value)}")
                data["value"] = value.to_dict()
                if location is not None and not passing:
                    present = location in value.locations
                    data["present"] = present
                    findings.append(f"it is {'' if present else 'not '}materialized at {location}")
                    if unavailable and not present:
                        action = (
                            f"admit {label(handle)} at {location} first (manager.materialize or "
                            "move, a scope, or a controller decision): acquire never places a "
                            "value"
                        )
        elif unavailable:
            action = (
                "check that the value exists, is not discarded and is materialized at that "
                "location (diagnose with the manager for its snapshot); acquire never places a "
                "value"
            )
    if requirements:
        rows = []
        for requirement in requirements:
            req_handle = handle_of(requirement.get("handle"))
            wanted = [str(requirement.get("location"))] + [
                str(f) for f in requirement.get("fallbacks", ()) or ()
            ]
            value = value_of(evidence, req_handle)
            now = (
                "where it is now is unknown (no manager given)"
                if evidence is None
                else (
                    "not in the state"
                    if value is None
                    else f"now at {where(value)}"
                    if value.locations
                    else "materialized nowhere now"
                )
            )
            mode = ""
            if value is not None:
                # Each requirement's value as the endpoint check reads it: its replica
                # mode, and whether (and through where) it can be rebuilt.
                rebuilt = (
                    f", reconstructible through its source_location {value.source_location}"
                    if value.has_source
                    else ""
                )
                mode = f" ({value.replica_mode.value}{rebuilt})"
            rows.append(f"({label(req_handle)}{mode}, {' | '.join(wanted)}): {now}")
        findings.append("the request's requirements, each on its own:")
        findings.extend(sub_items(rows))
        # Each requirement's handle, counted (handles_in would name each handle once).
        named = Counter(handle_of(r.get("handle")) for r in requirements)
        repeated = [h for h, n in named.items() if h is not None and n > 1]
        if repeated:
            findings.append(
                "named in several requirements (simultaneous postconditions, valid only for "
                "REPLICABLE values): " + ", ".join(label(h) for h in repeated)
            )
            exclusive = [
                h
                for h in repeated
                if (value := value_of(evidence, h)) is not None
                and value.replica_mode is ReplicaMode.EXCLUSIVE
            ]
            data["repeated"] = [h.to_dict() for h in repeated]
            if exclusive and action is None:
                names = ", ".join(label(h) for h in exclusive)
                action = (
                    f"keep one requirement for {names} (with fallbacks for alternatives), or "
                    "register it REPLICABLE: an EXCLUSIVE value lives at one location at a time"
                )
        data["requirements"] = [dict(r) for r in requirements]
    return make_step(2, findings, data, action)
