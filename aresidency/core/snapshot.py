"""Atomic, tensor-free, immutable views of the state, serializable to JSON and back."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import immutables

from .errors import ResidencyUnavailableError
from .locations import Location, LocationMap
from .sizes import format_nbytes
from .state import ResidencyState
from .values import MaterializationState, ReplicaMode, ValueHandle

__all__ = [
    "LocationRecord",
    "MaterializationRecord",
    "ResidencySnapshot",
    "ValueSnapshot",
    "take_snapshot",
]

RECONSTRUCTIBLE = "reconstructible"
NOT_RECONSTRUCTIBLE = "not-reconstructible"


def _path(where: str, key: str | int) -> str:
    return f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"


def _count(data: Any, key: str | int, where: str) -> int:
    """``data[key]``, a count of bytes or uses: an int (not a bool) that is not negative."""
    got = data[key]
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        raise ValueError(f"{_path(where, key)} must be a non-negative int, got {got!r}")
    return got


def _text(data: Any, key: str | int, where: str) -> str:
    got = data[key]
    if not isinstance(got, str):
        raise ValueError(f"{_path(where, key)} must be a str, got {got!r}")
    return got


def _flag(data: Any, key: str | int, where: str) -> bool:
    got = data[key]
    if not isinstance(got, bool):
        raise ValueError(f"{_path(where, key)} must be true or false, got {got!r}")
    return got


def _location(data: Any, key: str | int, where: str) -> Location:
    got = data[key]
    try:
        return Location.parse(got)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{_path(where, key)} is not a location: {error}") from None


def _handle(data: Any, key: str, where: str) -> ValueHandle:
    """``data[key]``, a handle as ``ValueHandle.to_dict`` writes it, each field checked."""
    got = data[key]
    if not isinstance(got, Mapping):
        raise ValueError(f"{_path(where, key)} must be a handle's dict, got {got!r}")
    path = _path(where, key)
    return ValueHandle(
        _text(got, "manager_id", path), _count(got, "value_id", path), _text(got, "name", path)
    )


E = TypeVar("E", bound=enum.Enum)


def _member(kind: type[E], data: Any, key: str, where: str) -> E:
    got = data[key]
    try:
        return kind(got)
    except ValueError:
        known = ", ".join(repr(m.value) for m in kind)
        raise ValueError(
            f"{_path(where, key)} is {got!r}, not a {kind.__name__} (one of {known})"
        ) from None


@dataclass(frozen=True, slots=True)
class LocationRecord:
    """One location's ledger: ``charged_bytes = used_bytes + reserved_bytes``.

    ``spare_bytes``: memory the backend keeps ready for new values here (at ``pinned-host``
    the pinned arena's free space, at ``pageable-host`` the freed pageable destinations kept
    with their pages faulted in): not charged, since a value copied there takes it over, and
    kept within the budget's headroom."""

    location: Location
    budget_bytes: int | None
    used_bytes: int
    reserved_bytes: int
    charged_bytes: int
    peak_bytes: int
    reservations: tuple[tuple[str, int], ...]
    spare_bytes: int = 0

    def __repr__(self) -> str:
        # Sizes as torch.cuda.memory_summary prints them (to_dict keeps the exact counts).
        budget = "unlimited" if self.budget_bytes is None else format_nbytes(self.budget_bytes)
        return (
            f"<Location {self.location} used={format_nbytes(self.used_bytes)} "
            f"reserved={format_nbytes(self.reserved_bytes)} "
            f"peak={format_nbytes(self.peak_bytes)} budget={budget}"
            + (f" spare={format_nbytes(self.spare_bytes)}" if self.spare_bytes else "")
            + ">"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "location": str(self.location),
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes,
            "reserved_bytes": self.reserved_bytes,
            "charged_bytes": self.charged_bytes,
            "peak_bytes": self.peak_bytes,
            "reservations": [[name, nbytes] for name, nbytes in self.reservations],
            "spare_bytes": self.spare_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "location") -> LocationRecord:
        """The record ``to_dict`` described (``ValueError`` naming a malformed field, ``where``
        its path in the snapshot; ``KeyError`` for a missing one)."""
        budget = data["budget_bytes"]
        used = _count(data, "used_bytes", where)
        reserved = _count(data, "reserved_bytes", where)
        charged = _count(data, "charged_bytes", where)
        if charged != used + reserved:
            raise ValueError(
                f"{where}.charged_bytes is {charged}, not used_bytes + reserved_bytes "
                f"({used} + {reserved}): the record is not one to_dict wrote"
            )
        reservations = data["reservations"]
        if not isinstance(reservations, list | tuple) or not all(
            isinstance(r, list | tuple) and len(r) == 2 for r in reservations
        ):
            raise ValueError(f"{where}.reservations must be a list of [name, bytes] pairs")
        return cls(
            _location(data, "location", where),
            None if budget is None else _count(data, "budget_bytes", where),
            used,
            reserved,
            charged,
            _count(data, "peak_bytes", where),
            tuple(
                (
                    _text(r, 0, f"{where}.reservations[{i}]"),
                    _count(r, 1, f"{where}.reservations[{i}]"),
                )
                for i, r in enumerate(reservations)
            ),
            _count(data, "spare_bytes", where) if "spare_bytes" in data else 0,
        )


