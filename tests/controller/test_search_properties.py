"""Property tests: the search against brute-force enumeration on small random states."""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller_oracle import brute_force, candidates
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aresidency.controller import (
    CandidateIndex,
    CostModel,
    FallbackGraph,
    ResidencyRequest,
    ResidencyRequirement,
    decide_nowait,
    simulate_entry,
)
from aresidency.controller.search import DEFAULT_OPTIMALITY_GAP
from aresidency.core import (
    MemoryReservation,
    ReplicaMode,
    ResidencyPlanError,
    ResidencySearchLimitError,
    ResidencyState,
)

UNIT = 512
LOCATIONS = ["cuda:0", "cuda:1", "pinned-host", "pageable-host"]
GRAPHS = [
    FallbackGraph.default(),
    FallbackGraph.default(allow_drop=False),
    FallbackGraph({"cuda:*": ["pinned-host"], "pinned-host": ["pageable-host"]}),
    FallbackGraph({"cuda:1": ["cuda:0", "pinned-host"], "cuda:0": ["pinned-host"]}),
]


@dataclass
class Scenario:
    state: ResidencyState
    request: ResidencyRequest
    graph: FallbackGraph
    cost: CostModel


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    state = ResidencyState()
    handles = []
    for i in range(draw(st.integers(1, 6))):
        mode = draw(st.sampled_from([ReplicaMode.EXCLUSIVE, ReplicaMode.REPLICABLE]))
        has_source = draw(st.booleans())
        location = draw(st.sampled_from(["cuda:0", *LOCATIONS]))
        handle = state.register(
            name=f"v{i}",
            charge_bytes=draw(st.integers(1, 3)) * UNIT,
            replica_mode=mode,
            location=location,
            has_source=has_source,
            source_location=draw(st.sampled_from(["pageable-host", "pinned-host"]))
            if has_source
            else None,
        )
        if mode is ReplicaMode.REPLICABLE and draw(st.booleans()):
            other = draw(st.sampled_from([loc for loc in LOCATIONS if loc != location]))
            state.commit_copy(state.begin_copy(handle, location, other, move=False))
        handles.append(handle)
    for _ in range(draw(st.integers(0, 6))):  # recency
        handle = draw(st.sampled_from(handles))
        first = sorted(state.value(handle).materializations)[0]
        state.lease(handle, first)
        state.unlease(handle, first)
    for handle in handles:  # protections
        kind = draw(st.sampled_from(["none"] * 5 + ["lease", "hold", "events"]))
        first = sorted(state.value(handle).materializations)[0]
        if kind == "lease":
            state.lease(handle, first)
        elif kind == "hold":
            state.hold(handle, first)
        elif kind == "events":
            state.record_events(handle, first, 1)
    requirements: list[ResidencyRequirement] = []
    for i in range(draw(st.integers(1, 2))):
        if draw(st.booleans()) or not handles:
            handle = state.register(
                name=f"new{i}",
                charge_bytes=draw(st.integers(1, 4)) * UNIT,
                replica_mode=draw(st.sampled_from(list(ReplicaMode))),
                has_source=True,
                source_location=draw(st.sampled_from(["pageable-host", "pinned-host"])),
            )
        else:
            handle = draw(st.sampled_from(handles))
        if any(r.handle == handle for r in requirements) and (
            state.value(handle).replica_mode is ReplicaMode.EXCLUSIVE
        ):
            continue
        alternatives = draw(st.permutations(LOCATIONS))[: draw(st.integers(1, 3))]
        requirements.append(ResidencyRequirement(handle, alternatives[0], alternatives[1:]))
    reservations = []
    if draw(st.booleans()):
        reservations.append(
            MemoryReservation(
                "work", draw(st.sampled_from(LOCATIONS)), draw(st.integers(0, 2)) * UNIT
            )
        )
    for location in LOCATIONS:  # budgets: at or a little above what is charged now
        if location == "cuda:0" or draw(st.integers(0, 3)):
            charged = state.ledger(location).charged_bytes
            state.set_budget(location, charged + draw(st.sampled_from([0, 0, 1, 2])) * UNIT)
    cost = CostModel(recency_half_life=draw(st.sampled_from([2.0, 8.0, 1e6])))
    return Scenario(
        state,
        ResidencyRequest("prop", requirements, reservations),
        draw(st.sampled_from(GRAPHS)),
        cost,
    )


def combinations(scenario: Scenario) -> int:
    total = 1
    for _, _, options in candidates(scenario.state, scenario.request, scenario.graph):
        total *= len(options) + 1
    return total


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_search_matches_brute_force(scenario: Scenario) -> None:
    assume(combinations(scenario) <= 1500)
    state, request = scenario.state, scenario.request
    version = state.state_version
    try:
        decision = decide_nowait(
            state,
            request,
            graph=scenario.graph,
            cost_model=scenario.cost,
            verify=True,
            optimality_gap=0.0,
        )
    except ResidencySearchLimitError:  # pragma: no cover - the states are tiny
        raise
    except ResidencyPlanError:
        decision = None
    assert state.state_version == version  # the search never mutates the state
    oracle = brute_force(state, request, scenario.graph, scenario.cost)
    assert (decision is None) == (oracle is None), (decision, oracle)
    if decision is None or oracle is None:
        return
    assert tuple(p.fallback_rank for p in decision.placements) == oracle.ranks
    assert decision.estimated_seconds <= oracle.cost * (1 + 1e-9) + 1e-18
    assert math.isclose(decision.estimated_seconds, oracle.cost, rel_tol=1e-9, abs_tol=1e-18)
    # every requested endpoint is in the simulated final state
    sim = simulate_entry(state, decision.plan)
    for placement in decision.placements:
        assert placement.location in sim.value(placement.requirement.handle).materializations
    # with the default tolerance: the same placement, within 1% of the cheapest
    default = decide_nowait(state, request, graph=scenario.graph, cost_model=scenario.cost)
    assert default.placements == decision.placements
    assert default.estimated_seconds <= oracle.cost / (1 - DEFAULT_OPTIMALITY_GAP) + 1e-18
    # protected materializations are never victims
    for eviction in decision.evictions:
        mat = state.value(eviction.handle).materializations[eviction.location]
        assert not (mat.use_count or mat.hold_count or mat.pending_event_count)
        assert eviction.handle not in request.handles()


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_search_is_deterministic_with_or_without_a_kept_index(scenario: Scenario) -> None:
    state, request = scenario.state, scenario.request
    outcomes: list[object] = []
    for index in (None, None, CandidateIndex.for_state(state, scenario.graph)):
        try:
            outcomes.append(
                decide_nowait(
                    state, request, graph=scenario.graph, cost_model=scenario.cost, index=index
                )
            )
        except ResidencyPlanError as error:
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1] == outcomes[2]
