"""Snapshots (atomic, tensor-free, immutable, JSON round trip) and the bounded trace."""

from __future__ import annotations

import copy
import dataclasses
import enum
import gc
import json
import re
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from aresidency.core import (
    Location,
    LocationRecord,
    MaterializationRecord,
    MaterializationState,
    ReplicaMode,
    ResidencySnapshot,
    ResidencyTrace,
    ResidencyUnavailableError,
    Transition,
    ValueHandle,
    ValueSnapshot,
    take_snapshot,
)
from aresidency.core.trace import TraceRing

from ._support import CUDA0, CUDA1, PAGEABLE, PINNED, make_state


def busy_state():
    state = make_state({CUDA0: 1 << 20, PINNED: None})
    w = state.register(name="w", charge_bytes=1000, location=CUDA0)
    r = state.register(
        name="r", charge_bytes=2048, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    s = state.register(name="s", charge_bytes=512, has_source=True, source_location=PAGEABLE)
    state.commit_copy(state.begin_copy(r, PINNED, CUDA1, move=False))
    state.lease(w, CUDA0)
    state.hold(r, PINNED)
    state.record_events(r, CUDA1, 2)
    state.begin_copy(r, PINNED, CUDA0, move=False)  # in flight
    state.reserve("kv", CUDA0, 4096, owner=torch.zeros(4))  # an owner that is a tensor
    state.reserve("ws", CUDA0, 512)
    return state, w, r, s


# ------------------------------------------------------------------------------- contents


def test_snapshot_reports_every_field_the_troubleshooting_steps_read():
    state, w, r, s = busy_state()
    snap = take_snapshot(state)
    assert snap.manager_id == "m-test" and snap.state_version == state.state_version
    cuda = snap.location(CUDA0)
    assert isinstance(cuda, LocationRecord)
    assert cuda.budget_bytes == 1 << 20
    assert cuda.used_bytes == 1000 + 2048
    assert cuda.reserved_bytes == 4608
    assert cuda.charged_bytes == cuda.used_bytes + cuda.reserved_bytes
    assert cuda.peak_bytes == cuda.charged_bytes
    assert cuda.reservations == (("kv", 4096), ("ws", 512))
    assert snap.location(PINNED).budget_bytes is None

    rv = snap.value(r)
    assert isinstance(rv, ValueSnapshot)
    assert (rv.handle, rv.name, rv.replica_mode) == (r, "r", ReplicaMode.REPLICABLE)
    assert (rv.recoverability, rv.has_source, rv.source_location) == (
        "not-reconstructible",
        False,
        None,
    )
    assert rv.charge_bytes == 2048 and not rv.discarded
    assert rv.locations == tuple(Location.parse(x) for x in (PINNED, CUDA0, CUDA1))
    pinned = rv.materialization(PINNED)
    assert isinstance(pinned, MaterializationRecord)
    assert (pinned.charged_bytes, pinned.use_count, pinned.hold_count) == (2048, 0, 1)
    assert pinned.pending_event_count == 1  # the copy in flight reads it
    assert pinned.state is MaterializationState.RESIDENT and pinned.protected
    assert rv.materialization(CUDA0).state is MaterializationState.INCOMING
    assert rv.materialization(CUDA1).pending_event_count == 2
    assert snap.value(w).materialization(CUDA0).use_count == 1

    sv = snap.value(s)
    assert (sv.recoverability, sv.has_source) == ("reconstructible", True)
    assert sv.source_location == Location.parse(PAGEABLE) and sv.materializations == ()


def test_snapshot_lookups_of_absent_things_raise_clearly():
    state, w, _, s = busy_state()
    snap = take_snapshot(state)
    with pytest.raises(ResidencyUnavailableError, match="not in this snapshot"):
        snap.value(ValueHandle("m-test", 999))
    # Step 2 of docs/troubleshooting.md (the handle is this manager's and not discarded):
    # the refusal said only "not in this snapshot" for both.
    state.discard(s)  # the source-backed value: nothing protects it
    later = take_snapshot(state)
    with pytest.raises(ResidencyUnavailableError) as discarded:
        later.value(s)
    assert f"not in this snapshot (v{later.state_version}): the value was discarded before" in (
        str(discarded.value)
    )
    with pytest.raises(ResidencyUnavailableError) as foreign:
        snap.value(ValueHandle("m-other", w.value_id))
    assert "belongs to manager m-other, and this is a snapshot of manager m-test" in str(
        foreign.value
    )
    with pytest.raises(TypeError, match="takes a ValueHandle, got 'w'"):
        snap.value("w")  # type: ignore[arg-type]
    with pytest.raises(ResidencyUnavailableError):
        snap.value(w).materialization(PAGEABLE)


def test_snapshot_value_names_what_was_wrong_with_what_it_was_given():
    state, w, _, s = busy_state()
    snap = take_snapshot(state)
    # A value's name is not its handle: the error says what it takes, not "unavailable".
    with pytest.raises(TypeError, match=r"takes a ValueHandle, got 'w' \(str\).*name"):
        snap.value("w")
    with pytest.raises(TypeError, match="takes a ValueHandle, got None"):
        snap.value(None)
    # Another manager's handle: said so (the troubleshooting's first check of a handle).
    foreign = ValueHandle("m-other", w.value_id, "w")
    with pytest.raises(ResidencyUnavailableError, match="belongs to manager m-other") as info:
        snap.value(foreign)
    assert "m-test" in str(info.value)
    # This manager's handle, not in the snapshot: discarded before it, or registered after.
    state.discard(s)
    with pytest.raises(ResidencyUnavailableError, match="discarded before") as info:
        take_snapshot(state).value(s)
    assert f"v{state.state_version}" in str(info.value)


def test_snapshot_and_record_reprs_show_state():
    state, *_ = busy_state()
    snap = take_snapshot(state)
    assert f"v{state.state_version}" in repr(snap) and "m-test" in repr(snap)
    text = repr(snap.location(CUDA0))
    assert text.startswith("<Location cuda:0 used=") and "reserved=" in text and "budget=" in text


# --------------------------------------------------------------- immutability, atomicity


def test_snapshot_records_are_frozen():
    state, w, *_ = busy_state()
    snap = take_snapshot(state)
    record = snap.value(w)
    for obj, attr in [
        (snap, "state_version"),
        (snap.location(CUDA0), "used_bytes"),
        (record, "name"),
        (record.materializations[0], "use_count"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, 0)


def test_snapshot_mappings_and_sequences_are_read_only():
    state, w, *_ = busy_state()
    for snap in (take_snapshot(state), ResidencySnapshot.from_dict(take_snapshot(state).to_dict())):
        with pytest.raises(TypeError):
            snap.locations[Location.parse(CUDA0)] = None  # type: ignore[index]
        with pytest.raises(TypeError):
            del snap.values[w]  # type: ignore[attr-defined]
        assert not hasattr(snap.values, "pop") and not hasattr(snap.locations, "clear")
        record = snap.value(w)
        assert isinstance(record.materializations, tuple) and isinstance(record.locations, tuple)
        assert isinstance(snap.location(CUDA0).reservations, tuple)


def test_snapshot_is_taken_in_one_call_and_later_transitions_do_not_reach_it():
    state, w, r, s = busy_state()
    snap = take_snapshot(state)
    frozen = json.dumps(snap.to_dict(), sort_keys=True)
    state.unlease(w, CUDA0)
    state.unhold(r, PINNED)
    state.unreserve("kv", CUDA0)
    state.commit_copy(state.open_tickets()[0])
    state.commit_copy(state.begin_load(s))
    state.discard(w)
    assert json.dumps(snap.to_dict(), sort_keys=True) == frozen
    assert snap.state_version < state.state_version
    assert take_snapshot(state) != snap


def _walk(obj, seen, found):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    found.add(type(obj))
    if isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None), enum.Enum)):
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            _walk(key, seen, found)
            _walk(value, seen, found)
    elif isinstance(obj, (tuple, list, set, frozenset)):
        for item in obj:
            _walk(item, seen, found)
    elif dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            _walk(getattr(obj, field.name), seen, found)
    else:
        for attr in getattr(type(obj), "__slots__", ()):
            _walk(getattr(obj, attr, None), seen, found)
        for value in getattr(obj, "__dict__", {}).values():
            _walk(value, seen, found)