@dataclass(frozen=True, slots=True)
class MaterializationRecord:
    """One copy of a value: its charge, its protections and its transfer state."""

    location: Location
    charged_bytes: int
    use_count: int
    hold_count: int
    pending_event_count: int
    state: MaterializationState

    @property
    def protected(self) -> bool:
        return bool(self.use_count or self.hold_count or self.pending_event_count)

    def to_dict(self) -> dict[str, Any]:
        return {
            "location": str(self.location),
            "charged_bytes": self.charged_bytes,
            "use_count": self.use_count,
            "hold_count": self.hold_count,
            "pending_event_count": self.pending_event_count,
            "state": self.state.value,
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str = "materialization"
    ) -> MaterializationRecord:
        """See :meth:`LocationRecord.from_dict`."""
        return cls(
            _location(data, "location", where),
            _count(data, "charged_bytes", where),
            _count(data, "use_count", where),
            _count(data, "hold_count", where),
            _count(data, "pending_event_count", where),
            _member(MaterializationState, data, "state", where),
        )


@dataclass(frozen=True, slots=True)
class ValueSnapshot:
    """One value: mode, recoverability (``reconstructible`` when it has a source), its fixed
    charge and its materializations ordered by location."""

    handle: ValueHandle
    name: str
    replica_mode: ReplicaMode
    recoverability: str
    has_source: bool
    source_location: Location | None
    charge_bytes: int
    discarded: bool
    locations: tuple[Location, ...]
    materializations: tuple[MaterializationRecord, ...]

    def materialization(self, location: Any) -> MaterializationRecord:
        loc = Location.parse(location)
        for record in self.materializations:
            if record.location == loc:
                return record
        raise ResidencyUnavailableError(self.handle, loc, "no materialization there")

    def to_dict(self) -> dict[str, Any]:
        return {
            "handle": self.handle.to_dict(),
            "name": self.name,
            "replica_mode": self.replica_mode.value,
            "recoverability": self.recoverability,
            "has_source": self.has_source,
            "source_location": None if self.source_location is None else str(self.source_location),
            "charge_bytes": self.charge_bytes,
            "discarded": self.discarded,
            "locations": [str(loc) for loc in self.locations],
            "materializations": [m.to_dict() for m in self.materializations],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "value") -> ValueSnapshot:
        """See :meth:`LocationRecord.from_dict`."""
        source = data["source_location"]
        locations = data["locations"]
        mats = data["materializations"]
        for field, items in (("locations", locations), ("materializations", mats)):
            if not isinstance(items, list | tuple):
                raise ValueError(f"{where}.{field} must be a list, got {items!r}")
        return cls(
            _handle(data, "handle", where),
            _text(data, "name", where),
            _member(ReplicaMode, data, "replica_mode", where),
            _text(data, "recoverability", where),
            _flag(data, "has_source", where),
            None if source is None else _location(data, "source_location", where),
            _count(data, "charge_bytes", where),
            _flag(data, "discarded", where),
            tuple(_location(locations, i, f"{where}.locations") for i in range(len(locations))),
            tuple(
                MaterializationRecord.from_dict(m, f"{where}.materializations[{i}]")
                for i, m in enumerate(mats)
            ),
        )


