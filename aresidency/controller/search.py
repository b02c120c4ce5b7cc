"""The search: a request and a ``ResidencyState`` in, a ``ResidencyDecision`` out.

Pure and synchronous (no asyncio, no device calls): :func:`decide_nowait` runs it to the end;
:func:`iter_decide` is the same search as a generator that yields between slices of work, which
``ResidencyController.decide`` drives on the event loop. Neither mutates the state.

How a decision is derived
-------------------------
1. **Validate** the request against the state: every handle belongs to the state and is not
   discarded; an EXCLUSIVE handle is named by one requirement only (several locations are
   simultaneous postconditions, valid only for REPLICABLE values). Else ``ResidencyPlanError``.
2. **Placements**, in order of preference: every requirement at its preferred location first,
   then assignments using fewer fallbacks before more, and among those the lexicographically
   smallest (earlier requirements keep their preference longest). The first placement for which
   an eviction plan exists wins.
3. **Profile** a placement: run its reservations and ``enter`` actions on a partial copy of the
   state without budgets (the same ``run_phase`` execution and ``explain`` use) and record, per
   location, how far above its starting charge the entry peaks (``need``): destination charges,
   source and destination overlap, temporary reconstruction loads, reservations. A structural
   failure (no path to a location, a protected value that must move, a reservation name in use)
   rules the placement out.
4. **Deficits**: at a location with a budget, after the reclaim phase, ``charged + need -
   budget`` must be <= 0 (``B``); and while the reclaim phase's moves are in flight, moves *into*
   a location need room beyond what releases there freed (``A``; a move frees its source only
   when its copy completes). Locations short of bytes, and the budgeted fallback tiers their
   victims may move to, form *groups*, visited in the graph's topological order.
5. **Branch and bound** over the candidates of each group, cheapest cost per byte first (merged
   from the candidate index's classes), each taken with one of its options (release or drop, or
   move to a fallback tier, cheapest first) or kept. A group whose constraints hold is closed
   (more victims there only cost more, and in an acyclic graph no later move can reach it). A
   node is pruned when the remaining candidates cannot cover a deficit, when its cost plus a
   lower bound (the fractional cover by cost per byte, and a count bound: at least
   ``ceil(deficit / largest charge)`` more victims, each at least the smallest charge times the
   next densities) cannot beat the best plan so far by more than ``optimality_gap`` (1% by
   default; 0 for an exact search), or when the same sub-problem (position and remaining
   deficits) was reached before at no greater cost. Every node visited counts in
   ``explored_states``; reaching ``search_state_limit`` raises ``ResidencySearchLimitError``.
6. **The plan**: ``reclaim`` = releases and drops, then moves (so that releases make room for
   moves into the same tier); ``reserve`` = the request's reservations; ``enter`` = a
   ``Materialize`` per placed requirement. ``explain_plan`` runs once on it; its explanation
   goes into the decision (and must be feasible).

Determinism: the index content, the candidate order (ties broken by class, recency and value
id), the option order and the node order are all functions of the state, the request, the graph
and the cost model; so are the decision and ``explored_states``. Time only decides where the
generator pauses, never what it explores.

Why this module is long: the search is one algorithm (enumeration of eviction sets, the bound,
the tiers, scoring, the slicing that keeps the loop free) whose determinism argument, stated
above, spans all of it; split across modules, that argument would have no single place to be
checked against the code.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import (
    ResidencyError,
    ResidencyPlanError,
    ResidencySearchLimitError,
    format_bytes,
)
from ..core.explain import PlanExplanation, explain_plan, simulate_requests
from ..core.locations import Location
from ..core.plans import ActionFailed, Materialize, Move, Release, ResidencyPlan, run_phase
from ..core.state import ResidencyState
from ..core.values import MaterializationState, ReplicaMode, ValueHandle
from .index import Bucket, CandidateIndex, LocationCandidates, Slicer
from .policy import CostModel, FallbackGraph
from .requests import (
    Eviction,
    Placement,
    ResidencyDecision,
    ResidencyRequest,
    ResidencyRequirement,
)

__all__ = [
    "DEFAULT_OPTIMALITY_GAP",
    "DEFAULT_SEARCH_STATE_LIMIT",
    "ModelMismatchError",
    "decide_nowait",
    "iter_decide",
    "placement_order",
    "simulate_entry",
]

DEFAULT_SEARCH_STATE_LIMIT = 10_000
#: Relative optimality tolerance: the decision's eviction cost is within this fraction of the
#: cheapest. Choosing victims of different sizes is a subset-sum problem: proving that no
#: combination overshoots the deficit by fewer bytes can take exponentially many states, for a
#: difference far below the precision of the cost estimates; 1% keeps such searches to a few
#: hundred states. ``0.0`` makes the search exact (the brute-force tests use it).
DEFAULT_OPTIMALITY_GAP = 0.01

_RESIDENT = MaterializationState.RESIDENT
_OUTGOING = MaterializationState.OUTGOING
# A lower bound is computed in floating point; shave it so that rounding never prunes a plan
# that is better by more than this relative margin.
_LB_SLACK = 1.0 - 1e-9
# How many nodes between two looks at the slice clock (a look costs ~50 ns).
_CLOCK_EVERY = 16


class ModelMismatchError(Exception):
    """Internal: ``explain_plan`` found the search's plan infeasible (the candidate index was out
    of step with the state). The controller rebuilds the index and searches again; otherwise it
    surfaces as a ``ResidencyPlanError`` (it never escapes as itself)."""


def _label(handle: ValueHandle) -> str:
    return handle.name or f"#{handle.value_id}"


def _ms(seconds: float) -> str:
    """A duration people can read: ``'1.250 ms'``, ``'3.2 us'``, ``'40 ns'``."""
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e9:.0f} ns"


def _protection(mat: Any) -> str:
    parts = [
        f"{count} {what}{'' if count == 1 else 's'}"
        for count, what in (
            (mat.use_count, "use"),
            (mat.hold_count, "hold"),
            (mat.pending_event_count, "pending event"),
        )
        if count
    ]
    return ", ".join(parts)


# ------------------------------------------------------------------------ placements


def placement_order(request: ResidencyRequest) -> Iterator[tuple[int, ...]]:
    """Fallback ranks per requirement, in order of preference: fewer fallbacks first, then the
    lexicographically smallest rank vector (earlier requirements keep their preference)."""
    caps = [len(req.alternatives) - 1 for req in request.requirements]
    n = len(caps)
    for total in range(sum(caps) + 1):
        # The lexicographically smallest vector with this sum: fill from the right.
        vector = [0] * n
        remaining = total
        for i in range(n - 1, -1, -1):
            vector[i] = min(caps[i], remaining)
            remaining -= vector[i]
        if remaining:
            continue
        while True:
            yield tuple(vector)
            # Next vector with the same sum: the rightmost position that can grow while the
            # positions after it still hold at least one unit; then refill them minimally.
            suffix = 0
            advanced = False
            for i in range(n - 1, -1, -1):
                if i < n - 1 and vector[i] < caps[i] and suffix > 0:
                    vector[i] += 1
                    left = suffix - 1
                    for j in range(n - 1, i, -1):
                        vector[j] = min(caps[j], left)
                        left -= vector[j]
                    advanced = True
                    break
                suffix += vector[i]
            if not advanced:
                break


def _validate(state: ResidencyState, request: ResidencyRequest) -> None:
    if not isinstance(request, ResidencyRequest):
        raise TypeError(f"expected a ResidencyRequest, got {request!r}")
    locations: dict[ValueHandle, list[ResidencyRequirement]] = {}
    for index, req in enumerate(request.requirements):
        try:
            value = state.value(req.handle)
        except ResidencyError as error:
            raise ResidencyPlanError(
                f"request {request.name!r} requirement #{index} {req} is invalid: {error}"
            ) from error
        locations.setdefault(req.handle, []).append(req)
        if value.replica_mode is ReplicaMode.EXCLUSIVE and len(locations[req.handle]) > 1:
            listed = ", ".join(str(r) for r in locations[req.handle])
            raise ResidencyPlanError(
                f"request {request.name!r} names EXCLUSIVE {req.handle} in several requirements "
                f"({listed}); several locations for one value are simultaneous postconditions, "
                "valid only for a REPLICABLE value: keep one requirement (with fallbacks for "
                "alternatives) or register the value REPLICABLE"
            )


def _enter_actions(placements: Sequence[Placement]) -> list[Materialize]:
    seen: set[tuple[ValueHandle, Location]] = set()
    actions: list[Materialize] = []
    for placement in placements:
        key = (placement.requirement.handle, placement.location)
        if key not in seen:
            seen.add(key)
            actions.append(Materialize(*key))
    return actions


@dataclass(frozen=True, slots=True)
class _Profile:
    need: dict[Location, int]
    failure: str | None
    # Per location, the values whose rebuild passes through it (their source_location) on the
    # way to another endpoint, with the temporary charge each holds there: part of ``need``
    # that the request did not name, so an infeasibility there says what it is.
    temporary: dict[Location, list[tuple[ValueHandle, int, Location]]] = field(default_factory=dict)


def _enter_profile(
    state: ResidencyState, request: ResidencyRequest, actions: Sequence[Materialize]
) -> _Profile:
    """How far above its starting charge each location peaks while the request's reservations
    are admitted and its ``enter`` actions run (on a budget-free partial copy)."""
    sim = state.clone([a.handle for a in actions])
    for loc in sim.locations():
        sim.ledger(loc).budget_bytes = None
    start = {loc: sim.ledger(loc).charged_bytes for loc in sim.locations()}
    peak = dict(start)
    temporary: dict[Location, list[tuple[ValueHandle, int, Location]]] = {}

    def watch(transition: Any) -> None:
        loc = transition.location
        if transition.kind == "rebuild_temp" and loc is not None:
            temporary.setdefault(loc, []).append(
                (transition.handle, transition.nbytes, transition.destination)
            )
        if loc is not None:
            charged = sim.ledger(loc).charged_bytes
            if charged > peak.get(loc, 0):
                peak[loc] = charged

    for action in actions:
        mat = sim.value(action.handle).materializations.get(action.location)
        if mat is not None and mat.state is _OUTGOING:
            return _Profile(
                {},
                f"{action.handle} is moving out of {action.location} (a transfer in flight); "
                "decide again once it completes",
            )
    sim.observers.append(watch)
    try:
        for reservation in request.reservations:
            sim.reserve(reservation.name, reservation.location, reservation.nbytes)
        simulate_requests(sim, run_phase(sim, "enter", actions))
    except ActionFailed as failed:
        return _Profile({}, f"{actions[failed.index]} cannot run: {failed.cause}")
    except (ResidencyError, ValueError) as error:
        return _Profile({}, str(error))
    finally:
        # (watch refers to sim: left subscribed, the two would be a cycle that only the
        # garbage collector frees, once per decision)
        sim.observers.clear()
    need = {loc: peak[loc] - start.get(loc, 0) for loc in peak if peak[loc] > start.get(loc, 0)}
    return _Profile(need, None, temporary)


def simulate_entry(state: ResidencyState, plan: ResidencyPlan) -> ResidencyState:
    """A partial copy of ``state`` after ``plan``'s reclaim, reserve and enter phases, as a
    scope body would see it (every transfer succeeds, every pending event completes).

    Raises what the phases raise (``ActionFailed``, ``ResidencyError``) when the plan cannot
    run. Used to check that every requested endpoint is in the simulated final state."""
    sim = state.clone(plan.handles())
    simulate_requests(sim, run_phase(sim, "reclaim", plan.reclaim))
    for reservation in plan.reserve:
        sim.reserve(reservation.name, reservation.location, reservation.nbytes)
    simulate_requests(sim, run_phase(sim, "enter", plan.enter))
    return sim


# --------------------------------------------------------------------------- streams


class _Item:
    """One candidate as the search sees it."""

    __slots__ = (
        "charge",
        "cls_replicas",
        "density",
        "droppable",
        "handle",
        "options",
        "position",
        "weight",
    )

    def __init__(
        self,
        handle: ValueHandle,
        charge: int,
        weight: float,
        density: float,
        options: list[tuple[float, int, Location | None]],
        replicas: int,
        droppable: bool,
        position: int,
    ) -> None:
        self.handle = handle
        self.charge = charge
        self.weight = weight
        self.density = density
        self.options = options  # (cost seconds, rank, destination or None = release)
        self.cls_replicas = replicas  # other resident replicas (0: the only resident copy)
        self.droppable = droppable
        self.position = position


class _VictimQueue:
    """A location's eviction candidates, merged across classes in increasing cost per byte,
    produced on demand; prefix sums of charge, cost, density and releasable charge for the
    bounds."""

    def __init__(
        self,
        location: Location,
        candidates: LocationCandidates | None,
        excluded: set[ValueHandle],
        index: CandidateIndex,
        cost: CostModel,
        state_version: int,
    ) -> None:
        self.location = location
        self.cost = cost
        self.now = state_version
        self.excluded = excluded
        self.items: list[_Item] = []
        self.pc: list[int] = [0]
        self.pcost: list[float] = [0.0]
        self.pdens: list[float] = [0.0]
        self.prel: list[int] = [0]
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.buckets: list[Bucket] = []
        self.coeffs: list[list[tuple[float, float, Location | None, int]]] = []
        total = rel_total = 0
        if candidates is not None:
            ordered = sorted(candidates.buckets.values(), key=lambda b: b.cls.sort_key())
            for rank, bucket in enumerate(ordered):
                self.buckets.append(bucket)
                self.coeffs.append(self._coefficients(bucket))
                total += bucket.total_bytes
                if bucket.cls.releasable:
                    rel_total += bucket.total_bytes
                self._push(rank, 0)
            self.cmin, self.cmax = candidates.charge_range()
            for handle in excluded:
                for loc, cls, entry in index.entries_of(handle):
                    if loc == location:
                        total -= entry[3]
                        if cls.releasable:
                            rel_total -= entry[3]
        else:
            self.cmin = self.cmax = 0
        self.total = total
        self.rel_total = rel_total
        self.exhausted = not self.heap

    def _coefficients(self, bucket: Bucket) -> list[tuple[float, float, Location | None, int]]:
        cls = bucket.cls
        loc = self.location
        if cls.replicas:
            return [(0.0, self.cost.release_restore(loc, cls.replicas, cls.source), None, 0)]
        out: list[tuple[float, float, Location | None, int]] = []
        if cls.droppable:
            out.append((0.0, self.cost.release_restore(loc, (), cls.source), None, 0))
        for rank, destination in enumerate(cls.moves, 1):
            now, restore = self.cost.move_coefficients(loc, destination)
            out.append((now, restore, destination, rank))
        return out

    def _push(self, rank: int, pos: int) -> None:
        entries = self.buckets[rank].entries
        excluded = self.excluded
        while pos < len(entries) and entries[pos][2] in excluded:
            pos += 1
        if pos >= len(entries):
            return
        last_used, value_id = entries[pos][0], entries[pos][1]
        weight = self.cost.reuse_weight(last_used, self.now)
        density = min(now + weight * restore for now, restore, _, _ in self.coeffs[rank])
        heapq.heappush(self.heap, (density, rank, last_used, value_id, pos))

    def _extend(self) -> None:
        density, rank, last_used, _, pos = heapq.heappop(self.heap)
        _, _, handle, charge = self.buckets[rank].entries[pos]
        self._push(rank, pos + 1)
        self.exhausted = not self.heap
        weight = self.cost.reuse_weight(last_used, self.now)
        options = sorted(
            (CostModel.option_seconds(charge, now, restore, weight), orank, destination)
            for now, restore, destination, orank in self.coeffs[rank]
        )
        cls = self.buckets[rank].cls
        item = _Item(
            handle,
            charge,
            weight,
            density,
            [(c, r, d) for c, r, d in options],
            len(cls.replicas),
            cls.droppable,
            len(self.items),
        )
        self.items.append(item)
        self.pc.append(self.pc[-1] + charge)
        self.pcost.append(self.pcost[-1] + charge * density)
        self.pdens.append(self.pdens[-1] + density)
        self.prel.append(self.prel[-1] + (charge if (cls.replicas or cls.droppable) else 0))

    def item(self, i: int) -> _Item | None:
        while len(self.items) <= i and not self.exhausted:
            self._extend()
        return self.items[i] if i < len(self.items) else None

    def lower_bound(self, i: int, need: int) -> float:
        """A lower bound on the cost of evicting ``need`` bytes from the candidates at ``i`` and
        after; ``inf`` when they cannot cover it."""
        if need <= 0:
            return 0.0
        pc = self.pc
        target = pc[i] + need
        while pc[-1] < target and not self.exhausted:
            self._extend()
        if pc[-1] < target:
            return math.inf
        j = bisect.bisect_left(pc, target)
        fractional = (
            self.pcost[j - 1] - self.pcost[i] + (target - pc[j - 1]) * self.items[j - 1].density
        )
        count = -(-need // self.cmax)
        while len(self.items) < i + count and not self.exhausted:
            self._extend()
        if len(self.items) < i + count:
            return math.inf
        by_count = self.cmin * (self.pdens[i + count] - self.pdens[i])
        return max(fractional, by_count)


@dataclass(slots=True)
class _LocationNeed:
    """What one location must free for a placement, and the queue of victims to free it."""

    location: Location
    budget: int
    charged: int
    need: int
    start_a: int  # charged - budget: room for moves in (<= 0: that much free)
    start_b: int  # charged + need - budget: what reclaim must free
    victims: _VictimQueue


# ---------------------------------------------------------------------------- search


_Choice = tuple[int, _Item, tuple[float, int, Location | None]]


class _Search:
    """One decision's search state across placements (see the module docstring)."""

    def __init__(
        self,
        state: ResidencyState,
        request: ResidencyRequest,
        graph: FallbackGraph,
        cost: CostModel,
        index: CandidateIndex,
        limit: int,
        slicer: Slicer | None,
        optimality_gap: float = 0.0,
    ) -> None:
        self.state = state
        # A node survives only if it could beat the best plan by more than the gap.
        self.keep_fraction = 1.0 - optimality_gap
        self.request = request
        self.graph = graph
        self.cost = cost
        self.index = index
        self.limit = limit
        self.slicer = slicer
        self.explored = 0
        self.excluded = set(request.handles())
        self.streams: dict[Location, _VictimQueue] = {}
        self.ledgers = {loc: state.ledger(loc) for loc in state.locations()}
        self.placement_text = ""
        self.best_cost = math.inf
        self.best: list[_Choice] | None = None
        self._group_of: dict[Location, int] = {}

    def stream(self, location: Location) -> _VictimQueue:
        stream = self.streams.get(location)
        if stream is None:
            stream = self.streams[location] = _VictimQueue(
                location,
                self.index.locations.get(location),
                self.excluded,
                self.index,
                self.cost,
                self.state.state_version,
            )
        return stream

    def budget(self, location: Location) -> int | None:
        ledger = self.ledgers.get(location)
        return None if ledger is None else ledger.budget_bytes

    def groups(self, need: dict[Location, int]) -> list[_LocationNeed]:
        """Locations short of bytes plus the budgeted tiers their victims may move to, in
        topological order of the fallback graph."""
        members: set[Location] = set()
        for loc, ledger in self.ledgers.items():
            budget = ledger.budget_bytes
            if budget is not None and ledger.charged_bytes + need.get(loc, 0) > budget:
                members.add(loc)
        if not members:
            return []
        frontier = sorted(members)
        while frontier:
            loc = frontier.pop()
            for destination in self.graph.destinations(loc):
                if destination not in members and self.budget(destination) is not None:
                    members.add(destination)
                    frontier.append(destination)
        indegree = {loc: 0 for loc in members}
        for loc in members:
            for destination in self.graph.destinations(loc):
                if destination in members:
                    indegree[destination] += 1
        ready = sorted((loc for loc, d in indegree.items() if d == 0), reverse=True)
        order: list[Location] = []
        while ready:
            loc = ready.pop()
            order.append(loc)
            for destination in self.graph.destinations(loc):
                if destination in members:
                    indegree[destination] -= 1
                    if indegree[destination] == 0:
                        ready.append(destination)
                        ready.sort(reverse=True)
        groups: list[_LocationNeed] = []
        for loc in order:
            ledger = self.ledgers[loc]
            budget = ledger.budget_bytes
            assert budget is not None
            charged = ledger.charged_bytes
            extra = need.get(loc, 0)
            groups.append(
                _LocationNeed(
                    loc,
                    budget,
                    charged,
                    extra,
                    charged - budget,
                    charged + extra - budget,
                    self.stream(loc),
                )
            )
        return groups

    def _limit_error(self) -> ResidencySearchLimitError:
        if self.best is None:
            found = "no feasible plan found yet"
        else:
            found = (
                f"best plan so far: {len(self.best)} eviction(s), est. {_ms(self.best_cost)}, "
                "not proven cheapest"
            )
        return ResidencySearchLimitError(
            self.request.name,
            self.limit,
            self.explored,
            f"while placing {self.placement_text or 'the request'}; {found}",
            plan_found=self.best is not None,
        )

    def count_node(self) -> None:
        if self.explored >= self.limit:
            raise self._limit_error()
        self.explored += 1

    def branch_and_bound(self, groups: list[_LocationNeed]) -> Generator[None, None, None]:
        """Search eviction sets for ``groups``; leaves the cheapest in ``self.best``."""
        self.best = None
        self.best_cost = math.inf
        ngroups = len(groups)
        streams = [g.victims for g in groups]
        start_a = [g.start_a for g in groups]
        start_b = [g.start_b for g in groups]
        group_of = {g.location: k for k, g in enumerate(groups)}
        self._group_of = group_of
        rel = [0] * ngroups
        out = [0] * ngroups
        inn = [0] * ngroups
        chosen: list[_Choice] = []
        released: dict[int, int] = {}  # value_id -> replicas released (multi-replica values)
        memo: dict[tuple[Any, ...], float] = {}
        slicer = self.slicer
        keep: tuple[float, int, Location | None] = (0.0, -1, None)
        # A frame: [group, position, cost, options (None until visited), next option, applied]
        stack: list[list[Any]] = [[0, 0, 0.0, None, 0, None]]
        while stack:
            frame = stack[-1]
            if frame[3] is None:
                self.count_node()
                if slicer is not None and self.explored % _CLOCK_EVERY == 0 and slicer():
                    yield
                options = self._visit(
                    frame, streams, start_a, start_b, rel, out, inn, chosen, released, memo
                )
                if options is None:
                    stack.pop()
                    self._undo(frame[5], rel, out, inn, chosen, released, group_of)
                    continue
                options.append(keep)
                frame[3] = options
                frame[4] = 0
            options = frame[3]
            if frame[4] < len(options):
                option = options[frame[4]]
                frame[4] += 1
                g, i = frame[0], frame[1]
                item = streams[g].items[i]
                applied = None if option is keep else (g, item, option)
                if applied is not None:
                    self._apply(applied, rel, out, inn, chosen, released, group_of)
                stack.append([g, i + 1, frame[2] + option[0], None, 0, applied])
            else:
                stack.pop()
                self._undo(frame[5], rel, out, inn, chosen, released, group_of)

    def _visit(
        self,
        frame: list[Any],
        streams: list[_VictimQueue],
        start_a: list[int],
        start_b: list[int],
        rel: list[int],
        out: list[int],
        inn: list[int],
        chosen: list[_Choice],
        released: dict[int, int],
        memo: dict[tuple[Any, ...], float],
    ) -> list[tuple[float, int, Location | None]] | None:
        """Visit a node: None when it is a leaf or pruned, else the options of its candidate."""
        g, i, cost = frame[0], frame[1], frame[2]
        ngroups = len(streams)
        a = b = 0
        while g < ngroups:
            a = start_a[g] + inn[g] - rel[g]
            b = start_b[g] + inn[g] - rel[g] - out[g]
            if a <= 0 and b <= 0:
                g += 1
                i = 0
                continue
            break
        if g == ngroups:
            if cost < self.best_cost:
                self.best_cost = cost
                self.best = list(chosen)
            return None
        frame[0], frame[1] = g, i
        stream = streams[g]
        if b > stream.total - stream.pc[i] or a > stream.rel_total - stream.prel[i]:
            return None
        bound = stream.lower_bound(i, a if a > b else b)
        for h in range(g + 1, ngroups):
            ah = start_a[h] + inn[h]
            bh = start_b[h] + inn[h]
            if ah > 0 or bh > 0:
                later = streams[h]
                if bh > later.total or ah > later.rel_total:
                    return None
                bound += later.lower_bound(0, ah if ah > bh else bh)
        if (cost + bound) * _LB_SLACK >= self.best_cost * self.keep_fraction:
            return None
        key = (
            g,
            i,
            a if a > 0 else 0,
            b if b > 0 else 0,
            tuple(inn[g + 1 :]),
            tuple(sorted(released.items())) if released else (),
        )
        seen = memo.get(key)
        if seen is not None and seen <= cost:
            return None
        memo[key] = cost
        item = stream.item(i)
        if item is None:
            return None
        options: list[tuple[float, int, Location | None]] = []
        for option in item.options:
            destination = option[2]
            if destination is None:
                if (
                    item.cls_replicas
                    and not item.droppable
                    and released.get(item.handle.value_id, 0) + 1 > item.cls_replicas
                ):
                    continue  # releasing every resident replica would lose the value
            else:
                d = self._group_of.get(destination, -1)
                if d >= 0 and start_a[d] + inn[d] + item.charge > streams[d].rel_total:
                    continue  # the tier could never make room for it during reclaim
            options.append(option)
        return options

    @staticmethod
    def _apply(
        applied: _Choice,
        rel: list[int],
        out: list[int],
        inn: list[int],
        chosen: list[_Choice],
        released: dict[int, int],
        group_of: dict[Location, int],
    ) -> None:
        g, item, option = applied
        destination = option[2]
        if destination is None:
            rel[g] += item.charge
            if item.cls_replicas:
                vid = item.handle.value_id
                released[vid] = released.get(vid, 0) + 1
        else:
            out[g] += item.charge
            d = group_of.get(destination, -1)
            if d >= 0:
                inn[d] += item.charge
        chosen.append(applied)

    @staticmethod
    def _undo(
        applied: _Choice | None,
        rel: list[int],
        out: list[int],
        inn: list[int],
        chosen: list[_Choice],
        released: dict[int, int],
        group_of: dict[Location, int],
    ) -> None:
        if applied is None:
            return
        g, item, option = applied
        destination = option[2]
        if destination is None:
            rel[g] -= item.charge
            if item.cls_replicas:
                vid = item.handle.value_id
                left = released[vid] - 1
                if left:
                    released[vid] = left
                else:
                    del released[vid]
        else:
            out[g] -= item.charge
            d = group_of.get(destination, -1)
            if d >= 0:
                inn[d] -= item.charge
        popped = chosen.pop()
        assert popped is applied

    # ------------------------------------------------------------ evidence

    def diagnose(
        self,
        groups: list[_LocationNeed],
        temporary: dict[Location, list[tuple[ValueHandle, int, Location]]] | None = None,
    ) -> str:
        """Why no eviction set fits (the placement's groups are known to be short).
        ``temporary``: the rebuilds' temporary charges per source location (see
        :class:`_Profile`), named where a short location holds one."""
        parts: list[str] = []
        cascade = [g for g in groups if g.start_b <= 0]
        for group in groups:
            if group.start_b <= 0:
                continue
            loc = group.location
            ledger = self.ledgers[loc]
            short = group.start_b
            protected = in_flight = own = stuck = protected_count = 0
            protected_names: list[str] = []
            evictable = group.victims.total
            for value in self.state.values():
                mat = value.materializations.get(loc)
                if mat is None:
                    continue
                if value.handle in self.excluded:
                    own += mat.charged_bytes
                elif mat.state is not _RESIDENT:
                    in_flight += mat.charged_bytes
                elif mat.use_count or mat.hold_count or mat.pending_event_count:
                    protected += mat.charged_bytes
                    protected_count += 1
                    if len(protected_names) < 5:
                        protected_names.append(f"{_label(value.handle)} ({_protection(mat)})")
            stuck = max(0, ledger.used_bytes - evictable - protected - in_flight - own)
            text = (
                f"{loc} is {format_bytes(short)} short (budget {format_bytes(group.budget)}, "
                f"used {format_bytes(ledger.used_bytes)}, reserved "
                f"{format_bytes(ledger.reserved_bytes)}, and the request adds "
                f"{format_bytes(group.need)} at its peak"
            )
            loads = (temporary or {}).get(loc)
            if loads:
                # Bytes the request did not name at this location: a rebuild passes through it.
                names = ", ".join(f"{_label(h)} on its way to {dst}" for h, _, dst in loads)
                text += (
                    f", {format_bytes(sum(n for _, n, _ in loads))} of it temporary "
                    f"reconstruction storage at the source_location of {names}"
                )
            text += ")"
            if evictable >= short:
                tiers = "; ".join(
                    f"{g.location} has {format_bytes(max(0, -g.start_a))} free and "
                    f"{format_bytes(g.victims.rel_total)} releasable"
                    for g in cascade
                )
                text += (
                    f": its evictable values ({format_bytes(evictable)}) would cover that, but "
                    "no choice of victims fits their fallback tiers (a move needs room at its "
                    "tier when the reclaim phase begins)" + (f" ({tiers})" if tiers else "")
                )
            elif evictable + protected >= short:
                names = ", ".join(protected_names)
                more = f" and {protected_count - 5} more" if protected_count > 5 else ""
                text += (
                    f": only {format_bytes(evictable)} is evictable and "
                    f"{format_bytes(protected)} more is protected by active uses, holds or "
                    f"pending events ({names}{more}); infeasible because of protections: the "
                    "controller never waits for protected values; end those leases or holds, "
                    "or decide again after their events complete"
                )
            else:
                missing = short - evictable
                text += (
                    f": even evicting everything evictable ({format_bytes(evictable)}) leaves "
                    f"{format_bytes(missing)} missing (protected {format_bytes(protected)}, in "
                    f"flight {format_bytes(in_flight)}, needed by the request itself "
                    f"{format_bytes(own)}, without a source or a fallback tier "
                    f"{format_bytes(stuck)}); reduce the request or raise the budget"
                )
            parts.append(text)
        return "; ".join(parts) if parts else "no eviction set fits the fallback tiers"

    def eviction_records(
        self, groups: list[_LocationNeed], choices: list[_Choice]
    ) -> tuple[list[Eviction], list[Release | Move]]:
        def order(choice: _Choice) -> tuple[int, int, int]:
            g, item, option = choice
            return (0 if option[2] is None else 1, g, item.position)

        evictions: list[Eviction] = []
        actions: list[Release | Move] = []
        moved_in: dict[Location, list[str]] = {}
        for g, _, option in choices:
            if option[2] is not None:
                moved_in.setdefault(option[2], []).append(str(groups[g].location))
        for g, item, option in sorted(choices, key=order):
            group = groups[g]
            loc = group.location
            cost_seconds, rank, destination = option
            if group.start_b > 0:
                why = (
                    f"{loc} is {format_bytes(group.start_b)} short for request "
                    f"{self.request.name!r}"
                )
            else:
                sources = ", ".join(sorted(set(moved_in.get(loc, []))))
                why = f"{loc} must make room for victims moved there from {sources}"
            value = self.state.value(item.handle)
            if destination is not None:
                how = f"moved to {destination} (fallback tier {rank} of {loc})"
                actions.append(Move(item.handle, destination))
            elif item.cls_replicas:
                others = sorted(
                    str(other)
                    for other, mat in value.materializations.items()
                    if other != loc and mat.state is _RESIDENT
                )
                how = f"released: a replica stays resident at {', '.join(others)}"
                actions.append(Release(item.handle, loc))
            else:
                how = (
                    f"dropped: it has a source and is rebuilt from it (via "
                    f"{value.source_location}) when needed"
                )
                actions.append(Release(item.handle, loc))
            evictions.append(
                Eviction(
                    item.handle,
                    loc,
                    item.charge,
                    destination,
                    f"{why}; {how}; est. {_ms(cost_seconds)} with reuse weight "
                    f"{item.weight:.3g} (lowest-cost choice)",
                    estimated_seconds=cost_seconds,
                )
            )
        return evictions, actions