def test_snapshot_holds_no_tensor_anywhere_inside():
    state, *_ = busy_state()
    found: set[type] = set()
    _walk(take_snapshot(state), set(), found)
    assert not any(issubclass(t, torch.Tensor) for t in found)
    allowed = {
        ResidencySnapshot,
        LocationRecord,
        ValueSnapshot,
        MaterializationRecord,
        Location,
        ValueHandle,
        MaterializationState,
        ReplicaMode,
        str,
        int,
        tuple,
        type(None),
        bool,
    }
    assert {t for t in found if not issubclass(t, Mapping)} <= allowed


def test_snapshot_round_trips_through_json():
    state, *_ = busy_state()
    snap = take_snapshot(state)
    text = json.dumps(snap.to_dict())
    again = ResidencySnapshot.from_dict(json.loads(text))
    assert again == snap
    assert dict(again.values) == dict(snap.values)  # the records themselves, not just dicts
    assert dict(again.locations) == dict(snap.locations)
    assert [v.name for v in again.values.values()] == ["w", "r", "s"]


def test_snapshot_values_iterate_in_registration_order_run_after_run():
    # Like a dict: registration order, whatever the handles hash to (the manager's id is new
    # each run), in the first snapshot, in snapshots brought up to date after discards and
    # new registrations, and after a JSON round trip.
    for manager_id in ("m-a", "m-b", "9f0c3e"):
        state = make_state({CUDA0: None}, manager_id=manager_id)
        handles = [state.register(name=f"v{i}", charge_bytes=8, location=CUDA0) for i in range(40)]
        snap = take_snapshot(state)
        assert list(snap.values) == handles
        assert [v.name for v in snap.values.values()] == [f"v{i}" for i in range(40)]
        for handle in handles[::3]:
            state.discard(handle)
        later = [state.register(name=f"w{i}", charge_bytes=8, location=CUDA0) for i in range(5)]
        kept = [h for i, h in enumerate(handles) if i % 3] + later
        snap = take_snapshot(state)
        assert list(snap.values) == kept
        assert [h for h, _ in snap.values.items()] == kept
        again = ResidencySnapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
        assert list(again.values) == kept and again == snap
        assert handles[0] not in snap.values and snap.values.get(handles[0]) is None
        assert len(snap.values) == len(kept)