class ValueRecords(Mapping[ValueHandle, "ValueSnapshot"]):
    """``snapshot.values``: every value's record by handle, read-only, iterated in the order
    the values were registered (the same order from one run to the next, as a dict's). It
    wraps the persistent map each snapshot shares with the next, so taking a snapshot never
    copies the records; the order is sorted on the first iteration only."""

    __slots__ = ("_map", "_order")

    def __init__(self, records: Mapping[ValueHandle, ValueSnapshot]) -> None:
        self._map = records
        self._order: tuple[ValueHandle, ...] | None = None

    def __getitem__(self, handle: ValueHandle) -> ValueSnapshot:
        return self._map[handle]

    def __contains__(self, handle: object) -> bool:
        return handle in self._map

    def get(self, handle: ValueHandle, default: Any = None) -> Any:
        return self._map.get(handle, default)

    def __len__(self) -> int:
        return len(self._map)

    def __iter__(self) -> Iterator[ValueHandle]:
        if self._order is None:
            self._order = tuple(sorted(self._map, key=lambda handle: handle.value_id))
        return iter(self._order)

    def __hash__(self) -> int:
        return hash(self._map)  # as the map it wraps (a persistent map is hashable)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ValueRecords, (dict(self.items()),))

    def __repr__(self) -> str:
        return f"ValueRecords({dict(self.items())!r})"


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    """The whole state at one ``state_version``, taken in one step; holds no tensor."""

    manager_id: str
    state_version: int
    locations: LocationMap[LocationRecord]
    values: Mapping[ValueHandle, ValueSnapshot]

    def __post_init__(self) -> None:
        if not isinstance(self.locations, LocationMap):  # snapshot.locations["cuda:0"] too
            object.__setattr__(self, "locations", LocationMap(self.locations))
        if not isinstance(self.values, ValueRecords):  # in registration order
            object.__setattr__(self, "values", ValueRecords(self.values))

    def value(self, handle: ValueHandle) -> ValueSnapshot:
        """The record of one value (``TypeError`` for what is not a handle, such as the
        value's name; ``ResidencyUnavailableError`` saying why for a handle it has not)."""
        if not isinstance(handle, ValueHandle):
            hint = (
                " (records are keyed by handle; by name: [v for v in snapshot.values.values() "
                f"if v.name == {handle!r}])"
                if isinstance(handle, str)
                else ""
            )
            raise TypeError(
                f"snapshot.value takes a ValueHandle, got {handle!r} "
                f"({type(handle).__name__}){hint}"
            )
        record = self.values.get(handle)
        if record is None:
            if handle.manager_id != self.manager_id:
                raise ResidencyUnavailableError(
                    handle,
                    None,
                    f"not in this snapshot: the handle belongs to manager {handle.manager_id}, "
                    f"and this is a snapshot of manager {self.manager_id}",
                )
            raise ResidencyUnavailableError(
                handle,
                None,
                f"not in this snapshot (v{self.state_version}): the value was discarded before "
                "it was taken, or registered after",
            )
        return record

    def location(self, location: Any) -> LocationRecord:
        """The record of one location (``ResidencyUnavailableError`` naming the locations the
        snapshot has, for one it has not)."""
        loc = Location.parse(location)
        record = self.locations.get(loc)
        if record is None:
            known = ", ".join(str(k) for k in sorted(self.locations)) or "none"
            raise ResidencyUnavailableError(
                None, loc, f"this snapshot has no record of it (it has: {known})"
            )
        return record

    def __repr__(self) -> str:
        return (
            f"<ResidencySnapshot manager={self.manager_id} v{self.state_version} "
            f"[{len(self.values)} values, {len(self.locations)} locations]>"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "manager_id": self.manager_id,
            "state_version": self.state_version,
            "locations": [record.to_dict() for record in self.locations.values()],
            "values": [
                record.to_dict()
                for record in sorted(self.values.values(), key=lambda r: r.handle.value_id)
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResidencySnapshot:
        """The snapshot ``to_dict`` described; ``ValueError`` naming the first missing or
        malformed field (JSON from elsewhere is checked, not trusted)."""
        try:
            for field in ("locations", "values"):
                if not isinstance(data[field], list | tuple):
                    raise ValueError(f"{field} must be a list, got {data[field]!r}")
            locations = [
                LocationRecord.from_dict(d, f"locations[{i}]")
                for i, d in enumerate(data["locations"])
            ]
            values = [
                ValueSnapshot.from_dict(d, f"values[{i}]") for i, d in enumerate(data["values"])
            ]
            manager_id, version = data["manager_id"], data["state_version"]
        except KeyError as missing:
            raise ValueError(
                f"not a snapshot dict: the field {missing} is missing (expected manager_id, "
                "state_version, locations, values as written by ResidencySnapshot.to_dict)"
            ) from None
        except (TypeError, AttributeError) as error:
            raise ValueError(f"not a snapshot dict: {error}") from None
        if (
            not isinstance(manager_id, str)
            or isinstance(version, bool)
            or not isinstance(version, int)
        ):
            raise ValueError(
                f"not a snapshot dict: manager_id must be a str and state_version an int, got "
                f"{manager_id!r} and {version!r}"
            )
        seen: set[object] = set()
        for i, record in enumerate(locations):
            if record.location in seen:
                raise ValueError(f"locations[{i}] repeats location {record.location}")
            seen.add(record.location)
        ids: set[int] = set()
        for i, value in enumerate(values):
            handle = value.handle
            if handle.manager_id != manager_id:
                raise ValueError(
                    f"values[{i}].handle.manager_id is {handle.manager_id!r}, not the "
                    f"snapshot's manager_id {manager_id!r}"
                )
            if handle.value_id in ids:
                raise ValueError(f"values[{i}] repeats value id {handle.value_id}")
            ids.add(handle.value_id)
        return cls(
            manager_id,
            version,
            LocationMap({r.location: r for r in locations}),
            MappingProxyType({v.handle: v for v in values}),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResidencySnapshot):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.manager_id, self.state_version))


