"""``ResidencyController``: request -> decision on the event loop, and decide-then-enter scopes.

The controller reads the manager's live state (``manager.state``) only synchronously, on the
loop that owns it, and never mutates it: decisions are entered through ``manager.scope``. It
uses the manager's public surface only (:class:`ManagerLike`).

Not blocking the loop: the search (``search.iter_decide``) runs in slices of ``slice_seconds``
(0.5 ms by default) with a checkpoint (``anyio.lowlevel.checkpoint``) between them, so other
tasks run at least that often. The state can change while the search is parked; a search whose
state moved restarts from the new state (never finishing on a stale one), up to
``max_restarts`` times, after which it runs to the end without parking (a manager that changes
faster than one slice would otherwise starve it). The candidate index is kept current by a state
observer; bringing it up to date is also sliced, and changes made meanwhile are caught by the
same observer, so that part never restarts.

Why this module is long: it is the controller and the two things its calls return, a decision
being derived (:class:`PendingDecision`) and a decide-then-enter scope
(:class:`ControllerScope`); both drive the controller's own search and candidate index, and the
scope's rules for waiting (stale decisions, transient state, what the entering task holds
itself) read best beside the search they re-run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from types import TracebackType
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from ..core.errors import (
    ResidencyError,
    ResidencyPlanError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
)
from ..core.explain import PlanExplanation
from ..core.locations import Location
from ..core.plans import MemoryReservation, ResidencyPlan
from ..core.state import ResidencyState
from ..core.timeouts import check_timeout
from .index import CandidateIndex, Slicer
from .policy import CostModel, FallbackGraph
from .requests import Eviction, Placement, ResidencyDecision, ResidencyRequest
from .search import (
    DEFAULT_OPTIMALITY_GAP,
    DEFAULT_SEARCH_STATE_LIMIT,
    ModelMismatchError,
    check_optimality_gap,
    decide_nowait,
    iter_decide,
)

__all__ = [
    "STALE_RETRIES_WITHOUT_TIME",
    "ControllerScope",
    "PendingDecision",
    "ResidencyController",
]

#: Stale decisions re-derived at most at a ``controller.scope(request, timeout=0)`` entry
#: (with time to wait, retries go on while it lasts).
STALE_RETRIES_WITHOUT_TIME = 3


class ManagerLike(Protocol):
    """What the controller needs of a ``ResidencyManager`` (public members only)."""

    @property
    def state(self) -> ResidencyState: ...

    @property
    def state_version(self) -> int: ...

    def check_thread(self) -> None: ...

    async def wait_for_change(self, timeout: float | None = None) -> bool: ...

    def scope(self, plan_or_decision: Any, timeout: float | None = None) -> Any: ...


class ResidencyController:
    """Turns :class:`ResidencyRequest` s into :class:`ResidencyDecision` s for one manager.

    ``search_state_limit`` bounds every search (``ResidencySearchLimitError`` when reached);
    ``optimality_gap`` is how close to the cheapest eviction set a decision must be (1%; 0 for
    an exact search, which can take exponentially many states when victims differ in size);
    ``fallback_graph`` and ``cost_model`` are the policy (defaults:
    ``cuda:N -> pinned-host -> pageable-host`` with drops, and the H200 anchors). A decision is
    a pure function of the manager's state, the request and the policy.

    State: the manager; a candidate index attached to the manager's state (its observer marks
    changed values; :meth:`close` detaches it); counters ``decisions``, ``restarts`` (searches
    restarted because the state moved while they were parked) and ``stale_retries`` (scope
    entries that found their decision stale and decided again).
    """

    def __init__(
        self,
        manager: ManagerLike,
        search_state_limit: int = DEFAULT_SEARCH_STATE_LIMIT,
        *,
        fallback_graph: FallbackGraph | None = None,
        cost_model: CostModel | None = None,
        max_stale_retries: int | None = None,
        slice_seconds: float = 0.0005,
        max_restarts: int = 16,
        optimality_gap: float = DEFAULT_OPTIMALITY_GAP,
    ) -> None:
        missing = [
            name
            for name in ("state", "state_version", "check_thread", "wait_for_change", "scope")
            if not hasattr(manager, name)
        ]
        if missing:
            raise TypeError(
                f"ResidencyController needs a ResidencyManager (or an object with its state, "
                f"state_version, check_thread, wait_for_change and scope); {manager!r} has no "
                f"{', '.join(missing)}"
            )
        if isinstance(search_state_limit, bool) or not isinstance(search_state_limit, int):
            raise TypeError(f"search_state_limit must be an int, got {search_state_limit!r}")
        if search_state_limit < 1:
            raise ValueError(f"search_state_limit must be >= 1, got {search_state_limit}")
        if max_stale_retries is not None:
            _check_count("max_stale_retries", max_stale_retries, "None or an int >= 0")
        _check_count("max_restarts", max_restarts, "an int >= 0")
        if isinstance(slice_seconds, bool) or not isinstance(slice_seconds, (int, float)):
            raise TypeError(f"slice_seconds must be a number of seconds > 0, got {slice_seconds!r}")
        if not slice_seconds > 0:
            raise ValueError(
                f"slice_seconds must be a number of seconds > 0, got {slice_seconds!r}"
            )
        self.manager = manager
        self.search_state_limit = search_state_limit
        self._graph = fallback_graph if fallback_graph is not None else FallbackGraph.default()
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.max_stale_retries = max_stale_retries
        self.slice_seconds = slice_seconds
        self.max_restarts = max_restarts
        self.optimality_gap = check_optimality_gap(optimality_gap)
        self._index: CandidateIndex | None = None
        self.decisions = 0
        self.restarts = 0
        self.stale_retries = 0

    def __repr__(self) -> str:
        return (
            f"<ResidencyController manager={self._state().manager_id} "
            f"search_state_limit={self.search_state_limit} decisions={self.decisions} "
            f"restarts={self.restarts} stale_retries={self.stale_retries}>"
        )

    # ----------------------------------------------------------------- policy

    @property
    def fallback_graph(self) -> FallbackGraph:
        return self._graph

    @fallback_graph.setter
    def fallback_graph(self, graph: FallbackGraph) -> None:
        if not isinstance(graph, FallbackGraph):
            raise TypeError(f"expected a FallbackGraph, got {graph!r}")
        self._graph = graph
        self.close()  # the index classifies candidates by the graph: rebuild it

    def close(self) -> None:
        """Detach the candidate index from the manager's state (it is rebuilt on next use)."""
        if self._index is not None:
            self._index.detach()
            self._index = None

    def __enter__(self) -> ResidencyController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- deciding

    def _state(self) -> ResidencyState:
        return self.manager.state

    def _check_loop(self) -> None:
        """The manager's check: running, and called from its loop's thread (its state is not
        thread-safe)."""
        self.manager.check_thread()

    def _index_for(self, state: ResidencyState) -> CandidateIndex:
        index = self._index
        if index is None or index.state is not state or index.graph != self._graph:
            self.close()
            index = self._index = CandidateIndex(self._graph)
            index.attach(state)
        return index

    def decide_nowait(self, request: ResidencyRequest) -> ResidencyDecision:
        """Derive a decision synchronously: blocks the loop for the whole search (use
        :meth:`decide` on the loop; this is for tests and tools). A location the manager does
        not have is ``ValueError``, as with :meth:`decide`. A ``ResidencyPlanError`` carries
        the ``request``."""
        self._check_loop()
        self._check_locations(request)
        try:
            return self._decide_nowait(request)
        except ResidencyPlanError as error:
            _with_request(error, request)
            raise

    def _decide_nowait(self, request: ResidencyRequest) -> ResidencyDecision:
        state = self._state()
        for attempt in range(2):
            index = self._index_for(state)
            steps = iter_decide(
                state,
                request,
                graph=self._graph,
                cost_model=self.cost_model,
                search_state_limit=self.search_state_limit,
                index=index,
                optimality_gap=self.optimality_gap,
            )
            try:
                while True:
                    next(steps)
            except StopIteration as done:
                decision: ResidencyDecision = done.value
                self.decisions += 1
                return decision
            except ModelMismatchError as error:
                if attempt:
                    raise ResidencyPlanError(str(error)) from None
                index.invalidate()
        raise AssertionError("unreachable")

    def decide(self, request: ResidencyRequest) -> PendingDecision:
        """Derive a decision for ``request`` from the manager's current state.

        ``decision = await controller.decide(request)`` runs the search in slices that leave the
        loop free for other tasks (see the module docstring); the decision's
        ``expected_state_version`` is the state version when the await returned. Reading the
        result without awaiting it (``controller.decide(request).explored_states``) derives it
        synchronously instead, blocking the loop for the search. Raises
        ``ResidencyPlanError`` (invalid or infeasible request) or
        ``ResidencySearchLimitError`` (bound reached: feasibility unknown), when awaited or
        read. Cancelling the await changes nothing."""
        if not isinstance(request, ResidencyRequest):
            raise TypeError(f"expected a ResidencyRequest, got {request!r}")
        self._check_loop()
        self._check_locations(request)
        return PendingDecision(self, request)

    def _check_locations(self, request: ResidencyRequest) -> None:
        """Every location the request names exists on this manager (its machine's devices and
        the host): ``ValueError`` at ``decide``, not a decision that fails at entry."""
        known = set(self._state().locations())
        for requirement in request.requirements:
            for location in requirement.alternatives:
                if location not in known:
                    names = ", ".join(str(k) for k in sorted(known))
                    raise ValueError(
                        f"request {request.name!r} asks for {requirement.handle} at {location}, "
                        f"which this manager does not have (it has: {names})"
                    )
        for reservation in request.reservations:
            if reservation.location not in known:
                names = ", ".join(str(k) for k in sorted(known))
                raise ValueError(
                    f"request {request.name!r} reserves {reservation.name!r} at "
                    f"{reservation.location}, which this manager does not have (it has: {names})"
                )

    async def _decide(self, request: ResidencyRequest) -> ResidencyDecision:
        try:
            return await self._decide_sliced(request)
        except ResidencyPlanError as error:
            _with_request(error, request)
            raise

    async def _decide_sliced(self, request: ResidencyRequest) -> ResidencyDecision:
        restarts = 0
        mismatches = 0
        while True:
            state = self._state()
            index = self._index_for(state)
            slicer: Slicer | None = None
            if restarts < self.max_restarts:
                slicer = Slicer(self.slice_seconds)
                # The index catches changes made while this is parked: no restart needed.
                for _ in index.refresh_steps(slicer):
                    await anyio.lowlevel.checkpoint()
                    slicer.restart()
            version = state.state_version
            steps = iter_decide(
                state,
                request,
                graph=self._graph,
                cost_model=self.cost_model,
                search_state_limit=self.search_state_limit,
                index=index,
                slicer=slicer,
                optimality_gap=self.optimality_gap,
            )
            try:
                while True:
                    next(steps)
                    assert slicer is not None
                    await anyio.lowlevel.checkpoint()
                    if state.state_version != version or self._state() is not state:
                        break  # the search saw an older state: start again
                    slicer.restart()
            except StopIteration as done:
                decision: ResidencyDecision = done.value
                self.decisions += 1
                return decision
            except ModelMismatchError as error:
                mismatches += 1
                if mismatches > 1:
                    raise ResidencyPlanError(str(error)) from None
                index.invalidate()
                continue
            finally:
                steps.close()
            restarts += 1
            self.restarts += 1

    # ----------------------------------------------------------------- scopes

    def scope(self, request: ResidencyRequest, timeout: float | None = None) -> ControllerScope:
        """``async with controller.scope(request, timeout=...) as scope``: decide and enter.

        Entry derives a decision and enters it with ``manager.scope``. A decision found stale at
        entry is re-derived from the current state (never replayed) while time remains: with a
        timeout, ``TimeoutError`` once it passed (chained to the last
        ``ResidencyStaleStateError``); ``timeout=None`` retries as long as decisions go stale
        (each one means another task changed the state: the manager makes progress). An int
        ``max_stale_retries`` bounds the retries too; with ``timeout=0`` (no time to wait) they
        are bounded by :data:`STALE_RETRIES_WITHOUT_TIME` unless it says otherwise; past the
        bound the last ``ResidencyStaleStateError`` is raised.

        For the block, the controller takes a hold on every requirement where the decision
        placed it (released before the scope's exit actions run), so the requirements stay in
        place: another decision cannot evict them (a protected materialization is no victim)
        and a direct removal is ``ResidencyInUseError``.

        A request that is infeasible only because of transient state (leases, holds, pending
        events, other scopes' reservations: it would fit on its own) waits for the
        state to change and decides again, as a manual scope waits for admission, for up to
        ``timeout`` seconds in all (``None``: as long as that lasts; ``0``: never waits), then
        raises ``TimeoutError``. It waits in the manager's admission queue
        (``manager.take_turn``), first come, first served with the manual scopes for the same
        room: from the moment it must wait (it does not fit now, or a scope already waits for
        room where it would charge) it has its place there, decides again only while that
        place is first, and enters its decision in it; what comes later for that room (a
        scope, a direct operation, a reservation) does not get ahead of it. A request that
        could never fit raises ``ResidencyPlanError`` at once, and so does one that only what
        the entering task holds itself keeps out (its leases, holds, scopes and reservation
        blocks end only when it goes on: ``hold_and_wait``).
        """
        timeout = check_timeout(timeout)
        if not isinstance(request, ResidencyRequest):
            raise TypeError(f"expected a ResidencyRequest, got {request!r}")
        self._check_loop()
        self._check_locations(request)
        return ControllerScope(self, request, timeout)

    def would_fit_alone(self, request: ResidencyRequest) -> bool:
        """Whether ``request`` is feasible once everything it does not name went away and
        nothing were protected (the manager's test for transient blocking)."""
        state = self._state()
        alone = state.isolated(request.handles())
        try:
            decide_nowait(
                alone,
                request,
                graph=self._graph,
                cost_model=self.cost_model,
                search_state_limit=self.search_state_limit,
                optimality_gap=self.optimality_gap,
            )
        except ResidencyPlanError:
            return False
        return True

    async def wait_for_change(self, deadline: float | None) -> bool:
        """Park until the manager's state commits a transition; False if ``deadline``
        (``anyio.current_time()`` clock) passed first. The manager's own change signal."""
        if deadline is None:
            return await self.manager.wait_for_change()
        remaining = deadline - anyio.current_time()
        if remaining <= 0:
            return False
        return await self.manager.wait_for_change(remaining)