def test_snapshots_of_different_versions_differ():
    state, w, *_ = busy_state()
    first = take_snapshot(state)
    state.unlease(w, CUDA0)
    assert take_snapshot(state) != first


# -------------------------------------------------------------------------------- trace


def test_trace_entries_carry_sequence_version_kind_handle_location_bytes_and_time():
    state = make_state()
    h = state.register(name="w", charge_bytes=1024, location=CUDA0)
    state.reserve("kv", PINNED, 512)
    trace = state.trace_ring.view()
    assert isinstance(trace, ResidencyTrace) and trace.enabled and trace.overwritten == 0
    first, second = trace.transitions
    assert (first.seq, first.state_version, first.kind, first.handle) == (1, 1, "register", h)
    assert (first.location, first.nbytes, first.time_ns) == (Location.parse(CUDA0), 1024, 1)
    assert (second.kind, second.handle, second.name, second.nbytes) == ("reserve", None, "kv", 512)
    assert second.time_ns == 2
    assert json.loads(json.dumps(first.to_dict()))["handle"]["name"] == "w"
    assert "register" in str(first) and "+1024 B" in str(first)


def test_the_ring_keeps_records_the_garbage_collector_stops_tracking():
    """The ring keeps thousands of transitions across thousands of operations: kept as
    objects the collector tracks, each one was promoted to its oldest generation and brought
    the next full collection (tens of milliseconds with torch imported) nearer. Its records
    are tuples of ints, strings and None, untracked after a collection; a view gives the
    transitions back, equal to those committed."""
    state = make_state({CUDA0: 1 << 20, PINNED: None})
    seen: list[Transition] = []
    state.recorders.append(seen)
    h = state.register(name="w", charge_bytes=1024, location=PINNED)
    state.commit_copy(state.begin_copy(h, PINNED, CUDA0, move=True))
    state.reserve("kv", CUDA0, 512)
    state.unreserve("kv", CUDA0)
    gc.collect()
    records = list(state.trace_ring.entries)
    assert len(records) == len(seen) == 5
    assert not any(gc.is_tracked(record) for record in records)
    transitions = state.trace_ring.view().transitions
    assert transitions == tuple(seen)
    moved = transitions[2]
    assert moved.handle == h and moved.handle.name == "w"
    assert moved.source is Location.parse(PINNED) and moved.destination is Location.parse(CUDA0)


