"""Plans, their actions, the phase runner shared by ``explain`` and execution, and ``explain``.

One function decides, another does: :func:`run_phase` is a generator that applies a phase's
actions to a :class:`ResidencyState` and *yields* the device work it needs (transfers to carry
out, materializations whose pending events must be reaped first). ``explain`` drives it with a
simulated driver on a copy of the state; the runtime drives it with real transfers on the live
state. Both therefore commit the same transitions in the same order, and the peak that
``explain`` predicts is the peak execution charges (a property test checks it).

Order inside a phase (and so what the peak counts):

1. each action, in order, begins: a ``Release`` commits at once (after its pending consumer
   events are reaped); a copy charges its destination now; a rebuild from a source charges its
   destination and, when that is not the value's ``source_location``, the source location too
   (the temporary reconstruction charge);
2. the phase's transfers run together (overlapping on the copy streams), then commit in action
   order: a move frees its source only now, so source and destination are charged together
   while the transfer is in flight; a rebuild frees its temporary charge now.

A scope runs ``reclaim``, admits ``reserve``, runs ``enter``, runs the body, ends the
reservations, runs ``exit``. ``execute`` does the same with an empty body.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from .errors import ResidencyError, ResidencyInUseError, ResidencyPlanError
from .locations import Location, LocationLike
from .state import (
    CopyTicket,
    MaterializationState,
    ReplicaMode,
    ResidencyState,
    ValueHandle,
    check_nbytes,
)
from .trace import Transition

__all__ = [
    "Action",
    "ExecutionReport",
    "Materialize",
    "MemoryReservation",
    "Move",
    "PeakLedger",
    "PlanExplanation",
    "Release",
    "ResidencyPlan",
    "SettleRequest",
    "TransferRequest",
    "explain_plan",
    "run_phase",
]


def _parse_action_location(self: Any, location: LocationLike) -> None:
    object.__setattr__(self, "location", Location.parse(location))


@dataclass(frozen=True, slots=True, init=False)
class Materialize:
    """Make ``handle`` present at ``location`` (EXCLUSIVE: a move; REPLICABLE: a new replica;
    no copy anywhere: rebuilt from its source). Already there: nothing to do."""

    handle: ValueHandle
    location: Location

    def __init__(self, handle: ValueHandle, location: LocationLike) -> None:
        object.__setattr__(self, "handle", handle)
        _parse_action_location(self, location)

    def __str__(self) -> str:
        return f"Materialize({self.handle.name or self.handle.value_id!r}, {self.location})"


@dataclass(frozen=True, slots=True, init=False)
class Move:
    """Copy ``handle`` to ``location``, then free the copy it came from."""

    handle: ValueHandle
    location: Location

    def __init__(self, handle: ValueHandle, location: LocationLike) -> None:
        object.__setattr__(self, "handle", handle)
        _parse_action_location(self, location)

    def __str__(self) -> str:
        return f"Move({self.handle.name or self.handle.value_id!r}, {self.location})"


@dataclass(frozen=True, slots=True, init=False)
class Release:
    """Drop the materialization of ``handle`` at ``location`` (after its consumer events)."""

    handle: ValueHandle
    location: Location

    def __init__(self, handle: ValueHandle, location: LocationLike) -> None:
        object.__setattr__(self, "handle", handle)
        _parse_action_location(self, location)

    def __str__(self) -> str:
        return f"Release({self.handle.name or self.handle.value_id!r}, {self.location})"


@dataclass(frozen=True, slots=True, init=False)
class MemoryReservation:
    """``nbytes`` named ``name`` at ``location`` (workspace, activations, KV headroom), charged as
    ``reserved_bytes`` while active."""

    name: str
    location: Location
    nbytes: int

    def __init__(self, name: str, location: LocationLike, nbytes: int) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a MemoryReservation needs a non-empty str name, got {name!r}")
        check_nbytes(nbytes, f"MemoryReservation {name!r} nbytes")
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
        object.__setattr__(self, "reclaim", tuple(reclaim))
        object.__setattr__(self, "reserve", tuple(reserve))
        object.__setattr__(self, "enter", tuple(enter))
        object.__setattr__(self, "exit", tuple(exit))
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
        out: list[ValueHandle] = []
        for action in (*self.reclaim, *self.enter, *self.exit):
            if action.handle not in out:
                out.append(action.handle)
        return out


@dataclass(frozen=True, slots=True)
class ExecutionReport:
    """Every transition a plan run committed, in order."""

    transitions: tuple[Transition, ...] = ()

    def __len__(self) -> int:
        return len(self.transitions)


# ----------------------------------------------------------------- the phase runner


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Carry out these begun transfers. The driver answers with a mapping from ticket id to the
    exception the transfer raised (absent or ``None``: it succeeded). For a move, the driver also
    waits until the source's other pending consumer events are reaped before answering."""

    tickets: tuple[CopyTicket, ...]
    action_indexes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SettleRequest:
    """Wait until the materialization has no pending consumer events (they are reaped)."""

    handle: ValueHandle
    location: Location
    action_index: int


