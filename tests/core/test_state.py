"""ResidencyState: value charges, budget arithmetic, versions and trace entries per transition,
moves and copies, protection, reconstruction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aresidency.core import (
    DEFAULT_GRANULARITY,
    Location,
    MaterializationState,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyInUseError,
    ResidencyPlanError,
    ResidencyUnavailableError,
    take_snapshot,
    value_charge,
)

from ._support import CUDA0, CUDA1, PAGEABLE, PINNED, assert_refused, make_state

# ---------------------------------------------------------------------------- value charge


def test_default_granularity_is_512():
    assert DEFAULT_GRANULARITY == 512


@pytest.mark.parametrize(
    ("storage", "charge"),
    [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (4096, 4096), (4097, 4608)],
)
def test_value_charge_rounds_storage_up_to_the_granularity(storage, charge):
    assert value_charge(storage) == charge


def test_value_charge_of_empty_storage_is_one_granule_not_zero():
    assert value_charge(0) == 512


def test_value_charge_accepts_a_larger_user_charge_as_given():
    assert value_charge(1000, 5000) == 5000
    assert value_charge(1000, 1024) == 1024  # exactly the rounded size is enough


def test_value_charge_refuses_a_user_charge_below_the_rounded_storage():
    with pytest.raises(ValueError, match="1023") as info:
        value_charge(1000, 1023)
    assert "1024" in str(info.value)


def test_value_charge_uses_the_given_granularity():
    assert value_charge(1000, granularity=256) == 1024
    assert value_charge(100, granularity=4096) == 4096


@pytest.mark.parametrize("bad", [-1, 1.5, True, "512", None])
def test_value_charge_refuses_a_storage_size_that_is_not_a_byte_count(bad):
    with pytest.raises((TypeError, ValueError)):
        value_charge(bad)


@pytest.mark.parametrize("bad", [0, -512, True, 512.0])
def test_value_charge_refuses_a_user_charge_that_is_not_a_positive_byte_count(bad):
    with pytest.raises((TypeError, ValueError)):
        value_charge(100, bad)


@given(st.integers(min_value=0, max_value=1 << 40), st.integers(min_value=1, max_value=1 << 16))
def test_value_charge_is_the_smallest_granule_multiple_that_covers_the_storage(storage, gran):
    charge = value_charge(storage, granularity=gran)
    assert charge % gran == 0 and charge >= storage and charge >= gran
    assert charge - gran < max(storage, 1)


# ----------------------------------------------------------------------- budget arithmetic


def test_an_operation_that_fills_the_budget_exactly_is_admitted():
    state = make_state({CUDA0: 2048})
    state.reserve("ws", CUDA0, 512)
    state.register(name="a", charge_bytes=1024, location=CUDA0)
    state.register(name="b", charge_bytes=512, location=CUDA0)  # 1024 + 512 + 512 == 2048
    record = take_snapshot(state).location(CUDA0)
    assert (record.used_bytes, record.reserved_bytes, record.charged_bytes) == (1536, 512, 2048)


def test_one_byte_over_the_budget_is_refused_with_the_five_fields():
    state = make_state({CUDA0: 2047})
    state.reserve("ws", CUDA0, 511)
    state.register(name="a", charge_bytes=1024, location=CUDA0)
    info = assert_refused(state, lambda: state.reserve("kv", CUDA0, 513), ResidencyBudgetError)
    error = info.value
    assert error.location == Location.parse(CUDA0)
    assert (error.budget_bytes, error.used_bytes, error.reserved_bytes) == (2047, 1024, 511)
    assert error.requested_bytes == 513


def test_a_location_without_a_budget_admits_anything():
    state = make_state({CUDA0: None})
    state.register(name="a", charge_bytes=1 << 50, location=CUDA0)
    state.register(name="b", charge_bytes=1 << 50, location=PINNED)  # never configured
    assert take_snapshot(state).location(CUDA0).budget_bytes is None


@given(
    budget=st.none() | st.integers(0, 8192),
    used=st.integers(0, 4096),
    reserved=st.integers(0, 4096),
    requested=st.integers(1, 4096),
)
def test_admission_is_exactly_the_documented_formula(budget, used, reserved, requested):
    state = make_state()
    if used:
        state.register(name="u", charge_bytes=used, location=CUDA0)
    if reserved:
        state.reserve("r", CUDA0, reserved)
    state.set_budget(CUDA0, None if budget is None else max(budget, used + reserved))
    budget = state.ledger(CUDA0).budget_bytes
    admissible = budget is None or used + reserved + requested <= budget
    if admissible:
        state.reserve("new", CUDA0, requested)
        assert state.ledger(CUDA0).charged_bytes == used + reserved + requested
    else:
        error = assert_refused(
            state, lambda: state.reserve("new", CUDA0, requested), ResidencyBudgetError
        ).value
        assert (error.budget_bytes, error.used_bytes) == (budget, used)
        assert (error.reserved_bytes, error.requested_bytes) == (reserved, requested)


def test_set_budget_below_the_current_charge_is_refused_and_none_clears_it():
    state = make_state({CUDA0: 4096})
    state.register(name="a", charge_bytes=2048, location=CUDA0)
    error = assert_refused(state, lambda: state.set_budget(CUDA0, 2047), ResidencyBudgetError).value
    assert error.kind == "budget" and error.budget_bytes == 2047
    assert str(error).startswith(
        "a new budget of 2047 B (2.0 KiB) at cuda:0 is below what is already charged there: "
        "used 2048 B (2.0 KiB) + reserved 0 B = 2048 B (2.0 KiB); free 1 B there first"
    ), str(error)
    state.set_budget(CUDA0, 2048)
    state.set_budget(CUDA0, None)
    state.register(name="b", charge_bytes=1 << 40, location=CUDA0)


# ------------------------------------------------- one version and one trace entry apiece


def _prepared():
    """A state where every transition below is legal once."""
    state = make_state({CUDA0: 1 << 20})
    rep = state.register(
        name="rep", charge_bytes=1024, location=CUDA0, replica_mode=ReplicaMode.REPLICABLE
    )
    exc = state.register(name="exc", charge_bytes=512, location=PINNED)
    src = state.register(name="src", charge_bytes=512, has_source=True, source_location=PAGEABLE)
    state.reserve("old", CUDA0, 64)
    state.hold(exc, PINNED)
    state.lease(exc, PINNED)
    state.record_events(exc, PINNED, 2)
    return state, rep, exc, src


TRANSITIONS = {
    "register-resident": (
        "register",
        lambda s, r, e, x: s.register(name="n", charge_bytes=512, location=CUDA1),
    ),
    "register-source": (
        "register",
        lambda s, r, e, x: s.register(
            name="n", charge_bytes=512, has_source=True, source_location=PINNED
        ),
    ),
    "set-budget": ("budget", lambda s, r, e, x: s.set_budget(PINNED, 1 << 20)),
    "reserve": ("reserve", lambda s, r, e, x: s.reserve("ws", CUDA0, 128)),
    "unreserve": ("unreserve", lambda s, r, e, x: s.unreserve("old", CUDA0)),
    "hold": ("hold", lambda s, r, e, x: s.hold(r, CUDA0)),
    "unhold": ("unhold", lambda s, r, e, x: s.unhold(e, PINNED)),
    "lease-read": ("lease", lambda s, r, e, x: s.lease(r, CUDA0, "read")),
    "lease-write-single-replica": ("lease", lambda s, r, e, x: s.lease(r, CUDA0, "write")),
    "unlease": ("unlease", lambda s, r, e, x: s.unlease(e, PINNED)),
    "record-events": ("event_recorded", lambda s, r, e, x: s.record_events(r, CUDA0, 3)),
    "reap-events": ("event_reaped", lambda s, r, e, x: s.reap_events(e, PINNED, 2)),
    "begin-copy": ("copy_begin", lambda s, r, e, x: s.begin_copy(r, CUDA0, CUDA1, move=False)),
    "begin-move": ("move_begin", lambda s, r, e, x: s.begin_copy(r, CUDA0, CUDA1, move=True)),
    "begin-load": ("load_begin", lambda s, r, e, x: s.begin_load(x)),
    "release-with-source": ("release", lambda s, r, e, x: s.release(r, CUDA0)),
    "discard": ("discard", lambda s, r, e, x: s.discard(r)),
    "peak-reset": ("peak_reset", lambda s, r, e, x: s.reset_peak_bytes()),
    "peak-reset-one-location": ("peak_reset", lambda s, r, e, x: s.reset_peak_bytes(CUDA0)),
}


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_each_committed_transition_bumps_the_version_by_one_and_appends_one_trace_entry(name):
    state, rep, exc, src = _prepared()
    if name == "release-with-source":
        # a second replica makes the release legal
        state.commit_copy(state.begin_copy(rep, CUDA0, PINNED, move=False))
    kind, call = TRANSITIONS[name]
    version = state.state_version
    entries = len(state.trace_ring.view().transitions)
    call(state, rep, exc, src)
    assert state.state_version == version + 1
    trace = state.trace_ring.view().transitions
    assert len(trace) == entries + 1
    assert trace[-1].kind == kind
    assert trace[-1].state_version == state.state_version
    assert trace[-1].seq == trace[-2].seq + 1
    state.check_invariants()


@pytest.mark.parametrize("finish", ["commit", "abort"])
def test_committing_or_aborting_a_transfer_is_one_transition(finish):
    state, rep, _, src = _prepared()
    for ticket in (state.begin_copy(rep, CUDA0, CUDA1, move=True), state.begin_load(src)):
        version = state.state_version
        getattr(state, f"{finish}_copy")(ticket)
        assert state.state_version == version + 1
        assert state.trace_ring.view().transitions[-1].state_version == version + 1
    state.check_invariants()


def test_write_lease_on_a_replicable_value_first_invalidates_each_other_replica():
    state = make_state()
    rep = state.register(
        name="rep", charge_bytes=1024, location=CUDA0, replica_mode=ReplicaMode.REPLICABLE
    )
    for destination in (CUDA1, PINNED):
        state.commit_copy(state.begin_copy(rep, CUDA0, destination, move=False))
    version = state.state_version
    state.lease(rep, CUDA1, mode="write")
    trace = state.trace_ring.view().transitions[-3:]
    assert [t.kind for t in trace] == ["invalidate", "invalidate", "lease"]
    assert [str(t.location) for t in trace] == [PINNED, CUDA0, CUDA1]  # ordered by location
    assert [t.nbytes for t in trace] == [-1024, -1024, 0]
    assert [t.state_version for t in trace] == [version + 1, version + 2, version + 3]
    assert state.state_version == version + 3
    assert take_snapshot(state).value(rep).locations == (Location.parse(CUDA1),)
    assert state.ledger(CUDA0).used_bytes == 0 and state.ledger(PINNED).used_bytes == 0
    state.check_invariants()


def test_write_lease_is_refused_while_another_replica_is_protected_and_nothing_is_invalidated():
    state = make_state()
    rep = state.register(
        name="rep", charge_bytes=512, location=CUDA0, replica_mode=ReplicaMode.REPLICABLE
    )
    state.commit_copy(state.begin_copy(rep, CUDA0, CUDA1, move=False))
    state.commit_copy(state.begin_copy(rep, CUDA0, PINNED, move=False))
    state.hold(rep, CUDA1)
    info = assert_refused(state, lambda: state.lease(rep, PINNED, "write"), ResidencyInUseError)
    assert info.value.location == Location.parse(CUDA1) and info.value.hold_count == 1


def test_read_and_write_leases_exclude_each_other():
    state = make_state()
    handle = state.register(name="a", charge_bytes=512, location=CUDA0)
    state.lease(handle, CUDA0, "read")
    state.lease(handle, CUDA0, "read")  # readers share
    assert_refused(state, lambda: state.lease(handle, CUDA0, "write"), ResidencyInUseError)
    state.unlease(handle, CUDA0)
    state.unlease(handle, CUDA0)
    state.lease(handle, CUDA0, "write")
    assert_refused(state, lambda: state.lease(handle, CUDA0, "read"), ResidencyInUseError)
    assert_refused(state, lambda: state.lease(handle, CUDA0, "write"), ResidencyInUseError)
    state.unlease(handle, CUDA0, "write")
    state.lease(handle, CUDA0, "read")


def test_reset_peaks_is_not_a_transition():
    state = make_state()
    state.register(name="a", charge_bytes=512, location=CUDA0)
    version, entries = state.state_version, state.trace_ring.view().transitions
    state.reset_peaks()
    assert state.state_version == version
    assert state.trace_ring.view().transitions == entries


# --------------------------------------------------------------------------- moves, copies


def test_move_charges_source_and_destination_together_until_it_commits():
    state = make_state({CUDA0: 4096, PINNED: 4096})
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    state.reset_peaks()
    ticket = state.begin_copy(handle, PINNED, CUDA0, move=True)
    assert (ticket.source, ticket.destination) == (Location.parse(PINNED), Location.parse(CUDA0))
    assert ticket.nbytes == 1024 and ticket.move
    snap = take_snapshot(state)
    assert snap.location(PINNED).used_bytes == 1024
    assert snap.location(CUDA0).used_bytes == 1024
    record = snap.value(handle)
    assert record.materialization(PINNED).state is MaterializationState.OUTGOING
    assert record.materialization(PINNED).pending_event_count == 1  # the copy reads it
    assert record.materialization(CUDA0).state is MaterializationState.INCOMING
    state.commit_copy(ticket)
    snap = take_snapshot(state)
    assert snap.location(PINNED).used_bytes == 0
    assert (snap.location(CUDA0).used_bytes, snap.location(CUDA0).peak_bytes) == (1024, 1024)
    assert snap.location(PINNED).peak_bytes == 1024
    assert snap.value(handle).locations == (Location.parse(CUDA0),)
    assert snap.value(handle).materialization(CUDA0).state is MaterializationState.RESIDENT
    kinds = [(t.kind, str(t.location), t.nbytes) for t in state.trace_ring.view().transitions[-2:]]
    assert kinds == [("move_begin", CUDA0, 1024), ("move_commit", PINNED, -1024)]
    state.check_invariants()


def test_a_move_does_not_fit_where_only_the_destination_would_after_the_source_is_freed():
    # source and destination are charged together: a move within one budgeted location pool
    # needs both charges at once, even though only one remains afterwards
    state = make_state({CUDA0: 1024, CUDA1: 512})
    handle = state.register(name="w", charge_bytes=1024, location=CUDA0)
    assert_refused(
        state, lambda: state.begin_copy(handle, CUDA0, CUDA1, move=True), ResidencyBudgetError
    )


def test_abort_leaves_the_source_intact_and_the_ledger_as_before_the_begin():
    state = make_state({CUDA0: 4096})
    handle = state.register(name="w", charge_bytes=1024, location=PINNED)
    state.reserve("ws", CUDA0, 512)
    before = take_snapshot(state)
    ticket = state.begin_copy(handle, PINNED, CUDA0, move=True)
    state.abort_copy(ticket)
    after = take_snapshot(state)
    assert after.value(handle) == before.value(handle)
    for loc in before.locations:
        b, a = before.location(loc), after.location(loc)
        assert (a.used_bytes, a.reserved_bytes, a.charged_bytes, a.reservations) == (
            b.used_bytes,
            b.reserved_bytes,
            b.charged_bytes,
            b.reservations,
        )
    assert after.location(CUDA0).peak_bytes == 1536  # the attempt is in the peak
    assert after.state_version == before.state_version + 2
    assert state.trace_ring.view().transitions[-1].kind == "copy_abort"
    assert state.trace_ring.view().transitions[-1].nbytes == -1024
    assert state.open_tickets() == []
    state.check_invariants()


def test_abort_of_a_copy_leaves_the_source_resident_and_unprotected():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    state.abort_copy(state.begin_copy(handle, PINNED, CUDA0, move=False))
    record = take_snapshot(state).value(handle).materialization(PINNED)
    assert record.state is MaterializationState.RESIDENT and not record.protected


def test_a_copy_of_a_replicable_value_keeps_the_source():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    state.commit_copy(state.begin_copy(handle, PINNED, CUDA0, move=False))
    record = take_snapshot(state).value(handle)
    assert record.locations == (Location.parse(PINNED), Location.parse(CUDA0))
    assert all(not m.protected for m in record.materializations)
    assert state.trace_ring.view().transitions[-1].kind == "copy_commit"


def test_a_move_does_not_commit_while_other_readers_of_its_source_are_pending():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, location=PINNED)
    state.record_events(handle, PINNED, 2)
    ticket = state.begin_copy(handle, PINNED, CUDA0, move=True)
    info = assert_refused(state, lambda: state.commit_copy(ticket), ResidencyInUseError)
    assert info.value.pending_event_count == 2  # the two readers, not the copy itself
    state.reap_events(handle, PINNED, 2)
    state.commit_copy(ticket)
    assert take_snapshot(state).value(handle).locations == (Location.parse(CUDA0),)


def test_a_move_out_of_a_leased_or_held_materialization_is_refused():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, location=PINNED)
    state.hold(handle, PINNED)
    assert_refused(
        state, lambda: state.begin_copy(handle, PINNED, CUDA0, move=True), ResidencyInUseError
    )
    state.unhold(handle, PINNED)
    state.lease(handle, PINNED)
    assert_refused(
        state, lambda: state.begin_copy(handle, PINNED, CUDA0, move=True), ResidencyInUseError
    )


def test_an_outgoing_materialization_cannot_be_leased_held_or_copied_from():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, location=PINNED)
    state.begin_copy(handle, PINNED, CUDA0, move=True)
    assert_refused(state, lambda: state.lease(handle, PINNED), ResidencyUnavailableError)
    assert_refused(state, lambda: state.hold(handle, PINNED), ResidencyUnavailableError)
    assert_refused(
        state,
        lambda: state.begin_copy(handle, PINNED, CUDA1, move=True),
        ResidencyUnavailableError,
    )
    assert_refused(state, lambda: state.release(handle, PINNED), ResidencyInUseError)
    assert_refused(state, lambda: state.discard(handle), ResidencyInUseError)


def test_a_lease_taken_while_a_load_is_in_flight_survives_the_commit():
    # the runtime leases first and waits for the data (acquire never places: the load was
    # already begun by someone else)
    state = make_state()
    handle = state.register(
        name="w",
        charge_bytes=512,
        has_source=True,
        source_location=PAGEABLE,
        replica_mode=ReplicaMode.REPLICABLE,
    )
    ticket = state.begin_load(handle)
    state.lease(handle, PAGEABLE)
    state.hold(handle, PAGEABLE)
    state.commit_copy(ticket)
    record = take_snapshot(state).value(handle).materialization(PAGEABLE)
    assert record.state is MaterializationState.RESIDENT
    assert (record.use_count, record.hold_count) == (1, 1)
    state.check_invariants()


def test_an_aborted_load_under_a_lease_leaves_a_consistent_model():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, has_source=True, source_location=PAGEABLE)
    ticket = state.begin_load(handle)
    state.lease(handle, PAGEABLE)
    state.abort_copy(ticket)
    state.check_invariants()
    assert state.ledger(PAGEABLE).used_bytes == 0


# ------------------------------------------------------------ release, discard, recovery


def test_release_of_a_replica_frees_its_charge_and_keeps_the_other():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=1024, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    state.commit_copy(state.begin_copy(handle, PINNED, CUDA0, move=False))
    assert state.release(handle, PINNED) == 1024
    assert state.ledger(PINNED).used_bytes == 0
    assert take_snapshot(state).value(handle).locations == (Location.parse(CUDA0),)


def test_release_of_last_copy_without_source_is_refused_and_changes_nothing():
    state = make_state()
    handle = state.register(name="w", charge_bytes=1024, location=CUDA0)
    info = assert_refused(state, lambda: state.release(handle, CUDA0), ResidencyPlanError)
    assert "last copy" in str(info.value)


def test_release_of_last_copy_with_a_source_is_allowed_and_it_is_reconstructed_later():
    state = make_state({PAGEABLE: 4096})
    handle = state.register(name="w", charge_bytes=1024, has_source=True, source_location=PAGEABLE)
    assert take_snapshot(state).value(handle).materializations == ()
    state.commit_copy(state.begin_load(handle))
    state.commit_copy(state.begin_copy(handle, PAGEABLE, CUDA0, move=True))
    state.release(handle, CUDA0)
    snap = take_snapshot(state)
    assert snap.value(handle).materializations == ()
    assert snap.value(handle).has_source and snap.value(handle).recoverability == "reconstructible"
    ticket = state.begin_load(handle)  # into source_location
    assert ticket.source is None and ticket.destination == Location.parse(PAGEABLE)
    state.commit_copy(ticket)
    assert [t.kind for t in state.trace_ring.view().transitions[-2:]] == [
        "load_begin",
        "load_commit",
    ]
    state.check_invariants()


@pytest.mark.parametrize("protection", ["lease", "hold", "event"])
def test_release_of_a_protected_materialization_is_in_use_with_its_counts(protection):
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, has_source=True, source_location=PAGEABLE, location=CUDA0
    )
    {
        "lease": lambda: state.lease(handle, CUDA0),
        "hold": lambda: state.hold(handle, CUDA0),
        "event": lambda: state.record_events(handle, CUDA0, 2),
    }[protection]()
    error = assert_refused(state, lambda: state.release(handle, CUDA0), ResidencyInUseError).value
    expected = {"lease": (1, 0, 0), "hold": (0, 1, 0), "event": (0, 0, 2)}[protection]
    assert (error.use_count, error.hold_count, error.pending_event_count) == expected


def test_reaping_the_last_event_makes_the_materialization_removable():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, has_source=True, source_location=PAGEABLE, location=CUDA0
    )
    state.record_events(handle, CUDA0, 2)
    state.reap_events(handle, CUDA0)
    assert_refused(state, lambda: state.release(handle, CUDA0), ResidencyInUseError)
    state.reap_events(handle, CUDA0)
    state.release(handle, CUDA0)


def test_discard_frees_every_materialization_and_the_handle_is_then_unusable():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    state.commit_copy(state.begin_copy(handle, PINNED, CUDA0, move=False))
    assert state.discard(handle) == 1024
    assert state.ledger(PINNED).used_bytes == state.ledger(CUDA0).used_bytes == 0
    # A discarded value leaves the state (a long-running manager must not grow).
    assert handle not in take_snapshot(state).values
    assert state.find_value(handle) is None
    with pytest.raises(ResidencyUnavailableError, match="discarded"):
        state.lease(handle, PINNED)
    state.check_invariants()


def test_a_rebuild_elsewhere_charges_the_source_location_temporarily_in_two_transitions():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, has_source=True, source_location=PAGEABLE)
    version = state.state_version
    ticket = state.begin_load(handle, CUDA0)
    assert ticket.source is None and ticket.via == Location.parse(PAGEABLE)
    trace = state.trace_ring.view().transitions[-2:]
    assert [(t.kind, str(t.location), t.nbytes) for t in trace] == [
        ("rebuild_temp", PAGEABLE, 512),
        ("load_begin", CUDA0, 512),
    ]
    assert state.state_version == version + 2
    assert state.ledger(CUDA0).used_bytes == 512
    assert state.ledger(PAGEABLE).used_bytes == 512  # no materialization there, only the charge
    assert take_snapshot(state).value(handle).locations == (Location.parse(CUDA0),)
    state.check_invariants()
    state.commit_copy(ticket)
    assert state.state_version == version + 3
    assert state.ledger(PAGEABLE).used_bytes == 0
    assert state.ledger(PAGEABLE).peak_bytes == 512
    state.check_invariants()


def test_an_aborted_rebuild_elsewhere_frees_both_charges():
    state = make_state()
    handle = state.register(name="w", charge_bytes=512, has_source=True, source_location=PAGEABLE)
    before = take_snapshot(state)
    state.abort_copy(state.begin_load(handle, CUDA0))
    after = take_snapshot(state)
    assert after.value(handle) == before.value(handle)
    assert after.location(CUDA0).used_bytes == after.location(PAGEABLE).used_bytes == 0
    assert [t.kind for t in state.trace_ring.view().transitions[-2:]] == [
        "copy_abort",
        "rebuild_abort",
    ]
    state.check_invariants()


def test_a_rebuild_elsewhere_needs_room_at_both_locations():
    state = make_state({PAGEABLE: 1024, CUDA0: 4096})
    handle = state.register(name="w", charge_bytes=2048, has_source=True, source_location=PAGEABLE)
    error = assert_refused(
        state, lambda: state.begin_load(handle, CUDA0), ResidencyBudgetError
    ).value
    assert error.location == Location.parse(PAGEABLE) and error.requested_bytes == 2048


def test_register_with_a_source_and_a_location_is_resident_and_reconstructible():
    state = make_state()
    handle = state.register(
        name="w", charge_bytes=512, has_source=True, source_location=PAGEABLE, location=CUDA0
    )
    record = take_snapshot(state).value(handle)
    assert record.locations == (Location.parse(CUDA0),)
    assert record.source_location == Location.parse(PAGEABLE)


def test_handles_are_unique_hashable_and_name_their_manager():
    state = make_state(manager_id="m-abc")
    a = state.register(name="w", charge_bytes=512, location=CUDA0)
    b = state.register(name="w", charge_bytes=512, location=CUDA0)
    assert a != b and len({a, b}) == 2
    assert a.manager_id == "m-abc" and "m-abc" in repr(a) and "w" in str(a)


def test_a_handle_formats_as_its_string_with_any_str_format_spec():
    """``f"{handle:<24}"`` in a table of values was ``TypeError: unsupported format string
    passed to ValueHandle.__format__``; it pads the handle's string as ``str`` does."""
    state = make_state(manager_id="m-abc")
    handle = state.register(name="w", charge_bytes=512, location=CUDA0)
    assert f"{handle}" == str(handle) == "value w (#1)"
    assert f"{handle:>14}|" == "  value w (#1)|" and f"{handle:.7}" == "value w"


def test_two_states_have_different_default_manager_ids():
    from aresidency.core import ResidencyState

    assert ResidencyState().manager_id != ResidencyState().manager_id
