"""The bounded trace of transitions: a ring buffer that says how much it overwrote.

A :class:`Transition` records one committed state change; a :class:`ResidencyTrace` is a
tensor-free copy of the ring; an :class:`ExecutionReport` lists what one plan run committed and
tells the clean-up entries (aborted copies, released reservation prefixes) from the transitions
that stay in effect. All three serialize to JSON-able dicts (``to_dict``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from .locations import Location

__all__ = [
    "ABORT_KINDS",
    "BEGIN_KINDS",
    "ExecutionReport",
    "ResidencyTrace",
    "TraceRing",
    "Transition",
    "trace_record",
]

#: Kinds that begin a transfer (charging its destination, or a rebuild's temporary storage).
BEGIN_KINDS = frozenset({"copy_begin", "move_begin", "load_begin", "rebuild_temp"})
#: Kinds that undo a begun transfer: clean-up, never an effect of their own.
ABORT_KINDS = frozenset({"copy_abort", "rebuild_abort"})

# What each abort undoes: the latest begin of one of these kinds, same handle and location.
_UNDOES = {
    "copy_abort": frozenset({"copy_begin", "move_begin", "load_begin"}),
    "rebuild_abort": frozenset({"rebuild_temp"}),
}


def _verb(kind: str) -> str:
    # An abort does not say whether it undid a copy or a move (its begin does): name neither.
    return "transfer" if kind in ABORT_KINDS else kind.split("_", 1)[0]


@dataclass(frozen=True, slots=True, init=False)
class Transition:
    """One committed state change: the state version it produced, its kind, and what it touched.

    ``handle`` is a ``ValueHandle`` or ``None``; ``name`` carries a reservation's name;
    ``location`` is where the bytes changed and ``nbytes`` the number of bytes charged there
    (positive) or freed (negative): replaying ``nbytes`` per ``location`` gives each ledger's
    charge. For transfers (copies, moves, loads and their commits and aborts) ``source`` and
    ``destination`` name both ends (``source`` is ``None`` for a load straight from the value's
    source): a move's commit is recorded at its source, where the bytes are freed, and still
    reads ``move cuda:0 -> pinned-host``.
    """

    seq: int
    state_version: int
    kind: str
    handle: Any
    location: Location | None
    nbytes: int
    time_ns: int
    name: str | None = None
    source: Location | None = None
    destination: Location | None = None

    def __init__(
        self,
        seq: int,
        state_version: int,
        kind: str,
        handle: Any,
        location: Location | None,
        nbytes: int,
        time_ns: int,
        name: str | None = None,
        source: Location | None = None,
        destination: Location | None = None,
    ) -> None:
        # What the dataclass's __init__ does (a frozen one sets each field through
        # object.__setattr__), through the fields' slots directly: one transition is made
        # per commit, several per operation, and this takes about half as long.
        _set_seq(self, seq)
        _set_state_version(self, state_version)
        _set_kind(self, kind)
        _set_handle(self, handle)
        _set_location(self, location)
        _set_nbytes(self, nbytes)
        _set_time_ns(self, time_ns)
        _set_name(self, name)
        _set_source(self, source)
        _set_destination(self, destination)

    @property
    def is_transfer(self) -> bool:
        """Whether the transition belongs to a transfer (it has a destination)."""
        return self.destination is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "state_version": self.state_version,
            "kind": self.kind,
            "handle": None if self.handle is None else self.handle.to_dict(),
            "location": None if self.location is None else str(self.location),
            "nbytes": self.nbytes,
            "time_ns": self.time_ns,
            "name": self.name,
            "source": None if self.source is None else str(self.source),
            "destination": None if self.destination is None else str(self.destination),
        }

    def __str__(self) -> str:
        what = self.handle if self.handle is not None else (self.name or "")
        head = f"#{self.seq} v{self.state_version} {self.kind} {what}"
        if self.destination is not None:
            source = "its source" if self.source is None else str(self.source)
            # Both ends, in the direction of the data; then where the bytes changed.
            where = f" at {self.location}" if self.location is not None else ""
            aborted = " aborted" if self.kind in ABORT_KINDS else ""
            return (
                f"{head}: {_verb(self.kind)} {source} -> {self.destination}{aborted}, "
                f"{self.nbytes:+d} B{where}"
            )
        where = f" @ {self.location}" if self.location is not None else ""
        return f"{head}{where} {self.nbytes:+d} B"


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The setter of ``cls``'s slot ``name``: a frozen slots dataclass's field, set without
    the generic ``object.__setattr__`` (what its generated ``__init__`` calls per field). The
    records made on every commit (:class:`Transition`, ``CopyTicket``) take about half the
    time to build through these."""
    setter: Callable[[Any, Any], None] = getattr(cls, name).__set__
    return setter


