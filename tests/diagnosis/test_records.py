"""The records a diagnosis reads, without a manager: every error's ``to_dict``, transitions that
name both ends of a transfer, the trace's and the execution report's JSON, and which committed
transitions an execution report counts as in effect."""

from __future__ import annotations

import json
import pickle

import pytest

from aresidency.core import (
    ExecutionReport,
    Location,
    Materialize,
    MemoryReservation,
    Move,
    ResidencyBudgetError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
    ResidencyUnavailableError,
    Transition,
    ValueHandle,
    explain_plan,
)
from aresidency.core.errors import exception_to_dict
from aresidency.core.state import ResidencyState
from aresidency.diagnosis import diagnose
from aresidency.diagnosis.evidence import trace_from_dict, transition_from_dict

H = ValueHandle("m-1", 7, "w0")
CUDA0 = Location.parse("cuda:0")
PINNED = Location.parse("pinned-host")


def _t(seq: int, kind: str, location: str | None, nbytes: int, **kw: object) -> Transition:
    handle = kw.pop("handle", H)
    return Transition(
        seq,
        seq,
        kind,
        handle,
        None if location is None else Location.parse(location),
        nbytes,
        seq * 1000,
        **kw,  # type: ignore[arg-type]
    )


def _errors() -> list[ResidencyError]:
    plan = ResidencyPlan(enter=[Move(H, "cuda:0")], reserve=[MemoryReservation("kv", CUDA0, 512)])
    report = ExecutionReport((_t(1, "release", "cuda:0", -512),))
    execution = ResidencyPlanExecutionError(
        "enter",
        failed_action=Move(H, "cuda:0"),
        failed_action_index=0,
        partial_report=report,
        detail="enter failed",
        plan=plan,
    )
    execution.__cause__ = OSError("copy engine fault")
    return [
        ResidencyBudgetError(CUDA0, 4096, 3072, 512, 1024, handle=H, kind="materialization"),
        ResidencyBudgetError(CUDA0, 4096, 3072, 512, 1024, kind="reservation", what="kv"),
        ResidencyPlanError("infeasible at enter #0"),
        ResidencySearchLimitError("step-7", 100, 100, "3 fallback tiers"),
        ResidencyStaleStateError(10, 12),
        ResidencyInUseError(H, CUDA0, 1, 2, 3, owners=("reader",)),
        ResidencyUnavailableError(H, CUDA0, "it has no materialization there"),
        execution,
    ]


@pytest.mark.parametrize("error", _errors(), ids=lambda e: type(e).__name__)
def test_every_error_to_dict_is_json_with_type_message_and_every_field(error: ResidencyError):
    data = json.loads(json.dumps(error.to_dict()))
    assert data["type"] == type(error).__name__
    assert data["message"] == str(error)
    for name in type(error).FIELDS:
        assert name in data, name


def test_the_cases_cover_every_error_class_and_every_attribute():
    def subclasses(cls: type) -> set[type]:
        return {c for s in cls.__subclasses__() for c in {s} | subclasses(s)}

    assert {type(e) for e in _errors()} == subclasses(ResidencyError)
    for error in _errors():
        data = error.to_dict()
        missing = [n for n in vars(error) if not n.startswith("_") and n not in data]
        assert not missing, (type(error).__name__, missing)


def test_error_dicts_turn_handles_locations_and_plans_into_json():
    budget = _errors()[0].to_dict()
    assert budget["handle"] == {"manager_id": "m-1", "value_id": 7, "name": "w0"}
    assert budget["location"] == "cuda:0" and budget["missing_bytes"] == 512
    assert budget["kind"] == "materialization" and budget["in_simulation"] is False
    execution = _errors()[-1].to_dict()
    assert execution["failed_action"] == {
        "type": "Move",
        "handle": {"manager_id": "m-1", "value_id": 7, "name": "w0"},
        "location": "cuda:0",
    }
    assert execution["plan"]["reserve"][0]["nbytes"] == 512
    assert execution["partial_report"]["in_effect"] == [1]
    assert execution["cause"] == {"type": "OSError", "message": "copy engine fault"}


def test_an_exception_whose_str_raises_is_converted_and_diagnosed_not_raised():
    """An application exception with a broken __str__ (raised while diagnosing, or chained
    under a residency error): exception_to_dict called str() on it and diagnose raised that
    failure instead of reporting. It now reads as the traceback module prints it."""

    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    data = exception_to_dict(Broken())
    assert data == {
        "type": "Broken",
        "message": "<exception str() failed: RuntimeError: no text>",
    }
    json.dumps(data)
    chained = ResidencyPlanError("infeasible")
    chained.__cause__ = Broken()
    assert chained.to_dict()["cause"]["type"] == "Broken"
    report = diagnose(Broken())
    assert report.error_type == "Broken" and "str() failed" in str(report)