class PendingDecision:
    """What :meth:`ResidencyController.decide` returns: a decision being derived.

    ``await`` it for the :class:`ResidencyDecision` (the search runs in slices; the loop stays
    free). Reading one of the decision's fields from it directly, or calling :meth:`result`,
    derives the decision synchronously (blocking the loop for the search), as in
    ``decision = controller.decide(request); print(decision.explored_states)``. Either
    way the decision is derived once and kept: awaiting again, or reading more fields, returns
    the same decision.
    """

    __slots__ = ("_controller", "_decision", "_request")

    def __init__(self, controller: ResidencyController, request: ResidencyRequest) -> None:
        self._controller = controller
        self._request = request
        self._decision: ResidencyDecision | None = None

    def __await__(self) -> Generator[Any, None, ResidencyDecision]:
        if self._decision is None:
            self._decision = yield from self._controller._decide(self._request).__await__()
        return self._decision

    def result(self) -> ResidencyDecision:
        """The decision, derived synchronously now if it was not yet (blocks the loop)."""
        if self._decision is None:
            self._decision = self._controller.decide_nowait(self._request)
        return self._decision

    def __repr__(self) -> str:
        if self._decision is None:
            return f"<PendingDecision {self._request.name!r} (await it, or call result())>"
        return f"<PendingDecision {self._decision!r}>"

    @property
    def request(self) -> ResidencyRequest:
        return self._request

    @property
    def expected_state_version(self) -> int:
        return self.result().expected_state_version

    @property
    def explored_states(self) -> int:
        return self.result().explored_states

    @property
    def evictions(self) -> tuple[Eviction, ...]:
        return self.result().evictions

    @property
    def plan(self) -> ResidencyPlan:
        return self.result().plan

    @property
    def explanation(self) -> PlanExplanation:
        return self.result().explanation

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.result().placements

    @property
    def estimated_seconds(self) -> float:
        return self.result().estimated_seconds


