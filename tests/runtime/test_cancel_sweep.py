"""Cancellation and close at every point of the runtime's public calls, swept.

Each scenario below is a short run of public awaitables (direct operations, ``execute``,
``materialize_nowait(...).wait()``, scopes, leases read and write, holds, reservation
blocks, the controller's scope, rebuilds from a source, several tasks contending for a small
budget). A run uncancelled tells how many turns of the event loop it takes; then, for ``k``
spread over that range and past it (about a dozen points; ``SWEEP_STEP=1`` in the environment
tries every turn), a fresh manager (the simulated backend: a simulation of CUDA devices in
host memory) runs the scenario again and, after the ``k``-th turn:

* the scenario is cancelled (a cancel scope; natively too, ``task.cancel()``, on asyncio):
  the cancellation reaches it (or it completed first), nothing is left charged, held,
  leased, reserved, incoming or waiting, every value's data is intact and the manager still
  serves new calls;
* or the manager closes (its ``async with`` ends in the task that entered it): the scenario
  ends, completed or with ``ManagerClosedError``, nothing hangs, nothing is in flight in the
  final state and every value's data is intact.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from _native import on_asyncio
from _sweep import count_turns, sweep_points

from aresidency import (
    CallableSource,
    Location,
    MaterializationState,
    Materialize,
    MemoryReservation,
    Move,
    Release,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyPlan,
    ResidencyRequest,
    ValueHandle,
)
from aresidency.runtime import ManagerClosedError
from aresidency.testing import assert_quiet, settled

pytestmark = pytest.mark.anyio

KiB = 1024
NUMEL = 1024  # 4 KiB of float32 per value
CHARGE = 4 * KiB
CUDA0 = "cuda:0"
#: Room for four values: the contending scenarios wait for room.
BUDGET = 4 * CHARGE


def data(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


@dataclass
class World:
    """One manager and its values: ``a`` (exclusive, pinned), ``b`` (replicable, pageable),
    ``c`` (exclusive, on the device), ``s`` (rebuilt from a source, nowhere yet)."""

    m: ResidencyManager
    originals: dict[str, torch.Tensor] = field(default_factory=dict)
    h: dict[str, ValueHandle] = field(default_factory=dict)

    def register(
        self,
        name: str,
        seed: int,
        location: str,
        mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
    ) -> ValueHandle:
        original = data(seed)
        self.originals[name] = original
        handle = self.m.register(original.clone(), name=name, replica_mode=mode, location=location)
        self.h[name] = handle
        return handle

    def setup(self) -> None:
        self.register("a", 1, "pinned-host")
        self.register("b", 2, "pageable-host", ReplicaMode.REPLICABLE)
        self.register("c", 3, CUDA0)
        original = data(4)
        self.originals["s"] = original
        source = CallableSource(lambda: original.clone(), shape=(NUMEL,), dtype=torch.float32)
        self.h["s"] = self.m.register_source(source, name="s")

    def __getattr__(self, name: str) -> ValueHandle:
        try:
            return self.__dict__["h"][name]
        except KeyError:
            raise AttributeError(name) from None


# ------------------------------------------------------------------ the scenarios


async def materialize(w: World) -> None:
    await w.m.materialize(w.a, CUDA0)
    await w.m.materialize(w.b, CUDA0)  # a replica


async def move(w: World) -> None:
    await w.m.move(w.a, CUDA0)
    await w.m.move(w.a, "pageable-host")
    await w.m.move(w.c, "pinned-host")


async def release(w: World) -> None:
    await w.m.materialize(w.b, CUDA0)
    await w.m.release(w.b, "pageable-host")
    await w.m.materialize(w.b, "pinned-host")
    await w.m.release(w.b, CUDA0)


async def discard(w: World) -> None:
    d = w.register("d", 5, "pinned-host")
    await w.m.materialize(d, CUDA0)
    async with w.m.acquire(d, CUDA0) as lease:
        w.m.backend.run_in_stream_order(lease.stream, lambda: None)  # a reader to wait for
    await w.m.discard(d)


async def execute(w: World) -> None:
    plan = ResidencyPlan(
        reclaim=[Move(w.c, "pinned-host")],
        reserve=[MemoryReservation("ws", CUDA0, CHARGE)],
        enter=[Materialize(w.a, CUDA0), Materialize(w.b, CUDA0), Materialize(w.s, "pinned-host")],
        exit=[Move(w.a, "pageable-host"), Release(w.b, CUDA0)],
    )
    await w.m.execute(plan)


async def nowait(w: World) -> None:
    await w.m.materialize_nowait(w.a, CUDA0).wait()
    await w.m.materialize_nowait(w.s, CUDA0).wait()
    await w.m.materialize_nowait(w.b, "pinned-host")


async def scope(w: World) -> None:
    plan = ResidencyPlan(
        reserve=[MemoryReservation("ws", CUDA0, CHARGE // 2)],
        enter=[Materialize(w.a, CUDA0), Materialize(w.s, CUDA0)],
        exit=[Move(w.a, "pinned-host"), Release(w.s, CUDA0)],
    )
    async with w.m.scope(plan) as entered:
        async with w.m.acquire(w.a, CUDA0):
            await anyio.lowlevel.checkpoint()
        await w.m.move(w.b, "pinned-host")
    assert entered.exit_error is None


async def lease(w: World) -> None:
    async with w.m.acquire(w.c, CUDA0):
        await w.m.materialize(w.b, CUDA0)
    # entered on an incoming copy, then a write lease on a replicable value
    pending = w.m.materialize_nowait(w.a, CUDA0)
    async with w.m.acquire(w.a, CUDA0) as read:
        await anyio.lowlevel.checkpoint()
        assert read.tensor.shape == (NUMEL,)
    await pending
    async with w.m.acquire(w.b, "pageable-host", mode="write") as write:
        write.tensor.copy_(w.originals["b"])  # the same data: the value stays what it was
        await anyio.lowlevel.checkpoint()


async def hold(w: World) -> None:
    with w.m.hold(w.c, CUDA0):
        await w.m.move(w.a, CUDA0)
        await w.m.move(w.a, "pinned-host")
    async with w.m.hold(w.a, "pinned-host"):
        await w.m.move(w.c, "pageable-host")


async def reservation(w: World) -> None:
    async with w.m.reservation("ws", CUDA0, CHARGE):
        await w.m.materialize(w.a, CUDA0)
        async with w.m.reservation("ws2", "pinned-host", CHARGE):
            await w.m.move(w.c, "pinned-host")


async def controller(w: World) -> None:
    request = ResidencyRequest(
        "r",
        requirements=[(w.a, CUDA0), (w.b, CUDA0), (w.s, CUDA0)],
        reservations=[MemoryReservation("kv", CUDA0, CHARGE)],
    )
    with ResidencyController(w.m) as control:
        async with control.scope(request, timeout=None), w.m.acquire(w.s, CUDA0):  # evicts c
            await anyio.lowlevel.checkpoint()


async def rebuild(w: World) -> None:
    await w.m.materialize(w.s, CUDA0)
    await w.m.release(w.s, CUDA0)  # dropped: rebuilt from its source next
    await w.m.materialize(w.s, "pinned-host")
    await w.m.move(w.s, CUDA0)
    await w.m.release(w.s, CUDA0)
    await w.m.materialize(w.s, "pageable-host")


async def contention(w: World) -> None:
    """Four tenants for room for one at a time (c takes a quarter of the budget; each needs a
    value and a workspace): three manual scopes and a controller scope wait their turns."""

    async def tenant(handle: ValueHandle, index: int) -> None:
        plan = ResidencyPlan(
            reserve=[MemoryReservation(f"ws{index}", CUDA0, CHARGE)],
            enter=[Materialize(handle, CUDA0)],
            exit=[Move(handle, "pinned-host")],
        )
        async with w.m.scope(plan, timeout=None), w.m.acquire(handle, CUDA0):
            await anyio.lowlevel.checkpoint()

    async def decided() -> None:
        request = ResidencyRequest(
            "r", requirements=[(w.s, CUDA0)], reservations=[MemoryReservation("wsr", CUDA0, 1)]
        )
        with ResidencyController(w.m) as control:
            async with control.scope(request, timeout=None):
                await anyio.lowlevel.checkpoint()

    d = w.register("d", 5, "pageable-host")
    with w.m.hold(w.c, CUDA0):  # not a victim: the tenants wait for one another
        async with anyio.create_task_group() as tasks:
            for index, handle in enumerate((w.a, w.b, d)):
                tasks.start_soon(tenant, handle, index)
            tasks.start_soon(decided)


SCENARIOS: dict[str, Callable[[World], Awaitable[None]]] = {
    f.__name__: f
    for f in (
        materialize,
        move,
        release,
        discard,
        execute,
        nowait,
        scope,
        lease,
        hold,
        reservation,
        controller,
        rebuild,
        contention,
    )
}


# ------------------------------------------------------------------ the checks


def manager() -> ResidencyManager:
    return ResidencyManager(budgets={CUDA0: BUDGET}, backend="sim")


def check_state(m: ResidencyManager) -> None:
    """Every materialization resident and charged once, nothing in flight, every reservation
    the backend's own (after a close: its final state)."""
    state = m.state
    state.check_invariants()
    assert state.open_tickets() == []
    used: dict[Location, int] = {}
    for value in state.values():
        assert value.materializations or value.has_source, value
        for location, mat in value.materializations.items():
            assert mat.state is MaterializationState.RESIDENT, (value.handle, location, mat)
            assert mat.pending_event_count == 0, (value.handle, location, mat)
            used[location] = used.get(location, 0) + value.charge_bytes
    for location in state.locations():
        ledger = state.find_ledger(location)
        if ledger is not None:
            assert ledger.used_bytes == used.get(location, 0), (location, ledger)


