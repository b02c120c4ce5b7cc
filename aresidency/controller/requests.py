"""The controller's records: what is asked (requests) and what was decided (decisions).

All records are frozen, hashable where their fields are, and tensor-free: they name values by
``ValueHandle`` and locations by ``Location``, never by tensor.

* :class:`ResidencyRequirement`: ``(handle, location)`` that must hold after admission, with
  optional ``fallbacks`` (other locations, in order of preference) used only when the preferred
  placement is infeasible.
* :class:`ResidencyRequest`: a named set of requirements plus reservations. Several requirements
  for one REPLICABLE handle are simultaneous postconditions (a replica at each location); for an
  EXCLUSIVE handle they are an invalid request (checked against the manager's state at decision
  time, since the replica mode is the state's).
* :class:`Eviction`: one victim the decision removes from a location: moved to ``destination``,
  or dropped (``destination is None``; the value is rebuilt from its source, or another replica
  stays resident).
* :class:`ResidencyDecision`: the decision evidence (docs/troubleshooting.md, step 5) and the
  plan to enter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import format_bytes
from ..core.explain import PlanExplanation
from ..core.locations import Location, LocationLike
from ..core.plans import MemoryReservation, ResidencyPlan, items_of
from ..core.values import ValueHandle

__all__ = [
    "Eviction",
    "Placement",
    "ResidencyDecision",
    "ResidencyRequest",
    "ResidencyRequirement",
]


def _handle_label(handle: ValueHandle) -> str:
    return handle.name or f"#{handle.value_id}"


@dataclass(frozen=True, slots=True)
class ResidencyRequirement:
    """``handle`` must be at ``location`` after admission; if that is infeasible, at the first
    feasible location of ``fallbacks`` (in order).

    ``location`` and each fallback are parsed like every location (``ValueError`` otherwise); a
    location may appear only once among them.
    """

    handle: ValueHandle
    location: Location
    fallbacks: tuple[Location, ...] = ()

    def __init__(
        self,
        handle: ValueHandle,
        location: LocationLike,
        fallbacks: Iterable[LocationLike] = (),
    ) -> None:
        if not isinstance(handle, ValueHandle):
            raise TypeError(
                f"a ResidencyRequirement needs a ValueHandle, got {handle!r} "
                f"({type(handle).__name__})"
            )
        if isinstance(fallbacks, (str, Location)):
            fallbacks = (fallbacks,)
        primary = Location.parse(location)
        parsed = tuple(Location.parse(item) for item in fallbacks)
        alternatives = (primary, *parsed)
        if len(set(alternatives)) != len(alternatives):
            listed = ", ".join(str(loc) for loc in alternatives)
            raise ValueError(
                f"requirement for {handle} lists a location twice ({listed}); each location may "
                "appear once, in order of preference"
            )
        object.__setattr__(self, "handle", handle)
        object.__setattr__(self, "location", primary)
        object.__setattr__(self, "fallbacks", parsed)

    @property
    def alternatives(self) -> tuple[Location, ...]:
        """``location`` then the fallbacks: every location that satisfies this requirement, in
        order of preference."""
        return (self.location, *self.fallbacks)

    def __str__(self) -> str:
        fallback = "".join(f" | {loc}" for loc in self.fallbacks)
        return f"({_handle_label(self.handle)}, {self.location}{fallback})"


RequirementLike = ResidencyRequirement | tuple[ValueHandle, LocationLike]


@dataclass(frozen=True, slots=True)
class ResidencyRequest:
    """A named set of :class:`ResidencyRequirement` plus :class:`MemoryReservation` s.

    ``requirements`` also accepts ``(handle, location)`` pairs. Construction checks the shape
    (types, a non-empty name, reservation names unique per location); what depends on the
    manager's state (the handles belong to it and are not discarded, EXCLUSIVE handles appear in
    one requirement only) is checked when a decision is derived, as ``ResidencyPlanError``.
    """

    name: str
    requirements: tuple[ResidencyRequirement, ...] = ()
    reservations: tuple[MemoryReservation, ...] = ()

    def __init__(
        self,
        name: str,
        requirements: Iterable[RequirementLike] = (),
        reservations: Iterable[MemoryReservation] = (),
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"a ResidencyRequest needs a non-empty, non-blank str name, got {name!r}"
            )
        parsed: list[ResidencyRequirement] = []
        for index, item in enumerate(items_of(requirements, f"request {name!r} requirements")):
            if isinstance(item, ResidencyRequirement):
                parsed.append(item)
            elif isinstance(item, tuple) and len(item) == 2:
                parsed.append(ResidencyRequirement(item[0], item[1]))
            else:
                raise TypeError(
                    f"request {name!r} requirement #{index} is {item!r}; expected a "
                    "ResidencyRequirement or a (handle, location) pair"
                )
        kept: list[MemoryReservation] = []
        seen: set[tuple[str, Location]] = set()
        for index, reservation in enumerate(
            items_of(reservations, f"request {name!r} reservations")
        ):
            if not isinstance(reservation, MemoryReservation):
                raise TypeError(
                    f"request {name!r} reservation #{index} is {reservation!r}, not a "
                    "MemoryReservation"
                )
            key = (reservation.name, reservation.location)
            if key in seen:
                raise ValueError(
                    f"request {name!r} reserves {reservation.name!r} at {reservation.location} "
                    "twice; reservation names are unique per location"
                )
            seen.add(key)
            kept.append(reservation)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "requirements", tuple(parsed))
        object.__setattr__(self, "reservations", tuple(kept))

    def handles(self) -> tuple[ValueHandle, ...]:
        """The distinct handles the requirements name, in order of first appearance."""
        return tuple(dict.fromkeys(req.handle for req in self.requirements))

    def __str__(self) -> str:
        reqs = ", ".join(str(req) for req in self.requirements)
        res = ", ".join(str(r) for r in self.reservations)
        return f"ResidencyRequest({self.name!r}, requirements=[{reqs}], reservations=[{res}])"


@dataclass(frozen=True, slots=True)
class Eviction:
    """One victim: the materialization of ``handle`` at ``location`` (``charge_bytes``) leaves.

    ``destination`` is the fallback tier it moves to, or ``None`` when it is dropped: rebuilt
    from its source later, or served by another replica that stays resident (``reason`` says
    which). ``estimated_seconds`` is the cost model's estimate (transfer now plus the expected
    cost of bringing it back); ``reason`` says why this victim and this destination.
    """

    handle: ValueHandle
    location: Location
    charge_bytes: int
    destination: Location | None
    reason: str
    estimated_seconds: float = field(default=0.0, compare=False)

    @property
    def dropped(self) -> bool:
        return self.destination is None

    def __str__(self) -> str:
        where = "dropped" if self.destination is None else f"-> {self.destination}"
        return (
            f"Eviction({_handle_label(self.handle)} @ {self.location} "
            f"{format_bytes(self.charge_bytes)} {where})"
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the decision places one requirement: ``location`` is ``requirement.location`` or
    one of its fallbacks (``fallback_rank`` 0 is the preferred location)."""

    requirement: ResidencyRequirement
    location: Location
    fallback_rank: int

    def __str__(self) -> str:
        mark = "" if self.fallback_rank == 0 else f" (fallback #{self.fallback_rank})"
        return f"{_handle_label(self.requirement.handle)} @ {self.location}{mark}"


