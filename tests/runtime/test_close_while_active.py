"""Closing the manager while leases, holds, scopes and reservation blocks are still active.

The state is final once the manager closed: what ends afterwards changes nothing (no
transition, no state version, no call into the closed backend) and raises
``ManagerClosedError``, the error of every operation after close.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import Move, ResidencyManager, ResidencyPlan
from aresidency.backends.sim import SimBackend
from aresidency.runtime import ManagerClosedError

pytestmark = pytest.mark.anyio

KiB = 1024


def tensor(n_bytes: int = 16 * KiB, seed: int = 0) -> torch.Tensor:
    return torch.randn(n_bytes // 4, generator=torch.Generator().manual_seed(seed))


async def test_everything_that_ends_after_close_raises_closed_and_changes_nothing() -> None:
    m = ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim")
    closed = anyio.Event()
    outcomes: dict[str, Any] = {}
    scopes: list[Any] = []
    entered = 0
    all_entered = anyio.Event()

    def one_more() -> None:
        nonlocal entered
        entered += 1
        if entered == 3:
            all_entered.set()

    async def lease(handle: Any) -> None:
        try:
            async with m.acquire(handle, "cuda:0"):
                one_more()
                await closed.wait()
            outcomes["lease"] = "exited"
        except ManagerClosedError as error:
            outcomes["lease"] = error

    async def scope(handle: Any) -> None:
        plan = ResidencyPlan(exit=[Move(handle, "pinned-host")])
        try:
            async with m.scope(plan) as entered_scope:
                scopes.append(entered_scope)
                one_more()
                await closed.wait()
            outcomes["scope"] = "exited"
        except ManagerClosedError as error:
            outcomes["scope"] = error

    async def reservation() -> None:
        try:
            async with m.reservation("ws", "cuda:0", 4 * KiB):
                one_more()
                await closed.wait()
            outcomes["reservation"] = "ended"
        except ManagerClosedError as error:
            outcomes["reservation"] = error

    async with anyio.create_task_group() as tg:
        async with m:
            a = m.register(tensor(), name="a", location="cuda:0")
            b = m.register(tensor(seed=1), name="b", location="cuda:0")
            c = m.register(tensor(seed=2), name="c", location="cuda:0")
            hold = m.hold(c, "cuda:0")
            tg.start_soon(lease, a)
            tg.start_soon(scope, b)
            tg.start_soon(reservation)
            with anyio.fail_after(10):
                await all_entered.wait()
            version = m.state_version
        with pytest.raises(ManagerClosedError):
            hold.release()
        closed.set()
    assert m.state_version == version  # nothing changed after close
    for what in ("lease", "scope", "reservation"):
        assert isinstance(outcomes[what], ManagerClosedError), (what, outcomes[what])
    assert isinstance(scopes[0].exit_error, ManagerClosedError)
    assert "not carried out" in str(scopes[0].exit_error)
    # The final state is the state at close: the exit move did not begin.
    (record,) = [v for v in m.state.values() if v.handle.name == "b"]
    assert [str(x) for x in record.materializations] == ["cuda:0"]


@pytest.mark.parametrize("turns", range(3))
async def test_a_scope_exit_that_wakes_as_the_close_stops_waiting_is_not_cut_off(
    turns: int,
) -> None:
    # The close waits for the work in flight, then freezes the state. A scope's body that
    # wakes when that last work finishes must find the state either still open (its exit is
    # carried out and waited for) or final (ManagerClosedError): never an exit begun that
    # the close does not wait for (its copy cut off by the closed backend). ``turns`` of the
    # loop after the wake-up land the exit before, in and after the close's last steps.
    # Copies slow enough (about 0.1 s each) to be in flight still if a close cut them off.
    backend = SimBackend(copy_gbps=16 * KiB / 0.1 / 1e9)
    m = ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend=backend)
    gate = threading.Event()
    scopes: list[Any] = []
    outcome: list[Any] = []
    woke = anyio.Event()

    async def scope(handle: Any, *, task_status: Any) -> None:
        try:
            async with m.scope(ResidencyPlan(exit=[Move(handle, "pinned-host")])) as entered:
                scopes.append(entered)
                task_status.started()
                await woke.wait()
                for _ in range(turns):
                    await anyio.lowlevel.checkpoint()
            outcome.append("exited")
        except ManagerClosedError as error:
            outcome.append(error)

    async def open_gate_once_closing(*, task_status: Any) -> None:
        task_status.started()
        with pytest.raises(ManagerClosedError):
            await m.wait_for_change()  # woken when the close begins
        gate.set()

    try:
        async with anyio.create_task_group() as tg, m:
            a = m.register(tensor(), name="a", location="cuda:0")
            b = m.register(tensor(seed=1), name="b", location="cuda:0")
            async with m.acquire(a, "cuda:0") as lease:
                m.backend.run_in_stream_order(lease.stream, gate.wait)
            # In flight until the gate opens: the move waits for the reader.
            pending = m.materialize_nowait(a, "pinned-host")
            pending.add_done_callback(lambda _: woke.set())
            await tg.start(scope, b)
            await tg.start(open_gate_once_closing)
    finally:
        gate.set()
    assert pending.done() and pending.exception() is None
    (entered,) = scopes
    (record,) = [v for v in m.state.values() if v.handle == b]
    states = {str(loc): mat.state.value for loc, mat in record.materializations.items()}
    if outcome == ["exited"]:  # the exit began before the state froze: the close waited
        assert entered.exit_error is None and states == {"pinned-host": "resident"}
    else:
        assert isinstance(outcome[0], ManagerClosedError), outcome
        assert entered.exit_error is outcome[0]
        assert states == {"cuda:0": "resident"}
    m.state.check_invariants()


async def test_the_final_state_is_read_after_close_as_a_dump_reads_it() -> None:
    """``manager.snapshot()`` and ``manager.trace()`` after the ``async with`` block raised
    ``ManagerClosedError`` ("it carries out nothing more"), while ``manager.dump`` and
    ``diagnose`` read the same final state: an ``except`` around the whole block could not
    print the snapshot of the failure it caught. They return the final state now (what was
    active at close included); operations still raise."""
    m = ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim")
    async with m:
        h = m.register(tensor(), name="w")
        await m.move(h, "cuda:0")
        hold = m.hold(h, "cuda:0")
        inside, trace_inside = m.snapshot(), m.trace()
    assert m.snapshot() == inside and m.snapshot().state_version == m.state_version
    assert m.trace() == trace_inside
    record = m.snapshot().value(h).materialization("cuda:0")
    assert record.hold_count == 1  # active at close, kept in the final state
    with pytest.raises(ManagerClosedError):
        await m.move(h, "pinned-host")
    with pytest.raises(ManagerClosedError):
        hold.release()
    errors: list[BaseException] = []

    def other() -> None:  # the state is final: any thread may read it
        try:
            assert m.snapshot() == inside
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=other)
    thread.start()
    await anyio.to_thread.run_sync(thread.join)
    assert errors == []
