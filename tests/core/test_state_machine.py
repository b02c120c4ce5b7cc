"""Random transition sequences on the model (hypothesis stateful testing).

After every step: the model's own invariants hold; each location's charge is the sum of its
charges (materializations, plus the temporary source-location charge of rebuilds in flight); no
strict budget is exceeded; no value without a source has lost its data; the version grew by
exactly the number of committed transitions (one; or one ``invalidate`` per replica plus the
write lease; or the two steps of a rebuild elsewhere; or one ``discard`` per location) and not
at all on a refused step, which also leaves the snapshot unchanged; replaying the trace's bytes
per location gives each ledger; the snapshot survives a JSON round trip.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aresidency.core import (
    MaterializationState,
    ReplicaMode,
    ResidencyError,
    ResidencySnapshot,
    take_snapshot,
)

from ._support import CUDA0, CUDA1, PAGEABLE, PINNED, make_state

LOCS = [PAGEABLE, PINNED, CUDA0, CUDA1]
locations = st.sampled_from(LOCS)
any_location = st.sampled_from([*LOCS, *LOCS, "gpu:0"])  # now and then an unknown string
charges = st.sampled_from([512, 1024, 1536, 2048])
byte_counts = st.one_of(
    st.integers(0, 8).map(lambda k: k * 256), st.sampled_from([-1, True, 1.5, "512"])
)
indexes = st.integers(0, 1000)
modes = st.sampled_from(ReplicaMode)


class ResidencyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = make_state({CUDA0: 4096, PINNED: 8192}, trace_capacity=1 << 16)
        self.committed: list = []
        self.state.recorders.append(self.committed)
        other = make_state(manager_id="m-other")
        self.handles = [other.register(name="foreign", charge_bytes=512, location=CUDA0)]
        self.tickets: list = []
        self.refused = 0

    # ------------------------------------------------------------------ the step wrapper

    def do(self, call):
        """Run one transition; check the version, the trace and (if refused) that nothing
        changed. Returns the call's result, or None when it was refused."""
        before = take_snapshot(self.state)
        version = self.state.state_version
        count = len(self.committed)
        try:
            result = call()
        except (ResidencyError, ValueError, TypeError):
            self.refused += 1
            assert self.state.state_version == version
            assert len(self.committed) == count
            assert take_snapshot(self.state) == before
            return None
        new = self.committed[count:]
        assert new, "a committed transition left no trace entry"
        assert self.state.state_version == version + len(new)
        assert [t.state_version for t in new] == list(range(version + 1, version + len(new) + 1))
        kinds = [t.kind for t in new]
        if len(new) > 1:
            # the only multi-entry steps: a write lease invalidating the other replicas, and a
            # rebuild elsewhere (temporary charge at the source location, then the load), which
            # also ends in two when aborted
            assert kinds in (
                ["invalidate"] * (len(new) - 1) + ["lease"],
                ["rebuild_temp", "load_begin"],
                ["copy_abort", "rebuild_abort"],
                ["discard"] * len(new),  # one per location a value was discarded from
            ), kinds
        assert self.state.trace_ring.view().transitions[-len(new) :] == tuple(new)
        return result

    def handle(self, index):
        return self.handles[index % len(self.handles)]

    # --------------------------------------------------------------------------- rules

    @rule(location=any_location, charge=charges, mode=modes)
    def register_resident(self, location, charge, mode):
        handle = self.do(
            lambda: self.state.register(
                name=f"v{len(self.handles)}",
                charge_bytes=charge,
                replica_mode=mode,
                location=location,
            )
        )
        if handle is not None:
            self.handles.append(handle)

    @rule(
        source=st.sampled_from([PAGEABLE, PINNED]),
        location=st.none() | locations,
        charge=charges,
        mode=modes,
    )
    def register_with_source(self, source, location, charge, mode):
        handle = self.do(
            lambda: self.state.register(
                name=f"s{len(self.handles)}",
                charge_bytes=charge,
                replica_mode=mode,
                location=location,
                has_source=True,
                source_location=source,
            )
        )
        if handle is not None:
            self.handles.append(handle)

    @rule(index=indexes, source=any_location, destination=locations, move=st.booleans())
    def begin_copy(self, index, source, destination, move):
        handle = self.handle(index)
        ticket = self.do(lambda: self.state.begin_copy(handle, source, destination, move=move))
        if ticket is not None:
            self.tickets.append(ticket)

    @rule(index=indexes, destination=st.none() | locations)
    def begin_load(self, index, destination):
        handle = self.handle(index)
        ticket = self.do(lambda: self.state.begin_load(handle, destination))
        if ticket is not None:
            self.tickets.append(ticket)

    @precondition(lambda self: self.tickets)
    @rule(index=indexes, commit=st.booleans())
    def finish_transfer(self, index, commit):
        ticket = self.tickets[index % len(self.tickets)]
        finish = self.state.commit_copy if commit else self.state.abort_copy
        if self.do(lambda: finish(ticket) or True):
            self.tickets.remove(ticket)

    @rule(index=indexes, location=any_location)
    def release(self, index, location):
        handle = self.handle(index)
        self.do(lambda: self.state.release(handle, location))

    @rule(index=indexes, location=any_location, on=st.booleans())
    def hold(self, index, location, on):
        handle = self.handle(index)
        call = self.state.hold if on else self.state.unhold
        self.do(lambda: call(handle, location))

    @rule(
        index=indexes,
        location=any_location,
        on=st.booleans(),
        mode=st.sampled_from(["read", "read", "write", "copy"]),
    )
    def lease(self, index, location, on, mode):
        handle = self.handle(index)
        call = self.state.lease if on else self.state.unlease
        self.do(lambda: call(handle, location, mode))

    @rule(index=indexes, location=any_location, record=st.booleans(), count=byte_counts)
    def events(self, index, location, record, count):
        handle = self.handle(index)
        call = self.state.record_events if record else self.state.reap_events
        self.do(lambda: call(handle, location, count))

    @rule(name=st.sampled_from(["kv", "ws", ""]), location=any_location, nbytes=byte_counts)
    def reserve(self, name, location, nbytes):
        self.do(lambda: self.state.reserve(name, location, nbytes))

    @rule(name=st.sampled_from(["kv", "ws"]), location=any_location)
    def unreserve(self, name, location):
        self.do(lambda: self.state.unreserve(name, location))

    @rule(
        location=any_location,
        budget=st.none()
        | st.integers(0, 16).map(lambda k: k * 512)
        | st.sampled_from([-1, True, 1.5, "4096"]),
    )
    def set_budget(self, location, budget):
        self.do(lambda: self.state.set_budget(location, budget))

    @rule(index=indexes)
    def discard(self, index):
        handle = self.handle(index)
        self.do(lambda: self.state.discard(handle))

    # ---------------------------------------------------------------------- invariants

    @invariant()
    def model_invariants_hold(self):
        self.state.check_invariants()

    @invariant()
    def ledger_is_the_sum_of_charges_and_within_budget(self):
        snap = take_snapshot(self.state)
        used: dict = {}
        for ticket in self.state.open_tickets():  # a rebuild's temporary source-location charge
            if ticket.via is not None:
                used[ticket.via] = used.get(ticket.via, 0) + ticket.nbytes
        for record in snap.values.values():
            for mat in record.materializations:
                assert mat.charged_bytes == record.charge_bytes
                used[mat.location] = used.get(mat.location, 0) + mat.charged_bytes
        for loc, record in snap.locations.items():
            assert record.used_bytes == used.get(loc, 0)
            assert record.reserved_bytes == sum(n for _, n in record.reservations)
            assert record.charged_bytes == record.used_bytes + record.reserved_bytes
            assert record.peak_bytes >= record.charged_bytes
            if record.budget_bytes is not None:
                assert record.charged_bytes <= record.budget_bytes
        assert set(used) <= set(snap.locations)

    @invariant()
    def nothing_is_lost(self):
        for record in take_snapshot(self.state).values.values():
            holders = [
                m for m in record.materializations if m.state is not MaterializationState.INCOMING
            ]
            if record.discarded:
                assert not record.materializations
            elif not record.has_source:
                assert holders, f"{record.handle} lost its last copy"
            if record.replica_mode is ReplicaMode.EXCLUSIVE:
                live = [
                    m
                    for m in record.materializations
                    if m.state is not MaterializationState.OUTGOING
                ]
                assert len(live) <= 1

    @invariant()
    def replaying_the_trace_per_location_gives_each_ledger(self):
        replayed: dict = {}
        for transition in self.committed:
            if transition.location is None:
                assert transition.nbytes == 0, transition
            else:
                location = transition.location
                replayed[location] = replayed.get(location, 0) + transition.nbytes
        snap = take_snapshot(self.state)
        for location, record in snap.locations.items():
            assert replayed.get(location, 0) == record.charged_bytes, (location, replayed)

    @invariant()
    def version_counts_every_committed_transition(self):
        assert self.state.state_version == len(self.committed)
        assert [t.seq for t in self.committed] == list(range(1, len(self.committed) + 1))

    @invariant()
    def open_transfers_are_the_ones_begun_and_not_finished(self):
        assert {t.ticket_id for t in self.state.open_tickets()} == {
            t.ticket_id for t in self.tickets
        }

    @invariant()
    def snapshot_survives_a_json_round_trip(self):
        snap = take_snapshot(self.state)
        assert ResidencySnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap


ResidencyMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_random_transition_sequences_keep_every_invariant = ResidencyMachine.TestCase
