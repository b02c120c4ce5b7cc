"""Every refused transition raises a clear error and changes nothing: same snapshot (peaks
included), same state version, no trace entry, no ticket opened or closed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aresidency.core import (
    Location,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyInUseError,
    ResidencyPlanError,
    ResidencyState,
    ResidencyUnavailableError,
    ValueHandle,
)

from ._support import CUDA0, CUDA1, PAGEABLE, PINNED, assert_refused, make_state


class World:
    """One state with every kind of value and protection, and a second manager."""

    def __init__(self) -> None:
        self.state = s = make_state({CUDA0: 8192, PINNED: 4096})
        self.other = make_state(manager_id="m-other")
        self.foreign = self.other.register(name="foreign", charge_bytes=512, location=CUDA0)
        self.exc = s.register(name="exc", charge_bytes=1024, location=CUDA0)
        self.rep = s.register(
            name="rep", charge_bytes=1024, location=CUDA0, replica_mode=ReplicaMode.REPLICABLE
        )
        self.src = s.register(
            name="src", charge_bytes=512, has_source=True, source_location=PAGEABLE
        )
        self.held = s.register(name="held", charge_bytes=512, location=PINNED)
        s.hold(self.held, PINNED)
        self.leased = s.register(
            name="leased",
            charge_bytes=512,
            location=PINNED,
            has_source=True,
            source_location=PAGEABLE,
        )
        s.lease(self.leased, PINNED)
        self.pending = s.register(
            name="pending",
            charge_bytes=512,
            location=CUDA1,
            has_source=True,
            source_location=PAGEABLE,
        )
        s.record_events(self.pending, CUDA1, 2)
        self.gone = s.register(name="gone", charge_bytes=512, location=CUDA1)
        s.discard(self.gone)
        self.moving = s.register(name="moving", charge_bytes=512, location=PAGEABLE)
        self.ticket = s.begin_copy(self.moving, PAGEABLE, CUDA1, move=True)
        s.reserve("ws", CUDA0, 1024)
        s.check_invariants()


Case = tuple[str, Any, Any, type[BaseException] | tuple[type[BaseException], ...], str | None]

CASES: list[Case] = [
    # foreign, discarded, unknown handles
    (
        "foreign-lease",
        None,
        lambda w: w.state.lease(w.foreign, CUDA0),
        ResidencyUnavailableError,
        "m-other",
    ),
    (
        "foreign-release",
        None,
        lambda w: w.state.release(w.foreign, CUDA0),
        ResidencyUnavailableError,
        "belongs to manager",
    ),
    (
        "foreign-copy",
        None,
        lambda w: w.state.begin_copy(w.foreign, CUDA0, PINNED, move=True),
        ResidencyUnavailableError,
        "belongs to manager",
    ),
    (
        "foreign-discard",
        None,
        lambda w: w.state.discard(w.foreign),
        ResidencyUnavailableError,
        "belongs to manager",
    ),
    (
        "foreign-hold",
        None,
        lambda w: w.state.hold(w.foreign, CUDA0),
        ResidencyUnavailableError,
        "belongs to manager",
    ),
    (
        "unknown-value-id",
        None,
        lambda w: w.state.hold(ValueHandle("m-test", 999), CUDA0),
        ResidencyUnavailableError,
        "discarded",
    ),
    ("not-a-handle", None, lambda w: w.state.hold("exc", CUDA0), TypeError, "ValueHandle"),
    (
        "discarded-lease",
        None,
        lambda w: w.state.lease(w.gone, CUDA1),
        ResidencyUnavailableError,
        "discarded",
    ),
    (
        "discarded-discard",
        None,
        lambda w: w.state.discard(w.gone),
        ResidencyUnavailableError,
        "discarded",
    ),
    (
        "discarded-record",
        None,
        lambda w: w.state.record_events(w.gone, CUDA1),
        ResidencyUnavailableError,
        "discarded",
    ),
    (
        "discarded-copy",
        None,
        lambda w: w.state.begin_copy(w.gone, CUDA1, CUDA0, move=True),
        ResidencyUnavailableError,
        "discarded",
    ),
    (
        "discarded-load",
        None,
        lambda w: w.state.begin_load(w.gone),
        ResidencyUnavailableError,
        "discarded",
    ),
    # unknown location strings
    ("bad-location-lease", None, lambda w: w.state.lease(w.exc, "gpu0"), ValueError, "'gpu0'"),
    (
        "bad-location-register",
        None,
        lambda w: w.state.register(name="n", charge_bytes=512, location="cuda"),
        ValueError,
        "'cuda'",
    ),
    (
        "bad-location-reserve",
        None,
        lambda w: w.state.reserve("x", "host", 512),
        ValueError,
        "'host'",
    ),
    (
        "bad-location-copy",
        None,
        lambda w: w.state.begin_copy(w.exc, CUDA0, "cuda:-1", move=True),
        ValueError,
        "'cuda:-1'",
    ),
    ("bad-location-budget", None, lambda w: w.state.set_budget("CPU", 512), ValueError, "'CPU'"),
    (
        "bad-source-location",
        None,
        lambda w: w.state.register(
            name="n", charge_bytes=512, has_source=True, source_location="disk"
        ),
        ValueError,
        "'disk'",
    ),
    # byte counts
    ("negative-reservation", None, lambda w: w.state.reserve("x", CUDA0, -1), ValueError, "-1"),
    # Sizes are read as people write them (512.0, "512", "1KiB"): what is refused is what no
    # byte count spells (a fraction, a bool, a typo in the unit, another type).
    ("fractional-reservation", None, lambda w: w.state.reserve("x", CUDA0, 0.5), ValueError, "0.5"),
    ("bool-reservation", None, lambda w: w.state.reserve("x", CUDA0, True), TypeError, "True"),
    (
        "bad-unit-reservation",
        None,
        lambda w: w.state.reserve("x", CUDA0, "512 bytes"),
        ValueError,
        "'512 bytes'",
    ),
    ("list-reservation", None, lambda w: w.state.reserve("x", CUDA0, [512]), TypeError, "[512]"),
    (
        "zero-charge",
        None,
        lambda w: w.state.register(name="n", charge_bytes=0, location=CUDA0),
        ValueError,
        "> 0",
    ),
    (
        "negative-charge",
        None,
        lambda w: w.state.register(name="n", charge_bytes=-512, location=CUDA0),
        ValueError,
        "-512",
    ),
    (
        "bool-charge",
        None,
        lambda w: w.state.register(name="n", charge_bytes=True, location=CUDA0),
        TypeError,
        "True",
    ),
    (
        "float-charge",
        None,
        lambda w: w.state.register(name="n", charge_bytes=512.0, location=CUDA0),
        TypeError,
        "512.0",
    ),
    ("negative-budget", None, lambda w: w.state.set_budget(CUDA0, -1), ValueError, "-1"),
    ("bool-budget", None, lambda w: w.state.set_budget(CUDA0, False), TypeError, "False"),
    ("fractional-budget", None, lambda w: w.state.set_budget(CUDA0, 1.5), ValueError, "1.5"),
    ("bad-unit-budget", None, lambda w: w.state.set_budget(CUDA0, "1 GBs"), ValueError, "'1 GBs'"),
    ("zero-events", None, lambda w: w.state.record_events(w.exc, CUDA0, 0), ValueError, "> 0"),
    ("bool-events", None, lambda w: w.state.record_events(w.exc, CUDA0, True), TypeError, "True"),
    # registration shape
    (
        "register-nowhere-no-source",
        None,
        lambda w: w.state.register(name="n", charge_bytes=512),
        ValueError,
        "location or a source",
    ),
    (
        "register-source-without-location",
        None,
        lambda w: w.state.register(name="n", charge_bytes=512, has_source=True),
        ValueError,
        "source_location",
    ),
    (
        "register-location-without-source",
        None,
        lambda w: w.state.register(name="n", charge_bytes=512, source_location=PAGEABLE),
        ValueError,
        "no source",
    ),
    (
        "register-bad-mode",
        None,
        lambda w: w.state.register(
            name="n", charge_bytes=512, location=CUDA0, replica_mode="exclusive"
        ),
        TypeError,
        "ReplicaMode",
    ),
    (
        "register-bad-name",
        None,
        lambda w: w.state.register(name=None, charge_bytes=512, location=CUDA0),
        TypeError,
        "name",
    ),
    # reservations
    ("duplicate-reservation", None, lambda w: w.state.reserve("ws", CUDA0, 1), ValueError, "'ws'"),
    ("empty-reservation-name", None, lambda w: w.state.reserve("", CUDA0, 1), ValueError, "name"),
    (
        "unreserve-unknown-name",
        None,
        lambda w: w.state.unreserve("nope", CUDA0),
        ValueError,
        "'nope'",
    ),
    (
        "unreserve-at-a-new-location",
        None,
        lambda w: w.state.unreserve("ws", "cuda:5"),
        ValueError,
        "cuda:5",
    ),
    # exclusivity
    (
        "exclusive-second-copy",
        None,
        lambda w: w.state.begin_copy(w.exc, CUDA0, PINNED, move=False),
        ValueError,
        "EXCLUSIVE",
    ),
    (
        "exclusive-load-while-materialized",
        None,
        lambda w: w.state.begin_load(w.leased),
        ValueError,
        "EXCLUSIVE",
    ),
    (
        "copy-onto-itself",
        None,
        lambda w: w.state.begin_copy(w.rep, CUDA0, CUDA0, move=False),
        ValueError,
        "two different",
    ),
    (
        "copy-onto-existing",
        None,
        lambda w: w.state.begin_copy(w.moving, PAGEABLE, CUDA1, move=True),
        ResidencyUnavailableError,
        None,
    ),
    (
        "load-without-source",
        None,
        lambda w: w.state.begin_load(w.exc),
        ResidencyUnavailableError,
        "no source",
    ),
    # nothing is lost
    (
        "release-last-copy-without-source",
        None,
        lambda w: w.state.release(w.exc, CUDA0),
        ResidencyPlanError,
        "last copy",
    ),
    # protection
    (
        "release-held",
        None,
        lambda w: w.state.release(w.held, PINNED),
        ResidencyInUseError,
        "hold_count=1",
    ),
    (
        "release-leased",
        None,
        lambda w: w.state.release(w.leased, PINNED),
        ResidencyInUseError,
        "use_count=1",
    ),
    (
        "release-pending",
        None,
        lambda w: w.state.release(w.pending, CUDA1),
        ResidencyInUseError,
        "pending_event_count=2",
    ),
    (
        "release-outgoing",
        None,
        lambda w: w.state.release(w.moving, PAGEABLE),
        ResidencyInUseError,
        None,
    ),
    (
        "release-incoming",
        None,
        lambda w: w.state.release(w.moving, CUDA1),
        ResidencyInUseError,
        None,
    ),
    ("discard-held", None, lambda w: w.state.discard(w.held), ResidencyInUseError, "hold_count=1"),
    (
        "discard-leased",
        None,
        lambda w: w.state.discard(w.leased),
        ResidencyInUseError,
        "use_count=1",
    ),
    (
        "discard-pending",
        None,
        lambda w: w.state.discard(w.pending),
        ResidencyInUseError,
        "pending_event_count=2",
    ),
    (
        "discard-in-flight",
        None,
        lambda w: w.state.discard(w.moving),
        ResidencyInUseError,
        "pending_event_count=1",
    ),
    (
        "discard-while-loading",
        lambda w: w.state.begin_load(w.src),
        lambda w: w.state.discard(w.src),
        ResidencyInUseError,
        "in flight",
    ),
    (
        "write-lease-while-read",
        None,
        lambda w: w.state.lease(w.leased, PINNED, "write"),
        ResidencyInUseError,
        None,
    ),
    (
        "move-out-of-held",
        None,
        lambda w: w.state.begin_copy(w.held, PINNED, CUDA0, move=True),
        ResidencyInUseError,
        "hold_count=1",
    ),
    (
        "bad-lease-mode",
        None,
        lambda w: w.state.lease(w.exc, CUDA0, "exclusive"),
        ValueError,
        "'exclusive'",
    ),
    # acquire never places
    (
        "lease-missing-endpoint",
        None,
        lambda w: w.state.lease(w.exc, PINNED),
        ResidencyUnavailableError,
        "it is at: cuda:0",
    ),
    (
        "lease-never-materialized",
        None,
        lambda w: w.state.lease(w.src, PAGEABLE),
        ResidencyUnavailableError,
        "nowhere",
    ),
    (
        "hold-missing-endpoint",
        None,
        lambda w: w.state.hold(w.rep, CUDA1),
        ResidencyUnavailableError,
        "cuda:1",
    ),
    (
        "record-missing-endpoint",
        None,
        lambda w: w.state.record_events(w.rep, CUDA1),
        ResidencyUnavailableError,
        None,
    ),
    (
        "copy-from-missing-endpoint",
        None,
        lambda w: w.state.begin_copy(w.rep, PINNED, CUDA1, move=False),
        ResidencyUnavailableError,
        None,
    ),
    # unbalanced releases of protection
    (
        "unlease-without-lease",
        None,
        lambda w: w.state.unlease(w.exc, CUDA0),
        ValueError,
        "no active lease",
    ),
    ("unhold-without-hold", None, lambda w: w.state.unhold(w.exc, CUDA0), ValueError, "no hold"),
    (
        "unlease-write-of-read-lease",
        None,
        lambda w: w.state.unlease(w.leased, PINNED, "write"),
        ValueError,
        "write",
    ),
    (
        "unlease-bad-mode",
        None,
        lambda w: w.state.unlease(w.leased, PINNED, "exclusive"),
        ValueError,
        "'exclusive'",
    ),
    (
        "reap-more-than-pending",
        None,
        lambda w: w.state.reap_events(w.pending, CUDA1, 3),
        ValueError,
        "fewer than 3",
    ),
    ("reap-where-nothing-is", None, lambda w: w.state.reap_events(w.exc, CUDA1), ValueError, None),
    # tickets
    (
        "commit-twice",
        lambda w: w.state.commit_copy(w.ticket),
        lambda w: w.state.commit_copy(w.ticket),
        ValueError,
        "not in flight",
    ),
    (
        "abort-foreign-ticket",
        lambda w: setattr(w, "t2", w.other.begin_copy(w.foreign, CUDA0, PINNED, move=True)),
        lambda w: w.state.abort_copy(w.t2),
        ValueError,
        "not in flight",
    ),
    # budgets
    (
        "over-budget-register",
        None,
        lambda w: w.state.register(name="n", charge_bytes=8192, location=CUDA0),
        ResidencyBudgetError,
        "cuda:0",
    ),
    (
        "over-budget-reserve-by-one-byte",
        None,
        lambda w: w.state.reserve("kv", PINNED, 3073),
        ResidencyBudgetError,
        "3073",
    ),
    (
        "copy-of-a-never-materialized-value",
        None,
        lambda w: w.state.begin_copy(w.src, PAGEABLE, PINNED, move=True),
        ResidencyUnavailableError,
        "nowhere",
    ),
    (
        "copy-onto-an-existing-replica",
        lambda w: w.state.commit_copy(w.state.begin_copy(w.rep, CUDA0, PINNED, move=False)),
        lambda w: w.state.begin_copy(w.rep, CUDA0, PINNED, move=False),
        ValueError,
        "already has",
    ),
    (
        "over-budget-copy",
        lambda w: w.state.reserve("big", PINNED, 3072),
        lambda w: w.state.begin_copy(w.rep, CUDA0, PINNED, move=False),
        ResidencyBudgetError,
        "pinned-host",
    ),
    (
        "over-budget-load",
        lambda w: (w.state.set_budget(PAGEABLE, 1024), w.state.reserve("r", PAGEABLE, 512)),
        lambda w: w.state.begin_load(w.src),
        ResidencyBudgetError,
        "pageable-host",
    ),
    (
        "over-budget-rebuild-at-destination",
        lambda w: w.state.reserve("big", CUDA0, 5120),
        lambda w: w.state.begin_load(w.src, CUDA0),
        ResidencyBudgetError,
        "cuda:0",
    ),
    (
        "over-budget-rebuild-at-source-location",
        lambda w: (w.state.set_budget(PAGEABLE, 1024), w.state.reserve("r", PAGEABLE, 512)),
        lambda w: w.state.begin_load(w.src, CUDA0),
        ResidencyBudgetError,
        "pageable-host",
    ),
    (
        "budget-below-charge",
        None,
        lambda w: w.state.set_budget(CUDA0, 1024),
        ResidencyBudgetError,
        "1024",
    ),
]


@pytest.mark.parametrize(
    ("setup", "call", "error", "match"), [pytest.param(*case[1:], id=case[0]) for case in CASES]
)
def test_refused_transition_raises_a_clear_error_and_changes_nothing(setup, call, error, match):
    world = World()
    if setup is not None:
        setup(world)  # legal steps that lead up to the refused call
    assert_refused(world.state, lambda: call(world), error, match)


def test_the_world_reaches_every_case_legally():
    World().state.check_invariants()


def test_a_refused_call_leaves_the_other_manager_untouched():
    world = World()
    before = world.other.state_version
    with pytest.raises(ResidencyUnavailableError):
        world.state.release(world.foreign, CUDA0)
    assert world.other.state_version == before


def test_budgets_given_to_the_constructor_are_checked():
    with pytest.raises(ValueError, match="'gpu'"):
        ResidencyState(budgets={"gpu": 1})
    with pytest.raises(ValueError, match="-5"):
        ResidencyState(budgets={CUDA0: -5})
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        ResidencyState(budgets={CUDA0: 1.5})
    with pytest.raises(TypeError, match="a list is not a size"):
        ResidencyState(budgets={CUDA0: [1024]})
    with pytest.raises(ValueError):
        ResidencyState(trace_capacity=-1)
    state = ResidencyState(budgets={Location.parse(CUDA0): 1024, PINNED: None})
    assert state.ledger(CUDA0).budget_bytes == 1024
    assert state.ledger(PINNED).budget_bytes is None


def test_two_budget_keys_naming_one_location_are_refused_not_one_picked() -> None:
    """{"cuda:0": 8 GiB, torch.device("cuda:0"): 10 GiB} (or a Location and its string) name
    one location twice: the later key silently won, where budgets_from_max_memory refuses the
    same mistake. Now a ValueError naming both keys."""
    with pytest.raises(ValueError, match=r"'cuda:0' and device\(type='cuda', index=0\) both"):
        ResidencyState(budgets={CUDA0: 5, torch.device("cuda:0"): 10})
    with pytest.raises(ValueError, match="both name pageable-host"):
        ResidencyState(budgets={PAGEABLE: 1, torch.device("cpu"): 2})
    with pytest.raises(ValueError, match="one budget"):
        ResidencyState(budgets={Location.parse(CUDA0): 7, CUDA0: 9})


def test_a_refused_rebuild_adds_no_location_record_for_the_source_location():
    state = ResidencyState(budgets={CUDA0: 512})
    handle = state.register(name="w", charge_bytes=1024, has_source=True, source_location=PINNED)
    assert [str(loc) for loc in state.locations()] == [CUDA0]
    assert_refused(state, lambda: state.begin_load(handle, CUDA0), ResidencyBudgetError)
    assert [str(loc) for loc in state.locations()] == [CUDA0]
