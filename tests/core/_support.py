"""Helpers shared by the core tests: a deterministic state factory, a refusal checker, and a
driver that executes a plan on the real model the way ``explain`` simulates it."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import pytest

from aresidency.core import ResidencyPlan, ResidencyState, take_snapshot
from aresidency.core.explain import plan_phases
from aresidency.core.plans import (
    ActionFailed,
    Checkpoint,
    SettleRequest,
    TransferRequest,
    run_phase,
)

CUDA0 = "cuda:0"
CUDA1 = "cuda:1"
PAGEABLE = "pageable-host"
PINNED = "pinned-host"


def make_state(
    budgets: dict[Any, int | None] | None = None,
    *,
    trace_capacity: int = 1 << 16,
    manager_id: str = "m-test",
) -> ResidencyState:
    """A state with a deterministic clock (1, 2, 3, ... ns) and a fixed manager id."""
    clock = itertools.count(1)
    return ResidencyState(
        manager_id=manager_id,
        budgets=budgets,
        trace_capacity=trace_capacity,
        clock_ns=lambda: next(clock),
    )


def assert_refused(
    state: ResidencyState,
    call: Callable[[], Any],
    error: type[BaseException] | tuple[type[BaseException], ...],
    match: str | None = None,
) -> pytest.ExceptionInfo[BaseException]:
    """``call`` raises ``error`` and leaves the state exactly as it was: same snapshot (peaks
    included), same version, no trace entry, no transfer begun or finished."""
    before = take_snapshot(state)
    version = state.state_version
    trace = state.trace_ring.view()
    tickets = {t.ticket_id for t in state.open_tickets()}
    with pytest.raises(error, match=match) as info:
        call()
    assert state.state_version == version
    assert take_snapshot(state) == before
    after = state.trace_ring.view()
    assert after.transitions == trace.transitions
    assert after.overwritten == trace.overwritten
    assert {t.ticket_id for t in state.open_tickets()} == tickets
    state.check_invariants()
    return info


def drive(state: ResidencyState, gen: Generator[Any, Any, None]) -> None:
    """Answer a ``run_phase`` generator as a quiet device would: every transfer succeeds, copies
    in flight elsewhere complete, and every pending consumer event completes (reaped on the
    model) when it is waited for. The reads of the request's own copies are not reaped: they
    end when those copies commit (before a move of the same request)."""
    try:
        request = next(gen)
        while True:
            if isinstance(request, Checkpoint):  # a long phase pauses: go on at once
                request = gen.send(None)
                continue
            if isinstance(request, SettleRequest):
                finish_copies_elsewhere(state, request.handle, request.location, ())
                mat = state.materialization(request.handle, request.location)
                consumers = mat.pending_event_count - reads(state, request.handle, mat.location)
                if consumers > 0:
                    state.reap_events(request.handle, request.location, consumers)
                request = gen.send(None)
                continue
            assert isinstance(request, TransferRequest)
            for ticket in request.tickets:
                if ticket.source is not None and ticket.move:
                    finish_copies_elsewhere(state, ticket.handle, ticket.source, request.tickets)
                    src = state.value(ticket.handle).materializations[ticket.source]
                    extra = src.pending_event_count - reads(state, ticket.handle, ticket.source)
                    if extra > 0:
                        state.reap_events(ticket.handle, ticket.source, extra)
            request = gen.send({})
    except StopIteration:
        return


def finish_copies_elsewhere(
    state: ResidencyState, handle: Any, location: Any, ours: tuple[Any, ...]
) -> None:
    mine = {t.ticket_id for t in ours}
    for ticket in state.open_tickets():
        same = ticket.handle == handle and ticket.source == location
        if same and not ticket.move and ticket.ticket_id not in mine:
            state.commit_copy(ticket)


def reads(state: ResidencyState, handle: Any, location: Any) -> int:
    """Open transfers that read the materialization (each holds one pending event)."""
    return sum(1 for t in state.open_tickets() if t.handle == handle and t.source == location)


@dataclass
class Failure:
    phase: str
    index: int | None
    cause: BaseException


def execute(state: ResidencyState, plan: ResidencyPlan) -> Failure | None:
    """Run ``plan``'s phases on the real ``state`` (reclaim, reserve, enter, end of the
    reservations, exit) and return the first failure, or ``None``."""
    for phase, items in plan_phases(plan):
        if phase == "reserve":
            for index, reservation in enumerate(items):
                try:
                    state.reserve(reservation.name, reservation.location, reservation.nbytes)
                except Exception as error:
                    return Failure(phase, index, error)
        elif phase == "unreserve":
            for reservation in items:
                state.unreserve(reservation.name, reservation.location)
        else:
            try:
                drive(state, run_phase(state, phase, items))
            except ActionFailed as failed:
                return Failure(phase, failed.index, failed.cause)
    return None
