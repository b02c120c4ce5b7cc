"""The model's records: value handles, modes, charges, materializations, ledgers, tickets.

Pure data with the small rules that belong to each record (a value's conservative charge, a
ledger's admission test, what counts as protected). :class:`~aresidency.core.state.ResidencyState`
owns them and changes them only through its transitions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ResidencyBudgetError
from .locations import Location
from .trace import slot_setter

__all__ = [
    "DEFAULT_GRANULARITY",
    "CopyTicket",
    "DuplicateReservationError",
    "LocationLedger",
    "Materialization",
    "MaterializationState",
    "ReplicaMode",
    "Value",
    "ValueHandle",
    "check_flag",
    "check_nbytes",
    "value_charge",
]

#: Allocation granularity used for the conservative value charge. The CUDA caching allocator
#: rounds every block to a multiple of 512 bytes; host copies made by the manager are sized
#: exactly, so 512 is conservative for both.
DEFAULT_GRANULARITY = 512


class ReplicaMode(enum.Enum):
    """How many materializations a value may have at once."""

    EXCLUSIVE = "exclusive"  # at most one: placing elsewhere is a move
    REPLICABLE = "replicable"  # several; a write lease invalidates the others


class MaterializationState(enum.Enum):
    INCOMING = "incoming"  # charged; a transfer into it is in flight
    RESIDENT = "resident"  # holds the value
    OUTGOING = "outgoing"  # still holds the value; a move out of it is in flight


@dataclass(frozen=True, slots=True)
class ValueHandle:
    """Opaque, hashable name of one value of one manager.

    Equality and hashing use ``(manager_id, value_id)``; ``name`` is for people.
    """

    manager_id: str
    value_id: int
    name: str = field(default="", compare=False)
    # Handles key every table of the runtime: hash once, not on every lookup.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.manager_id, self.value_id)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ValueHandle):
            return NotImplemented
        return self.value_id == other.value_id and self.manager_id == other.manager_id

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt, not restored: a string's hash differs from one process to the next.
        return (ValueHandle, (self.manager_id, self.value_id, self.name))

    def __str__(self) -> str:
        return f"value {self.name or '#' + str(self.value_id)} (#{self.value_id})"

    def __repr__(self) -> str:
        return f"<ValueHandle {self.name!r} #{self.value_id} of manager {self.manager_id}>"

    def __format__(self, spec: str) -> str:
        # As its string: f"{handle:<24}" pads it (object's own refuses every spec).
        return format(str(self), spec)

    def to_dict(self) -> dict[str, Any]:
        return {"manager_id": self.manager_id, "value_id": self.value_id, "name": self.name}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValueHandle:
        return cls(str(data["manager_id"]), int(data["value_id"]), str(data.get("name", "")))


def check_value_name(name: Any) -> str:
    """Return ``name`` if it can name a value: a str with something other than whitespace in
    it (the name is how errors, snapshots, traces and diagnoses tell values apart); else a
    ``TypeError`` (not a str) or ``ValueError`` (blank) naming it."""
    if not isinstance(name, str):
        raise TypeError(
            f"a value's name must be a str (or None for a name of its own), got {name!r}"
        )
    if not name.strip():
        raise ValueError(
            f"a value needs a non-blank name (errors, snapshots and traces name it by it), got "
            f"{name!r}: give a name, or None for a name of its own"
        )
    return name


def check_optional_name(name: Any, what: str, carried_by: str) -> str | None:
    """Return ``name`` if it is ``None`` (a name of its own is made) or a str with something
    other than whitespace in it; else a ``TypeError`` (not a str) or ``ValueError`` (blank)
    saying that it must name ``what``, whose ``carried_by`` carry it."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string or None, got {name!r}")
    if name is not None and not name.strip():
        raise ValueError(
            f"name must name the {what} ({carried_by} carry it), got {name!r}: give a "
            "non-blank string, or None for a name of its own"
        )
    return name


def check_flag(value: Any, what: str) -> bool:
    """Return ``value`` if it is ``True`` or ``False``, else a ``TypeError`` naming ``what``
    (``"no"``, ``None`` or ``1`` would be taken for their truth value, silently)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


def check_nbytes(value: Any, what: str, *, allow_zero: bool = True) -> int:
    """Return ``value`` if it is a byte count (an int >= 0), else raise naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int number of bytes, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be {bound}, got {value}")
    return value


