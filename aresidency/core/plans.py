"""Plans, their actions, and the phase runner shared by ``explain`` and execution.

One function decides, another does: :func:`run_phase` is a generator that applies a phase's
actions to a :class:`ResidencyState` and *yields* the device work it needs (transfers to carry
out, materializations whose pending events must be reaped first). ``explain`` drives it with a
simulated driver on a copy of the state; the runtime drives it with real transfers on the live
state. Both therefore commit the same transitions (execution commits a phase's copies in the
order they complete, ``explain`` in action order), and the peak that ``explain`` predicts is
the peak execution charges: a commit never charges anything, so the peak is reached while the
actions begin, in the same order in both (a property test checks it).

Order inside a phase (and so what the peak counts):

1. each action, in order, begins: a ``Release`` commits at once (after its pending consumer
   events are reaped); a copy charges its destination now; a rebuild from a source charges its
   destination and, when that is not the value's ``source_location``, the source location too
   (the temporary reconstruction charge);
2. the phase's transfers run together (overlapping on the copy streams; a driver may start
   those begun before a checkpoint while the rest are being begun), then commit, each once
   every action began and its transfer completed (a driver answers :class:`CommitNow` for
   the ones that may go first): a move frees its source only now, so source and destination
   are charged together while the transfer is in flight; a rebuild frees its temporary charge
   now.

A scope runs ``reclaim``, admits ``reserve``, runs ``enter``, runs the body, ends the
reservations, runs ``exit``. ``execute`` does the same with an empty body.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from .errors import ResidencyError, ResidencyInUseError, ResidencyPlanError
from .locations import Location, LocationLike
from .sizes import ByteSize, parse_nbytes
from .state import ResidencyState
from .trace import Transition, slot_setter
from .values import (
    CopyTicket,
    MaterializationState,
    ReplicaMode,
    Value,
    ValueHandle,
)

__all__ = [
    "Action",
    "CHECKPOINT_EVERY",
    "ActionFailed",
    "Checkpoint",
    "CommitNow",
    "Materialize",
    "MemoryReservation",
    "Move",
    "PhaseRequest",
    "Release",
    "ResidencyPlan",
    "SettleRequest",
    "TransferRequest",
    "TransitionRecorder",
    "begin_placement",
    "choose_source",
    "items_of",
    "run_phase",
]


def items_of(value: Any, what: str) -> tuple[Any, ...]:
    """``value`` (an iterable of items, a phase of a plan or a request's list) as a tuple;
    ``TypeError`` naming ``what`` for ``None``, a string, or anything else not iterable."""
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be an iterable (a list or tuple), got {value!r}")
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(
            f"{what} must be an iterable (a list or tuple), got {value!r} ({type(value).__name__})"
        ) from None


def _parse_action_location(self: Any, location: LocationLike) -> None:
    if type(location) is not Location:
        location = Location.parse(location)
    object.__setattr__(self, "location", location)


@dataclass(frozen=True, slots=True, init=False)
class Materialize:
    """Make ``handle`` present at ``location`` (EXCLUSIVE: a move; REPLICABLE: a new replica;
    no copy anywhere: rebuilt from its source). Already there: nothing to do."""

    handle: ValueHandle
    location: Location

    def __init__(self, handle: ValueHandle, location: LocationLike) -> None:
        # (through the slots' setters: what the frozen dataclass's object.__setattr__ does)
        _set_materialize_handle(self, handle)
        _set_materialize_location(
            self, location if type(location) is Location else Location.parse(location)
        )

    def __str__(self) -> str:
        return f"Materialize({self.handle.name or self.handle.value_id!r}, {self.location})"


@dataclass(frozen=True, slots=True, init=False)
class Move:
    """Copy ``handle`` to ``location``, then free the copy it came from."""

    handle: ValueHandle
    location: Location

    def __init__(self, handle: ValueHandle, location: LocationLike) -> None:
        # (through the slots' setters: what the frozen dataclass's object.__setattr__ does)
        _set_move_handle(self, handle)
        _set_move_location(
            self, location if type(location) is Location else Location.parse(location)
        )

    def __str__(self) -> str:
        return f"Move({self.handle.name or self.handle.value_id!r}, {self.location})"


@dataclass(frozen=True, slots=True, init=False)
class Release:
    """Drop the materialization of ``handle`` at ``location`` (after its consumer events)."""

    handle: ValueHandle
    location: Location

    def __init__(self, handle: ValueHandle, location: LocationLike) -> None:
        # (through the slots' setters: what the frozen dataclass's object.__setattr__ does)
        _set_release_handle(self, handle)
        _set_release_location(
            self, location if type(location) is Location else Location.parse(location)
        )

    def __str__(self) -> str:
        return f"Release({self.handle.name or self.handle.value_id!r}, {self.location})"


_set_materialize_handle = slot_setter(Materialize, "handle")
_set_materialize_location = slot_setter(Materialize, "location")
_set_move_handle = slot_setter(Move, "handle")
_set_move_location = slot_setter(Move, "location")
_set_release_handle = slot_setter(Release, "handle")
_set_release_location = slot_setter(Release, "location")


@dataclass(frozen=True, slots=True, init=False)
class MemoryReservation:
    """``nbytes`` named ``name`` at ``location`` (workspace, activations, KV headroom), charged as
    ``reserved_bytes`` while active."""

    name: str
    location: Location
    nbytes: int

    def __init__(self, name: str, location: LocationLike, nbytes: ByteSize) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"a MemoryReservation needs a non-empty, non-blank str name, got {name!r}"
            )
        # "512MB", 10.5e9 or an int: kept as the exact int parse_nbytes reads.
        nbytes = parse_nbytes(nbytes, f"MemoryReservation {name!r} nbytes")
        object.__setattr__(self, "name", name)
        _parse_action_location(self, location)
        object.__setattr__(self, "nbytes", nbytes)

    def __str__(self) -> str:
        return f"MemoryReservation({self.name!r}, {self.location}, {self.nbytes} B)"


Action: TypeAlias = Materialize | Move | Release

_PHASE_KINDS: dict[str, tuple[type, ...]] = {
    "reclaim": (Release, Move),
    "enter": (Materialize, Move),
    "exit": (Release, Move, Materialize),
}


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    """Ordered actions in phases: ``reclaim`` (Release, Move out), ``reserve``
    (MemoryReservation), ``enter`` (Materialize, Move in), ``exit`` (run when the scope ends).

    Construction validates the shape (action types per phase, unique reservation names per
    location) and raises ``ResidencyPlanError`` naming the offending entry."""

    reclaim: tuple[Action, ...] = ()
    reserve: tuple[MemoryReservation, ...] = ()
    enter: tuple[Action, ...] = ()
    exit: tuple[Action, ...] = ()
    expected_state_version: int | None = field(default=None, compare=False)

    def __init__(
        self,
        reclaim: Iterable[Action] = (),
        reserve: Iterable[MemoryReservation] = (),
        enter: Iterable[Action] = (),
        exit: Iterable[Action] = (),
        *,
        expected_state_version: int | None = None,
    ) -> None:
        object.__setattr__(self, "reclaim", items_of(reclaim, "the plan's reclaim phase"))
        object.__setattr__(self, "reserve", items_of(reserve, "the plan's reserve phase"))
        object.__setattr__(self, "enter", items_of(enter, "the plan's enter phase"))
        object.__setattr__(self, "exit", items_of(exit, "the plan's exit phase"))
        if expected_state_version is not None and (
            isinstance(expected_state_version, bool) or not isinstance(expected_state_version, int)
        ):
            raise TypeError(
                f"expected_state_version must be None or an int, got {expected_state_version!r}"
            )
        object.__setattr__(self, "expected_state_version", expected_state_version)
        for phase, kinds in _PHASE_KINDS.items():
            for index, action in enumerate(getattr(self, phase)):
                if not isinstance(action, kinds):
                    allowed = ", ".join(k.__name__ for k in kinds)
                    raise ResidencyPlanError(
                        f"plan phase {phase!r} entry #{index} is {action!r}; that phase takes "
                        f"{allowed}"
                    )
                handle = getattr(action, "handle", None)
                if not isinstance(handle, ValueHandle):
                    raise ResidencyPlanError(
                        f"plan phase {phase!r} entry #{index} names {handle!r}, not a ValueHandle"
                    )
        seen: set[tuple[str, Location]] = set()
        for index, reservation in enumerate(self.reserve):
            if not isinstance(reservation, MemoryReservation):
                raise ResidencyPlanError(
                    f"plan phase 'reserve' entry #{index} is {reservation!r}, not a "
                    "MemoryReservation"
                )
            key = (reservation.name, reservation.location)
            if key in seen:
                raise ResidencyPlanError(
                    f"plan reserves {reservation.name!r} at {reservation.location} twice "
                    f"(entry #{index}); reservation names are unique per location"
                )
            seen.add(key)

    def handles(self) -> list[ValueHandle]:
        """The values the plan's actions name, each once, in first-appearance order."""
        return list(dict.fromkeys(a.handle for a in (*self.reclaim, *self.enter, *self.exit)))


# ----------------------------------------------------------------- the phase runner


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Carry out these begun transfers. The driver answers with a mapping from ticket id to the
    exception the transfer raised (absent or ``None``: it succeeded). For a move, the driver also
    waits until the source's other pending consumer events are reaped before answering."""

    tickets: tuple[CopyTicket, ...]
    action_indexes: tuple[int, ...]
    #: An action that failed to begin (the phase ends with it, whatever the transfers do).
    failure: ActionFailed | None = None


@dataclass(frozen=True, slots=True)
class CommitNow:
    """An answer to a :class:`TransferRequest` before all of its transfers completed: these
    tickets' transfers succeeded and may commit now (the driver checked that no other copy
    of the request still reads a source they free). The runner commits them and yields the
    same request again; the final answer (the mapping of errors) covers the others."""

    ticket_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SettleRequest:
    """Wait until the materialization has no pending consumer events (they are reaped)."""

    handle: ValueHandle
    location: Location
    action_index: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A long phase pauses here so that the driver can let other work run (a real driver
    continues on a later turn of its event loop; a simulation at once). ``stage`` is
    ``"begin"`` (between actions being begun) or ``"commit"`` (between commits: answer it,
    never throw).

    ``issue`` (``"begin"`` only): transfers begun since the last checkpoint, which a driver
    may start now, while the phase goes on beginning its other actions (their device work
    then overlaps the rest of the begin stage; the phase's :class:`TransferRequest` lists them
    again). A cancellation thrown in at a ``"begin"`` checkpoint, or at a
    :class:`SettleRequest`, aborts the transfers not handed out this way at once; those that
    were are carried out first (a :class:`TransferRequest` for them, answered as usual), then
    the cancellation propagates."""

    stage: str
    issue: tuple[CopyTicket, ...] = ()


#: Actions begun (or committed) between two checkpoints: a phase's synchronous work stays
#: well under a millisecond at a time, whatever its length.
CHECKPOINT_EVERY = 16
#: A long phase's first checkpoint comes after this many actions, so that its first copies
#: start (:attr:`Checkpoint.issue`) while the rest of its first actions are being begun.
FIRST_HAND_OUT = 4

PhaseRequest: TypeAlias = TransferRequest | SettleRequest | Checkpoint


class ActionFailed(Exception):
    """Internal: action ``index`` of a phase failed; ``cause`` is the error it raised."""

    def __init__(self, index: int, action: Any, cause: BaseException) -> None:
        super().__init__(index, action, cause)
        self.index = index
        self.action = action
        self.cause = cause


class TransitionRecorder:
    """``with TransitionRecorder(state, origin) as rec``: the transitions that the synchronous
    state calls made inside the block commit are appended to ``rec.transitions`` (and only
    those: not what other tasks commit while the owner of ``origin`` awaits elsewhere)."""

    def __init__(
        self, state: ResidencyState, origin: object, transitions: list[Transition] | None = None
    ) -> None:
        self.state = state
        self.origin = origin
        self.transitions: list[Transition] = [] if transitions is None else transitions
        self._previous: object | None = None

    def __enter__(self) -> TransitionRecorder:
        state = self.state
        self._previous, state.origin = state.origin, self.origin
        state.origin_recorders[self.origin] = self.transitions
        return self

    def __exit__(self, *exc: object) -> None:
        self.state.origin = self._previous
        self.state.origin_recorders.pop(self.origin, None)


_SOURCE_PREFERENCE: dict[str, tuple[str, ...]] = {
    # cheapest source first: peer copies over NVLink beat the host link (docs/performance.md).
    "cuda": ("cuda", "pinned-host", "pageable-host"),
    "pinned-host": ("cuda", "pageable-host"),
    "pageable-host": ("pinned-host", "cuda"),
}


def choose_source(
    state: ResidencyState, handle: ValueHandle, destination: Location
) -> Location | None:
    """The resident materialization a copy to ``destination`` should read, or ``None``."""
    return _choose_source(state.value(handle), destination)


def _choose_source(value: Value, destination: Location) -> Location | None:
    """:func:`choose_source` for the value's record."""
    resident = [
        loc
        for loc, mat in value.materializations.items()
        if mat.state is MaterializationState.RESIDENT and loc != destination
    ]
    if len(resident) > 1:
        resident.sort()
    for kind in _SOURCE_PREFERENCE[destination.kind]:
        for loc in resident:
            if loc.kind == kind:
                return loc
    return None


def _release_step(
    state: ResidencyState,
    action: Release,
    index: int,
    reading: set[tuple[ValueHandle, Location]],
) -> Generator[PhaseRequest, Any, None]:
    """Carry out the Release ``index``, once its materialization's readers completed."""
    mat = state.materialization(action.handle, action.location)
    if (action.handle, mat.location) in reading:
        # A copy out of it begun by this phase commits only after every action has begun:
        # waiting for it here would never end, and reaping it would free what it reads.
        raise ResidencyInUseError(
            action.handle,
            mat.location,
            mat.use_count,
            mat.hold_count,
            mat.pending_event_count,
            operation="release",
            transfer="outgoing",
        )
    if mat.pending_event_count and not (mat.use_count or mat.hold_count):
        yield SettleRequest(action.handle, action.location, index)
    state.release(action.handle, action.location)


def _moving(value: Value) -> str | None:
    """``"moving from X to Y"`` while ``value``'s one copy moves out of X, else None."""
    mats = value.materializations
    out = [loc for loc, m in mats.items() if m.state is MaterializationState.OUTGOING]
    into = [loc for loc, m in mats.items() if m.state is MaterializationState.INCOMING]
    if not out or any(m.state is MaterializationState.RESIDENT for m in mats.values()):
        return None
    to = f" to {', '.join(str(loc) for loc in sorted(into))}" if into else ""
    return f"moving from {', '.join(str(loc) for loc in sorted(out))}{to}"


def _in_flight(value: Value) -> str:
    """What an EXCLUSIVE value with no readable copy is doing: ``"moving from X to Y"``, or
    ``"arriving at X"`` (a load from its source)."""
    moving = _moving(value)
    if moving is not None:
        return moving
    into = sorted(
        loc for loc, m in value.materializations.items() if m.state is MaterializationState.INCOMING
    )
    if into:
        return f"arriving at {', '.join(str(loc) for loc in into)} (loaded from its source)"
    where = ", ".join(str(loc) for loc in sorted(value.materializations))
    return f"at {where} with no copy resident yet"


def begin_placement(
    state: ResidencyState, action: Materialize | Move, wanted: set[Location] | frozenset[Location]
) -> CopyTicket | None:
    """Begin a Materialize or Move: its ticket (a copy from a resident replica, or a load from
    the value's source), or None if the value is there already.

    ``wanted`` are the locations the phase's Materialize/Move actions ask for this value: all
    of them must hold when the phase ends, so none is moved away (a REPLICABLE value is copied
    from a wanted replica instead) and an EXCLUSIVE value may be asked at one location only."""
    value = state.value(action.handle)
    if value.replica_mode is ReplicaMode.EXCLUSIVE and len(wanted) > 1:
        raise ResidencyPlanError(
            f"{action.handle} is EXCLUSIVE but this plan phase asks for it at "
            f"{', '.join(str(loc) for loc in sorted(wanted))} at once; several locations are "
            "simultaneous postconditions, valid only for REPLICABLE values"
        )
    present = value.materializations.get(action.location)
    if present is not None:
        if present.state is MaterializationState.OUTGOING:
            raise ResidencyPlanError(
                f"{action.handle} is moving out of {action.location}, so it cannot also stay "
                "there; ask for it after that move"
            )
        return None  # resident, or arriving (a REPLICABLE value's other replicas stay)
    source = _choose_source(value, action.location)
    if source is not None:
        if value.replica_mode is ReplicaMode.EXCLUSIVE:
            move = True
        else:  # a move never drops a replica that this phase asks for
            move = isinstance(action, Move) and source not in wanted
        return state._begin_copy(value, source, action.location, move=move)
    if value.replica_mode is ReplicaMode.EXCLUSIVE and value.materializations:
        # Its one copy is in flight (loaded from its source, or moving out): none can be read
        # until that transfer commits, and loading it again would make it two copies.
        raise ResidencyPlanError(
            f"{action.handle} cannot reach {action.location} now: it is {_in_flight(value)}, "
            "and no copy can be read until that transfer commits (ask once it has)"
        )
    if not value.has_source or value.source_location is None:
        moving = _moving(value)
        if moving is not None:
            raise ResidencyPlanError(
                f"{action.handle} cannot reach {action.location} now: it is {moving}, and no "
                "copy can be read until that move commits (ask once it has)"
            )
        where = ", ".join(str(loc) for loc in sorted(value.materializations)) or "nowhere"
        raise ResidencyPlanError(
            f"{action.handle} cannot reach {action.location}: no resident copy to read (it is "
            f"at: {where}) and no source to rebuild it from"
        )
    return state.begin_load(action.handle, action.location)


def run_phase(
    state: ResidencyState, phase: str, actions: Sequence[Action]
) -> Generator[PhaseRequest, Any, None]:
    """Apply ``actions`` (one phase) to ``state``; yield the device work; see the module doc.

    Raises :class:`ActionFailed` for the first action that failed, after every transfer already
    begun has been carried out and committed (or aborted if it failed)."""
    targets: dict[ValueHandle, set[Location]] = {}
    for action in actions:
        if isinstance(action, (Materialize, Move)):
            targets.setdefault(action.handle, set()).add(action.location)
    failure: ActionFailed | None = None
    tickets: list[tuple[int, CopyTicket]] = []
    handed_out = 0  # tickets[:handed_out] went out with a checkpoint (the driver may issue them)
    reading: set[tuple[ValueHandle, Location]] = set()  # what this phase's copies read
    for index, action in enumerate(actions):
        try:
            if isinstance(action, Release):
                ticket = None
                yield from _release_step(state, action, index, reading)
            else:
                ticket = begin_placement(state, action, targets.get(action.handle, set()))
        except (ResidencyError, ValueError) as error:
            failure = ActionFailed(index, action, error)
            break
        except GeneratorExit:
            _abandon(state, tickets)
            raise
        except BaseException:
            # Thrown in at a SettleRequest (cancellation).
            yield from _give_up(state, tickets, handed_out)
            raise
        if ticket is not None:
            tickets.append((index, ticket))
            if ticket.source is not None:
                reading.add((ticket.handle, ticket.source))
        at_checkpoint = index % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1
        if (at_checkpoint or index == FIRST_HAND_OUT - 1) and index + 1 < len(actions):
            fresh = tuple(t for _, t in tickets[handed_out:])
            handed_out = len(tickets)
            try:
                yield Checkpoint("begin", fresh)
            except GeneratorExit:
                _abandon(state, tickets)
                raise
            except BaseException:
                yield from _give_up(state, tickets, handed_out)
                raise
    failure = yield from _carry_out(state, tickets, failure)
    if failure is not None:
        try:
            raise failure
        finally:
            failure = None  # (kept by this frame, in its traceback: a cycle for the collector)


def _abandon(state: ResidencyState, tickets: list[tuple[int, CopyTicket]]) -> None:
    """The runner was closed unfinished (a simulation stopped part-way, as admission's sliced
    ``explain`` does when the state changed): its driver issued nothing it will wait for, so
    every begun ticket is aborted at once (a closed generator may not yield again)."""
    for _, begun in tickets:
        state.abort_copy(begun)


def _give_up(
    state: ResidencyState, tickets: list[tuple[int, CopyTicket]], handed_out: int
) -> Generator[PhaseRequest, Any, None]:
    """A cancellation was thrown in while actions were being begun: the tickets no checkpoint
    handed out have no device work and are aborted now; those handed out are carried out
    (committed if their transfer succeeded, as a lease may read them; aborted otherwise)."""
    for _, begun in tickets[handed_out:]:
        state.abort_copy(begun)
    if handed_out:
        yield from _carry_out(state, tickets[:handed_out], None)


def _carry_out(
    state: ResidencyState, tickets: list[tuple[int, CopyTicket]], failure: ActionFailed | None
) -> Generator[PhaseRequest, Any, ActionFailed | None]:
    if not tickets:
        return failure
    request = TransferRequest(tuple(t for _, t in tickets), tuple(i for i, _ in tickets), failure)
    committed: set[int] = set()  # committed early, at a CommitNow answer
    by_id: dict[int, CopyTicket] = {}
    while True:
        try:
            answer: Mapping[int, BaseException | None] | CommitNow = yield request
        except BaseException:
            # Thrown in instead of an answer: the driver started no device work for these.
            for _, ticket in tickets:
                if ticket.ticket_id not in committed:
                    state.abort_copy(ticket)
            raise
        if not isinstance(answer, CommitNow):
            break
        if not by_id:
            by_id = {t.ticket_id: t for t in request.tickets}
        for ticket_id in answer.ticket_ids:
            state.commit_copy(by_id[ticket_id])
            committed.add(ticket_id)
    errors = answer
    transfer_failure: ActionFailed | None = None
    for position, (index, ticket) in enumerate(tickets):
        if ticket.ticket_id in committed:
            continue
        error = errors.get(ticket.ticket_id)
        if error is None:
            state.commit_copy(ticket)
        else:
            state.abort_copy(ticket)
            if transfer_failure is None:
                transfer_failure = ActionFailed(index, None, error)
        if position % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1 and position + 1 < len(tickets):
            yield Checkpoint("commit")
    if failure is None and transfer_failure is not None:
        return transfer_failure
    return failure