PhaseRequest: TypeAlias = TransferRequest | SettleRequest


class ActionFailed(Exception):
    """Internal: action ``index`` of a phase failed; ``cause`` is the error it raised."""

    def __init__(self, index: int, action: Any, cause: BaseException) -> None:
        super().__init__(index, action, cause)
        self.index = index
        self.action = action
        self.cause = cause


class TransitionRecorder:
    """Collects the transitions that a sequence of state calls committed."""

    def __init__(self, state: ResidencyState) -> None:
        self.state = state
        self.transitions: list[Transition] = []

    def __enter__(self) -> TransitionRecorder:
        self.state.recorders.append(self.transitions)
        return self

    def __exit__(self, *exc: object) -> None:
        self.state.recorders.remove(self.transitions)


_SOURCE_PREFERENCE: dict[str, tuple[str, ...]] = {
    # cheapest source first: peer copies over NVLink beat the host link (ANCHORS.md).
    "cuda": ("cuda", "pinned-host", "pageable-host"),
    "pinned-host": ("cuda", "pageable-host"),
    "pageable-host": ("pinned-host", "cuda"),
}


def choose_source(
    state: ResidencyState, handle: ValueHandle, destination: Location
) -> Location | None:
    """The resident materialization a copy to ``destination`` should read, or ``None``."""
    value = state.value(handle)
    resident = sorted(
        loc
        for loc, mat in value.materializations.items()
        if mat.state is MaterializationState.RESIDENT and loc != destination
    )
    for kind in _SOURCE_PREFERENCE[destination.kind]:
        for loc in resident:
            if loc.kind == kind:
                return loc
    return None


def transfer_reads(
    state: ResidencyState, handle: ValueHandle, location: Location
) -> list[CopyTicket]:
    """The open transfers that read the materialization. Each holds one of its
    ``pending_event_count`` until it commits or aborts: those are not consumer events to reap.
    A driver lets the ones begun elsewhere complete; the ones of the same request commit first
    (in action order), so a move of the request waits for neither."""
    return [t for t in state.open_tickets() if t.handle == handle and t.source == location]


def _first_step(
    state: ResidencyState,
    action: Action,
    index: int,
    targets: Mapping[ValueHandle, set[Location]],
    begun: Sequence[tuple[int, CopyTicket]],
) -> Generator[PhaseRequest, Any, CopyTicket | None]:
    """Begin action ``index``: return its ticket, or None if it is already done.

    ``targets`` are the locations this phase's Materialize/Move actions ask for, per value: all
    of them must hold when the phase ends, so none is moved away (a REPLICABLE value is copied
    from a wanted replica instead) and an EXCLUSIVE value may be asked at one location only."""
    if isinstance(action, Release):
        mat = state.materialization(action.handle, action.location)
        if any(t.handle == action.handle and t.source == mat.location for _, t in begun):
            # A copy out of it begun by this phase commits only after every action has begun:
            # waiting for it here would never end, and reaping it would free what it reads.
            raise ResidencyInUseError(
                action.handle,
                mat.location,
                mat.use_count,
                mat.hold_count,
                mat.pending_event_count,
                operation="release (a copy out of it is in flight)",
            )
        if mat.pending_event_count and not (mat.use_count or mat.hold_count):
            yield SettleRequest(action.handle, action.location, index)
        state.release(action.handle, action.location)
        return None
    value = state.value(action.handle)
    wanted = targets.get(action.handle, set())
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
    source = choose_source(state, action.handle, action.location)
    if source is not None:
        if value.replica_mode is ReplicaMode.EXCLUSIVE:
            move = True
        else:  # a move never drops a replica that this phase asks for
            move = isinstance(action, Move) and source not in wanted
        return state.begin_copy(action.handle, source, action.location, move=move)
    if not value.has_source or value.source_location is None:
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
    for index, action in enumerate(actions):
        try:
            ticket = yield from _first_step(state, action, index, targets, tickets)
        except (ResidencyError, ValueError) as error:
            failure = ActionFailed(index, action, error)
            break
        except BaseException:
            # Thrown in at a SettleRequest (cancellation): no device work was started for the
            # tickets begun so far, so aborting them loses nothing.
            for _, begun in tickets:
                state.abort_copy(begun)
            raise
        if ticket is not None:
            tickets.append((index, ticket))
    failure = yield from _carry_out(state, tickets, failure)
    if failure is not None:
        raise failure