def check_data(w: World, tensor: Callable[[ValueHandle, Location], torch.Tensor]) -> None:
    """Every materialization holds its value's original data."""
    for value in w.m.state.values():
        original = w.originals[value.handle.name]
        for location in value.materializations:
            got = tensor(value.handle, location)
            assert torch.equal(got.cpu(), original), (value.handle, location)


async def check_quiet_and_serving(w: World) -> None:
    """After a cancellation: nothing left behind, the data intact, and new calls served."""
    m = w.m
    await settled(m)
    assert_quiet(m)
    check_state(m)
    check_data(w, m.tensor)
    # New calls: clear the device, rebuild the source value there with a scope, read back.
    for value in list(m.state.values()):
        if CUDA0 in {str(loc) for loc in value.materializations}:
            if len(value.materializations) > 1:
                await m.release(value.handle, CUDA0)
            else:
                await m.move(value.handle, "pageable-host")
    plan = ResidencyPlan(
        enter=[Materialize(w.s, CUDA0), Materialize(w.a, CUDA0)],
        exit=[Release(w.s, CUDA0), Move(w.a, "pinned-host")],
    )
    async with m.scope(plan, timeout=0), m.acquire(w.s, CUDA0) as leased:
        assert torch.equal(leased.tensor.cpu(), w.originals["s"])
    await settled(m)
    assert_quiet(m)
    check_state(m)
    check_data(w, m.tensor)