def test_the_runtimes_journal_gets_kind_handle_and_location_of_each_commit():
    state = make_state({CUDA0: 1 << 20})
    journal: list[tuple[str, Any, Location | None]] = []
    state.journal = journal
    h = state.register(name="w", charge_bytes=1024, location=CUDA0)
    state.reserve("kv", CUDA0, 512)
    assert journal == [
        ("register", h, Location.parse(CUDA0)),
        ("reserve", None, Location.parse(CUDA0)),
    ]


def test_replaying_the_trace_per_location_gives_each_ledger_after_discards():
    # Each entry's nbytes is charged (or freed) at its location: summing them per location
    # must give the ledgers, also after discarding a value resident at several locations.
    state = make_state()
    r = state.register(
        name="r", charge_bytes=2048, location=PINNED, replica_mode=ReplicaMode.REPLICABLE
    )
    state.commit_copy(state.begin_copy(r, PINNED, CUDA1, move=False))
    w = state.register(name="w", charge_bytes=1024, location=CUDA0)
    s = state.register(name="s", charge_bytes=512, has_source=True, source_location=PAGEABLE)
    keep = state.register(name="keep", charge_bytes=512, location=CUDA1)
    for handle in (r, w, s):
        state.discard(handle)
    replayed: dict[Any, int] = {}
    for t in state.trace_ring.view().transitions:
        if t.location is not None:
            replayed[t.location] = replayed.get(t.location, 0) + t.nbytes
        else:
            assert t.nbytes == 0, t  # bytes always change somewhere
    ledgers = {loc: rec.charged_bytes for loc, rec in take_snapshot(state).locations.items()}
    assert {loc: n for loc, n in replayed.items() if n} == {Location.parse(CUDA1): 512}
    assert {loc: n for loc, n in ledgers.items() if n} == {Location.parse(CUDA1): 512}
    discards = [t for t in state.trace_ring.view().transitions if t.kind == "discard"]
    assert [(t.handle, str(t.location), t.nbytes) for t in discards] == [
        (r, PINNED, -2048),
        (r, CUDA1, -2048),
        (w, CUDA0, -1024),
        (s, "None", 0),
    ]
    assert state.find_value(keep) is not None
    state.check_invariants()


def test_trace_ring_keeps_the_newest_entries_and_counts_the_overwritten():
    state = make_state(trace_capacity=3)
    state.register(name="w", charge_bytes=512, location=CUDA0)
    for index in range(4):
        state.reserve(f"r{index}", CUDA0, 1)
    trace = state.trace_ring.view()
    assert trace.capacity == 3 and len(trace.transitions) == 3
    assert trace.overwritten == 2
    assert [t.seq for t in trace.transitions] == [3, 4, 5]
    assert [t.state_version for t in trace.transitions] == [3, 4, 5]
    # Its repr is a summary, as a snapshot's is (it printed every transition: thousands of
    # lines for manager.trace() at a prompt, with the default capacity).
    assert repr(trace) == "<ResidencyTrace 3 of capacity 3, versions 3 to 5, 2 overwritten>"


def test_trace_disabled_at_capacity_zero_records_nothing_but_versions_still_advance():
    state = make_state(trace_capacity=0)
    state.register(name="w", charge_bytes=512, location=CUDA0)
    state.reserve("r", CUDA0, 1)
    trace = state.trace_ring.view()
    assert not trace.enabled and trace.capacity == 0
    assert trace.transitions == () and trace.overwritten == 0
    assert state.state_version == 2
    assert repr(trace) == "<ResidencyTrace disabled (trace_capacity=0)>"


