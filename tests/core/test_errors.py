"""The exception hierarchy (docs/api/exceptions.md), its structured fields, messages and
pickling."""

from __future__ import annotations

import pickle

import pytest

from aresidency.core import (
    ExecutionReport,
    Location,
    MemoryReservation,
    Release,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
    ResidencyUnavailableError,
    Transition,
    ValueHandle,
)
from aresidency.core.errors import format_bytes

from ._support import make_state

ALL_ERRORS = [
    ResidencyError,
    ResidencyBudgetError,
    ResidencyPlanError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
    ResidencyInUseError,
    ResidencyUnavailableError,
    ResidencyPlanExecutionError,
]

# Each class's direct parent, exactly as the documented hierarchy states it.
PARENT = {
    ResidencyError: Exception,
    ResidencyBudgetError: ResidencyError,
    ResidencyPlanError: ResidencyError,
    ResidencySearchLimitError: ResidencyPlanError,
    ResidencyStaleStateError: ResidencyPlanError,
    ResidencyInUseError: ResidencyError,
    ResidencyUnavailableError: ResidencyError,
    ResidencyPlanExecutionError: ResidencyError,
}


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_each_error_has_exactly_the_documented_parent(cls):
    assert cls.__bases__ == (PARENT[cls],)


@pytest.mark.parametrize("sub", ALL_ERRORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("sup", ALL_ERRORS, ids=lambda c: c.__name__)
def test_subclass_relations_are_exactly_the_documented_tree(sub, sup):
    expected = sup is sub
    parent = PARENT.get(sub)
    while parent in PARENT:
        expected = expected or parent is sup
        parent = PARENT[parent]
    assert issubclass(sub, sup) is expected


def test_execution_error_is_a_sibling_of_plan_error_not_a_subclass():
    assert not issubclass(ResidencyPlanExecutionError, ResidencyPlanError)
    assert not issubclass(ResidencyPlanError, ResidencyPlanExecutionError)
    assert issubclass(ResidencySearchLimitError, ResidencyPlanError)
    assert issubclass(ResidencyStaleStateError, ResidencyPlanError)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_no_error_pretends_to_be_a_builtin_category(cls):
    # A ResidencyError must not be swallowed by `except (ValueError, RuntimeError, KeyError)`.
    for builtin in (ValueError, TypeError, RuntimeError, KeyError, LookupError, OSError):
        assert not issubclass(cls, builtin)


HANDLE = ValueHandle("m-1", 7, "w0")
CUDA0 = Location.parse("cuda:0")


def _transition() -> Transition:
    return Transition(1, 5, "release", HANDLE, CUDA0, -512, 123)


def _instances():
    report = ExecutionReport((_transition(),))
    return {
        "budget": (
            ResidencyBudgetError(CUDA0, 4096, 3072, 512, 1024),
            {
                "location": CUDA0,
                "budget_bytes": 4096,
                "used_bytes": 3072,
                "reserved_bytes": 512,
                "requested_bytes": 1024,
            },
        ),
        "plan": (ResidencyPlanError("the plan is infeasible at enter #0"), {"reason": None}),
        "search-limit": (
            ResidencySearchLimitError("step-7", 100, 100, "3 fallback tiers"),
            {
                "request_name": "step-7",
                "state_limit": 100,
                "explored_states": 100,
                "detail": "3 fallback tiers",
            },
        ),
        "stale": (
            ResidencyStaleStateError(10, 12),
            {"expected_version": 10, "actual_version": 12},
        ),
        "in-use-transfer": (
            ResidencyInUseError(HANDLE, CUDA0, 0, 0, 0, operation="release", transfer="incoming"),
            {"handle": HANDLE, "location": CUDA0, "operation": "release", "transfer": "incoming"},
        ),
        "in-use": (
            ResidencyInUseError(HANDLE, CUDA0, 1, 2, 3),
            {
                "handle": HANDLE,
                "location": CUDA0,
                "use_count": 1,
                "hold_count": 2,
                "pending_event_count": 3,
            },
        ),
        "unavailable": (
            ResidencyUnavailableError(HANDLE, CUDA0, "it has no materialization there"),
            {"handle": HANDLE, "location": CUDA0, "detail": "it has no materialization there"},
        ),
        "execution": (
            ResidencyPlanExecutionError(
                "enter",
                failed_action=Release(HANDLE, "cuda:0"),
                failed_action_index=2,
                partial_report=report,
            ),
            {
                "phase": "enter",
                "failed_action": Release(HANDLE, "cuda:0"),
                "failed_action_index": 2,
                "failed_reservation": None,
                "failed_reservation_index": None,
                "partial_report": report,
            },
        ),
        "execution-reservation": (
            ResidencyPlanExecutionError(
                "reserve",
                failed_reservation=MemoryReservation("kv", "cuda:0", 1024),
                failed_reservation_index=0,
                partial_report=ExecutionReport(),
            ),
            {
                "phase": "reserve",
                "failed_action": None,
                "failed_action_index": None,
                "failed_reservation": MemoryReservation("kv", "cuda:0", 1024),
                "failed_reservation_index": 0,
            },
        ),
    }


INSTANCES = _instances()


@pytest.mark.parametrize("key", list(INSTANCES))
def test_every_documented_field_is_an_attribute_with_the_given_value(key):
    error, fields = INSTANCES[key]
    for name, value in fields.items():
        assert hasattr(error, name), name
        if value is not None or name.startswith("failed_"):
            assert getattr(error, name) == value, name


@pytest.mark.parametrize("key", list(INSTANCES))
def test_str_is_a_non_empty_sentence_naming_the_numbers(key):
    error, fields = INSTANCES[key]
    text = str(error)
    assert text and text == error.args[0]
    for name, value in fields.items():
        if isinstance(value, (int, str, Location)) and not isinstance(value, bool):
            assert str(value) in text, (name, text)


@pytest.mark.parametrize("key", list(INSTANCES))
def test_pickling_round_trips_the_type_the_fields_and_the_message(key):
    error, fields = INSTANCES[key]
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert str(clone) == str(error)
    assert clone.args == error.args
    for name in fields:
        assert getattr(clone, name) == getattr(error, name), name
    with pytest.raises(ResidencyError):
        raise clone


def test_budget_error_str_shows_every_byte_field_and_the_missing_headroom():
    error = ResidencyBudgetError(CUDA0, 4096, 3072, 512, 1024)
    text = str(error)
    for number in ("4096", "3072", "512", "1024", "4608"):
        assert number in text
    assert "cuda:0" in text
    assert error.current_bytes == 3584
    assert error.missing_bytes == 512  # 3072 + 512 + 1024 - 4096
    assert "raise the budget" in text


@pytest.mark.parametrize(
    ("kind", "smaller"),
    [
        ("materialization", "the value smaller"),
        ("reservation", "the reservation smaller"),
        ("reconstruction", "the value smaller, or give its source a source_location"),
    ],
)
def test_a_request_larger_than_the_whole_budget_says_it_can_never_fit(kind, smaller):
    """Freeing room cannot admit what an empty location would not hold: the advice says what
    would (a budget of at least the request, or a smaller request); every field stays."""
    handle = None if kind == "reservation" else ValueHandle("m", 1, "big")
    error = ResidencyBudgetError(CUDA0, 4096, 1024, 512, 8192, handle=handle, kind=kind)
    text = str(error)
    assert error.never_fits
    assert "free " not in text and "release or move" not in text
    assert (
        "; it can never fit under this budget, even with nothing else charged at cuda:0: "
        f"raise the budget to at least {format_bytes(8192)}, or make {smaller}"
    ) in text
    fields = (error.location, error.budget_bytes, error.used_bytes, error.reserved_bytes)
    assert fields == (CUDA0, 4096, 1024, 512)
    assert (error.requested_bytes, error.handle, error.kind) == (8192, handle, kind)
    assert error.missing_bytes == 1024 + 512 + 8192 - 4096
    # Exactly the whole budget fits an empty location: the usual advice.
    fits_empty = ResidencyBudgetError(CUDA0, 4096, 1024, 0, 4096, kind=kind)
    assert not fits_empty.never_fits
    assert f"free {format_bytes(1024)} there (release or move values" in str(fits_empty)


def test_plan_error_reason_is_its_message_and_subclasses_carry_a_reason_too():
    assert ResidencyPlanError("no room").reason == "no room"
    limit = ResidencySearchLimitError("r", 5, 5, "d")
    assert limit.reason == str(limit) and "'r'" in limit.reason
    assert "12" in ResidencyStaleStateError(10, 12).reason


def test_search_limit_message_says_feasibility_is_unknown_not_disproved():
    text = str(ResidencySearchLimitError("step-7", 100, 100, "d"))
    assert "unknown" in text and "search_state_limit" in text


def test_execution_error_refuses_an_unknown_phase():
    with pytest.raises(ValueError, match="warmup"):
        ResidencyPlanExecutionError("warmup", partial_report=ExecutionReport())


@pytest.mark.parametrize("phase", ["execute", "reclaim", "reserve", "enter", "exit"])
def test_execution_error_accepts_every_documented_phase_and_chains_its_cause(phase):
    cause = OSError("copy engine fault")
    with pytest.raises(ResidencyPlanExecutionError) as info:
        try:
            raise cause
        except OSError as error:
            raise ResidencyPlanExecutionError(
                phase, partial_report=ExecutionReport((_transition(),))
            ) from error
    assert info.value.phase == phase
    assert info.value.__cause__ is cause
    assert info.value.partial_report.transitions == (_transition(),)
    assert "1 committed transition" in str(info.value)


def test_budget_error_from_the_model_carries_the_ledger_numbers():
    state = make_state({"cuda:0": 2048})
    state.register(name="a", charge_bytes=1024, location="cuda:0")
    state.reserve("ws", "cuda:0", 512)
    with pytest.raises(ResidencyBudgetError) as info:
        state.register(name="b", charge_bytes=1024, location="cuda:0")
    error = info.value
    assert (error.location, error.budget_bytes, error.used_bytes) == (CUDA0, 2048, 1024)
    assert (error.reserved_bytes, error.requested_bytes) == (512, 1024)


def test_in_use_error_from_the_model_carries_every_protection_count():
    state = make_state()
    handle = state.register(
        name="a", charge_bytes=512, location="cuda:0", replica_mode=ReplicaMode.REPLICABLE
    )
    state.register(name="b", charge_bytes=512, location="pinned-host")
    state.lease(handle, "cuda:0")
    state.hold(handle, "cuda:0")
    state.hold(handle, "cuda:0")
    state.record_events(handle, "cuda:0", 3)
    state.begin_copy(handle, "cuda:0", "pinned-host", move=False)  # the copy reads it: +1 event
    with pytest.raises(ResidencyInUseError) as info:
        state.release(handle, "cuda:0")
    error = info.value
    assert (error.handle, error.location) == (handle, CUDA0)
    assert (error.use_count, error.hold_count, error.pending_event_count) == (1, 2, 4)
    assert "use_count=1" in str(error) and "hold_count=2" in str(error)
    assert "pending_event_count=4" in str(error)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (None, "unlimited"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1536 B (1.5 KiB)"),
        (3 << 30, "3221225472 B (3.0 GiB)"),
    ],
)
def test_format_bytes_gives_exact_bytes_first(nbytes, text):
    assert format_bytes(nbytes) == text