# The slots' setters (what Transition.__init__ calls), one per field.
_set_seq = slot_setter(Transition, "seq")
_set_state_version = slot_setter(Transition, "state_version")
_set_kind = slot_setter(Transition, "kind")
_set_handle = slot_setter(Transition, "handle")
_set_location = slot_setter(Transition, "location")
_set_nbytes = slot_setter(Transition, "nbytes")
_set_time_ns = slot_setter(Transition, "time_ns")
_set_name = slot_setter(Transition, "name")
_set_source = slot_setter(Transition, "source")
_set_destination = slot_setter(Transition, "destination")
assert [f.name for f in fields(Transition)] == [
    "seq",
    "state_version",
    "kind",
    "handle",
    "location",
    "nbytes",
    "time_ns",
    "name",
    "source",
    "destination",
], "Transition.__init__ sets every field"


@dataclass(frozen=True, slots=True)
class ResidencyTrace:
    """A tensor-free copy of the trace ring taken in one step.

    ``overwritten`` counts transitions the ring dropped because it was full; when ``enabled`` is
    false nothing was recorded and ``transitions`` is empty.
    """

    enabled: bool
    capacity: int
    overwritten: int
    transitions: tuple[Transition, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``json.dumps(manager.trace().to_dict())`` works."""
        return {
            "enabled": self.enabled,
            "capacity": self.capacity,
            "overwritten": self.overwritten,
            "transitions": [t.to_dict() for t in self.transitions],
        }

    def __repr__(self) -> str:
        # A summary, as a snapshot's repr is: the transitions (thousands by default) are in
        # ``transitions``, each printing as one line.
        if not self.enabled:
            return "<ResidencyTrace disabled (trace_capacity=0)>"
        kept = self.transitions
        span = f", versions {kept[0].state_version} to {kept[-1].state_version}" if kept else ""
        return (
            f"<ResidencyTrace {len(kept)} of capacity {self.capacity}{span}, "
            f"{self.overwritten} overwritten>"
        )

    def between(self, after_version: int, up_to_version: int) -> tuple[Transition, ...]:
        """The transitions that took the state from ``after_version`` to ``up_to_version``
        (``after_version < state_version <= up_to_version``): what a stale decision missed."""
        return tuple(
            t for t in self.transitions if after_version < t.state_version <= up_to_version
        )


# Locations as small ints in the ring's records (see TraceRing): a record of plain ints,
# strings and None is one the garbage collector stops tracking at its first collection.
_LOCATION_CODES: dict[Location | None, int] = {None: 0}
_LOCATIONS: list[Location | None] = [None]


def _location_code(location: Location | None) -> int:
    code = _LOCATION_CODES.get(location)
    if code is None:  # a location not seen before (a handful per program)
        code = _LOCATION_CODES.setdefault(location, len(_LOCATIONS))
        if code == len(_LOCATIONS):
            _LOCATIONS.append(location)
    return code


def trace_record(
    seq: int,
    state_version: int,
    kind: str,
    handle: Any,
    location: Location | None,
    nbytes: int,
    time_ns: int,
    name: str | None = None,
    source: Location | None = None,
    destination: Location | None = None,
) -> tuple[Any, ...]:
    """A transition as the ring keeps it: a tuple of ints, strings and ``None`` (a handle as
    its fields, each location as a code), which the garbage collector stops tracking at its
    first collection. The ring holds thousands of them for thousands of operations; kept as
    :class:`Transition` objects, each one was promoted to the oldest generation and counted
    towards its next full collection (tens of milliseconds with torch imported, during which
    the event loop stands still). :func:`_expand` gives the transition back."""
    if handle is None:
        manager_id, value_id, handle_name = None, None, None
    else:  # a ValueHandle (its fields; anything else is kept as it is)
        try:
            manager_id, value_id, handle_name = handle.manager_id, handle.value_id, handle.name
        except AttributeError:
            manager_id, value_id, handle_name = None, handle, None
    get = _LOCATION_CODES.get
    lcode, scode, dcode = get(location), get(source), get(destination)
    if lcode is None:
        lcode = _location_code(location)
    if scode is None:
        scode = _location_code(source)
    if dcode is None:
        dcode = _location_code(destination)
    return (
        seq,
        state_version,
        kind,
        manager_id,
        value_id,
        handle_name,
        lcode,
        nbytes,
        time_ns,
        name,
        scode,
        dcode,
    )


def _expand(
    record: tuple[Any, ...],
    make_handle: Callable[[str, int, str], Any] | None,
    handles: dict[tuple[str, int, str], Any],
) -> Transition:
    """The :class:`Transition` a :func:`trace_record` was made of (``make_handle``: the
    ``ValueHandle`` class, given by the state: this module cannot import it; ``handles``: the
    ones made so far in this view, one per value)."""
    seq, version, kind, manager_id, value_id, handle_name = record[:6]
    lcode, nbytes, t, name, scode, dcode = record[6:]
    if manager_id is None:
        handle = value_id
    else:
        key = (manager_id, value_id, handle_name)
        handle = handles.get(key)
        if handle is None:
            if make_handle is None:
                raise RuntimeError("a trace ring that records value handles needs make_handle")
            handle = handles[key] = make_handle(manager_id, value_id, handle_name)
    return Transition(
        seq,
        version,
        kind,
        handle,
        _LOCATIONS[lcode],
        nbytes,
        t,
        name,
        _LOCATIONS[scode],
        _LOCATIONS[dcode],
    )


class TraceRing:
    """Ring buffer of transitions; ``capacity == 0`` disables it.

    ``entries`` is the ring itself (a deque bounded by the capacity: a disabled ring keeps
    nothing) of :func:`trace_record` tuples, and ``appended`` counts every transition ever
    given to it, so what it overwrote is the difference: recording one is an append and an
    increment (the state does both on every commit, in ``ResidencyState._commit``).
    :meth:`view` gives the :class:`Transition` objects back, their handles made by
    ``make_handle`` (the state's ``ValueHandle``)."""

    __slots__ = ("_capacity", "_make_handle", "appended", "entries")

    def __init__(
        self, capacity: int, make_handle: Callable[[str, int, str], Any] | None = None
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"trace_capacity must be an int >= 0, got {capacity!r}")
        self._capacity = capacity
        self._make_handle = make_handle
        self.entries: deque[tuple[Any, ...]] = deque(maxlen=capacity)
        self.appended = 0

    def view(self) -> ResidencyTrace:
        handles: dict[tuple[str, int, str], Any] = {}
        return ResidencyTrace(
            enabled=self._capacity > 0,
            capacity=self._capacity,
            overwritten=self.appended - len(self.entries) if self._capacity else 0,
            transitions=tuple(_expand(r, self._make_handle, handles) for r in self.entries),
        )


def _undone(transitions: Iterable[Transition], cleanup: frozenset[int]) -> frozenset[int]:
    """The seqs of the clean-up entries and of the begins they undid.

    An abort undoes the latest earlier begin of its transfer (same kind family, handle and
    location); an ``unreserve`` listed in ``cleanup`` undoes the latest ``reserve`` of the same
    name and location. Aborts are always clean-up; other kinds only when listed."""
    out: set[int] = set()
    kept: list[Transition] = []
    for transition in transitions:
        undoes: frozenset[str] | None = None
        if transition.kind in ABORT_KINDS:
            undoes = _UNDOES[transition.kind]
        elif transition.seq in cleanup and transition.kind == "unreserve":
            undoes = frozenset({"reserve"})
        elif transition.seq in cleanup:
            out.add(transition.seq)
            continue
        if undoes is None:
            kept.append(transition)
            continue
        out.add(transition.seq)
        for index in range(len(kept) - 1, -1, -1):
            begun = kept[index]
            if (
                begun.kind in undoes
                and begun.handle == transition.handle
                and begun.location == transition.location
                and begun.name == transition.name
            ):
                out.add(begun.seq)
                del kept[index]
                break
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class ExecutionReport:
    """Every transition a plan run committed, in order (``transitions``), and which of them
    stay in effect.

    ``cleanup`` holds the seqs of entries committed only to clean up after a failure (the
    ``unreserve`` of a failed entry's reservation prefix); aborted transfers (``copy_abort``,
    ``rebuild_abort``) are clean-up by their kind. :attr:`in_effect` leaves out the clean-up
    entries and the begins they undid: what the run changed and nobody rolled back.
    """

    transitions: tuple[Transition, ...] = ()
    cleanup: frozenset[int] = field(default=frozenset())

    def __len__(self) -> int:
        return len(self.transitions)

    @property
    def undone(self) -> tuple[Transition, ...]:
        """The clean-up entries and the begins they undid, in order."""
        gone = _undone(self.transitions, self.cleanup)
        return tuple(t for t in self.transitions if t.seq in gone)

    @property
    def in_effect(self) -> tuple[Transition, ...]:
        """The committed transitions that stay in effect, in order (see the class docstring)."""
        gone = _undone(self.transitions, self.cleanup)
        return tuple(t for t in self.transitions if t.seq not in gone)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: every transition, and the seqs of those in effect."""
        return {
            "transitions": [t.to_dict() for t in self.transitions],
            "in_effect": [t.seq for t in self.in_effect],
            "cleanup": sorted(self.cleanup),
        }
