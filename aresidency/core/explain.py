"""``explain``: what a plan would charge, simulated on a copy of the state.

The simulation drives the same phase runner as execution (:func:`~aresidency.core.plans.run_phase`)
with a driver that assumes every transfer succeeds and every pending consumer event completes,
so it commits the same transitions (a phase's commits in action order, where execution commits
them as they complete, after every action of the phase began either way): the peak it predicts
at each location is the peak execution charges on a quiet manager (a property test compares
them).

Cost: a partial copy of the state (the plan's own values and the ledgers) and one pass over the
actions; a :class:`_PeakWatcher` reads each ledger's breakdown (incoming, outgoing, temporary
reconstruction, reserved) from counters the state keeps, so every transition costs O(1) and
``explain`` is linear in the plan's size, whatever the number of values.

An infeasible plan is explained in full: after the first failure, the plan is simulated again
with every budget lifted, so ``predicted_peak_bytes`` says what it *would* reach, and
``blocking_error`` (the first failure) says what stopped it.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from .errors import ResidencyBudgetError, ResidencyError, ResidencyInUseError, ResidencyPlanError
from .locations import Location, LocationMap
from .plans import (
    ActionFailed,
    Checkpoint,
    Move,
    PhaseRequest,
    Release,
    ResidencyPlan,
    SettleRequest,
    run_phase,
)
from .state import ResidencyState
from .trace import Transition
from .values import DuplicateReservationError, MaterializationState, ReplicaMode, ValueHandle

__all__ = [
    "PeakLedger",
    "PlanExplanation",
    "Steps",
    "drain",
    "explain_plan",
    "explain_plan_steps",
    "fails_while_kept_steps",
    "plan_fits",
    "plan_fits_at_once",
    "plan_fits_steps",
    "plan_phases",
    "simulate_requests",
    "simulate_requests_steps",
]


@dataclass(frozen=True, slots=True)
class PeakLedger:
    """What makes up the predicted peak at one location (the accounting a budget review needs).

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
    state that will change on its own (leases, holds, pending events, transfers in flight,
    others' reservations).

    For an infeasible plan ``predicted_peak_bytes`` is what the whole plan would reach if the
    budgets allowed it (when only budgets stop it), and ``reached_peak_bytes`` what execution
    would charge before it fails (for a feasible plan the two are equal);
    ``blocking_error`` is the first failure (a ``ResidencyBudgetError`` names the location and
    the five byte counts)."""

    feasible: bool
    reason: str
    predicted_peak_bytes: LocationMap[int]
    ledger: LocationMap[PeakLedger]
    failed_phase: str | None = None
    failed_action_index: int | None = None
    blocking_error: BaseException | None = field(default=None, compare=False, repr=False)
    transient: bool = False
    reached_peak_bytes: LocationMap[int] = field(default_factory=LocationMap)

    def __post_init__(self) -> None:
        # Indexed by location strings too (peaks["cuda:0"]), whatever mapping was given.
        for name in ("predicted_peak_bytes", "ledger", "reached_peak_bytes"):
            value = getattr(self, name)
            if not isinstance(value, LocationMap):
                object.__setattr__(self, name, LocationMap(value))


class _PeakWatcher:
    """Observes every transition on a cloned state and keeps each location's peak breakdown
    (O(1) per transition: the ledgers keep their own breakdown counters)."""

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
        parts = {
            "destination": entry.incoming_bytes,
            "overlap": entry.outgoing_bytes,
            "reconstruction": entry.reconstruction_bytes,
            "reserved": entry.reserved_bytes,
        }
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
        # A move's source also turned outgoing, but its charge did not change, so no peak
        # there can have moved: only the transition's own location is looked at.
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
    mine: Collection[int],
) -> None:
    """On a quiet manager, the copies in flight elsewhere (not in ``mine``, ticket ids) that
    read the materialization complete (the runtime waits for them before freeing it)."""
    for ticket in state.reads_of(handle, location):
        if ticket.ticket_id not in mine and not ticket.move:
            state.commit_copy(ticket)


T = TypeVar("T")

#: A computation that pauses (yields ``None``) at the phase runner's checkpoints and returns
#: its result: the async side drives it a slice at a time, a sync caller with :func:`drain`.
Steps: TypeAlias = Generator[None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run ``steps`` to the end at once and return its result."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def simulate_requests_steps(
    state: ResidencyState, gen: Generator[PhaseRequest, Any, None]
) -> Steps[None]:
    """Drive a phase as if every transfer succeeds and every pending event completes,
    pausing at its checkpoints."""
    request: Any = None
    try:
        request = next(gen)
        while True:
            if isinstance(request, Checkpoint):
                yield None
                request = gen.send(None)
                continue
            if isinstance(request, SettleRequest):
                _complete_reads_elsewhere(state, request.handle, request.location, ())
                mat = state.materialization(request.handle, request.location)
                consumers = mat.pending_event_count - len(
                    state.reads_of(request.handle, mat.location)
                )
                if consumers > 0:
                    state.reap_events(request.handle, request.location, consumers)
                request = gen.send(None)
                continue
            mine = {t.ticket_id for t in request.tickets}
            for ticket in request.tickets:
                value = state.value(ticket.handle)
                if ticket.source is not None and ticket.move:
                    _complete_reads_elsewhere(state, ticket.handle, ticket.source, mine)
                    src = value.materializations[ticket.source]
                    # consumer events only: the request's own copies commit before the move
                    extra = src.pending_event_count - len(
                        state.reads_of(ticket.handle, ticket.source)
                    )
                    if extra > 0:
                        state.reap_events(ticket.handle, ticket.source, extra)
            request = gen.send({})
    except StopIteration:
        return
    finally:
        # (a failure the phase raises has this frame in its traceback, and a request may
        # carry it: kept here, the two would be a cycle only the garbage collector frees)
        request = None


def simulate_requests(state: ResidencyState, gen: Generator[PhaseRequest, Any, None]) -> None:
    """:func:`simulate_requests_steps` run at once."""
    drain(simulate_requests_steps(state, gen))


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
) -> Steps[_Failure | None]:
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
            yield from simulate_requests_steps(sim, run_phase(sim, phase, items))
        except ActionFailed as failed:
            return (phase, failed.index, failed.cause)
        except (ResidencyError, ValueError) as error:
            return (phase, None, error)
    return None


def plan_fits_steps(state: ResidencyState, plan: ResidencyPlan) -> Steps[bool]:
    """:func:`plan_fits`, pausing at checkpoints (the async side runs it in slices)."""
    sim = yield from state.clone_steps(plan.handles())
    failure = yield from _simulate_plan(sim, plan)
    return failure is None


def plan_fits_at_once(state: ResidencyState, plan: ResidencyPlan) -> bool:
    """Whether ``plan`` certainly fits without simulating it (admission's fastest path, O(its
    actions)): it reserves nothing and releases nothing; each value it places exists, is held
    somewhere (no rebuild), is not being written, and is not in use where a move takes it
    from; and every location it copies to has room for all of its copies at once, counting
    no credit for what its moves free. False means "simulate", never "does not fit"."""
    if plan.reserve:
        return False
    for phase in (plan.reclaim, plan.enter, plan.exit):
        if len(phase) > 1 and _names_exclusive_twice(state, phase):
            return False  # invalid: the simulation says so (never "fits")
    adds: dict[Location, int] = {}
    values = state._values  # (find_value, inline)
    for action in (*plan.reclaim, *plan.enter, *plan.exit):
        if isinstance(action, Release):
            return False
        value = values.get(action.handle)
        if value is None or value.discarded:
            return False
        # One pass over its materializations: whether any holds the value (resident or
        # moving out), any of those is resident, written, or used or held.
        held = resident = used = False
        for m in value.materializations.values():
            if m.state is MaterializationState.INCOMING:
                continue
            if m.write_count:
                return False
            held = True
            if m.state is MaterializationState.RESIDENT:
                resident = True
            if m.use_count or m.hold_count:
                used = True
        if not held:
            return False
        present = value.materializations.get(action.location)
        if present is not None:
            if present.state is MaterializationState.OUTGOING:
                return False  # moving out of there: it cannot also stay (the simulation says)
            continue  # already there (or arriving): nothing charged
        if not resident:
            return False  # only moving out: no copy to read until that move commits
        moves = isinstance(action, Move) or value.replica_mode is ReplicaMode.EXCLUSIVE
        if moves and used:
            return False
        adds[action.location] = adds.get(action.location, 0) + value.charge_bytes
    for location, nbytes in adds.items():
        ledger = state.find_ledger(location)
        if ledger is None:
            return False
        budget = ledger.budget_bytes
        if budget is not None and ledger.used_bytes + ledger.reserved_bytes + nbytes > budget:
            return False  # (ledger.charged_bytes is used + reserved)
    return True


def _names_exclusive_twice(state: ResidencyState, actions: Sequence[Any]) -> bool:
    """Whether one phase asks for an EXCLUSIVE value at several locations (invalid)."""
    seen: dict[ValueHandle, Location] = {}
    for action in actions:
        if isinstance(action, Release):
            continue
        first = seen.setdefault(action.handle, action.location)
        if first != action.location:
            value = state.find_value(action.handle)
            if value is None or value.replica_mode is ReplicaMode.EXCLUSIVE:
                return True
    return False


def plan_fits(state: ResidencyState, plan: ResidencyPlan) -> bool:
    """``explain_plan(state, plan).feasible``, without building the evidence (admission's fast
    path: the simulation only, on a copy of the plan's own values)."""
    return drain(plan_fits_steps(state, plan))


def explain_plan_steps(
    state: ResidencyState, plan: ResidencyPlan, *, scoped: Iterable[ValueHandle] = ()
) -> Steps[PlanExplanation]:
    """:func:`explain_plan`, pausing at checkpoints (the async side runs it in slices)."""
    if not isinstance(plan, ResidencyPlan):
        raise TypeError(f"explain takes a ResidencyPlan, got {plan!r}")
    sim = yield from state.clone_steps(plan.handles())
    sim.reset_peaks()
    watcher = _PeakWatcher(sim, plan)
    sim.observers.append(watcher.observe)
    try:
        failure = yield from _simulate_plan(sim, plan, watcher)
    finally:
        # (the watcher refers to sim: left subscribed, the two would be a cycle that only the
        # garbage collector frees, once per explanation)
        sim.observers.clear()
    peaks, ledgers = watcher.result()
    if failure is None:
        peak_map = LocationMap(peaks)
        return PlanExplanation(
            True, "feasible", peak_map, LocationMap(ledgers), reached_peak_bytes=peak_map
        )
    reached = dict(peaks)
    phase, index, error = failure
    where = f"{phase} #{index}" if index is not None else phase
    transient = yield from _is_transient(state, plan, error, scoped)
    if isinstance(error, ResidencyBudgetError):
        # Explain in full: what the plan would reach if the budgets allowed it.
        unlimited = state.clone(plan.handles())
        for location in unlimited.locations():
            unlimited.ledger(location).budget_bytes = None
        unlimited.reset_peaks()
        full = _PeakWatcher(unlimited, plan)
        unlimited.observers.append(full.observe)
        try:
            fits = (yield from _simulate_plan(unlimited, plan, full)) is None
        finally:
            unlimited.observers.clear()
        if fits:
            peaks, ledgers = full.result()
            for location, ledger in ledgers.items():
                live = state.find_ledger(location)  # never add a location to the live state
                ledgers[location] = _with_budget(
                    ledger, None if live is None else live.budget_bytes
                )
    return PlanExplanation(
        False,
        f"infeasible at {where}: {error}",
        LocationMap(peaks),
        LocationMap(ledgers),
        failed_phase=phase,
        failed_action_index=index,
        blocking_error=error,
        transient=transient,
        reached_peak_bytes=LocationMap(reached),
    )


def explain_plan(
    state: ResidencyState, plan: ResidencyPlan, *, scoped: Iterable[ValueHandle] = ()
) -> PlanExplanation:
    """Simulate ``plan`` on a copy of ``state``; the real state is not touched.

    The simulation runs the same transitions as execution (see :func:`run_phase`), assuming every
    transfer succeeds and every pending consumer event completes. Its peaks are therefore the
    peaks execution charges on a quiet manager. ``scoped`` names the values of entered scopes
    (their exit may move them): waiting for them counts as transient. O(plan), blocking the
    caller for all of it (the runtime's admission runs :func:`explain_plan_steps` in slices)."""
    return drain(explain_plan_steps(state, plan, scoped=scoped))


def _with_budget(ledger: PeakLedger, budget: int | None) -> PeakLedger:
    from dataclasses import replace

    return replace(ledger, budget_bytes=budget)


def _is_transient(
    state: ResidencyState,
    plan: ResidencyPlan,
    error: BaseException,
    scoped: Iterable[ValueHandle] = (),
) -> Steps[bool]:
    """Would the plan fit once everything transient ended (leases, holds, pending events,
    transfers in flight, the reservations of scopes and blocks)? Resident values that nobody
    protects stay: nothing moves them on its own (see ``ResidencyState.settled``)."""
    if not isinstance(
        error,
        # (a ResidencyPlanError: a value only moving out now has no copy to read until that
        # move commits; the simulation on the settled state tells it from a plan never valid)
        (ResidencyBudgetError, ResidencyInUseError, DuplicateReservationError, ResidencyPlanError),
    ):
        return False
    return (yield from _simulate_plan(state.settled(plan.handles(), scoped), plan)) is None


def fails_while_kept_steps(
    state: ResidencyState,
    plan: ResidencyPlan,
    *,
    scoped: Iterable[ValueHandle] = (),
    kept: Iterable[tuple[ValueHandle, Location]] = (),
    kept_reservations: Iterable[tuple[str, Location]] = (),
    kept_uses: Iterable[tuple[ValueHandle, Location]] = (),
) -> Steps[tuple[str, BaseException] | None]:
    """Where (``"enter #0"``) and why the plan would still fail once everything transient
    ended except ``kept`` and ``kept_reservations`` (what the task that would wait for it
    holds itself, ``kept_uses`` the leases among ``kept``: see
    :meth:`ResidencyState.settled`); ``None`` when it would fit then. ``scoped``: the values
    of scopes *other* tasks entered (their exit may move them)."""
    settled = state.settled(
        plan.handles(),
        scoped,
        kept=kept,
        kept_reservations=kept_reservations,
        kept_uses=kept_uses,
    )
    failure = yield from _simulate_plan(settled, plan)
    if failure is None:
        return None
    phase, index, error = failure
    return (f"{phase} #{index}" if index is not None else phase), error