def test_a_trace_view_is_an_immutable_copy():
    state = make_state()
    state.register(name="w", charge_bytes=512, location=CUDA0)
    view = state.trace_ring.view()
    state.reserve("r", CUDA0, 1)
    assert len(view.transitions) == 1 and isinstance(view.transitions, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.overwritten = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.transitions[0].kind = "x"  # type: ignore[misc]


@pytest.mark.parametrize("capacity", [-1, True, 1.5, "10", None])
def test_trace_capacity_must_be_a_non_negative_int(capacity):
    with pytest.raises(ValueError, match="trace_capacity"):
        TraceRing(capacity)


def test_transition_without_handle_or_location_serializes():
    transition = Transition(1, 1, "budget", None, None, 0, 5)
    assert transition.to_dict()["handle"] is None and transition.to_dict()["location"] is None


def _snapshot_dict() -> dict[str, Any]:
    state = make_state()
    handle = state.register(
        name="v", charge_bytes=512, replica_mode=ReplicaMode.REPLICABLE, location=PAGEABLE
    )
    state.begin_copy(handle, PAGEABLE, CUDA0, move=False)  # in flight: every field in use
    return take_snapshot(state).to_dict()


def _set(data: dict[str, Any], path: str, new: Any) -> None:
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        name, _, index = part.partition("[")
        node = node[name][int(index[:-1])] if index else node[name]
    node[last] = new


@pytest.mark.parametrize(
    ("path", "new", "said"),
    [
        ("locations[0].used_bytes", "abc", "locations[0].used_bytes must be a non-negative int"),
        ("locations[0].used_bytes", None, "locations[0].used_bytes must be a non-negative int"),
        ("locations[0].used_bytes", -5, "locations[0].used_bytes must be a non-negative int"),
        ("locations[0].peak_bytes", True, "locations[0].peak_bytes must be a non-negative int"),
        ("locations[0].charged_bytes", 7, "not used_bytes + reserved_bytes"),
        ("locations[0].location", "gpu", "locations[0].location is not a location"),
        ("values[0].charge_bytes", "x", "values[0].charge_bytes must be a non-negative int"),
        ("values[0].replica_mode", "bogus", "values[0].replica_mode is 'bogus', not a ReplicaMode"),
        ("values[0].discarded", "no", "values[0].discarded must be true or false"),
        ("values[0].name", 3, "values[0].name must be a str"),
        ("values[0].handle", "v", "values[0].handle must be a handle's dict"),
        ("values[0].handle.value_id", 1.5, "values[0].handle.value_id must be a non-negative int"),
        ("values[0].handle.value_id", "x", "values[0].handle.value_id must be a non-negative int"),
        ("values[0].handle.manager_id", None, "values[0].handle.manager_id must be a str"),
        ("values[0].handle.name", None, "values[0].handle.name must be a str"),
        ("values", {}, "values must be a list, got {}"),
        ("locations", {}, "locations must be a list, got {}"),
        (
            "values[0].handle.manager_id",
            "other",
            "values[0].handle.manager_id is 'other', not the snapshot's manager_id",
        ),
        (
            "values[0].materializations[0].use_count",
            "x",
            "values[0].materializations[0].use_count must be a non-negative int",
        ),
        (
            "values[0].materializations[0].state",
            "gone",
            "values[0].materializations[0].state is 'gone', not a MaterializationState",
        ),
    ],
)
def test_a_snapshot_dict_with_a_malformed_field_is_refused_naming_it(
    path: str, new: Any, said: str
) -> None:
    """JSON from elsewhere is checked, not trusted: a malformed field is a ``ValueError``
    naming its path, not a snapshot that fails later, far from the cause."""
    data = _snapshot_dict()
    assert ResidencySnapshot.from_dict(copy.deepcopy(data)).to_dict() == data
    _set(data, path, new)
    with pytest.raises(ValueError, match=re.escape(said)):
        ResidencySnapshot.from_dict(data)


@pytest.mark.parametrize(
    ("field", "said"),
    [("values", "values[1] repeats value id"), ("locations", "locations[1] repeats location")],
)
def test_a_snapshot_dict_that_lists_a_value_or_location_twice_is_refused(
    field: str, said: str
) -> None:
    """Read as it was, the second record would replace the first without a word."""
    data = _snapshot_dict()
    data[field] = [data[field][0], copy.deepcopy(data[field][0])]
    with pytest.raises(ValueError, match=re.escape(said)):
        ResidencySnapshot.from_dict(data)