async def turns_of(scenario: Callable[[World], Awaitable[None]]) -> int:
    """How many loop turns ``scenario`` takes, uncancelled: the sweep's range (about a dozen
    points spread over it). The most of up to three runs: the simulated copies finish on
    their own threads, and one whose copies all landed before the loop turned takes only a
    couple of turns, too few to sweep."""
    turns = 0
    for _ in range(3):
        async with manager() as m:
            w = World(m)
            w.setup()
            turns = max(turns, await count_turns(functools.partial(scenario, w)))
            await check_quiet_and_serving(w)  # the scenario itself leaves nothing behind
        if turns > 2:
            break
    return turns


async def after_turns(turns: int) -> None:
    for _ in range(turns):
        await anyio.lowlevel.checkpoint()


# ------------------------------------------------------------------ the sweeps


@pytest.mark.parametrize("name", SCENARIOS)
async def test_cancelled_at_any_turn_leaves_nothing_behind(name: str) -> None:
    scenario = SCENARIOS[name]
    total = await turns_of(scenario)
    assert total > 2
    cancelled = 0
    for k in sweep_points(total, 12):
        async with manager() as m:
            w = World(m)
            w.setup()
            done = False
            with anyio.fail_after(20):  # a hang fails here
                with anyio.CancelScope() as cancel:
                    async with anyio.create_task_group() as tasks:

                        async def cancel_after(turns: int = k) -> None:
                            await after_turns(turns)
                            cancel.cancel()

                        tasks.start_soon(cancel_after)
                        await scenario(w)
                        done = True
                        tasks.cancel_scope.cancel()  # it ended first: stop the timer
                assert done or cancel.cancelled_caught, k
                cancelled += not done
                await check_quiet_and_serving(w)
    assert cancelled > 0  # the sweep cut runs short (the rest ran to their end)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("name", SCENARIOS)