def value_charge(
    storage_nbytes: int, charge_bytes: int | None = None, granularity: int = DEFAULT_GRANULARITY
) -> int:
    """The fixed conservative charge of a value.

    ``storage_nbytes`` rounded up to ``granularity`` (at least one granule: an empty tensor
    is charged ``granularity``), or ``charge_bytes`` when the user gives a larger one. A
    smaller user charge is refused: it would let the ledger under-count.
    """
    check_nbytes(storage_nbytes, "storage size")
    check_nbytes(granularity, "granularity", allow_zero=False)
    rounded = -(-storage_nbytes // granularity) * granularity
    if charge_bytes is None:
        return max(rounded, granularity)
    check_nbytes(charge_bytes, "charge_bytes", allow_zero=False)
    if charge_bytes < rounded:
        raise ValueError(
            f"charge_bytes={charge_bytes} is smaller than the storage rounded to the allocator "
            f"granularity ({rounded} B); give at least that"
        )
    return charge_bytes


class DuplicateReservationError(ValueError):
    """A reservation with this name is already active at the location."""


class Materialization:
    """One value's bytes at one location. ``fill_failure``: for an INCOMING one, the error of
    the transfer or load that was filling it when that failed before its data existed (it is
    aborted once nothing protects it; a lease waiting for its data reads this instead)."""

    __slots__ = (
        "charged_bytes",
        "fill_failure",
        "hold_count",
        "location",
        "pending_event_count",
        "state",
        "use_count",
        "write_count",
    )

    def __init__(self, location: Location, charged_bytes: int, state: MaterializationState):
        self.location = location
        self.charged_bytes = charged_bytes
        self.state = state
        self.use_count = 0
        self.write_count = 0
        self.hold_count = 0
        self.pending_event_count = 0
        self.fill_failure: BaseException | None = None

    @property
    def protected(self) -> bool:
        return bool(self.use_count or self.hold_count or self.pending_event_count)

    def copy(self) -> Materialization:
        twin = Materialization.__new__(Materialization)
        twin.location = self.location
        twin.charged_bytes = self.charged_bytes
        twin.state = self.state
        twin.use_count = self.use_count
        twin.write_count = self.write_count
        twin.hold_count = self.hold_count
        twin.pending_event_count = self.pending_event_count
        twin.fill_failure = self.fill_failure
        return twin


class Value:
    __slots__ = (
        "charge_bytes",
        "discarded",
        "handle",
        "has_source",
        "last_used_version",
        "materializations",
        "replica_mode",
        "source_location",
    )

    def __init__(
        self,
        handle: ValueHandle,
        replica_mode: ReplicaMode,
        charge_bytes: int,
        has_source: bool,
        source_location: Location | None,
    ) -> None:
        self.handle = handle
        self.replica_mode = replica_mode
        self.charge_bytes = charge_bytes
        self.has_source = has_source
        self.source_location = source_location
        self.discarded = False
        self.materializations: dict[Location, Materialization] = {}
        self.last_used_version = 0

    def copy(self) -> Value:
        """A copy sharing nothing mutable (the simulations of ``explain`` work on these)."""
        twin = Value.__new__(Value)
        twin.handle = self.handle
        twin.replica_mode = self.replica_mode
        twin.charge_bytes = self.charge_bytes
        twin.has_source = self.has_source
        twin.source_location = self.source_location
        twin.discarded = self.discarded
        twin.last_used_version = self.last_used_version
        twin.materializations = {loc: m.copy() for loc, m in self.materializations.items()}
        return twin

    def holders(self) -> list[Materialization]:
        """Materializations that hold the value's data now (resident or moving out)."""
        return [
            m for m in self.materializations.values() if m.state != MaterializationState.INCOMING
        ]


class LocationLedger:
    """One location's budget and charges.

    ``used_bytes`` counts every materialization here plus temporary reconstruction charges;
    of it, ``incoming_bytes`` are destinations of transfers in flight, ``outgoing_bytes``
    sources of moves in flight, ``reconstruction_bytes`` temporary loads from a source passing
    through (kept up to date by the transitions, so ``explain`` reads its breakdown in O(1));
    ``protected_bytes`` are materializations in use, held or read (what admission may wait
    for, since protection ends on its own).
    ``reserved_bytes`` is the sum of the named reservations (kept, not recomputed).
    ``spare_bytes``: bytes the backend keeps ready for new values here (a pinned arena's free
    space; freed pageable destinations kept for reuse). Not charged: a value copied there
    takes them over; the runtime keeps them within the budget's headroom (shown, never
    admitted against).
    """

    __slots__ = (
        "budget_bytes",
        "incoming_bytes",
        "location",
        "outgoing_bytes",
        "peak_bytes",
        "protected_bytes",
        "reconstruction_bytes",
        "reservations",
        "reserved_bytes",
        "spare_bytes",
        "used_bytes",
    )

    def __init__(self, location: Location, budget_bytes: int | None) -> None:
        self.location = location
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.incoming_bytes = 0
        self.outgoing_bytes = 0
        self.reconstruction_bytes = 0
        self.protected_bytes = 0
        self.reservations: dict[str, tuple[int, Any]] = {}  # name -> (nbytes, owner)
        self.reserved_bytes = 0
        self.spare_bytes = 0
        self.peak_bytes = 0

    def add_reservation(self, name: str, nbytes: int, owner: Any) -> None:
        self.reservations[name] = (nbytes, owner)
        self.reserved_bytes += nbytes

    def pop_reservation(self, name: str) -> int:
        nbytes, _ = self.reservations.pop(name)
        self.reserved_bytes -= nbytes
        return nbytes

    def copy(self) -> LocationLedger:
        twin = LocationLedger(self.location, self.budget_bytes)
        twin.used_bytes = self.used_bytes
        twin.incoming_bytes = self.incoming_bytes
        twin.outgoing_bytes = self.outgoing_bytes
        twin.reconstruction_bytes = self.reconstruction_bytes
        twin.protected_bytes = self.protected_bytes
        twin.reservations = dict(self.reservations)
        twin.reserved_bytes = self.reserved_bytes
        twin.spare_bytes = self.spare_bytes
        twin.peak_bytes = self.peak_bytes
        return twin

    @property
    def charged_bytes(self) -> int:
        return self.used_bytes + self.reserved_bytes

    def check_admit(
        self,
        requested: int,
        what: str,
        *,
        handle: ValueHandle | None = None,
        kind: str = "materialization",
        in_simulation: bool = False,
    ) -> None:
        """``ResidencyBudgetError`` if ``requested`` more bytes would exceed the budget;
        ``handle``, ``kind`` and ``in_simulation`` go into the error (see its docstring)."""
        if self.budget_bytes is not None and self.charged_bytes + requested > self.budget_bytes:
            raise ResidencyBudgetError(
                self.location,
                self.budget_bytes,
                self.used_bytes,
                self.reserved_bytes,
                requested,
                what=what,
                handle=handle,
                kind=kind,
                in_simulation=in_simulation,
            )

    def note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.charged_bytes)