def _carry_out(
    state: ResidencyState, tickets: list[tuple[int, CopyTicket]], failure: ActionFailed | None
) -> Generator[PhaseRequest, Any, ActionFailed | None]:
    if not tickets:
        return failure
    try:
        errors: Mapping[int, BaseException | None] = yield TransferRequest(
            tuple(t for _, t in tickets), tuple(i for i, _ in tickets)
        )
    except BaseException:
        # Thrown in instead of an answer: the driver started no device work for these.
        for _, ticket in tickets:
            state.abort_copy(ticket)
        raise
    transfer_failure: ActionFailed | None = None
    for index, ticket in tickets:
        error = errors.get(ticket.ticket_id)
        if error is None:
            state.commit_copy(ticket)
        else:
            state.abort_copy(ticket)
            if transfer_failure is None:
                transfer_failure = ActionFailed(index, None, error)
    if failure is None and transfer_failure is not None:
        return transfer_failure
    return failure


# ------------------------------------------------------------------------ explain


@dataclass(frozen=True, slots=True)
class PeakLedger:
    """What makes up the predicted peak at one location (the guide's accounting review).

    At the moment of the peak: ``resident_bytes`` (values resident there and not moving),
    ``reserved_bytes`` (active named reservations, the plan's and others'),
    ``destination_bytes`` (materializations being copied in), ``transfer_overlap_bytes``
    (sources still charged while their move is in flight), ``reconstruction_bytes`` (temporary
    loads from a source at its ``source_location``); they add up to ``peak_bytes``.
    ``start_bytes`` is the charge before the plan; ``reclaimed_bytes`` what its reclaim phase
    freed before reservations were admitted. ``value_charges`` lists the fixed conservative
    charge of each value the plan brings here; ``peak_at`` says where in the plan the peak fell.
    """

    location: Location
    budget_bytes: int | None
    start_bytes: int
    reclaimed_bytes: int
    resident_bytes: int
    reserved_bytes: int
    destination_bytes: int
    transfer_overlap_bytes: int
    reconstruction_bytes: int
    peak_bytes: int
    peak_at: str
    reservations: tuple[tuple[str, int], ...]
    value_charges: tuple[tuple[ValueHandle, int], ...]

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self.peak_bytes


@dataclass(frozen=True, slots=True)
class PlanExplanation:
    """``feasible``, the ``reason`` naming the first blocking fact, the predicted peak per
    location and the ledger behind it. ``transient`` is true when the plan is blocked only by
    state that will change on its own (leases, holds, pending events, others' reservations)."""

    feasible: bool
    reason: str
    predicted_peak_bytes: Mapping[Location, int]
    ledger: Mapping[Location, PeakLedger]
    failed_phase: str | None = None
    failed_action_index: int | None = None
    blocking_error: BaseException | None = field(default=None, compare=False, repr=False)
    transient: bool = False