def iter_decide(
    state: ResidencyState,
    request: ResidencyRequest,
    *,
    graph: FallbackGraph | None = None,
    cost_model: CostModel | None = None,
    search_state_limit: int = DEFAULT_SEARCH_STATE_LIMIT,
    index: CandidateIndex | None = None,
    slicer: Slicer | None = None,
    verify: bool = False,
    optimality_gap: float = DEFAULT_OPTIMALITY_GAP,
) -> Generator[None, None, ResidencyDecision]:
    """The search as a generator: it yields whenever ``slicer()`` says the current slice is used
    up (never, without a slicer) and returns the decision. The caller must not let the state
    change while the generator is suspended (the controller restarts the search instead).

    ``index``: a candidate index attached to ``state`` (refreshed here); without one, a fresh
    index is built. ``verify``: also check, on a simulated copy, that every requested endpoint
    is present after entry (``explain_plan`` runs in any case). ``optimality_gap``: the
    eviction cost is within this fraction of the cheapest (``0.0``: exact; it never affects
    feasibility, since only a plan already found prunes by cost). Raises ``ResidencyPlanError``
    (invalid or infeasible), ``ResidencySearchLimitError`` (bound reached, feasibility unknown).
    """
    graph = graph if graph is not None else FallbackGraph.default()
    cost = cost_model if cost_model is not None else CostModel()
    if isinstance(search_state_limit, bool) or not isinstance(search_state_limit, int):
        raise TypeError(f"search_state_limit must be an int, got {search_state_limit!r}")
    if search_state_limit < 1:
        raise ValueError(f"search_state_limit must be >= 1, got {search_state_limit}")
    check_optimality_gap(optimality_gap)
    _validate(state, request)
    if index is None:
        index = CandidateIndex(graph)
        index.state = state
        yield from index.build_steps(slicer)
    else:
        if index.state is not state:
            raise ValueError("the candidate index belongs to another state")
        if index.graph != graph:
            raise ValueError("the candidate index was built for another fallback graph")
        yield from index.refresh_steps(slicer)
    search = _Search(state, request, graph, cost, index, search_state_limit, slicer, optimality_gap)
    failures: list[tuple[str, str]] = []
    for ranks in placement_order(request):
        placements = tuple(
            Placement(req, req.alternatives[rank], rank)
            for req, rank in zip(request.requirements, ranks)
        )
        search.placement_text = ", ".join(str(p) for p in placements) or "its reservations"
        actions = _enter_actions(placements)
        if slicer is not None and slicer():
            yield
        profile = _enter_profile(state, request, actions)
        if profile.failure is not None:
            search.count_node()
            failures.append((search.placement_text, profile.failure))
            continue
        if slicer is not None and slicer():
            yield
        groups = search.groups(profile.need)
        yield from search.branch_and_bound(groups)
        if search.best is None:
            failures.append((search.placement_text, search.diagnose(groups, profile.temporary)))
            continue
        if slicer is not None and slicer():
            yield
        evictions, reclaim = search.eviction_records(groups, search.best)
        plan = ResidencyPlan(
            reclaim,
            request.reservations,
            actions,
            expected_state_version=state.state_version,
        )
        if slicer is not None and slicer():
            yield
        explanation = explain_plan(state, plan)
        _check(state, request, plan, explanation, placements, verify)
        return ResidencyDecision(
            request,
            state.state_version,
            search.explored,
            tuple(evictions),
            plan,
            explanation,
            placements=placements,
            estimated_seconds=sum(e.estimated_seconds for e in evictions),
            manager_id=state.manager_id,
        )
    raise ResidencyPlanError(_infeasible_reason(request, failures))


