"""Step 7: a plan run that failed after preflight: the failed entry, its cause, and what stays
in effect."""

from __future__ import annotations

from collections.abc import Mapping

from ._facts import (
    Errors,
    action_text,
    first,
    make_step,
    sub_items,
    transitions_of,
    where,
)
from .evidence import Evidence
from .report import DiagnosisStep

__all__ = ["step_7"]


def step_7(errors: Errors, evidence: Evidence | None) -> DiagnosisStep | None:
    """The phase, the failed entry, the cause, and what the run left in effect."""
    failure = first(errors, "ResidencyPlanExecutionError")
    if failure is None:
        return None
    findings: list[str] = []
    phase = failure.get("phase")
    if failure.get("failed_reservation") is not None:
        failed = (
            f"reservation #{failure.get('failed_reservation_index')} "
            f"{action_text(failure.get('failed_reservation'))}"
        )
    elif failure.get("failed_action") is not None:
        failed = (
            f"action #{failure.get('failed_action_index')} "
            f"{action_text(failure.get('failed_action'))}"
        )
    else:
        failed = "no single action"
    findings.append(f"failed in phase {phase!r} at {failed}")
    cause = failure.get("cause")
    if isinstance(cause, Mapping):
        findings.append(f"cause: {cause.get('type')}: {cause.get('message')}")
    transitions, in_effect_seqs = transitions_of(failure.get("partial_report"))
    in_effect = [t for t in transitions if t.seq in in_effect_seqs]
    undone = [t for t in transitions if t.seq not in in_effect_seqs]
    findings.append(
        f"the run committed {len(transitions)} transition(s): {len(in_effect)} stay in effect "
        f"(not rolled back), {len(undone)} were clean-up or undone by it"
    )
    if in_effect:
        findings.append("in effect:")
        findings.extend(sub_items([str(t) for t in in_effect]))
    if undone:
        findings.append("clean-up and what it undid:")
        findings.extend(sub_items([str(t) for t in undone]))
    values_now: dict[str, list[str]] = {}
    if evidence is not None:
        touched = dict.fromkeys(t.handle for t in transitions if t.handle is not None)
        rows = []
        for handle in touched:
            value = evidence.snapshot.values.get(handle)
            now = "is not in the state" if value is None else f"now at {where(value)}"
            values_now[str(handle)] = [] if value is None else [str(x) for x in value.locations]
            rows.append(f"{handle} {now}")
        if rows:
            findings.append(f"now (v{evidence.snapshot.state_version}):")
            findings.extend(sub_items(rows))
    if phase == "execute":  # manager.execute: no scope to re-enter
        findings.append("execute does not roll back: run a new plan for what is still needed")
    else:
        findings.append("a failed scope is single use: it cannot be re-entered to finish the plan")
    data = {
        "phase": phase,
        "failed_action": failure.get("failed_action"),
        "failed_action_index": failure.get("failed_action_index"),
        "failed_reservation": failure.get("failed_reservation"),
        "failed_reservation_index": failure.get("failed_reservation_index"),
        "cause": cause,
        "committed": len(transitions),
        "in_effect": [t.to_dict() for t in in_effect],
        "undone": [t.to_dict() for t in undone],
        "values_now": values_now,
    }
    action = (
        "take a new snapshot and continue from the actual state (what stays in effect is not "
        "rolled back); make a new scope or decision for what is still needed"
    )
    return make_step(7, findings, data, action)