@dataclass(frozen=True, slots=True)
class ResidencyDecision:
    """The controller's answer to a request, and the evidence behind it (step 5 of
    docs/troubleshooting.md).

    ``plan`` (``reclaim``: the evictions; ``reserve``: the request's reservations; ``enter``: a
    ``Materialize`` per placed requirement) carries ``expected_state_version``: entering it after
    any intervening mutation raises ``ResidencyStaleStateError`` before anything changes.
    ``explored_states`` counts search nodes (deterministic; not an eviction count or a
    performance score). ``explanation`` is ``explain_plan`` of ``plan`` against the state the
    decision was derived from; it is feasible, and every requested endpoint is in its simulated
    final state. ``placements`` says which alternative each requirement got;
    ``estimated_seconds`` is the cost model's total for the evictions. ``manager_id`` names the
    manager whose state it was derived from: another manager refuses to explain or enter it
    (its state versions count another history).
    """

    request: ResidencyRequest
    expected_state_version: int
    explored_states: int
    evictions: tuple[Eviction, ...]
    plan: ResidencyPlan
    explanation: PlanExplanation
    placements: tuple[Placement, ...] = field(default=(), compare=False)
    estimated_seconds: float = field(default=0.0, compare=False)
    manager_id: str | None = None

    @property
    def feasible(self) -> bool:
        return self.explanation.feasible

    def __repr__(self) -> str:
        return (
            f"<ResidencyDecision {self.request.name!r} v{self.expected_state_version} "
            f"explored={self.explored_states} evictions={len(self.evictions)} "
            f"est={self.estimated_seconds * 1e3:.3f} ms>"
        )

    def summary(self) -> dict[str, Any]:
        """A tensor-free, JSON-friendly summary (for logs)."""
        return {
            "request": self.request.name,
            "expected_state_version": self.expected_state_version,
            "explored_states": self.explored_states,
            "placements": [str(p) for p in self.placements],
            "evictions": [
                {
                    "handle": e.handle.to_dict(),
                    "location": str(e.location),
                    "charge_bytes": e.charge_bytes,
                    "destination": None if e.destination is None else str(e.destination),
                    "reason": e.reason,
                }
                for e in self.evictions
            ],
            "predicted_peak_bytes": {
                str(loc): nbytes for loc, nbytes in self.explanation.predicted_peak_bytes.items()
            },
            "estimated_seconds": self.estimated_seconds,
        }