class ControllerScope:
    """The async context manager ``controller.scope(request, timeout)`` returns (single use).

    After entry: ``decision`` is the decision entered, ``decisions`` every decision derived on
    the way (the last is ``decision``), ``manager_scope`` the manager's scope (``report`` and
    ``exit_error`` are its). While entered it holds every requirement where the decision placed
    it; exit releases those holds, then runs the manager scope's exit.
    """

    def __init__(
        self, controller: ResidencyController, request: ResidencyRequest, timeout: float | None
    ) -> None:
        self.controller = controller
        self.request = request
        self.timeout = timeout
        self.decisions: list[ResidencyDecision] = []
        self._decision: ResidencyDecision | None = None
        self.manager_scope: Any = None
        self.stale_retries = 0
        self._holds: list[Any] = []  # on the requirements, while entered
        self.status = "new"

    def __repr__(self) -> str:
        return (
            f"<ControllerScope {self.request.name!r} {self.status} "
            f"[{len(self.decisions)} decisions, {self.stale_retries} stale]>"
        )

    @property
    def decision(self) -> ResidencyDecision:
        """The decision that was entered (``RuntimeError`` before entry)."""
        if self._decision is None:
            raise RuntimeError("the scope has not been entered")
        return self._decision

    @property
    def report(self) -> Any:
        if self.manager_scope is None:
            raise RuntimeError("the scope has not been entered")
        return self.manager_scope.report

    @property
    def exit_error(self) -> BaseException | None:
        return None if self.manager_scope is None else self.manager_scope.exit_error

    async def __aenter__(self) -> ControllerScope:
        if self.status != "new":
            raise RuntimeError(
                f"a controller scope is single use and this one is {self.status}; make a new "
                "one from the request"
            )
        self.status = "entering"
        controller = self.controller
        timeout = self.timeout
        deadline = None if timeout is None else anyio.current_time() + timeout
        # Its place in the manager's admission queue while it waits (see _take_turn).
        turn: Any = None
        registered: contextlib.ExitStack | None = None
        try:
            while True:
                if turn is None:
                    turn = self._take_turn(only_behind_others=True)
                if turn is not None:
                    # Judged only once no earlier waiter for the same room is ahead of it.
                    while not turn.first:
                        if not await turn.wait(deadline):
                            raise TimeoutError(
                                f"request {self.request.name!r} not admitted within {timeout} "
                                f"s: {turn.waiting_ahead} earlier waiter(s) come first (FIFO)"
                            )
                try:
                    decision = await controller._decide(self.request)
                except ResidencySearchLimitError:
                    raise
                except ResidencyPlanError as error:
                    if timeout == 0 or not controller.would_fit_alone(self.request):
                        raise
                    never = self._never_admitted()
                    if never is not None:
                        raise never from error
                    if turn is None:
                        turn = self._take_turn()
                    # Registered for the hold-and-wait check, as a waiting manual scope is:
                    # refused here if it closes a cycle of tasks each waiting for room the
                    # others hold, and a later wait closing one is refused. Anew at each
                    # wait: what it needs changes as values arrive and leave.
                    if registered is not None:
                        registered.close()  # (closing it again in the finally does nothing)
                    registered = self._register_wait()
                    if turn is not None:
                        changed = await turn.wait(deadline)
                    else:  # a stand-in manager, without an admission queue
                        changed = await controller.wait_for_change(deadline)
                    if not changed:
                        raise TimeoutError(
                            f"request {self.request.name!r} not admitted within {timeout} s: "
                            f"{error.reason}"
                        ) from error
                    continue
                if turn is None:
                    # Scopes came to wait for the same room while it decided: its turn comes
                    # after theirs, then it decides again.
                    turn = self._take_turn(only_behind_others=True)
                    if turn is not None:
                        continue
                self.decisions.append(decision)
                remaining = None if deadline is None else max(0.0, deadline - anyio.current_time())
                # No await between the decision and this entry: it is fresh here unless entry
                # itself has to wait for admission behind other scopes.
                if turn is None:
                    manager_scope = controller.manager.scope(decision, timeout=remaining)
                else:  # (a manager with take_turn: its scope takes the turn too)
                    scope_in_turn: Any = controller.manager.scope
                    manager_scope = scope_in_turn(decision, timeout=remaining, turn=turn)
                try:
                    await manager_scope.__aenter__()
                except ResidencyStaleStateError as stale:
                    self.stale_retries += 1
                    controller.stale_retries += 1
                    limit = controller.max_stale_retries
                    if limit is None and timeout == 0:
                        limit = STALE_RETRIES_WITHOUT_TIME
                    if limit is not None and self.stale_retries > limit:
                        raise
                    if deadline is not None and anyio.current_time() >= deadline and timeout:
                        raise TimeoutError(
                            f"request {self.request.name!r} not admitted within {timeout} s: "
                            f"its decision went stale {self.stale_retries} time(s) (other tasks "
                            "kept changing the state between decision and entry)"
                        ) from stale
                    continue
                try:
                    self._hold_placements(manager_scope, decision)
                except BaseException as error:
                    await manager_scope.__aexit__(type(error), error, error.__traceback__)
                    raise
                self.manager_scope = manager_scope
                self._decision = decision
                self.status = "entered"
                return self
        except BaseException:
            self.status = "failed"
            raise
        finally:
            if registered is not None:
                registered.close()
            if turn is not None:
                turn.leave()  # (nothing once the entry was admitted in it)

    def _register_wait(self) -> contextlib.ExitStack:
        """Register this scope's wait with the manager (``manager.plan_wait``) as the room it
        needs at least: the bytes of each requirement with a single location (budgeted, and
        the value not there yet), and the request's reservations, as one reservation per
        location. What has alternatives is left out, so the wait is judged as needing no more
        than it does (a cycle is never seen where one of its waits could end). Raises the
        ``ResidencyPlanError`` (``hold_and_wait``) of a wait that closes a cycle."""
        stack = contextlib.ExitStack()
        plan_wait = getattr(self.controller.manager, "plan_wait", None)
        if plan_wait is None:  # a stand-in manager, which registers no waits
            return stack
        state = self.controller._state()
        needs: dict[Location, int] = {}
        for reservation in self.request.reservations:
            needs[reservation.location] = needs.get(reservation.location, 0) + reservation.nbytes
        for requirement in self.request.requirements:
            value = state.find_value(requirement.handle)
            location = requirement.location
            if requirement.fallbacks or value is None or location in value.materializations:
                continue
            needs[location] = needs.get(location, 0) + value.charge_bytes
        name = f"aresidency.request.{self.request.name}"
        plan = ResidencyPlan(
            reserve=[MemoryReservation(name, loc, n) for loc, n in needs.items() if n > 0]
        )
        try:
            stack.enter_context(plan_wait(plan, what=f"request {self.request.name!r}"))
        except ResidencyPlanError as error:
            error.request = self.request
            raise
        return stack

    def _take_turn(self, *, only_behind_others: bool = False) -> Any:
        """A place in the manager's admission queue (``manager.take_turn``) for this scope,
        charging every location the request may charge (each requirement's alternatives, the
        source locations of values it may rebuild, its reservations), so that it waits for
        room first come, first served with the manual scopes, and what comes later for the
        same room does not overtake it; ``None`` for a stand-in manager without a queue (and,
        ``only_behind_others``, when it would wait behind no one)."""
        take_turn = getattr(self.controller.manager, "take_turn", None)
        if take_turn is None:
            return None
        state = self.controller._state()
        locations = {r.location for r in self.request.reservations}
        for requirement in self.request.requirements:
            locations.update(requirement.alternatives)
            value = state.find_value(requirement.handle)
            if value is not None and value.has_source and value.source_location is not None:
                locations.add(value.source_location)
        return take_turn(sorted(locations), only_behind_others=only_behind_others)

    def _never_admitted(self) -> ResidencyPlanError | None:
        """The refusal of a request that waiting would never admit: it is infeasible even once
        everything transient ended but what the entering task holds itself (its leases and
        holds stay protected, its scopes' and reservation blocks' reservations stay), which
        ends only when that task goes on. As a manual scope is refused (hold and wait);
        ``None`` when waiting may end."""
        holdings = getattr(self.controller.manager, "task_holdings", None)
        if holdings is None:  # a stand-in that only decides
            return None
        kept, reservations, described = holdings()
        if not kept and not reservations:
            return None
        # The task's leases stand in as uses, its holds as holds: protected alike (the
        # decision is the same), and an error then says what the task really holds.
        leases = getattr(self.controller.manager, "task_leases", None)
        uses = list(leases()) if leases is not None else []
        controller = self.controller
        state = controller._state()
        alone = state.isolated([*self.request.handles(), *(handle for handle, _ in kept)])
        try:
            for handle, location in kept:
                value = alone.find_value(handle)
                if value is not None and location in value.materializations:
                    if (handle, location) in uses:
                        uses.remove((handle, location))
                        alone.lease(handle, location)
                    else:
                        alone.hold(handle, location)
            for name, location in reservations:
                ledger = state.find_ledger(location)
                entry = None if ledger is None else ledger.reservations.get(name)
                if entry is not None and name not in alone.ledger(location).reservations:
                    alone.reserve(name, location, entry[0])
        except (ResidencyError, ValueError):
            return None  # not a state to judge by: waiting may still end
        try:
            decide_nowait(
                alone,
                self.request,
                graph=controller.fallback_graph,
                cost_model=controller.cost_model,
                search_state_limit=controller.search_state_limit,
                optimality_gap=controller.optimality_gap,
            )
        except ResidencySearchLimitError:
            return None  # unknown: waiting may still end
        except ResidencyPlanError as error:
            refused = ResidencyPlanError(f"{error.reason}; {described}")
            refused.hold_and_wait = True
            refused.request = self.request
            return refused
        return None

    def _hold_placements(self, manager_scope: Any, decision: ResidencyDecision) -> None:
        del manager_scope  # entered: the caller exits it if this raises
        """Hold every requirement where the decision placed it, right after entry (no await
        in between: nothing moved them yet). A hold that cannot be taken (the manager closing)
        leaves none behind and the error propagates, after the manager scope's exit."""
        # A ResidencyManager has ``hold``; a stand-in without one (a view that only decides)
        # keeps nothing in place.
        hold = getattr(self.controller.manager, "hold", None)
        if hold is None:
            return
        try:
            for placement in decision.placements:
                self._holds.append(hold(placement.requirement.handle, placement.location))
        except BaseException:
            self._release_holds()
            raise

    def _release_holds(self) -> None:
        holds, self._holds = self._holds, []
        for hold in holds:
            try:
                hold.release()
            except RuntimeError:  # the manager closed (ManagerClosedError): its state is final
                pass

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self.status != "entered":
            return None
        self._release_holds()  # before the exit actions, which may move the requirements
        try:
            result: bool | None = await self.manager_scope.__aexit__(exc_type, exc, tb)
        finally:
            self.status = "exited"
        return result


def _check_count(keyword: str, value: object, expected: str) -> None:
    """Refuse a count that is not an int >= 0, naming the keyword (``True`` is no count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{keyword} must be {expected}, got {value!r}")
    if value < 0:
        raise ValueError(f"{keyword} must be {expected}, got {value!r}")


def _with_request(error: ResidencyPlanError, request: ResidencyRequest) -> None:
    """Give ``error`` the request it refused (its ``request`` field, for ``to_dict`` and the
    diagnosis's check of every requirement), unless it already names one."""
    if getattr(error, "request", None) is None:
        error.request = request