class _PeakWatcher:
    """Observes every transition on a cloned state and keeps each location's peak breakdown."""

    def __init__(self, state: ResidencyState, plan: ResidencyPlan) -> None:
        self.state = state
        self.where = "start"
        self.reclaimed: dict[Location, int] = {}
        self.start = {loc: state.ledger(loc).charged_bytes for loc in state.locations()}
        self.best: dict[Location, tuple[int, dict[str, int], str, tuple[tuple[str, int], ...]]] = {}
        self.charges: dict[Location, dict[ValueHandle, int]] = {}
        for loc in state.locations():
            self._snap(loc)

    def _snap(self, loc: Location) -> None:
        entry = self.state.ledger(loc)
        charged = entry.charged_bytes
        best = self.best.get(loc)
        if best is not None and charged <= best[0]:
            return
        # Only the plan's values are in the (partial) copy; everything else at the location is
        # resident and untouched, so "resident" is what remains of the charge.
        parts = {"destination": 0, "overlap": 0, "reconstruction": 0}
        for ticket in self.state.open_tickets():
            if ticket.via == loc:
                parts["reconstruction"] += ticket.nbytes
        for value in self.state.values():
            mat = value.materializations.get(loc)
            if mat is None:
                continue
            if mat.state is MaterializationState.INCOMING:
                parts["destination"] += mat.charged_bytes
            elif mat.state is MaterializationState.OUTGOING:
                parts["overlap"] += mat.charged_bytes
        parts["reserved"] = entry.reserved_bytes
        parts["resident"] = charged - sum(parts.values())
        reservations = tuple(sorted((n, b) for n, (b, _) in entry.reservations.items()))
        self.best[loc] = (charged, parts, self.where, reservations)

    def observe(self, transition: Transition) -> None:
        loc = transition.location
        if loc is None:
            return
        if self.where.startswith("reclaim") and transition.nbytes < 0:
            self.reclaimed[loc] = self.reclaimed.get(loc, 0) - transition.nbytes
        if transition.kind in ("copy_begin", "move_begin", "load_begin", "rebuild_temp"):
            self.charges.setdefault(loc, {})[transition.handle] = transition.nbytes
        self._snap(loc)

    def result(self) -> tuple[dict[Location, int], dict[Location, PeakLedger]]:
        peaks: dict[Location, int] = {}
        ledgers: dict[Location, PeakLedger] = {}
        for loc in self.state.locations():
            self._snap(loc)
            peak, parts, where, reservations = self.best[loc]
            peaks[loc] = peak
            ledgers[loc] = PeakLedger(
                location=loc,
                budget_bytes=self.state.ledger(loc).budget_bytes,
                start_bytes=self.start.get(loc, 0),
                reclaimed_bytes=self.reclaimed.get(loc, 0),
                resident_bytes=parts["resident"],
                reserved_bytes=parts["reserved"],
                destination_bytes=parts["destination"],
                transfer_overlap_bytes=parts["overlap"],
                reconstruction_bytes=parts["reconstruction"],
                peak_bytes=peak,
                peak_at=where,
                reservations=reservations,
                value_charges=tuple(
                    sorted(self.charges.get(loc, {}).items(), key=lambda i: i[0].value_id)
                ),
            )
        return peaks, ledgers


def _complete_reads_elsewhere(
    state: ResidencyState,
    handle: ValueHandle,
    location: Location,
    ours: Sequence[CopyTicket],
) -> None:
    """On a quiet manager, the copies in flight elsewhere that read the materialization
    complete (the runtime waits for them before freeing it)."""
    mine = {t.ticket_id for t in ours}
    for ticket in transfer_reads(state, handle, location):
        if ticket.ticket_id not in mine and not ticket.move:
            state.commit_copy(ticket)