def test_a_chained_residency_cause_is_nested_with_its_fields():
    cause = ResidencyBudgetError(CUDA0, 4096, 3072, 512, 1024, handle=H)
    try:
        try:
            raise cause
        except ResidencyBudgetError as error:
            raise ResidencyPlanError("infeasible") from error
    except ResidencyPlanError as error:
        data = exception_to_dict(error)
    assert data["cause"]["type"] == "ResidencyBudgetError"
    assert data["cause"]["requested_bytes"] == 1024


@pytest.mark.parametrize("error", _errors(), ids=lambda e: type(e).__name__)
def test_new_fields_survive_pickling(error: ResidencyError):
    clone = pickle.loads(pickle.dumps(error))
    assert str(clone) == str(error)
    assert {k: v for k, v in clone.to_dict().items() if k != "cause"} == {
        k: v for k, v in error.to_dict().items() if k != "cause"
    }


def test_budget_error_names_what_was_asked_and_refuses_an_unknown_kind():
    assert "a MemoryReservation" in str(_errors()[1])
    text = str(ResidencyBudgetError(PINNED, 1024, 512, 0, 1024, handle=H, kind="reconstruction"))
    assert "temporary reconstruction storage" in text
    assert "simulat" not in text
    with pytest.raises(ValueError, match="'eviction'"):
        ResidencyBudgetError(CUDA0, 1, 0, 0, 2, kind="eviction")


def test_a_budget_error_from_explain_says_its_numbers_are_the_simulated_state():
    state = ResidencyState(budgets={"cuda:0": 1024})
    a = state.register(name="a", charge_bytes=512, location="pinned-host")
    b = state.register(name="b", charge_bytes=1024, location="pinned-host")
    plan = ResidencyPlan(enter=[Materialize(a, "cuda:0"), Materialize(b, "cuda:0")])
    error = explain_plan(state, plan).blocking_error
    assert isinstance(error, ResidencyBudgetError)
    # Partway through the plan: a's 512 B are charged in the simulation, not in the state.
    assert (error.used_bytes, error.requested_bytes, error.handle) == (512, 1024, b)
    assert error.in_simulation and error.to_dict()["in_simulation"] is True
    assert "simulated state partway through the plan" in str(error)
    assert state.ledger("cuda:0").used_bytes == 0
    with pytest.raises(ResidencyBudgetError) as live:
        state.register(name="c", charge_bytes=2048, location="cuda:0")
    assert not live.value.in_simulation and "simulat" not in str(live.value)


def test_in_use_error_names_its_owning_tasks():
    error = ResidencyInUseError(H, CUDA0, 1, 0, 0, operation="release")
    assert "'reader'" not in str(error) and error.owners == ()
    assert error.with_owners(("reader",)) is error
    assert "'reader'" in str(error) and "'reader'" in error.args[0]


# ----------------------------------------------------------------------- transitions


def test_a_move_names_both_ends_in_its_begin_and_its_commit():
    state = ResidencyState(budgets={})
    h = state.register(name="w", charge_bytes=512, location="cuda:0")
    ticket = state.begin_copy(h, "cuda:0", "pinned-host", move=True)
    state.commit_copy(ticket)
    begin, commit = state.trace_ring.view().transitions[-2:]
    # Where the bytes changed stays as it was (the ledger replay depends on it) ...
    assert (begin.location, begin.nbytes) == (PINNED, 512)
    assert (commit.location, commit.nbytes) == (CUDA0, -512)
    # ... and both entries say which way the data went.
    for transition in (begin, commit):
        assert (transition.source, transition.destination) == (CUDA0, PINNED)
        assert "move cuda:0 -> pinned-host" in str(transition)
    assert commit.to_dict()["source"] == "cuda:0"
    assert commit.to_dict()["destination"] == "pinned-host"


def test_a_load_through_its_source_location_names_it_as_the_source():
    state = ResidencyState(budgets={})
    h = state.register(name="w", charge_bytes=512, has_source=True, source_location="pageable-host")
    ticket = state.begin_load(h, "cuda:0")
    state.commit_copy(ticket)
    temp, begin, commit = state.trace_ring.view().transitions[-3:]
    assert [t.kind for t in (temp, begin, commit)] == ["rebuild_temp", "load_begin", "load_commit"]
    assert all(t.source == Location.parse("pageable-host") for t in (temp, begin, commit))
    assert all(t.destination == CUDA0 for t in (temp, begin, commit))
    assert "load pageable-host -> cuda:0" in str(begin)


