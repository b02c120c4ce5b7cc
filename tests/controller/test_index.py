"""The candidate index: kept current by the state's observer, equal to a fresh build."""

from __future__ import annotations

import gc
import random

import pytest

from aresidency.controller import CandidateIndex, FallbackGraph
from aresidency.controller.index import EvictionClass, Slicer, classify
from aresidency.core import (
    Location,
    ReplicaMode,
    ResidencyError,
    ResidencyState,
)

UNIT = 512
LOCATIONS = ["cuda:0", "cuda:1", "pinned-host", "pageable-host"]


def random_step(state: ResidencyState, rng: random.Random) -> None:
    """One random transition (or an attempt that the state refuses and that changes nothing)."""
    values = [v for v in state.values() if not v.discarded]
    kind = rng.choice(
        [
            "register",
            "register",
            "lease",
            "hold",
            "events",
            "copy",
            "move",
            "release",
            "discard",
            "unprotect",
            "unprotect",
            "source",
        ]
    )
    try:
        if kind == "register" or not values:
            state.register(
                name="v",
                charge_bytes=rng.randint(1, 4) * UNIT,
                replica_mode=rng.choice(list(ReplicaMode)),
                location=rng.choice(LOCATIONS),
            )
            return
        if kind == "source":
            state.register(
                name="s",
                charge_bytes=UNIT,
                has_source=True,
                source_location="pageable-host",
                location=rng.choice(LOCATIONS),
            )
            return
        value = rng.choice(values)
        handle = value.handle
        locations = sorted(value.materializations)
        if not locations:
            state.commit_copy(state.begin_load(handle))
            return
        loc = rng.choice(locations)
        mat = value.materializations[loc]
        if kind == "lease":
            state.lease(handle, loc, rng.choice(["read", "write"]))
        elif kind == "hold":
            state.hold(handle, loc)
        elif kind == "events":
            state.record_events(handle, loc, 1)
        elif kind == "unprotect":
            if mat.use_count:
                state.unlease(handle, loc, "write" if mat.write_count else "read")
            elif mat.hold_count:
                state.unhold(handle, loc)
            elif mat.pending_event_count:
                state.reap_events(handle, loc, 1)
        elif kind in ("copy", "move"):
            others = [d for d in LOCATIONS if Location.parse(d) not in value.materializations]
            ticket = state.begin_copy(handle, loc, rng.choice(others), move=kind == "move")
            if rng.random() < 0.7:
                if rng.random() < 0.8:
                    state.commit_copy(ticket)
                else:
                    state.abort_copy(ticket)
        elif kind == "release":
            state.release(handle, loc)
        elif kind == "discard":
            state.discard(handle)
    except (ResidencyError, ValueError, IndexError):
        pass


@pytest.mark.parametrize("seed", range(8))
def test_attached_index_stays_equal_to_a_fresh_build(seed: int) -> None:
    rng = random.Random(seed)
    state = ResidencyState()
    graph = FallbackGraph.default()
    index = CandidateIndex(graph)
    index.attach(state)
    for _ in range(rng.randint(0, 30)):
        random_step(state, rng)
    for _ in range(40):
        for _ in range(rng.randint(1, 12)):
            random_step(state, rng)
        for _ in index.refresh_steps(None):
            pass
        index.check()
    index.detach()
    assert not state.observers


def test_sliced_build_catches_changes_made_while_it_was_parked() -> None:
    rng = random.Random(7)
    state = ResidencyState()
    for _ in range(3000):
        random_step(state, rng)
    index = CandidateIndex(FallbackGraph.default())
    index.attach(state)
    slicer = Slicer(0.0)  # always expired: yields at every opportunity
    steps = index.refresh_steps(slicer)
    parks = 0
    for _ in steps:
        parks += 1
        random_step(state, rng)  # the state changes while the build is parked
    assert parks > 1
    for _ in index.refresh_steps(None):
        pass
    index.check()


def test_index_does_not_keep_itself_alive_through_the_observer() -> None:
    state = ResidencyState()
    index = CandidateIndex(FallbackGraph.default())
    index.attach(state)
    del index
    gc.collect()
    state.register(name="x", charge_bytes=UNIT, location="cuda:0")  # dead observer: no error


def test_classes_group_by_eviction_options() -> None:
    state = ResidencyState()
    graph = FallbackGraph.default()
    plain = state.register(name="plain", charge_bytes=UNIT, location="cuda:0")
    sourced = state.register(
        name="sourced",
        charge_bytes=UNIT,
        location="cuda:0",
        has_source=True,
        source_location="pageable-host",
    )
    shared = state.register(
        name="shared", charge_bytes=UNIT, location="cuda:0", replica_mode=ReplicaMode.REPLICABLE
    )
    state.commit_copy(state.begin_copy(shared, "cuda:0", "pinned-host", move=False))
    stuck = state.register(name="stuck", charge_bytes=UNIT, location="pageable-host")
    cuda0 = Location.parse("cuda:0")
    pinned = Location.parse("pinned-host")
    pageable = Location.parse("pageable-host")
    (entry,) = classify(state.value(plain), graph)
    assert entry[1] == EvictionClass((), None, (pinned, pageable), False)
    (entry,) = classify(state.value(sourced), graph)
    assert entry[1] == EvictionClass((), pageable, (pinned, pageable), True)
    assert entry[1].releasable
    entries = classify(state.value(shared), graph)
    assert {(loc, cls) for loc, cls, _ in entries} == {
        (cuda0, EvictionClass((pinned,), None, (), False)),
        (pinned, EvictionClass((cuda0,), None, (), False)),
    }
    assert classify(state.value(stuck), graph) == []  # no source, no tier below pageable
    state.hold(plain, "cuda:0")
    assert classify(state.value(plain), graph) == []