def check_optimality_gap(gap: float) -> float:
    if isinstance(gap, bool) or not isinstance(gap, (int, float)):
        raise TypeError(f"optimality_gap must be a number, got {gap!r}")
    if not 0.0 <= gap < 1.0:
        raise ValueError(f"optimality_gap must be in [0, 1), got {gap!r}")
    return float(gap)


def _check(
    state: ResidencyState,
    request: ResidencyRequest,
    plan: ResidencyPlan,
    explanation: PlanExplanation,
    placements: Sequence[Placement],
    verify: bool,
) -> None:
    if not explanation.feasible:
        raise ModelMismatchError(
            f"the controller's plan for request {request.name!r} failed its own check "
            f"({explanation.reason}); this is a controller bug, please report it with the "
            "snapshot"
        )
    if verify:
        sim = simulate_entry(state, plan)
        for placement in placements:
            handle = placement.requirement.handle
            if placement.location not in sim.value(handle).materializations:
                raise ModelMismatchError(
                    f"the controller's plan for request {request.name!r} does not leave "
                    f"{handle} at {placement.location}; this is a controller bug"
                )


def _infeasible_reason(request: ResidencyRequest, failures: list[tuple[str, str]]) -> str:
    head = f"request {request.name!r} is infeasible"
    if len(failures) == 1:
        return f"{head}: {failures[0][1]}"
    first, reason = failures[0]
    text = f"{head} in all {len(failures)} placements; preferred ({first}): {reason}"
    later, later_reason = failures[1]
    extra = len(failures) - 1
    return f"{text}; {extra} fallback placement(s) also infeasible, first ({later}): {later_reason}"


def decide_nowait(
    state: ResidencyState,
    request: ResidencyRequest,
    *,
    graph: FallbackGraph | None = None,
    cost_model: CostModel | None = None,
    search_state_limit: int = DEFAULT_SEARCH_STATE_LIMIT,
    index: CandidateIndex | None = None,
    verify: bool = False,
    optimality_gap: float = DEFAULT_OPTIMALITY_GAP,
) -> ResidencyDecision:
    """Derive a decision for ``request`` from ``state`` synchronously (see :func:`iter_decide`).

    Blocks the calling thread for the whole search; on the event loop use
    ``ResidencyController.decide``, which runs the same search in slices."""
    steps = iter_decide(
        state,
        request,
        graph=graph,
        cost_model=cost_model,
        search_state_limit=search_state_limit,
        index=index,
        verify=verify,
        optimality_gap=optimality_gap,
    )
    try:
        while True:
            next(steps)
    except StopIteration as done:
        decision: ResidencyDecision = done.value
        return decision
    except ModelMismatchError as error:
        raise ResidencyPlanError(str(error)) from None
