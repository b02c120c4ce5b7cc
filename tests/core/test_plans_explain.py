"""Plans and ``explain_plan``: validation, feasibility, the peak ledger, reconstruction, and the
property that explain predicts exactly what execution charges."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from aresidency.core import (
    Location,
    Materialize,
    MemoryReservation,
    Move,
    Release,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyState,
    ResidencyUnavailableError,
    explain_plan,
    take_snapshot,
)
from aresidency.core.plans import ActionFailed, TransferRequest, run_phase

from ._support import CUDA0, CUDA1, PAGEABLE, PINNED, execute, make_state

LOCS = [PAGEABLE, PINNED, CUDA0, CUDA1]


def explain_without_mutation(state: ResidencyState, plan: ResidencyPlan):
    """explain_plan, checking that the real state is exactly as before (peaks included)."""
    before = take_snapshot(state)
    version = state.state_version
    trace = state.trace_ring.view()
    tickets = state.open_tickets()
    explanation = explain_plan(state, plan)
    assert take_snapshot(state) == before
    assert state.state_version == version
    assert state.trace_ring.view() == trace
    assert state.open_tickets() == tickets
    assert state.observers == [] and state.recorders == []
    return explanation


def assert_ledger_adds_up(explanation) -> None:
    assert set(explanation.ledger) == set(explanation.predicted_peak_bytes)
    for loc, ledger in explanation.ledger.items():
        parts = (
            ledger.resident_bytes,
            ledger.reserved_bytes,
            ledger.destination_bytes,
            ledger.transfer_overlap_bytes,
            ledger.reconstruction_bytes,
        )
        assert all(part >= 0 for part in parts), (loc, ledger)
        assert sum(parts) == ledger.peak_bytes == explanation.predicted_peak_bytes[loc]
        assert ledger.location == loc
        assert ledger.reserved_bytes == sum(nbytes for _, nbytes in ledger.reservations)


def execute_and_compare(state: ResidencyState, plan: ResidencyPlan):
    """Explain, execute on the real model after a peak reset, and check they agree."""
    explanation = explain_without_mutation(state, plan)
    assert_ledger_adds_up(explanation)
    state.reset_peaks()
    failure = execute(state, plan)
    assert explanation.feasible == (failure is None), (explanation.reason, failure)
    if failure is not None:
        assert failure.phase == explanation.failed_phase
        assert failure.index == explanation.failed_action_index
        assert type(failure.cause) is type(explanation.blocking_error)
        assert str(failure.cause) in explanation.reason
    peaks = {loc: state.ledger(loc).peak_bytes for loc in state.locations()}
    assert peaks == dict(explanation.reached_peak_bytes)
    if failure is None:
        assert peaks == dict(explanation.predicted_peak_bytes)
    else:  # the whole plan's peak, had the budgets allowed it, is never below what it reached
        for loc, peak in explanation.predicted_peak_bytes.items():
            assert peak >= explanation.reached_peak_bytes.get(loc, 0)
    state.check_invariants()
    return explanation, failure


# ------------------------------------------------------------------------ plan validation


def test_a_plan_refuses_an_action_its_phase_does_not_take_naming_phase_and_entry():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, location=CUDA0)
    with pytest.raises(ResidencyPlanError, match=r"'reclaim' entry #1"):
        ResidencyPlan(reclaim=[Release(handle, CUDA0), Materialize(handle, CUDA1)])
    with pytest.raises(ResidencyPlanError, match=r"'enter' entry #0"):
        ResidencyPlan(enter=[Release(handle, CUDA0)])
    with pytest.raises(ResidencyPlanError, match=r"'reserve' entry #0"):
        ResidencyPlan(reserve=[Release(handle, CUDA0)])
    with pytest.raises(ResidencyPlanError, match="not a ValueHandle"):
        ResidencyPlan(enter=[Materialize("w", CUDA0)])  # type: ignore[arg-type]


def test_a_plan_refuses_a_reservation_name_twice_at_one_location_but_not_at_two():
    with pytest.raises(ResidencyPlanError, match="'kv' at cuda:0 twice"):
        ResidencyPlan(
            reserve=[MemoryReservation("kv", CUDA0, 1), MemoryReservation("kv", "cuda:0", 2)]
        )
    plan = ResidencyPlan(
        reserve=[MemoryReservation("kv", CUDA0, 1), MemoryReservation("kv", CUDA1, 2)]
    )
    assert len(plan.reserve) == 2


@pytest.mark.parametrize(
    ("name", "location", "nbytes", "error"),
    [
        ("", CUDA0, 1, ValueError),
        (None, CUDA0, 1, ValueError),
        ("kv", "gpu", 1, ValueError),
        ("kv", CUDA0, -1, ValueError),
        ("kv", CUDA0, True, TypeError),
        ("kv", CUDA0, 1.5, ValueError),  # a float size must be whole
        ("kv", CUDA0, [1], TypeError),
    ],
)
def test_memory_reservation_refuses_bad_fields(name, location, nbytes, error):
    with pytest.raises(error):
        MemoryReservation(name, location, nbytes)


def test_actions_parse_their_location_and_are_frozen():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, location=CUDA0)
    action = Move(handle, "pinned-host")
    assert action.location == Location.parse(PINNED)
    assert Materialize(handle, CUDA0) == Materialize(handle, Location.parse(CUDA0))
    with pytest.raises(AttributeError):
        action.location = Location.parse(CUDA0)  # type: ignore[misc]
    with pytest.raises(ValueError):
        Release(handle, "cuda")


def test_explain_takes_only_a_plan():
    with pytest.raises(TypeError, match="ResidencyPlan"):
        explain_plan(make_state(), [Materialize])  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- explain


def test_a_feasible_move_predicts_the_destination_charge_and_keeps_the_source_charged():
    state = make_state({CUDA0: 4096})
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    explanation, _ = execute_and_compare(state, ResidencyPlan(enter=[Materialize(handle, CUDA0)]))
    assert explanation.feasible and explanation.reason == "feasible"
    assert explanation.predicted_peak_bytes[Location.parse(CUDA0)] == 1024
    assert explanation.predicted_peak_bytes[Location.parse(PINNED)] == 1024
    cuda = explanation.ledger[Location.parse(CUDA0)]
    assert cuda.destination_bytes == 1024 and cuda.headroom_bytes == 3072
    assert cuda.value_charges == ((handle, 1024),)
    assert take_snapshot(state).value(handle).locations == (Location.parse(CUDA0),)


def test_explanations_and_snapshots_are_indexed_by_location_strings_too():
    """They print as dicts keyed by locations; ``peaks["cuda:0"]``, the natural next step, was
    ``KeyError: 'cuda:0'``. A string (or a torch.device) names the location there too."""
    import pickle

    import torch

    state = make_state({CUDA0: 4096})
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    plan = ResidencyPlan(enter=[Move(handle, CUDA0), Materialize(handle, CUDA1)])
    explanation = explain_plan(state, ResidencyPlan(enter=[Move(handle, CUDA0)]))
    peaks = explanation.predicted_peak_bytes
    assert peaks["cuda:0"] == peaks[Location.parse(CUDA0)] == peaks[torch.device("cuda:0")]
    assert explanation.ledger["cuda:0"].destination_bytes == 1024
    assert explanation.reached_peak_bytes["pinned-host"] == 1024
    assert "cuda:0" in peaks and "cuda" not in peaks and peaks.get("cuda:9") is None
    with pytest.raises(KeyError):
        peaks["cuda"]
    assert peaks == dict(peaks) and repr(peaks) == repr(dict(peaks))
    assert pickle.loads(pickle.dumps(explanation)) == explanation
    infeasible = explain_plan(state, plan)  # EXCLUSIVE at two places: refused, still a map
    assert infeasible.reached_peak_bytes["cuda:0"] == infeasible.reached_peak_bytes[CUDA0]
    snapshot = take_snapshot(state)
    assert snapshot.locations["pinned-host"].used_bytes == 1024


def test_the_peak_counts_a_moving_source_as_transfer_overlap():
    state = make_state()
    w = state.register(name="w", charge_bytes=1024, location=PINNED)
    y = state.register(name="y", charge_bytes=512, location=PAGEABLE)
    plan = ResidencyPlan(enter=[Move(w, CUDA0), Move(y, PINNED)])
    explanation, _ = execute_and_compare(state, plan)
    pinned = explanation.ledger[Location.parse(PINNED)]
    # w is still charged at pinned-host (moving out) while y is copied in
    assert (pinned.transfer_overlap_bytes, pinned.destination_bytes) == (1024, 512)
    assert pinned.peak_bytes == 1536 and pinned.peak_at == "enter"


def test_reclaim_frees_room_before_the_reservations_are_admitted():
    state = make_state({CUDA0: 2048})
    a = state.register(name="a", charge_bytes=1024, location=CUDA0)
    b = state.register(
        name="b", charge_bytes=1024, location=CUDA0, has_source=True, source_location=PAGEABLE
    )
    plan = ResidencyPlan(
        reclaim=[Move(a, PINNED), Release(b, CUDA0)],
        reserve=[MemoryReservation("kv", CUDA0, 2048)],
    )
    explanation, _ = execute_and_compare(state, plan)
    cuda = explanation.ledger[Location.parse(CUDA0)]
    assert explanation.feasible
    assert (cuda.start_bytes, cuda.reclaimed_bytes, cuda.peak_bytes) == (2048, 2048, 2048)
    assert cuda.peak_at == "start"  # the first moment the peak was reached
    # without the reclaim the same reservation does not fit
    alone = explain_without_mutation(
        state_with(2048, a=1024), ResidencyPlan(reserve=[MemoryReservation("kv", CUDA0, 2048)])
    )
    assert not alone.feasible and alone.failed_phase == "reserve"


def state_with(budget: int, **charges: int) -> ResidencyState:
    state = make_state({CUDA0: budget})
    for name, charge in charges.items():
        state.register(name=name, charge_bytes=charge, location=CUDA0)
    return state


def test_active_reservations_of_others_count_in_the_peak():
    state = make_state({CUDA0: 4096})
    state.reserve("someone-else", CUDA0, 3072)
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    explanation, _ = execute_and_compare(state, ResidencyPlan(enter=[Move(handle, CUDA0)]))
    cuda = explanation.ledger[Location.parse(CUDA0)]
    assert (cuda.reserved_bytes, cuda.destination_bytes, cuda.peak_bytes) == (3072, 1024, 4096)


def test_an_infeasible_plan_names_the_location_and_the_bytes():
    state = make_state({CUDA0: 2048})
    state.reserve("ws", CUDA0, 1536)
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    explanation, failure = execute_and_compare(
        state, ResidencyPlan(enter=[Materialize(handle, CUDA0)])
    )
    assert not explanation.feasible and failure is not None
    assert "infeasible at enter #0" in explanation.reason
    assert "cuda:0" in explanation.reason
    for number in ("2048", "1536", "1024"):
        assert number in explanation.reason
    error = explanation.blocking_error
    assert isinstance(error, ResidencyBudgetError)
    assert (error.budget_bytes, error.reserved_bytes, error.requested_bytes) == (2048, 1536, 1024)
    assert (explanation.failed_phase, explanation.failed_action_index) == ("enter", 0)
    # the blocking reservation belongs to someone else and will end: worth waiting for
    assert explanation.transient


def test_a_plan_blocked_by_a_hold_is_infeasible_now_but_transient():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, location=CUDA0, has_source=True, source_location=PAGEABLE
    )
    state.hold(handle, CUDA0)
    explanation = explain_without_mutation(state, ResidencyPlan(reclaim=[Release(handle, CUDA0)]))
    assert not explanation.feasible
    assert isinstance(explanation.blocking_error, ResidencyInUseError)
    assert explanation.transient


def test_a_plan_that_could_never_fit_is_not_transient():
    state = make_state({CUDA0: 1024})
    handle = state.register(name="w", charge_bytes=2048, location=PINNED)
    explanation = explain_without_mutation(state, ResidencyPlan(enter=[Move(handle, CUDA0)]))
    assert not explanation.feasible and not explanation.transient


def test_a_plan_naming_a_foreign_or_discarded_handle_is_infeasible_and_changes_nothing():
    state = make_state()
    foreign = make_state(manager_id="m-other").register(name="f", charge_bytes=512, location=CUDA0)
    gone = state.register(name="g", charge_bytes=512, location=CUDA0)
    state.discard(gone)
    for handle in (foreign, gone):
        explanation = explain_without_mutation(
            state, ResidencyPlan(enter=[Materialize(handle, CUDA1)])
        )
        assert not explanation.feasible
        assert isinstance(explanation.blocking_error, ResidencyUnavailableError)


def test_releasing_the_last_copy_without_a_source_is_infeasible():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, location=CUDA0)
    explanation, _ = execute_and_compare(state, ResidencyPlan(reclaim=[Release(handle, CUDA0)]))
    assert not explanation.feasible and "last copy" in explanation.reason


def test_a_release_waits_for_pending_consumer_events_in_the_plan():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, location=CUDA0, has_source=True, source_location=PAGEABLE
    )
    state.record_events(handle, CUDA0, 2)
    explanation, failure = execute_and_compare(
        state, ResidencyPlan(reclaim=[Release(handle, CUDA0)])
    )
    assert explanation.feasible and failure is None
    assert take_snapshot(state).value(handle).materializations == ()


def test_releasing_the_source_of_a_copy_begun_in_the_same_phase_is_in_use_not_a_crash():
    state = make_state()
    handle = state.register(
        name="v",
        charge_bytes=512,
        location=PINNED,
        replica_mode=ReplicaMode.REPLICABLE,
        has_source=True,
        source_location=PAGEABLE,
    )
    plan = ResidencyPlan(exit=[Materialize(handle, PAGEABLE), Release(handle, PINNED)])
    explanation, failure = execute_and_compare(state, plan)
    assert not explanation.feasible and failure is not None
    assert isinstance(explanation.blocking_error, ResidencyInUseError)
    assert (explanation.failed_phase, explanation.failed_action_index) == ("exit", 1)
    # the copy that was begun still completed; nothing was lost
    snap = take_snapshot(state)
    assert snap.value(handle).locations == (Location.parse(PAGEABLE), Location.parse(PINNED))
    assert all(m.pending_event_count == 0 for m in snap.value(handle).materializations)


def test_a_copy_and_a_move_out_of_one_replica_in_one_phase_commit_copy_first():
    state = make_state()
    handle = state.register(
        name="v", charge_bytes=512, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    plan = ResidencyPlan(enter=[Materialize(handle, CUDA0), Move(handle, CUDA1)])
    explanation, failure = execute_and_compare(state, plan)
    assert explanation.feasible and failure is None
    snap = take_snapshot(state)
    assert snap.value(handle).locations == (Location.parse(CUDA0), Location.parse(CUDA1))
    kinds = [t.kind for t in state.trace_ring.view().transitions if t.kind.endswith("commit")]
    assert kinds[-2:] == ["copy_commit", "move_commit"]
    assert not any(t.kind == "event_reaped" for t in state.trace_ring.view().transitions)


def test_a_move_out_of_a_replica_that_a_copy_in_flight_elsewhere_reads_waits_for_that_copy():
    state = make_state()
    handle = state.register(
        name="v", charge_bytes=512, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    state.begin_copy(handle, PINNED, CUDA0, move=False)  # someone else's transfer
    explanation, failure = execute_and_compare(state, ResidencyPlan(exit=[Move(handle, PAGEABLE)]))
    assert explanation.feasible and failure is None
    assert take_snapshot(state).value(handle).locations == (
        Location.parse(PAGEABLE),
        Location.parse(CUDA0),
    )
    assert state.open_tickets() == []


def test_a_move_in_the_same_phase_does_not_drop_a_replica_the_phase_asks_for():
    state = make_state()
    handle = state.register(
        name="v", charge_bytes=512, location=CUDA1, replica_mode=ReplicaMode.REPLICABLE
    )
    for plan in (
        ResidencyPlan(enter=[Materialize(handle, CUDA1), Move(handle, CUDA0)]),
        ResidencyPlan(enter=[Move(handle, PINNED), Materialize(handle, CUDA1)]),
    ):
        explanation, failure = execute_and_compare(state, plan)
        assert explanation.feasible and failure is None
        locations = take_snapshot(state).value(handle).locations
        for action in plan.enter:
            assert action.location in locations


def test_a_failed_transfer_in_a_phase_leaves_its_source_intact_and_names_the_action():
    state = make_state({CUDA0: 4096})
    stay = state.register(name="stay", charge_bytes=512, location=PINNED)
    moved = state.register(name="moved", charge_bytes=1024, location=PINNED)
    before = take_snapshot(state)
    gen = run_phase(state, "enter", [Move(stay, CUDA1), Move(moved, CUDA0)])
    request = next(gen)
    assert isinstance(request, TransferRequest) and request.action_indexes == (0, 1)
    failing = request.tickets[1].ticket_id
    with pytest.raises(ActionFailed) as info:
        gen.send({failing: OSError("copy engine fault")})
    assert info.value.index == 1 and isinstance(info.value.cause, OSError)
    snap = take_snapshot(state)
    assert snap.value(moved) == before.value(moved)  # still resident at pinned-host, unprotected
    assert snap.value(stay).locations == (Location.parse(CUDA1),)  # the other move committed
    assert snap.location(CUDA0).used_bytes == 0
    assert state.open_tickets() == []
    state.check_invariants()


# ------------------------------------------------------------------------- reconstruction


def test_reconstruction_into_cuda_charges_the_source_location_temporarily():
    state = make_state({CUDA0: 4096, PAGEABLE: 4096})
    handle = state.register(name="s", charge_bytes=1024, has_source=True, source_location=PAGEABLE)
    explanation, _ = execute_and_compare(state, ResidencyPlan(enter=[Materialize(handle, CUDA0)]))
    assert explanation.feasible
    host = explanation.ledger[Location.parse(PAGEABLE)]
    assert host.reconstruction_bytes == 1024 and host.peak_bytes == 1024
    assert explanation.predicted_peak_bytes[Location.parse(CUDA0)] == 1024
    # the temporary copy is gone afterwards
    snap = take_snapshot(state)
    assert snap.location(PAGEABLE).used_bytes == 0
    assert snap.value(handle).locations == (Location.parse(CUDA0),)
    assert [t.kind for t in state.trace_ring.view().transitions[-3:]] == [
        "rebuild_temp",
        "load_begin",
        "load_commit",
    ]


def test_reconstruction_is_infeasible_when_the_source_location_budget_is_too_small():
    state = make_state({CUDA0: 1 << 30, PAGEABLE: 4096})
    state.reserve("staging", PAGEABLE, 3584)  # 512 B left at pageable-host
    handle = state.register(name="s", charge_bytes=1024, has_source=True, source_location=PAGEABLE)
    explanation, failure = execute_and_compare(
        state, ResidencyPlan(enter=[Materialize(handle, CUDA0)])
    )
    assert not explanation.feasible and failure is not None
    error = explanation.blocking_error
    assert isinstance(error, ResidencyBudgetError)
    assert error.location == Location.parse(PAGEABLE) and error.requested_bytes == 1024
    assert "pageable-host" in explanation.reason
    assert take_snapshot(state).location(CUDA0).used_bytes == 0


def test_reconstruction_into_the_source_location_itself_is_not_temporary():
    state = make_state()
    handle = state.register(name="s", charge_bytes=1024, has_source=True, source_location=PINNED)
    explanation, _ = execute_and_compare(state, ResidencyPlan(enter=[Materialize(handle, PINNED)]))
    pinned = explanation.ledger[Location.parse(PINNED)]
    assert (pinned.reconstruction_bytes, pinned.destination_bytes) == (0, 1024)
    assert take_snapshot(state).value(handle).locations == (Location.parse(PINNED),)


def test_a_replicable_value_rebuilt_for_cuda_and_wanted_at_its_source_location_stays_at_both():
    state = make_state()
    handle = state.register(
        name="s",
        charge_bytes=512,
        has_source=True,
        source_location=PAGEABLE,
        replica_mode=ReplicaMode.REPLICABLE,
    )
    plan = ResidencyPlan(enter=[Materialize(handle, CUDA0), Materialize(handle, PAGEABLE)])
    explanation, _ = execute_and_compare(state, plan)
    assert explanation.feasible
    assert take_snapshot(state).value(handle).locations == (
        Location.parse(PAGEABLE),
        Location.parse(CUDA0),
    )


def test_an_exclusive_value_asked_at_two_locations_in_one_phase_is_infeasible():
    state = make_state()
    rebuilt = state.register(name="s", charge_bytes=512, has_source=True, source_location=PAGEABLE)
    resident = state.register(name="r", charge_bytes=512, location=PINNED)
    for plan in (
        ResidencyPlan(enter=[Materialize(rebuilt, CUDA0), Materialize(rebuilt, PAGEABLE)]),
        ResidencyPlan(enter=[Materialize(resident, CUDA0), Materialize(resident, PINNED)]),
    ):
        explanation, _ = execute_and_compare(state, plan)
        assert not explanation.feasible
        assert isinstance(explanation.blocking_error, ResidencyPlanError)


def test_explain_works_with_reservation_owners_and_clocks_that_cannot_be_copied():
    lock = threading.Lock()
    state = ResidencyState(clock_ns=lambda: 0 if lock else 1)
    state.reserve("scope", CUDA0, 512, owner=lock)
    handle = state.register(name="w", charge_bytes=512, location=PINNED)
    explanation = explain_without_mutation(state, ResidencyPlan(enter=[Move(handle, CUDA0)]))
    assert explanation.feasible
    assert explanation.predicted_peak_bytes[Location.parse(CUDA0)] == 1024


def test_the_same_state_and_plan_give_the_same_explanation():
    state = make_state({CUDA0: 4096})
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    plan = ResidencyPlan(
        reserve=[MemoryReservation("kv", CUDA0, 2048)], enter=[Move(handle, CUDA0)]
    )
    first, second = explain_plan(state, plan), explain_plan(state, plan)
    assert first == second


def test_an_explanation_is_hashable_as_a_frozen_record():
    """A frozen record with its peaks in a ``LocationMap``: ``hash(explanation)`` (a set of
    them, a dict keyed by them, ``functools.cache``) was ``TypeError: unhashable type:
    'LocationMap'``, while a snapshot hashed. Equal explanations hash equal now."""
    state = make_state({CUDA0: 4096})
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    plan = ResidencyPlan(
        reserve=[MemoryReservation("kv", CUDA0, 2048)], enter=[Move(handle, CUDA0)]
    )
    first, second = explain_plan(state, plan), explain_plan(state, plan)
    assert hash(first) == hash(second) and len({first, second}) == 1
    peaks = first.predicted_peak_bytes
    assert hash(peaks) == hash(second.predicted_peak_bytes) and {peaks: 1}[peaks] == 1
    other = explain_plan(state, ResidencyPlan(enter=[Move(handle, CUDA1)]))
    assert len({first, other}) == 2


# ----------------------------------------------------------------------- property: peaks

HANDLE_SLOTS = 5


@st.composite
def scenarios(draw):
    """A random state (values, replicas, protections, reservations, transfers in flight,
    tight budgets) and a random plan over its values."""
    state = make_state()
    handles = []
    for index in range(draw(st.integers(1, HANDLE_SLOTS))):
        charge = draw(st.sampled_from([512, 1024, 1536, 2048]))
        mode = draw(st.sampled_from(ReplicaMode))
        if draw(st.booleans()):
            source = draw(st.sampled_from([PAGEABLE, PINNED]))
            location = draw(st.none() | st.sampled_from(LOCS))
            handles.append(
                state.register(
                    name=f"v{index}",
                    charge_bytes=charge,
                    replica_mode=mode,
                    location=location,
                    has_source=True,
                    source_location=source,
                )
            )
        else:
            location = draw(st.sampled_from(LOCS))
            handles.append(
                state.register(
                    name=f"v{index}", charge_bytes=charge, replica_mode=mode, location=location
                )
            )
    pick = st.sampled_from(handles)
    loc = st.sampled_from(LOCS)
    for step in range(draw(st.integers(0, 8))):
        op = draw(
            st.sampled_from(
                [
                    "copy",
                    "move",
                    "load",
                    "hold",
                    "lease",
                    "events",
                    "reserve",
                    "release",
                    "discard",
                    "open-transfer",
                ]
            )
        )
        h, where, there = draw(pick), draw(loc), draw(loc)
        try:
            if op == "copy":
                state.commit_copy(state.begin_copy(h, where, there, move=False))
            elif op == "move":
                state.commit_copy(state.begin_copy(h, where, there, move=True))
            elif op == "load":
                state.commit_copy(state.begin_load(h, draw(st.none() | loc)))
            elif op == "hold":
                state.hold(h, where)
            elif op == "lease":
                state.lease(h, where, draw(st.sampled_from(["read", "write"])))
            elif op == "events":
                state.record_events(h, where, draw(st.integers(1, 2)))
            elif op == "reserve":
                state.reserve(f"r{step}", where, draw(st.integers(0, 4)) * 512)
            elif op == "release":
                state.release(h, where)
            elif op == "discard":
                state.discard(h)
            else:
                state.begin_copy(h, where, there, move=draw(st.booleans()))
        except (ResidencyError, ValueError):
            pass
    for where in LOCS:
        if draw(st.booleans()):
            headroom = draw(st.integers(0, 6)) * 512
            state.set_budget(where, state.ledger(where).charged_bytes + headroom)
    state.check_invariants()

    def actions(kinds, max_size):
        return st.lists(st.tuples(st.sampled_from(kinds), pick, loc), max_size=max_size).map(
            lambda items: [kind(h, where) for kind, h, where in items]
        )

    reservation = st.builds(
        MemoryReservation,
        st.sampled_from(["p0", "p1", "r0", "r1"]),
        loc,
        st.integers(0, 6).map(lambda k: k * 512),
    )
    reservations = st.lists(reservation, max_size=2, unique_by=lambda r: (r.name, r.location))
    plan = ResidencyPlan(
        reclaim=draw(actions([Release, Move], 3)),
        reserve=draw(reservations),
        enter=draw(actions([Materialize, Move], 3)),
        exit=draw(actions([Release, Move, Materialize], 2)),
    )
    return state, plan


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_explain_predicts_exactly_the_peaks_that_execution_charges(scenario):
    state, plan = scenario
    note(f"state before the plan: {take_snapshot(state).to_dict()}")
    note(f"open transfers: {state.open_tickets()}")
    explanation, failure = execute_and_compare(state, plan)
    if failure is None and not plan.exit:
        # every requested endpoint of the enter phase holds afterwards
        for action in plan.enter:
            assert action.location in take_snapshot(state).value(action.handle).locations, (
                action,
                explanation,
            )


def test_a_phase_closed_at_a_checkpoint_that_handed_out_copies_aborts_them_quietly():
    """A simulation may stop a phase part-way (admission's sliced ``explain`` starts again
    when the state changed): closing the runner where a checkpoint handed out copies aborts
    everything it began and raises nothing (a closed generator may not yield again)."""
    from aresidency.core.plans import Checkpoint

    state = make_state()
    handles = [state.register(name=f"v{i}", charge_bytes=512, location=PAGEABLE) for i in range(8)]
    gen = run_phase(state, "enter", [Materialize(h, CUDA0) for h in handles])
    request = next(gen)
    assert isinstance(request, Checkpoint) and request.stage == "begin" and request.issue
    assert len(state.open_tickets()) == len(request.issue)
    gen.close()  # raised "generator ignored GeneratorExit" when it carried the copies out
    assert state.open_tickets() == []
    assert take_snapshot(state).location(CUDA0).charged_bytes == 0
    state.check_invariants()
