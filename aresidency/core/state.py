"""The residency model: values, materializations, the per-location ledger, and transitions.

Pure and synchronous: no asyncio, no device calls. The runtime owns one :class:`ResidencyState`
and calls its transition methods; ``explain`` runs the same methods on a copy.

State and invariants (checked by ``check_invariants`` and by the property tests):

* ``locations[loc].used_bytes`` is the sum of ``charged_bytes`` of every materialization at
  ``loc``; ``reserved_bytes`` is the sum of its named reservations.
* ``used_bytes + reserved_bytes <= budget_bytes`` whenever the budget is strict (not ``None``).
* ``peak_bytes`` is the largest ``used_bytes + reserved_bytes`` seen since the last peak reset.
* a value without a source that is not discarded has at least one materialization.
* an EXCLUSIVE value has at most one materialization that is not OUTGOING.
* ``state_version`` grows by exactly one for every committed transition; a transition whose
  validation fails raises and changes nothing (validate first, then commit).
* every committed transition appends exactly one trace entry.

Why this module is long: it is one class whose every transition validates completely before it
commits anything, and keeps several derived counters (charges, breakdowns, protection, the
reads index) in step; the transitions read best side by side, with the copies that explain and
admission simulate on (``clone``, ``settled``, ``isolated``) and the invariant check that
guards them all. The records it holds live in :mod:`~aresidency.core.values`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

from .errors import (
    ResidencyBudgetError,
    ResidencyInUseError,
    ResidencyPlanError,
    ResidencyUnavailableError,
    format_bytes,
)
from .locations import Location, LocationLike
from .sizes import ByteSize, parse_nbytes
from .trace import TraceRing, Transition, trace_record
from .values import (
    DEFAULT_GRANULARITY,
    CopyTicket,
    DuplicateReservationError,
    LocationLedger,
    Materialization,
    MaterializationState,
    ReplicaMode,
    Value,
    ValueHandle,
    check_nbytes,
    check_value_name,
)

__all__ = ["ResidencyState"]


class ResidencyState:
    """All manager state, mutated only through the transition methods below."""

    def __init__(
        self,
        manager_id: str | None = None,
        budgets: Mapping[Any, ByteSize | None] | None = None,
        trace_capacity: int = 4096,
        granularity: int = DEFAULT_GRANULARITY,
        clock_ns: Any = time.monotonic_ns,
    ) -> None:
        self.manager_id = manager_id or f"m-{uuid.uuid4().hex[:12]}"
        self.state_version = 0
        self.granularity = check_nbytes(granularity, "granularity", allow_zero=False)
        self._locations: dict[Location, LocationLedger] = {}
        self._values: dict[ValueHandle, Value] = {}
        self._tickets: dict[int, CopyTicket] = {}
        # (handle, source location) -> open transfers reading it: O(1) answers for the
        # phase runner, which asks once per action.
        self._reads: dict[tuple[ValueHandle, Location], list[CopyTicket]] = {}
        # Two counters: value ids (what handles print, "#5": the fifth value registered) and
        # copy ticket ids, each unique per state, neither skipping numbers for the other.
        self._next_value_id = 1
        self._next_id = 1
        self._seq = 0
        self._trace = TraceRing(trace_capacity, ValueHandle)
        self._clock_ns = clock_ns
        # True on the copies explain and admission simulate on: their budget errors say so.
        self.in_simulation = False
        # The runtime's journal: (kind, handle, location) of every transition committed since
        # it last settled (a tuple, not a Transition: it is made on every commit); lists that
        # collect every committed transition and callbacks told of each (explain's peak
        # watcher, the controller's index): usually none.
        self.journal: list[tuple[str, Any, Location | None]] | None = None
        self.recorders: list[list[Transition]] = []
        self.observers: list[Any] = []
        # The runtime sets ``origin`` while it advances one plan run synchronously; transitions
        # committed meanwhile also go to ``origin_recorders[origin]``, so that a run reports
        # its own transitions and not those other tasks commit while it awaits.
        self.origin: object | None = None
        self.origin_recorders: dict[object, list[Transition]] = {}
        # Snapshots: the values changed since the last one, and the persistent map of value
        # records it left (see core.snapshot.take_snapshot: O(changes), not O(values)).
        # Nothing is tracked before the first snapshot; at most O(values) after it.
        self.changed_values: set[ValueHandle] = set()
        self.snapshot_values: Any = None
        # Values whose records the map lacks since it was (re)started (see bring_up_to_date).
        self.snapshot_backlog: list[ValueHandle] = []
        # Budgets as people write them ("10GiB", 10.5e9, 8 << 30): parse_nbytes reads them
        # exactly; all are parsed before any ledger exists, so a bad one leaves no state.
        parsed: list[tuple[Location, int | None]] = []
        keys: dict[Location, Any] = {}
        for key, budget in (budgets or {}).items():
            location = Location.parse(key)
            if location in keys:  # {"cuda:0": ..., torch.device("cuda:0"): ...}: which one?
                raise ValueError(
                    f"budgets keys {keys[location]!r} and {key!r} both name {location}; give "
                    "each location one budget"
                )
            keys[location] = key
            nbytes = None if budget is None else parse_nbytes(budget, f"budget for {location}")
            parsed.append((location, nbytes))
        for location, budget in parsed:
            self._locations[location] = LocationLedger(location, budget)

    # ------------------------------------------------------------------ reading

    def ledger(self, location: LocationLike) -> LocationLedger:
        if type(location) is not Location:
            location = Location.parse(location)
        entry = self._locations.get(location)
        if entry is None:
            entry = self._locations[location] = LocationLedger(location, None)
        return entry

    def __repr__(self) -> str:
        return (
            f"<ResidencyState of manager {self.manager_id} v{self.state_version} "
            f"[{len(self._values)} values, {len(self._locations)} locations]>"
        )

    def locations(self) -> list[Location]:
        return sorted(self._locations)

    def ledgers_by_location(self) -> Iterable[tuple[Location, LocationLedger]]:
        """(location, ledger) of every location the state has a ledger for (a live view)."""
        return self._locations.items()

    def value(self, handle: Any) -> Value:
        """The value for ``handle``; raises for a foreign, unknown or discarded handle."""
        if type(handle) is ValueHandle:
            # The common case first: a handle of this manager's (one of another manager's
            # is never equal to one of these keys, and falls through to say so).
            found = self._values.get(handle)
            if found is not None:
                return found
        if not isinstance(handle, ValueHandle):
            raise TypeError(f"expected a ValueHandle, got {handle!r} ({type(handle).__name__})")
        if handle.manager_id != self.manager_id:
            raise ResidencyUnavailableError(
                handle,
                None,
                f"the handle belongs to manager {handle.manager_id}, not to this manager "
                f"({self.manager_id}); use it with the manager that registered it",
            )
        value = self._values.get(handle)
        if value is None:
            # Discarded values leave the state (a long-running manager would otherwise grow
            # without bound); every other handle of this manager names a live value.
            raise ResidencyUnavailableError(
                handle,
                None,
                "the value was discarded (or the handle was not made by register): register "
                "the tensor again to use it",
            )
        return value

    def find_value(self, handle: ValueHandle) -> Value | None:
        """The value for ``handle``, or ``None`` if this state has none (never raises)."""
        return self._values.get(handle)

    def find_ledger(self, location: Location) -> LocationLedger | None:
        """The ledger of ``location`` if the state has one (unlike :meth:`ledger`, never adds
        one)."""
        return self._locations.get(location)

    def values(self) -> Iterator[Value]:
        return iter(self._values.values())

    def value_handles(self) -> list[ValueHandle]:
        """The handles of every value, as a list (one C-level copy of the table's keys)."""
        return list(self._values)

    def materialization(self, handle: Any, location: LocationLike) -> Materialization:
        if type(location) is not Location:
            location = Location.parse(location)
        value = self.value(handle)
        mat = value.materializations.get(location)
        if mat is None:
            where = ", ".join(str(loc) for loc in sorted(value.materializations)) or "nowhere"
            raise ResidencyUnavailableError(
                handle, location, f"it has no materialization there (it is at: {where})"
            )
        return mat

    def ticket(self, ticket_id: int) -> CopyTicket:
        return self._tickets[ticket_id]

    def open_tickets(self) -> list[CopyTicket]:
        return list(self._tickets.values())

    @property
    def trace_ring(self) -> TraceRing:
        return self._trace

    # ----------------------------------------------------------------- internals

    def _commit(
        self,
        kind: str,
        handle: ValueHandle | None,
        location: Location | None,
        nbytes: int,
        name: str | None = None,
        *,
        source: Location | None = None,
        destination: Location | None = None,
        value: Value | None = None,
    ) -> None:
        """Record one transition (see the module docstring); ``value``: the value of
        ``handle`` when the caller has it (else looked up)."""
        self.state_version += 1
        self._seq += 1
        if handle is not None:
            if self.snapshot_values is not None:
                self._note_changed(handle)
            if value is None:
                value = self._values.get(handle)
            if value is not None:
                value.last_used_version = self.state_version
        fields = (
            self._seq,
            self.state_version,
            kind,
            handle,
            location,
            nbytes,
            self._clock_ns(),
            name,
            source,
            destination,
        )
        trace = self._trace  # one commit is one trace entry (see TraceRing)
        trace.appended += 1
        if trace.entries.maxlen:
            trace.entries.append(trace_record(*fields))
        journal = self.journal
        if journal is not None:
            journal.append((kind, handle, location))
        own = None if self.origin is None else self.origin_recorders.get(self.origin)
        if not (self.recorders or self.observers or own is not None):
            return  # nobody wants the Transition object itself
        transition = Transition(*fields)
        for recorder in self.recorders:
            recorder.append(transition)
        if own is not None:
            own.append(transition)
        for observer in self.observers:
            observer(transition)

    def _note_changed(self, handle: ValueHandle) -> None:
        """Remember a change for the next snapshot; bounded: past as many changes as values
        (plus slack), the next snapshot rebuilds whole instead (it costs the same then)."""
        changed = self.changed_values
        changed.add(handle)
        if len(changed) > len(self._values) + 1024:
            changed.clear()
            self.snapshot_values = None
            self.snapshot_backlog = []

    def subscribe(self, observer: Any) -> Any:
        """Call ``observer(transition)`` after every committed transition (synchronously, in
        the committing call: keep it short and never mutate the state from it). Returns a
        function that ends the subscription."""
        self.observers.append(observer)

        def unsubscribe() -> None:
            if observer in self.observers:
                self.observers.remove(observer)

        return unsubscribe

    def _protection_changed(self, mat: Materialization, was: bool) -> None:
        """Keep ``protected_bytes`` of the materialization's ledger in step with its counts."""
        now = mat.protected
        if now != was:
            ledger = self._locations[mat.location]
            ledger.protected_bytes += mat.charged_bytes if now else -mat.charged_bytes

    def _charge(self, location: Location, nbytes: int) -> None:
        entry = self.ledger(location)
        entry.used_bytes += nbytes
        entry.note_peak()

    def _uncharge(self, location: Location, nbytes: int) -> None:
        self.ledger(location).used_bytes -= nbytes

    def _check_removable(self, value: Value, mat: Materialization, operation: str) -> None:
        if mat.protected:
            raise ResidencyInUseError(
                value.handle,
                mat.location,
                mat.use_count,
                mat.hold_count,
                mat.pending_event_count,
                operation=operation,
            )

    def _check_not_last(self, value: Value, location: Location, operation: str) -> None:
        if value.has_source:
            return
        for mat in value.materializations.values():
            if mat.location != location and mat.state is not MaterializationState.INCOMING:
                return  # another copy holds the value
        raise ResidencyPlanError(
            f"cannot {operation} {value.handle} at {location}: it is the last copy of a "
            "value without a source and would be lost; move it elsewhere or discard the "
            "value"
        )

    # -------------------------------------------------------------- transitions

    def register(
        self,
        *,
        name: str,
        charge_bytes: int,
        replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
        location: LocationLike | None = None,
        has_source: bool = False,
        source_location: LocationLike | None = None,
    ) -> ValueHandle:
        """Register a value: resident at ``location``, or (with a source) nowhere yet."""
        check_value_name(name)
        if not isinstance(replica_mode, ReplicaMode):
            raise TypeError(f"replica_mode must be a ReplicaMode, got {replica_mode!r}")
        check_nbytes(charge_bytes, f"charge of {name!r}", allow_zero=False)
        loc = None if location is None else Location.parse(location)
        src = None if source_location is None else Location.parse(source_location)
        if has_source and src is None:
            raise ValueError(f"value {name!r} has a source but no source_location")
        if not has_source and src is not None:
            raise ValueError(f"value {name!r} has a source_location but no source")
        if loc is None and not has_source:
            raise ValueError(
                f"value {name!r} needs a location or a source: without either it would hold no data"
            )
        if loc is not None:
            self.ledger(loc).check_admit(
                charge_bytes, f"registering {name!r}", in_simulation=self.in_simulation
            )
        handle = ValueHandle(self.manager_id, self._new_value_id(), name)
        value = Value(handle, replica_mode, charge_bytes, has_source, src)
        self._values[handle] = value
        if loc is not None:
            value.materializations[loc] = Materialization(
                loc, charge_bytes, MaterializationState.RESIDENT
            )
            self._charge(loc, charge_bytes)
        self._commit("register", handle, loc, charge_bytes if loc is not None else 0)
        return handle

    def set_budget(self, location: LocationLike, budget_bytes: ByteSize | None) -> None:
        """Set or clear a strict budget (a byte count as :func:`~.sizes.parse_nbytes` reads
        it, or ``None``). Refused if the location already holds more."""
        loc = Location.parse(location)
        budget_bytes = (
            None if budget_bytes is None else parse_nbytes(budget_bytes, f"budget for {loc}")
        )
        entry = self.ledger(loc)
        if budget_bytes is not None and entry.charged_bytes > budget_bytes:
            raise ResidencyBudgetError(
                loc,
                budget_bytes,
                entry.used_bytes,
                entry.reserved_bytes,
                0,
                what="the new budget",
                kind="budget",
                in_simulation=self.in_simulation,
            )
        entry.budget_bytes = budget_bytes
        self._commit("budget", None, loc, 0)

    def reserve(
        self, name: str, location: LocationLike, nbytes: ByteSize, owner: Any = None
    ) -> None:
        """Admit a named reservation of ``nbytes`` (as :func:`~.sizes.parse_nbytes` reads it)
        at ``location``."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a reservation needs a non-empty, non-blank str name, got {name!r}")
        loc = Location.parse(location)
        nbytes = parse_nbytes(nbytes, f"reservation {name!r}")
        entry = self.ledger(loc)
        if name in entry.reservations:
            raise DuplicateReservationError(
                f"a reservation named {name!r} is already active at {loc}"
            )
        entry.check_admit(
            nbytes, f"reservation {name!r}", kind="reservation", in_simulation=self.in_simulation
        )
        entry.add_reservation(name, nbytes, owner)
        entry.note_peak()
        self._commit("reserve", None, loc, nbytes, name)

    def set_spare_bytes(self, location: LocationLike, nbytes: int) -> None:
        """Note the page-locked bytes the backend keeps ready at ``location`` for new values
        (see ``LocationLedger.spare_bytes``). Not a transition: nothing is charged, nothing is
        admitted against it, the state version stays."""
        loc = Location.parse(location)
        check_nbytes(nbytes, f"spare bytes at {loc}")
        self.ledger(loc).spare_bytes = nbytes

    def unreserve(self, name: str, location: LocationLike) -> int:
        loc = Location.parse(location)
        entry = self._locations.get(loc)  # not ledger(): a refused call must add no location
        if entry is None or name not in entry.reservations:
            raise ValueError(f"no active reservation named {name!r} at {loc}")
        nbytes = entry.pop_reservation(name)
        self._commit("unreserve", None, loc, -nbytes, name)
        return nbytes

    def hold(self, handle: ValueHandle, location: LocationLike) -> Materialization:
        """Hold the materialization (returned: give it to :meth:`unhold`)."""
        mat = self._usable(handle, location, "hold")
        was = mat.protected
        mat.hold_count += 1
        self._protection_changed(mat, was)
        self._commit("hold", handle, mat.location, 0)
        return mat

    def is_current(self, handle: ValueHandle, location: LocationLike, mat: Materialization) -> bool:
        """Whether ``mat`` is still the value's materialization at ``location`` (a copy given
        up before its data existed drops its destination, leases and holds with it; a later
        copy there makes a new one, which they must not count down)."""
        value = self._values.get(handle)
        return value is not None and value.materializations.get(Location.parse(location)) is mat

    def unhold(
        self, handle: ValueHandle, location: LocationLike, mat: Materialization | None = None
    ) -> bool:
        """End a hold; with ``mat`` (what :meth:`hold` returned), nothing changes and the
        result is ``False`` when that materialization is gone (its hold went with it)."""
        if mat is not None and not self.is_current(handle, location, mat):
            return False
        mat = self.materialization(handle, location)
        if mat.hold_count <= 0:
            raise ValueError(f"{handle} has no hold at {mat.location}")
        was = mat.protected
        mat.hold_count -= 1
        self._protection_changed(mat, was)
        self._commit("unhold", handle, mat.location, 0)
        return True

    def _usable(self, handle: ValueHandle, location: LocationLike, what: str) -> Materialization:
        mat = self.materialization(handle, location)
        if mat.state == MaterializationState.OUTGOING:
            raise ResidencyUnavailableError(
                handle, mat.location, f"it is moving out; cannot {what} it"
            )
        return mat

    def lease(
        self, handle: ValueHandle, location: LocationLike, mode: str = "read"
    ) -> Materialization:
        """Begin a use of the materialization (returned: give it to :meth:`unlease`). A write
        lease on a REPLICABLE value first invalidates the other replicas (each removal is its
        own ``invalidate`` transition, all validated before any commits)."""
        if mode not in ("read", "write"):
            raise ValueError(f"lease mode must be 'read' or 'write', got {mode!r}")
        mat = self._usable(handle, location, "lease")
        value = self.value(handle)
        others = [m for m in value.materializations.values() if m is not mat]
        if mode == "write":
            if mat.write_count or (mat.use_count and mode == "write"):
                raise ResidencyInUseError(
                    handle,
                    mat.location,
                    mat.use_count,
                    mat.hold_count,
                    mat.pending_event_count,
                    operation="write-lease (another lease is active)",
                )
            for other in others:
                self._check_removable(value, other, "invalidate")
                if other.state != MaterializationState.RESIDENT:
                    raise ResidencyInUseError(
                        handle,
                        other.location,
                        other.use_count,
                        other.hold_count,
                        other.pending_event_count,
                        operation="invalidate",
                        transfer=other.state.value,
                    )
            for other in sorted(others, key=lambda m: m.location):
                del value.materializations[other.location]
                self._uncharge(other.location, other.charged_bytes)
                self._commit("invalidate", handle, other.location, -other.charged_bytes)
            mat.write_count += 1
        elif mat.write_count:
            raise ResidencyInUseError(
                handle,
                mat.location,
                mat.use_count,
                mat.hold_count,
                mat.pending_event_count,
                operation="read-lease (a write lease is active)",
            )
        was = mat.protected
        mat.use_count += 1
        self._protection_changed(mat, was)
        self._commit("lease", handle, mat.location, 0)
        return mat

    def unlease(
        self,
        handle: ValueHandle,
        location: LocationLike,
        mode: str = "read",
        mat: Materialization | None = None,
    ) -> bool:
        """End a use; with ``mat`` (what :meth:`lease` returned), nothing changes and the
        result is ``False`` when that materialization is gone (its use went with it)."""
        if mode not in ("read", "write"):
            raise ValueError(f"lease mode must be 'read' or 'write', got {mode!r}")
        if mat is not None and not self.is_current(handle, location, mat):
            return False
        mat = self.materialization(handle, location)
        if mat.use_count <= 0:
            raise ValueError(f"{handle} has no active lease at {mat.location}")
        # The mode must match a lease that is active, or the write count drifts (a negative one
        # would refuse every later write lease; a stale one every later read lease).
        if mode == "write" and mat.write_count <= 0:
            raise ValueError(f"{handle} has no active write lease at {mat.location}")
        if mode == "read" and mat.use_count <= mat.write_count:
            raise ValueError(
                f"{handle} has no active read lease at {mat.location} (only a write lease)"
            )
        if mode == "write":
            mat.write_count -= 1
        was = mat.protected
        mat.use_count -= 1
        self._protection_changed(mat, was)
        self._commit("unlease", handle, mat.location, 0)
        return True

    def record_events(self, handle: ValueHandle, location: LocationLike, count: int = 1) -> None:
        """``count`` consumer events were recorded against the materialization."""
        check_nbytes(count, "event count", allow_zero=False)
        mat = self.materialization(handle, location)
        was = mat.protected
        mat.pending_event_count += count
        self._protection_changed(mat, was)
        self._commit("event_recorded", handle, mat.location, 0)

    def reap_events(self, handle: ValueHandle, location: LocationLike, count: int = 1) -> None:
        """``count`` consumer events completed."""
        check_nbytes(count, "event count", allow_zero=False)
        value = self.value(handle)
        mat = value.materializations.get(Location.parse(location))
        if mat is None or mat.pending_event_count < count:
            raise ValueError(f"{handle} has fewer than {count} pending events at {location}")
        was = mat.protected
        mat.pending_event_count -= count
        self._protection_changed(mat, was)
        self._commit("event_reaped", handle, mat.location, 0)

    def release(self, handle: ValueHandle, location: LocationLike) -> int:
        """Drop one resident, unprotected materialization; returns the bytes freed."""
        loc = location if type(location) is Location else Location.parse(location)
        value = self.value(handle)
        mat = value.materializations.get(loc)
        if mat is None:
            mat = self.materialization(handle, loc)  # raises, naming where the value is
        if mat.state is not MaterializationState.RESIDENT:
            raise ResidencyInUseError(
                handle,
                loc,
                mat.use_count,
                mat.hold_count,
                mat.pending_event_count,
                operation="release",
                transfer=mat.state.value,
            )
        if mat.use_count or mat.hold_count or mat.pending_event_count:
            self._check_removable(value, mat, "release")  # raises
        self._check_not_last(value, loc, "release")
        del value.materializations[loc]
        self._locations[loc].used_bytes -= mat.charged_bytes
        self._commit("release", handle, loc, -mat.charged_bytes, value=value)
        return mat.charged_bytes

    def discard(self, handle: ValueHandle) -> int:
        """Forget the value; every materialization must be unprotected and settled.

        Like a write lease's invalidations, each materialization freed is its own ``discard``
        transition at its location (in location order, all validated before any commits), so
        that replaying ``nbytes`` per location gives each ledger; a value with none (a source
        only) is one ``discard`` at no location, of 0 bytes."""
        value = self.value(handle)
        for mat in value.materializations.values():
            self._check_removable(value, mat, "discard")
            if mat.state != MaterializationState.RESIDENT:
                raise ResidencyInUseError(
                    handle,
                    mat.location,
                    mat.use_count,
                    mat.hold_count,
                    mat.pending_event_count,
                    operation="discard",
                    transfer=mat.state.value,
                )
        mats = sorted(value.materializations.values(), key=lambda m: m.location)
        value.materializations.clear()
        value.discarded = True
        del self._values[handle]
        for mat in mats:
            self._uncharge(mat.location, mat.charged_bytes)
            self._commit("discard", handle, mat.location, -mat.charged_bytes)
        if not mats:
            self._commit("discard", handle, None, 0)
        return sum(mat.charged_bytes for mat in mats)

    def begin_copy(
        self, handle: ValueHandle, source: LocationLike, destination: LocationLike, *, move: bool
    ) -> CopyTicket:
        """Charge ``destination`` (INCOMING) for a copy from ``source``.

        The source gets one pending event (the copy reads it) and, for a move, turns OUTGOING.
        Source and destination stay charged together until the copy commits.
        """
        src = Location.parse(source)
        dst = Location.parse(destination)
        return self._begin_copy(self.value(handle), src, dst, move=move)

    def _begin_copy(self, value: Value, src: Location, dst: Location, *, move: bool) -> CopyTicket:
        """:meth:`begin_copy` of ``value`` (this state's, as :meth:`value` returned it) between
        two parsed locations: every check, then the transition."""
        handle = value.handle
        if src == dst:
            raise ValueError(f"a copy of {handle} needs two different locations, got {src} twice")
        mat = value.materializations.get(src)
        if mat is None:
            mat = self.materialization(handle, src)  # raises, naming where the value is
        if mat.state is not MaterializationState.RESIDENT:
            raise ResidencyUnavailableError(
                handle, src, f"it is {mat.state.value} there, so it cannot be copied from yet"
            )
        if dst in value.materializations:
            raise ValueError(f"{handle} already has a materialization at {dst}")
        if mat.write_count:
            # A copy would read it while the writer changes it: a torn or stale replica.
            raise ResidencyInUseError(
                handle,
                src,
                mat.use_count,
                mat.hold_count,
                mat.pending_event_count,
                operation="copy from (a write lease is active)",
            )
        if move:
            if mat.use_count or mat.hold_count:
                raise ResidencyInUseError(
                    handle,
                    src,
                    mat.use_count,
                    mat.hold_count,
                    mat.pending_event_count,
                    operation="move out of",
                )
        elif value.replica_mode is ReplicaMode.EXCLUSIVE:
            raise ValueError(
                f"{handle} is EXCLUSIVE and already at {src}: a second materialization at {dst} "
                "is not allowed (move it instead, or register it REPLICABLE)"
            )
        charge = value.charge_bytes
        ledger = self._locations.get(dst)
        if ledger is None:
            ledger = self.ledger(dst)  # (adds it)
        budget = ledger.budget_bytes
        if budget is not None and ledger.used_bytes + ledger.reserved_bytes + charge > budget:
            ledger.check_admit(  # raises (the message is built only then)
                charge,
                f"{handle} ({'move' if move else 'copy'} from {src})",
                handle=handle,
                in_simulation=self.in_simulation,
            )
        self._next_id += 1
        ticket = CopyTicket(self._next_id - 1, handle, src, dst, charge, move)
        value.materializations[dst] = Materialization(dst, charge, MaterializationState.INCOMING)
        ledger.used_bytes += charge
        charged = ledger.used_bytes + ledger.reserved_bytes  # ledger.note_peak(), inline
        if charged > ledger.peak_bytes:
            ledger.peak_bytes = charged
        ledger.incoming_bytes += charge
        source_ledger = self._locations[src]
        was = mat.use_count or mat.hold_count or mat.pending_event_count
        mat.pending_event_count += 1
        now = mat.use_count or mat.hold_count or mat.pending_event_count
        if (not now) != (not was):  # _protection_changed(mat, was), inline
            source_ledger.protected_bytes += mat.charged_bytes if now else -mat.charged_bytes
        if move:
            mat.state = MaterializationState.OUTGOING
            source_ledger.outgoing_bytes += charge
        self._tickets[ticket.ticket_id] = ticket  # self._open(ticket), inline
        self._reads.setdefault((handle, src), []).append(ticket)
        self._commit(
            "move_begin" if move else "copy_begin",
            handle,
            dst,
            charge,
            source=src,
            destination=dst,
            value=value,
        )
        return ticket

    def begin_load(
        self, handle: ValueHandle, destination: LocationLike | None = None
    ) -> CopyTicket:
        """Charge ``destination`` (INCOMING) for a rebuild from the value's source.

        When the destination is not the value's ``source_location``, the load passes through
        ``source_location``, which is charged too (temporarily, until the ticket ends): both
        budgets are checked before either is charged. Two transitions (``rebuild_temp`` at the
        source location, then ``load_begin``) in that case, one otherwise."""
        value = self.value(handle)
        if not value.has_source or value.source_location is None:
            raise ResidencyUnavailableError(
                handle, None, "it has no source to reconstruct from and no materialization"
            )
        dst = value.source_location if destination is None else Location.parse(destination)
        via = None if dst == value.source_location else value.source_location
        if dst in value.materializations:
            raise ValueError(f"{handle} already has a materialization at {dst}")
        if value.replica_mode is ReplicaMode.EXCLUSIVE and value.materializations:
            raise ValueError(f"{handle} is EXCLUSIVE and already materialized; move it instead")
        charge = value.charge_bytes
        # Checked on existing ledgers only: a refused call must not add a location (a location
        # without a ledger has no budget and admits anything).
        if via is not None and via in self._locations:
            self._locations[via].check_admit(
                charge,
                f"{handle} (temporary load from its source, on its way to {dst})",
                handle=handle,
                kind="reconstruction",
                in_simulation=self.in_simulation,
            )
        if dst in self._locations:
            self._locations[dst].check_admit(
                charge,
                f"{handle} (rebuilt from its source)",
                handle=handle,
                in_simulation=self.in_simulation,
            )
        ticket = CopyTicket(self._new_id(), handle, None, dst, charge, False, via)
        self._open(ticket)
        if via is not None:
            self._charge(via, charge)
            self._locations[via].reconstruction_bytes += charge
            self._commit("rebuild_temp", handle, via, charge, source=via, destination=dst)
        value.materializations[dst] = Materialization(dst, charge, MaterializationState.INCOMING)
        self._charge(dst, charge)
        self._locations[dst].incoming_bytes += charge
        self._commit("load_begin", handle, dst, charge, source=via, destination=dst)
        return ticket

    def commit_copy(self, ticket: CopyTicket) -> None:
        """The transfer finished: the destination is RESIDENT; a move frees its source.

        A move's source must have no other pending events (its readers were reaped)."""
        known = self._tickets.get(ticket.ticket_id)
        if known is not ticket and known != ticket:
            # (compared whole: a ticket of another state, or a stale one, may share its id)
            raise ValueError(f"transfer {ticket.ticket_id} is not in flight")
        value = self._values.get(ticket.handle)
        if value is None:
            value = self.value(ticket.handle)  # raises, saying why
        dst = value.materializations[ticket.destination]
        src = None if ticket.source is None else value.materializations[ticket.source]
        if src is not None and ticket.move and (src.pending_event_count > 1 or src.use_count):
            raise ResidencyInUseError(
                ticket.handle,
                src.location,
                src.use_count,
                src.hold_count,
                src.pending_event_count - 1,
                operation="complete the move out of",
            )
        del self._tickets[ticket.ticket_id]  # self._close(ticket), inline
        if ticket.source is not None:
            key = (ticket.handle, ticket.source)
            reads = self._reads.pop(key)
            reads.remove(ticket)
            if reads:
                self._reads[key] = reads
        dst.state = MaterializationState.RESIDENT
        self._locations[ticket.destination].incoming_bytes -= ticket.nbytes
        freed = 0
        if src is not None:
            was = src.use_count or src.hold_count or src.pending_event_count
            src.pending_event_count -= 1
            now = src.use_count or src.hold_count or src.pending_event_count
            if (not now) != (not was):  # _protection_changed(src, was), inline
                ledger = self._locations[src.location]
                ledger.protected_bytes += src.charged_bytes if now else -src.charged_bytes
            if ticket.move:
                del value.materializations[src.location]
                ledger = self._locations[src.location]  # (charged there: it has a ledger)
                ledger.used_bytes -= src.charged_bytes
                ledger.outgoing_bytes -= src.charged_bytes
                freed = src.charged_bytes
        # Both ends are named: a move's commit is recorded where its bytes change (the source).
        source, destination = ticket.source or ticket.via, ticket.destination
        if src is not None and ticket.move:
            # The bytes change at the source: record the transition there.
            self._commit(
                "move_commit",
                ticket.handle,
                src.location,
                -freed,
                source=source,
                destination=destination,
                value=value,
            )
        elif ticket.via is not None:
            # The temporary charge ends at the source location: record it there.
            self._uncharge(ticket.via, ticket.nbytes)
            self._locations[ticket.via].reconstruction_bytes -= ticket.nbytes
            self._commit(
                "load_commit",
                ticket.handle,
                ticket.via,
                -ticket.nbytes,
                source=source,
                destination=destination,
                value=value,
            )
        else:
            kind = "load_commit" if src is None else "copy_commit"
            self._commit(
                kind,
                ticket.handle,
                destination,
                0,
                source=source,
                destination=destination,
                value=value,
            )

    def abort_copy(self, ticket: CopyTicket) -> None:
        """The transfer failed: drop the destination; the source stays intact."""
        if self._tickets.get(ticket.ticket_id) != ticket:
            # (compared whole: a ticket of another state, or a stale one, may share its id)
            raise ValueError(f"transfer {ticket.ticket_id} is not in flight")
        self._close(ticket)
        value = self.value(ticket.handle)
        dst = value.materializations.pop(ticket.destination)
        if dst.protected:  # a driver waits for that; a simulation may not
            self._locations[ticket.destination].protected_bytes -= dst.charged_bytes
        self._uncharge(ticket.destination, dst.charged_bytes)
        self._locations[ticket.destination].incoming_bytes -= dst.charged_bytes
        if ticket.source is not None:
            src = value.materializations[ticket.source]
            was = src.protected
            src.pending_event_count -= 1
            self._protection_changed(src, was)
            if ticket.move:
                src.state = MaterializationState.RESIDENT
                self._locations[ticket.source].outgoing_bytes -= src.charged_bytes
        source, destination = ticket.source or ticket.via, ticket.destination
        self._commit(
            "copy_abort",
            ticket.handle,
            destination,
            -dst.charged_bytes,
            source=source,
            destination=destination,
        )
        if ticket.via is not None:
            self._uncharge(ticket.via, ticket.nbytes)
            self._locations[ticket.via].reconstruction_bytes -= ticket.nbytes
            self._commit(
                "rebuild_abort",
                ticket.handle,
                ticket.via,
                -ticket.nbytes,
                source=source,
                destination=destination,
            )

    def _open(self, ticket: CopyTicket) -> None:
        self._tickets[ticket.ticket_id] = ticket
        if ticket.source is not None:
            self._reads.setdefault((ticket.handle, ticket.source), []).append(ticket)

    def _close(self, ticket: CopyTicket) -> None:
        del self._tickets[ticket.ticket_id]
        if ticket.source is not None:
            key = (ticket.handle, ticket.source)
            reads = self._reads.pop(key)
            reads.remove(ticket)
            if reads:
                self._reads[key] = reads  # (in the order they began, still)

    def reads_of(self, handle: ValueHandle, location: Location) -> list[CopyTicket]:
        """The open transfers that read the materialization (in the order they began)."""
        return list(self._reads.get((handle, location), ()))

    # ---------------------------------------------------------------- utilities

    def reset_peak_bytes(self, location: LocationLike | None = None) -> None:
        """Start peak tracking afresh (one location, or all): a transition like any other."""
        locs = self.locations() if location is None else [Location.parse(location)]
        for loc in locs:
            entry = self._locations.get(loc)
            if entry is None:  # validated before anything changes: no phantom location
                known = ", ".join(str(known) for known in self.locations()) or "none"
                raise ValueError(f"{loc} is not a location of this manager (it has: {known})")
        for loc in locs:
            entry = self._locations[loc]
            entry.peak_bytes = entry.charged_bytes
        self._commit("peak_reset", None, None if location is None else locs[0], 0)

    def reset_peaks(self) -> None:
        """Set every location's peak to its current charge (not a transition)."""
        for entry in self._locations.values():
            entry.peak_bytes = entry.charged_bytes

    def clone(self, handles: Iterable[ValueHandle] | None = None) -> ResidencyState:
        """A copy sharing nothing mutable, with the trace disabled (for ``explain``).

        With ``handles``, only those values are copied (the ledgers are copied whole): enough to
        simulate a plan that touches only them, in time independent of the number of values.
        Such a partial copy does not satisfy ``check_invariants``."""
        steps = self.clone_steps(handles)
        try:
            while True:
                next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def clone_steps(
        self, handles: Iterable[ValueHandle] | None = None, every: int = 256
    ) -> Generator[None, None, ResidencyState]:
        """:meth:`clone`, pausing (yielding ``None``) every ``every`` values, so that a caller
        on an event loop can copy tens of thousands of values in slices (it must start again
        if this state changed in between: the copy would not be of one state)."""
        other = ResidencyState.__new__(ResidencyState)
        other.manager_id = self.manager_id
        other.state_version = self.state_version
        other.granularity = self.granularity
        other._locations = {loc: entry.copy() for loc, entry in self._locations.items()}
        if handles is None:
            selected: list[Value] = list(self._values.values())
        else:
            selected = [self._values[h] for h in dict.fromkeys(handles) if h in self._values]
        other._values = {}
        other._reads = {}
        reads = self._reads
        for count, value in enumerate(selected, 1):
            other._values[value.handle] = value.copy()
            if reads:
                for loc in value.materializations:
                    open_reads = reads.get((value.handle, loc))
                    if open_reads:
                        other._reads[(value.handle, loc)] = list(open_reads)
            if count % every == 0 and count < len(selected):
                yield None
        other._tickets = dict(self._tickets)
        other._next_value_id = self._next_value_id
        other._next_id = self._next_id
        other._seq = self._seq
        other._trace = TraceRing(0)
        other._clock_ns = self._clock_ns
        other.in_simulation = True
        other.journal = None
        other.recorders = []
        other.observers = []
        other.origin = None
        other.origin_recorders = {}
        other.changed_values = set()
        other.snapshot_values = None
        other.snapshot_backlog = []
        return other

    def _new_id(self) -> int:
        """A new copy ticket id."""
        self._next_id += 1
        return self._next_id - 1

    def _new_value_id(self) -> int:
        """A new value id: 1, 2, 3... in registration order (handles print it)."""
        self._next_value_id += 1
        return self._next_value_id - 1

    def settled(
        self,
        handles: Iterable[ValueHandle],
        scoped: Iterable[ValueHandle] = (),
        *,
        kept: Iterable[tuple[ValueHandle, Location]] = (),
        kept_reservations: Iterable[tuple[str, Location]] = (),
        kept_uses: Iterable[tuple[ValueHandle, Location]] = (),
    ) -> ResidencyState:
        """A partial copy (``handles`` only) of what this state becomes once everything
        *transient* has ended: every transfer in flight completed (its destination resident,
        a move's source and a load's temporary charge gone); no lease, hold or pending event;
        no reservation but the backend's own (scopes and reservation blocks end); and, of the
        other values, every materialization that is protected now (in use, held or read) or
        belongs to a value in ``scoped`` (the values of entered scopes, whose exit may move
        them) assumed gone. Resident values that nothing protects stay where they are and
        stay charged: nothing moves them on its own.

        ``kept`` (materializations as ``(handle, location)``) and ``kept_reservations``
        (``(name, location)``) are exempt: what a task that would wait holds itself (its
        leases, holds and scopes' reservations) does not end while it waits, so they stay
        protected and charged. They keep the counts the task holds: one hold per entry of
        ``kept``, but for the entries ``kept_uses`` lists (the task's leases, one per lease),
        which count as uses; so an error the copy raises says what the task really holds
        (protected either way: what is decided does not depend on it).

        A plan that fails on this copy could not be admitted by waiting. O(len(handles) +
        len(scoped) + len(kept) + open transfers + locations), whatever the number of
        values."""
        keep = dict.fromkeys(handles)
        other = self.clone(keep)
        ledgers = other._locations
        for entry in ledgers.values():
            entry.used_bytes -= entry.protected_bytes + entry.reconstruction_bytes
        for handle in keep:
            value = self._values.get(handle)
            if value is None:
                continue
            for mat in value.materializations.values():
                if mat.protected:  # the plan's own values stay: count them back
                    ledgers[mat.location].used_bytes += mat.charged_bytes
        kept_mats: dict[tuple[ValueHandle, Location], Materialization] = {}
        kept_counts: dict[tuple[ValueHandle, Location], int] = {}
        for handle, location in kept:
            found = self._find_mat(handle, location)
            if found is not None and found.protected:
                kept_mats[handle, location] = found
                kept_counts[handle, location] = kept_counts.get((handle, location), 0) + 1
        uses: dict[tuple[ValueHandle, Location], int] = {}
        for pair in kept_uses:
            uses[pair] = uses.get(pair, 0) + 1
        for (handle, location), held in kept_mats.items():
            if handle not in keep:  # not copied: its bytes stay charged, as opaque use
                ledgers[location].used_bytes += held.charged_bytes
        for ticket in self._tickets.values():
            if ticket.move and ticket.source is not None:
                src = self._values[ticket.handle].materializations[ticket.source]
                if not src.protected:  # protected ones were taken out above
                    ledgers[ticket.source].used_bytes -= ticket.nbytes
        for handle in dict.fromkeys(scoped):
            value = self._values.get(handle)
            if value is None or handle in keep:
                continue
            for mat in value.materializations.values():
                if not mat.protected and mat.state is not MaterializationState.OUTGOING:
                    ledgers[mat.location].used_bytes -= mat.charged_bytes
        kept_names = set(kept_reservations)
        other._tickets.clear()
        other._reads.clear()
        for entry in ledgers.values():
            entry.incoming_bytes = entry.outgoing_bytes = entry.reconstruction_bytes = 0
            entry.protected_bytes = 0
            # Reservations of the backend itself (the staging pool) never go away.
            entry.reservations = {
                name: held
                for name, held in entry.reservations.items()
                if held[1] == "backend" or (name, entry.location) in kept_names
            }
            entry.reserved_bytes = sum(nbytes for nbytes, _ in entry.reservations.values())
        for value in other._values.values():
            for loc, mat in list(value.materializations.items()):
                if mat.state == MaterializationState.OUTGOING:
                    del value.materializations[loc]
                    ledgers[loc].used_bytes -= mat.charged_bytes
                    continue
                mat.state = MaterializationState.RESIDENT
                mat.use_count = mat.hold_count = mat.pending_event_count = mat.write_count = 0
                pair = (value.handle, loc)
                if pair in kept_mats:  # still held by the task that waits: its own counts
                    count = kept_counts[pair]
                    mat.use_count = min(uses.get(pair, 0), count)
                    mat.hold_count = count - mat.use_count
                    ledgers[loc].protected_bytes += mat.charged_bytes
        other.reset_peaks()
        return other

    def _find_mat(self, handle: ValueHandle, location: Location) -> Materialization | None:
        value = self._values.get(handle)
        return None if value is None else value.materializations.get(location)

    def isolated(self, handles: Iterable[ValueHandle]) -> ResidencyState:
        """A copy holding only ``handles``, unprotected, with no reservations but the
        backend's and no transfers in flight: the manager as if everything else went away
        (the controller's test for a request that waiting could admit, since it may evict
        any other value that nothing protects)."""
        keep = dict.fromkeys(handles)
        other = self.settled(keep)
        for entry in other._locations.values():
            entry.used_bytes = entry.incoming_bytes = entry.outgoing_bytes = 0
            entry.reconstruction_bytes = 0
        for value in other._values.values():
            for loc, mat in value.materializations.items():
                other.ledger(loc).used_bytes += mat.charged_bytes
        other.reset_peaks()
        return other

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant in the module docstring is broken."""
        used: dict[Location, int] = {}
        incoming: dict[Location, int] = {}
        outgoing: dict[Location, int] = {}
        protected: dict[Location, int] = {}
        temporary: dict[Location, int] = {}
        reads: dict[tuple[ValueHandle, Location], int] = {}
        for ticket in self._tickets.values():
            if ticket.via is not None:
                used[ticket.via] = used.get(ticket.via, 0) + ticket.nbytes
                temporary[ticket.via] = temporary.get(ticket.via, 0) + ticket.nbytes
            if ticket.source is not None:
                key = (ticket.handle, ticket.source)
                reads[key] = reads.get(key, 0) + 1
        assert reads == {k: len(v) for k, v in self._reads.items()}, "reads index drifted"
        for value in self._values.values():
            assert not value.discarded, f"{value.handle} discarded but still in the state"
            if not value.has_source:
                assert value.holders(), f"{value.handle} has no source and no data"
            if value.replica_mode is ReplicaMode.EXCLUSIVE:
                live = [
                    m
                    for m in value.materializations.values()
                    if m.state != MaterializationState.OUTGOING
                ]
                assert len(live) <= 1, f"{value.handle} is EXCLUSIVE with {len(live)} copies"
            for mat in value.materializations.values():
                assert mat.charged_bytes == value.charge_bytes
                assert min(mat.use_count, mat.hold_count, mat.pending_event_count) >= 0
                loc = mat.location
                used[loc] = used.get(loc, 0) + mat.charged_bytes
                if mat.protected:
                    protected[loc] = protected.get(loc, 0) + mat.charged_bytes
                if mat.state is MaterializationState.INCOMING:
                    incoming[loc] = incoming.get(loc, 0) + mat.charged_bytes
                elif mat.state is MaterializationState.OUTGOING:
                    outgoing[loc] = outgoing.get(loc, 0) + mat.charged_bytes
        for loc, entry in self._locations.items():
            assert entry.used_bytes == used.get(loc, 0), (
                f"{loc}: used_bytes {entry.used_bytes} != sum of charges {used.get(loc, 0)}"
            )
            assert entry.incoming_bytes == incoming.get(loc, 0), f"{loc}: incoming drifted"
            assert entry.outgoing_bytes == outgoing.get(loc, 0), f"{loc}: outgoing drifted"
            assert entry.reconstruction_bytes == temporary.get(loc, 0), f"{loc}: temp drifted"
            assert entry.protected_bytes == protected.get(loc, 0), f"{loc}: protected drifted"
            assert entry.reserved_bytes == sum(n for n, _ in entry.reservations.values())
            if entry.budget_bytes is not None:
                assert entry.charged_bytes <= entry.budget_bytes, (
                    f"{loc}: charged {format_bytes(entry.charged_bytes)} over budget "
                    f"{format_bytes(entry.budget_bytes)}"
                )
            assert entry.peak_bytes >= entry.charged_bytes