@dataclass(frozen=True, slots=True, init=False)
class CopyTicket:
    """A transfer begun on the model and not yet committed or aborted.

    ``source is None`` means a load from the value's source into ``destination`` (reconstruction);
    ``via`` is then the ``source_location`` the load passes through when the destination is
    elsewhere, charged temporarily (no materialization) until the load commits or aborts.
    ``move`` means the source materialization is removed when the copy commits.
    """

    ticket_id: int
    handle: ValueHandle
    source: Location | None
    destination: Location
    nbytes: int
    move: bool
    via: Location | None = None

    def __init__(
        self,
        ticket_id: int,
        handle: ValueHandle,
        source: Location | None,
        destination: Location,
        nbytes: int,
        move: bool,
        via: Location | None = None,
    ) -> None:
        # The dataclass's __init__, through the slots' setters (see trace.slot_setter).
        _set_ticket_id(self, ticket_id)
        _set_handle(self, handle)
        _set_source(self, source)
        _set_destination(self, destination)
        _set_nbytes(self, nbytes)
        _set_move(self, move)
        _set_via(self, via)


_set_ticket_id = slot_setter(CopyTicket, "ticket_id")
_set_handle = slot_setter(CopyTicket, "handle")
_set_source = slot_setter(CopyTicket, "source")
_set_destination = slot_setter(CopyTicket, "destination")
_set_nbytes = slot_setter(CopyTicket, "nbytes")
_set_move = slot_setter(CopyTicket, "move")
_set_via = slot_setter(CopyTicket, "via")
assert [f.name for f in fields(CopyTicket)] == [
    "ticket_id",
    "handle",
    "source",
    "destination",
    "nbytes",
    "move",
    "via",
], "CopyTicket.__init__ sets every field"
