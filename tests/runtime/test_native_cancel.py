"""Work that must finish does, under a *native* cancellation too.

On asyncio (and uvloop) ``task.cancel()``, ``asyncio.timeout`` and ``asyncio.wait_for`` throw
``CancelledError`` through an anyio shield; a scope's exit, the clean-up wait of a cancelled
phase and the manager's close must finish anyway and raise the cancellation afterwards. On
trio the same tests cancel through a cancel scope (trio has no other kind of cancellation).

The device work is held back by a "kernel" that waits on a ``threading.Event`` on a reader
stream (the simulation runs it on the stream's worker thread): a move out of the value waits
for it, so the tests know the exit is in flight without timing anything.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from _native import on_asyncio

from aresidency import (
    Location,
    MaterializationState,
    MemoryReservation,
    Move,
    ResidencyManager,
    ResidencyPlan,
)

pytestmark = pytest.mark.anyio

KiB = 1024
CUDA0 = Location.parse("cuda:0")
PINNED = Location.parse("pinned-host")


def tensor(n_bytes: int = 16 * KiB, seed: int = 0) -> torch.Tensor:
    return torch.randn(n_bytes // 4, generator=torch.Generator().manual_seed(seed))


async def cancel_when(
    fn: Callable[[], Awaitable[None]],
    when: Callable[[], Awaitable[None]],
    *,
    twice: bool = False,
    then: Callable[[], None] = lambda: None,
) -> str:
    """Run ``fn()`` in a task of its own; once ``when()`` returned, cancel it, natively on
    asyncio (``task.cancel()``, twice if asked), through a cancel scope on trio; then call
    ``then()`` (let the device work go on). Returns ``"cancelled"`` or ``"completed"``."""
    if on_asyncio():
        task = asyncio.get_running_loop().create_task(fn())
        await when()
        task.cancel()
        if twice:
            await asyncio.sleep(0)
            task.cancel()
        await asyncio.sleep(0)
        then()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "completed"
    outcome = "completed"
    scope = anyio.CancelScope()

    async def runner() -> None:
        nonlocal outcome
        with scope:
            await fn()
        if scope.cancelled_caught:
            outcome = "cancelled"

    async with anyio.create_task_group() as tg:
        tg.start_soon(runner)
        await when()
        scope.cancel()
        await anyio.lowlevel.checkpoint()
        then()
    return outcome


async def until(m: ResidencyManager, condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await m.wait_for_change()


def state_at(m: ResidencyManager, handle: Any, location: Location) -> Any:
    for mat in m.snapshot().value(handle).materializations:
        if mat.location == location:
            return mat.state
    return None


async def test_a_native_cancel_while_the_exit_runs_still_carries_it_out() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        gate = threading.Event()
        plan = ResidencyPlan(
            reserve=[MemoryReservation("ws", "cuda:0", 8 * KiB)], exit=[Move(a, "pinned-host")]
        )
        scopes: list[Any] = []

        async def body() -> None:
            async with m.scope(plan) as scope:
                scopes.append(scope)
                async with m.acquire(a, "cuda:0") as lease:
                    m.backend.run_in_stream_order(lease.stream, gate.wait)

        async def exit_in_flight() -> None:
            await until(m, lambda: state_at(m, a, PINNED) is MaterializationState.INCOMING)

        try:
            outcome = await cancel_when(body, exit_in_flight, twice=True, then=gate.set)
        finally:
            gate.set()
        # Raised once the exit finished (on trio only at a later checkpoint, if any).
        assert outcome == "cancelled" or not on_asyncio()
        # Nothing is left in flight when the cancelled task goes on: the exit finished first.
        assert [str(x) for x in m.snapshot().value(a).locations] == ["pinned-host"]
        assert state_at(m, a, PINNED) is MaterializationState.RESIDENT
        assert scopes[0].exit_error is None and scopes[0].status == "exited"
        assert m.snapshot().locations[CUDA0].reserved_bytes == 0


@pytest.mark.parametrize("steps", range(8))
async def test_a_native_cancel_at_any_step_of_the_exit_still_carries_it_out(steps: int) -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        body_done = anyio.Event()
        plan = ResidencyPlan(exit=[Move(a, "pinned-host")])
        scopes: list[Any] = []

        async def body() -> None:
            async with m.scope(plan) as scope:
                scopes.append(scope)
                body_done.set()

        async def after_steps() -> None:
            await body_done.wait()
            for _ in range(steps):
                await anyio.lowlevel.checkpoint()

        outcome = await cancel_when(body, after_steps)
        assert outcome in ("cancelled", "completed")
        assert [str(x) for x in m.snapshot().value(a).locations] == ["pinned-host"]
        assert state_at(m, a, PINNED) is MaterializationState.RESIDENT
        assert scopes[0].exit_error is None


async def test_a_timeout_expiring_during_the_exit_is_a_timeout_after_the_exit() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        gate = threading.Event()
        plan = ResidencyPlan(exit=[Move(a, "pinned-host")])
        in_exit = anyio.Event()
        unlisten = m.add_change_listener(
            lambda: (
                in_exit.set() if state_at(m, a, PINNED) is MaterializationState.INCOMING else None
            )
        )
        try:
            with pytest.raises(TimeoutError):
                if on_asyncio():
                    async with asyncio.timeout(None) as deadline:
                        async with m.scope(plan) as scope:
                            async with m.acquire(a, "cuda:0") as lease:
                                m.backend.run_in_stream_order(lease.stream, gate.wait)

                            async def expire() -> None:
                                await in_exit.wait()
                                deadline.reschedule(asyncio.get_running_loop().time())
                                await asyncio.sleep(0)
                                gate.set()

                            asyncio.get_running_loop().create_task(expire())
                else:
                    with anyio.fail_after(None) as deadline_scope:  # type: ignore[arg-type]
                        async with m.scope(plan) as scope:
                            async with m.acquire(a, "cuda:0") as lease:
                                m.backend.run_in_stream_order(lease.stream, gate.wait)
                            deadline_scope.deadline = anyio.current_time()
                            gate.set()
                            raise TimeoutError  # trio: a deadline in the body, as fail_after
        finally:
            gate.set()
            unlisten()
        assert [str(x) for x in m.snapshot().value(a).locations] == ["pinned-host"]
        assert scope.exit_error is None


async def test_a_second_native_cancel_does_not_cut_the_clean_up_of_a_cancelled_entry() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        gate = threading.Event()
        async with m.acquire(a, "cuda:0") as lease:
            m.backend.run_in_stream_order(lease.stream, gate.wait)  # the move waits for it
        plan = ResidencyPlan(enter=[Move(a, "pinned-host")])
        left_in_flight: list[list[Any]] = []

        async def enter_then_look() -> None:
            try:
                async with m.scope(plan):
                    pass  # pragma: no cover - cancelled during entry
            finally:
                snap = m.snapshot()  # before anything else runs on the loop
                left_in_flight.append(
                    [
                        (str(x.location), x.state)
                        for v in snap.values.values()
                        for x in v.materializations
                        if x.state is not MaterializationState.RESIDENT
                    ]
                )

        async def entry_in_flight() -> None:
            await until(m, lambda: state_at(m, a, PINNED) is MaterializationState.INCOMING)

        try:
            outcome = await cancel_when(enter_then_look, entry_in_flight, twice=True, then=gate.set)
        finally:
            gate.set()
        assert outcome == "cancelled"
        assert left_in_flight == [[]]  # every transfer committed or aborted before it went on
        assert m.snapshot().locations[CUDA0].reserved_bytes == 0


async def test_closing_the_manager_finishes_under_a_native_cancel() -> None:
    m = ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim")
    gate = threading.Event()
    pending: list[Any] = []

    async def run_and_close() -> None:
        async with m:
            a = m.register(tensor(), name="a", location="cuda:0")
            async with m.acquire(a, "cuda:0") as lease:
                m.backend.run_in_stream_order(lease.stream, gate.wait)
            # The move's copy waits for a's reader (the gate): in flight when the block ends.
            pending.append(m.materialize_nowait(a, "pinned-host"))

    async def closing() -> None:
        await anyio.lowlevel.checkpoint()
        while m.running or not pending:
            await anyio.lowlevel.checkpoint()

    try:
        outcome = await cancel_when(run_and_close, closing, twice=True, then=gate.set)
    finally:
        gate.set()
    assert outcome == "cancelled" or not on_asyncio()
    assert not m.running
    # The close waited for the move (a closed backend did not cut it), then re-raised.
    assert pending[0].done() and pending[0].exception() is None
    (value,) = m.state.values()
    assert [str(x) for x in value.materializations] == ["pinned-host"]


@pytest.mark.parametrize("how", ["a task group's failed child", "a cancellation swallowed"])
async def test_closing_raises_no_cancellation_nobody_sent(how: str) -> None:
    """The task's native cancellation count can stay raised with nothing cancelling it:
    Python 3.11's ``asyncio.TaskGroup`` leaves it so after a child failed (the error handled
    with ``except*``), and a caught ``CancelledError`` without ``uncancel()`` does the same on
    every version. Leaving the manager then closes it and raises nothing (anyio would re-raise
    its own cancellation of the background tasks); a cancellation that arrives during the
    close is still raised (the other tests of this module)."""
    if not on_asyncio():
        pytest.skip("a native cancellation count exists on asyncio only")
    task = asyncio.current_task()
    assert task is not None
    m = ResidencyManager(backend="sim")
    async with m:
        h = m.register(tensor(), name="a")
        if how == "a task group's failed child":

            async def fails() -> None:
                await asyncio.sleep(0)
                raise ValueError("a request handler failed")

            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(m.materialize(h, "cuda:0"))
                    group.create_task(fails())
            except* ValueError:
                pass
        else:
            task.cancel()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass  # swallowed, the count left as it is
            assert task.cancelling() == 1
        await m.move(h, "pinned-host")  # the manager still works
    assert not m.running
    while task.cancelling():  # (the count as the test found it, for the runner)
        task.uncancel()