def bring_up_to_date(state: ResidencyState, seconds: float | None = None) -> bool:
    """Rebuild the records of the values changed since the map was last brought up to date
    (for the first time: of every value), for at most ``seconds`` (``None``: all of them).
    Returns whether nothing is left. A value changed meanwhile is noted again and redone, so
    ``manager.snapshot_async`` can bring the map up in slices and take the snapshot, atomically,
    once the last slice left nothing: its loop is blocked one slice at a time (plus, the first
    time, one copy of the handles), not for every record at once."""
    if state.snapshot_values is None:
        state.snapshot_values = immutables.Map()
        state.snapshot_backlog = state.value_handles()
        state.changed_values.clear()
    backlog, changed = state.snapshot_backlog, state.changed_values
    if not backlog and not changed:
        return True
    deadline = None if seconds is None else time.perf_counter() + seconds
    done = 0
    with state.snapshot_values.mutate() as changing:
        while backlog or changed:
            handle = backlog.pop() if backlog else changed.pop()
            value = state.find_value(handle)
            if value is None:
                changing.pop(handle, None)  # discarded
            else:
                changing[handle] = _value_record(value)
            done += 1
            if deadline is not None and done % 64 == 0 and time.perf_counter() >= deadline:
                break
        state.snapshot_values = changing.finish()
    return not backlog and not changed


def _value_record(value: Any) -> ValueSnapshot:
    mats = tuple(
        MaterializationRecord(
            m.location,
            m.charged_bytes,
            m.use_count,
            m.hold_count,
            m.pending_event_count,
            m.state,
        )
        for m in sorted(value.materializations.values(), key=lambda m: m.location)
    )
    return ValueSnapshot(
        value.handle,
        value.handle.name,
        value.replica_mode,
        RECONSTRUCTIBLE if value.has_source else NOT_RECONSTRUCTIBLE,
        value.has_source,
        value.source_location,
        value.charge_bytes,
        value.discarded,
        tuple(m.location for m in mats),
        mats,
    )


def take_snapshot(state: ResidencyState) -> ResidencySnapshot:
    """Copy ``state`` into records in one synchronous step (so it is atomic on the loop).

    Cost: O(values changed since the previous snapshot + locations), not O(values): value
    records live in a persistent (structurally shared) map kept on the state; a snapshot takes
    the current map and only the changed values are rebuilt into the next one."""
    locations = {}
    for loc in state.locations():
        entry = state.ledger(loc)
        locations[loc] = LocationRecord(
            loc,
            entry.budget_bytes,
            entry.used_bytes,
            entry.reserved_bytes,
            entry.charged_bytes,
            entry.peak_bytes,
            tuple(sorted((name, nbytes) for name, (nbytes, _) in entry.reservations.items())),
            entry.spare_bytes,
        )
    if state.snapshot_values is None:
        # The first snapshot: every record at once (a dict is quicker to fill than the map).
        state.snapshot_values = immutables.Map({v.handle: _value_record(v) for v in state.values()})
        state.changed_values.clear()
        state.snapshot_backlog = []
    else:
        bring_up_to_date(state)
    values = state.snapshot_values
    return ResidencySnapshot(
        state.manager_id,
        state.state_version,
        LocationMap(locations),
        values,
    )
