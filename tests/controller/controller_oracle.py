"""Test helpers for the controller: small states and a brute-force oracle.

The oracle enumerates every combination of eviction options for every candidate of the state
(at every location, not only the ones the search looks at), orders the combinations by cost and
asks ``explain_plan`` — not the search's arithmetic — which is the cheapest feasible one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from aresidency.controller import CostModel, FallbackGraph, ResidencyRequest
from aresidency.controller.search import placement_order
from aresidency.core import (
    Location,
    MaterializationState,
    Materialize,
    Move,
    Release,
    ResidencyPlan,
    ResidencyState,
    ValueHandle,
    explain_plan,
)

RESIDENT = MaterializationState.RESIDENT


@dataclass(frozen=True)
class OracleAnswer:
    ranks: tuple[int, ...]
    cost: float
    evictions: tuple[tuple[ValueHandle, Location, Location | None], ...]


def option_cost(
    state: ResidencyState,
    cost: CostModel,
    handle: ValueHandle,
    location: Location,
    destination: Location | None,
) -> float:
    """The cost of one eviction, straight from the state (independent of the search's classes)."""
    value = state.value(handle)
    mat = value.materializations[location]
    weight = cost.reuse_weight(value.last_used_version, state.state_version)
    if destination is None:
        others = [
            loc
            for loc, other in value.materializations.items()
            if loc != location and other.state is RESIDENT
        ]
        source = value.source_location if value.has_source else None
        now, restore = 0.0, cost.release_restore(location, others, source)
    else:
        now, restore = cost.move_coefficients(location, destination)
    return CostModel.option_seconds(mat.charged_bytes, now, restore, weight)


def candidates(
    state: ResidencyState, request: ResidencyRequest, graph: FallbackGraph
) -> list[tuple[ValueHandle, Location, list[Location | None]]]:
    """Every (handle, location, options) the plan space allows; ``None`` = release/drop."""
    excluded = set(request.handles())
    out: list[tuple[ValueHandle, Location, list[Location | None]]] = []
    for value in sorted(state.values(), key=lambda v: v.handle.value_id):
        if value.discarded or value.handle in excluded:
            continue
        resident = [loc for loc, m in value.materializations.items() if m.state is RESIDENT]
        for loc in sorted(resident):
            mat = value.materializations[loc]
            if mat.use_count or mat.hold_count or mat.pending_event_count:
                continue
            options: list[Location | None] = []
            if len(resident) > 1:
                options.append(None)
            else:
                if value.has_source and graph.allow_drop:
                    options.append(None)
                options.extend(
                    d for d in graph.destinations(loc) if d not in value.materializations
                )
            if options:
                out.append((value.handle, loc, options))
    return out


def brute_force(
    state: ResidencyState,
    request: ResidencyRequest,
    graph: FallbackGraph,
    cost: CostModel,
) -> OracleAnswer | None:
    cands = candidates(state, request, graph)
    for ranks in placement_order(request):
        enter: list[Materialize] = []
        for req, rank in zip(request.requirements, ranks):
            action = Materialize(req.handle, req.alternatives[rank])
            if action not in enter:
                enter.append(action)
        combos: list[tuple[float, int, tuple[Location | str | None, ...]]] = []
        choices: list[list[Location | str | None]] = [["keep", *opts] for _, _, opts in cands]
        for number, combo in enumerate(itertools.product(*choices)):
            # Policy: never release every resident replica of a value that may not be dropped.
            released: dict[ValueHandle, int] = {}
            total = 0.0
            for (handle, loc, _), choice in zip(cands, combo):
                if choice == "keep":
                    continue
                destination = None if choice is None else choice
                assert not isinstance(destination, str)
                total += option_cost(state, cost, handle, loc, destination)
                if choice is None:
                    released[handle] = released.get(handle, 0) + 1
            legal = True
            for handle, count in released.items():
                value = state.value(handle)
                resident = [m for m in value.materializations.values() if m.state is RESIDENT]
                droppable = value.has_source and graph.allow_drop
                if count >= len(resident) and not droppable:
                    legal = False
            if legal:
                combos.append((total, number, combo))
        combos.sort(key=lambda c: (c[0], c[1]))
        for total, _, combo in combos:
            releases = [Release(h, loc) for (h, loc, _), c in zip(cands, combo) if c is None]
            moves = [Move(h, c) for (h, _, _), c in zip(cands, combo) if isinstance(c, Location)]
            plan = ResidencyPlan(
                [*releases, *moves],
                request.reservations,
                enter,
                expected_state_version=state.state_version,
            )
            if explain_plan(state, plan).feasible:
                evictions = tuple(
                    (h, loc, c if isinstance(c, Location) else None)
                    for (h, loc, _), c in zip(cands, combo)
                    if c != "keep"
                )
                return OracleAnswer(ranks, total, evictions)
    return None