def test_an_abort_names_both_ends_without_calling_a_move_a_copy():
    state = ResidencyState(budgets={})
    h = state.register(name="w", charge_bytes=512, location="pinned-host")
    state.abort_copy(state.begin_copy(h, "pinned-host", "cuda:0", move=True))
    begin, abort = state.trace_ring.view().transitions[-2:]
    assert "move pinned-host -> cuda:0" in str(begin)
    assert abort.kind == "copy_abort"  # the kind of every transfer's abort
    assert "transfer pinned-host -> cuda:0 aborted, -512 B at cuda:0" in str(abort)


def test_transitions_and_traces_round_trip_through_json():
    state = ResidencyState(budgets={})
    h = state.register(name="w", charge_bytes=512, location="cuda:0")
    state.commit_copy(state.begin_copy(h, "cuda:0", "pinned-host", move=True))
    state.reserve("kv", "cuda:0", 1024)
    trace = state.trace_ring.view()
    text = json.dumps(trace.to_dict())
    assert trace_from_dict(json.loads(text)) == trace
    for transition in trace.transitions:
        assert transition_from_dict(json.loads(json.dumps(transition.to_dict()))) == transition


def test_trace_between_gives_the_transitions_after_one_version_up_to_another():
    state = ResidencyState(budgets={})
    for i in range(5):
        state.register(name=f"v{i}", charge_bytes=512, location="pinned-host")
    assert [t.state_version for t in state.trace_ring.view().between(2, 4)] == [3, 4]


# ------------------------------------------------------------------ execution reports


def test_in_effect_leaves_out_aborts_and_the_begins_they_undid():
    report = ExecutionReport(
        (
            _t(1, "move_begin", "pinned-host", 512, source=CUDA0, destination=PINNED),
            _t(2, "move_commit", "cuda:0", -512, source=CUDA0, destination=PINNED),
            _t(3, "reserve", "cuda:0", 1024, handle=None, name="ws"),
            _t(4, "move_begin", "cuda:0", 512, source=PINNED, destination=CUDA0),
            _t(5, "copy_abort", "cuda:0", -512, source=PINNED, destination=CUDA0),
            _t(6, "unreserve", "cuda:0", -1024, handle=None, name="ws"),
        ),
        cleanup=frozenset({6}),
    )
    assert [t.seq for t in report.in_effect] == [1, 2]
    assert [t.seq for t in report.undone] == [3, 4, 5, 6]
    assert report.transitions[0].seq == 1 and len(report) == 6
    assert report.to_dict()["in_effect"] == [1, 2]


def test_an_unreserve_not_marked_as_clean_up_is_an_effect():
    # A scope's exit ends its reservations: that is an effect, not a clean-up.
    report = ExecutionReport(
        (
            _t(1, "reserve", "cuda:0", 1024, handle=None, name="ws"),
            _t(2, "unreserve", "cuda:0", -1024, handle=None, name="ws"),
        )
    )
    assert [t.seq for t in report.in_effect] == [1, 2]


def test_a_rebuild_abort_undoes_only_its_own_temporary_charge():
    src = Location.parse("pageable-host")
    report = ExecutionReport(
        (
            _t(1, "rebuild_temp", "pageable-host", 512, source=src, destination=CUDA0),
            _t(2, "load_begin", "cuda:0", 512, source=src, destination=CUDA0),
            _t(3, "copy_abort", "cuda:0", -512, source=src, destination=CUDA0),
            _t(4, "rebuild_abort", "pageable-host", -512, source=src, destination=CUDA0),
            _t(5, "release", "pinned-host", -512),
        )
    )
    assert [t.seq for t in report.in_effect] == [5]


def test_execution_error_message_counts_only_what_stays_in_effect():
    report = ExecutionReport(
        (
            _t(1, "move_begin", "pinned-host", 512, source=CUDA0, destination=PINNED),
            _t(2, "move_commit", "cuda:0", -512, source=CUDA0, destination=PINNED),
            _t(3, "move_begin", "cuda:0", 512, source=PINNED, destination=CUDA0),
            _t(4, "copy_abort", "cuda:0", -512, source=PINNED, destination=CUDA0),
        )
    )
    error = ResidencyPlanExecutionError("enter", partial_report=report)
    assert "2 committed transition(s) stay in effect (2 more were clean-up" in str(error)
    error.set_report(ExecutionReport(report.transitions[:2]))
    assert "2 committed transition(s) stay in effect (see" in error.args[0]