def _simulate_requests(state: ResidencyState, gen: Generator[PhaseRequest, Any, None]) -> None:
    """Drive a phase as if every transfer succeeds and every pending event completes."""
    try:
        request = next(gen)
        while True:
            if isinstance(request, SettleRequest):
                _complete_reads_elsewhere(state, request.handle, request.location, ())
                mat = state.materialization(request.handle, request.location)
                consumers = mat.pending_event_count - len(
                    transfer_reads(state, request.handle, mat.location)
                )
                if consumers > 0:
                    state.reap_events(request.handle, request.location, consumers)
                request = gen.send(None)
                continue
            for ticket in request.tickets:
                value = state.value(ticket.handle, allow_discarded=True)
                if ticket.source is not None and ticket.move:
                    _complete_reads_elsewhere(state, ticket.handle, ticket.source, request.tickets)
                    src = value.materializations[ticket.source]
                    # consumer events only: the request's own copies commit before the move
                    extra = src.pending_event_count - len(
                        transfer_reads(state, ticket.handle, ticket.source)
                    )
                    if extra > 0:
                        state.reap_events(ticket.handle, ticket.source, extra)
            request = gen.send({})
    except StopIteration:
        return


def plan_phases(plan: ResidencyPlan) -> list[tuple[str, Sequence[Any]]]:
    """The phases in execution order; ``unreserve`` ends the plan's reservations."""
    return [
        ("reclaim", plan.reclaim),
        ("reserve", plan.reserve),
        ("enter", plan.enter),
        ("unreserve", plan.reserve),
        ("exit", plan.exit),
    ]


_Failure: TypeAlias = tuple[str, int | None, BaseException]


def _simulate_plan(
    sim: ResidencyState, plan: ResidencyPlan, watcher: _PeakWatcher | None = None
) -> _Failure | None:
    """Run ``plan`` on ``sim`` (a copy) as execution would; return the first failure."""
    for phase, items in plan_phases(plan):
        if phase == "reserve":
            for index, reservation in enumerate(items):
                if watcher is not None:
                    watcher.where = f"reserve #{index}"
                try:
                    sim.reserve(reservation.name, reservation.location, reservation.nbytes)
                except (ResidencyError, ValueError) as error:
                    return (phase, index, error)
            continue
        if phase == "unreserve":
            if watcher is not None:
                watcher.where = "scope end"
            for reservation in items:
                sim.unreserve(reservation.name, reservation.location)
            continue
        if watcher is not None:
            watcher.where = phase
        try:
            _simulate_requests(sim, run_phase(sim, phase, items))
        except ActionFailed as failed:
            return (phase, failed.index, failed.cause)
        except (ResidencyError, ValueError) as error:
            return (phase, None, error)
    return None


def plan_fits(state: ResidencyState, plan: ResidencyPlan) -> bool:
    """``explain_plan(state, plan).feasible``, without building the evidence (admission's fast
    path: the simulation only, on a copy of the plan's own values)."""
    return _simulate_plan(state.clone(plan.handles()), plan) is None


def explain_plan(state: ResidencyState, plan: ResidencyPlan) -> PlanExplanation:
    """Simulate ``plan`` on a copy of ``state``; the real state is not touched.

    The simulation runs the same transitions as execution (see :func:`run_phase`), assuming every
    transfer succeeds and every pending consumer event completes. Its peaks are therefore the
    peaks execution charges on a quiet manager."""
    if not isinstance(plan, ResidencyPlan):
        raise TypeError(f"explain takes a ResidencyPlan, got {plan!r}")
    sim = state.clone(plan.handles())
    sim.reset_peaks()
    watcher = _PeakWatcher(sim, plan)
    sim.observers.append(watcher.observe)
    failure = _simulate_plan(sim, plan, watcher)
    peaks, ledgers = watcher.result()
    if failure is None:
        return PlanExplanation(True, "feasible", peaks, ledgers)
    phase, index, error = failure
    where = f"{phase} #{index}" if index is not None else phase
    transient = _is_transient(state, plan, error)
    return PlanExplanation(
        False,
        f"infeasible at {where}: {error}",
        peaks,
        ledgers,
        failed_phase=phase,
        failed_action_index=index,
        blocking_error=error,
        transient=transient,
    )


def _is_transient(state: ResidencyState, plan: ResidencyPlan, error: BaseException) -> bool:
    """Would the plan fit if everything it does not touch went away and nothing were protected?"""
    from .errors import ResidencyBudgetError
    from .state import DuplicateReservationError

    if not isinstance(
        error, (ResidencyBudgetError, ResidencyInUseError, DuplicateReservationError)
    ):
        return False
    return _simulate_plan(state.isolated(plan.handles()), plan) is None