async def test_cancelled_natively_at_any_turn_leaves_nothing_behind(name: str) -> None:
    """The same sweep with asyncio's own cancellation (``task.cancel()``: what
    ``asyncio.timeout`` and a server's dropped request do), which no anyio shield holds off:
    a task that was cancelled before it ended ends cancelled (never swallowed)."""
    assert on_asyncio()
    scenario = SCENARIOS[name]
    total = await turns_of(scenario)
    cancelled = 0
    for k in sweep_points(total, 12):
        async with manager() as m:
            w = World(m)
            w.setup()
            task = asyncio.ensure_future(scenario(w))
            for _ in range(k):
                if task.done():
                    break
                await anyio.lowlevel.checkpoint()
            requested = task.cancel()
            with anyio.fail_after(20):  # a hang fails here
                try:
                    await asyncio.shield(task)
                except asyncio.CancelledError:
                    assert task.cancelled(), k
                    cancelled += 1
                else:
                    assert not requested, f"turn {k}: the cancellation was swallowed"
                await check_quiet_and_serving(w)
    assert cancelled > 0


@pytest.mark.parametrize("name", SCENARIOS)
async def test_closed_at_any_turn_ends_clean(name: str) -> None:
    scenario = SCENARIOS[name]
    total = await turns_of(scenario)
    closed = 0
    for k in sweep_points(total, 12):
        m = manager()
        w = World(m)
        outcome: list[Any] = []

        async def run(w: World = w, outcome: list[Any] = outcome) -> None:
            try:
                await scenario(w)
            except* ManagerClosedError as group:
                # (alone, or several of a scenario's own tasks met the close: its task group
                # raises them together)
                outcome.append(group)
            else:
                outcome.append("done")

        with anyio.fail_after(20):  # a hang fails here
            async with anyio.create_task_group() as tasks, m:
                w.setup()
                tasks.start_soon(run)
                await after_turns(k)
                # closed: the scenario's task ends on its own
        (result,) = outcome
        closed += result != "done"
        check_state(m)
        assert m._rt is not None
        payloads = m._rt.payloads

        def final(handle: ValueHandle, location: Location, payloads: Any = payloads) -> Any:
            payload = payloads.get(handle, location)
            assert payload is not None, (handle, location)
            return payload.tensor

        check_data(w, final)
        with pytest.raises(ManagerClosedError):
            await m.materialize(w.a, CUDA0)
    assert closed > 0
