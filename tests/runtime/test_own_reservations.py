"""A reservation made with ``reserve_nowait`` is the room of the task that made it, until
``unreserve_nowait`` ends it: a wait of that task that only it keeps out would never end (the
task would wait for itself), so every waiting call of the task is refused at once, naming it;
the task's direct operations and scopes do not queue behind a scope that waits for that room;
and two tasks each waiting for the room the other reserved are told at once (hold and wait).
Simulated backend (CUDA simulated in host memory); every test bounds itself and waits on
conditions."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from aresidency import (
    Materialize,
    MemoryReservation,
    ResidencyController,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyRequest,
    ResidencyRequirement,
)
from aresidency.testing import assert_quiet, settled

pytestmark = pytest.mark.anyio

UNIT = 4096
CUDA0 = "cuda:0"


def tensor(nbytes: int = UNIT, seed: int = 0) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


async def until_waiting(m: ResidencyManager, count: int) -> None:
    """Until ``count`` scopes and operations wait in the admission queue."""
    with anyio.fail_after(10):
        while m.waiting < count:
            await anyio.wait_all_tasks_blocked()


@pytest.mark.parametrize(
    "how", ["scope", "controller scope", "scope of the same name", "controller of the same name"]
)
async def test_a_wait_only_the_tasks_own_reserve_nowait_keeps_out_is_refused_at_once(
    how: str,
) -> None:
    """The task reserved 12 of 16 units with reserve_nowait, then waits, with no timeout, for
    8 more (or for a reservation of the name it holds): only its own reservation keeps that
    out, and only it would end it. It waited for ever; it is refused at once, naming the
    reservation and what to do, and nothing changed."""
    async with ResidencyManager(budgets={CUDA0: 16 * UNIT}, backend="sim") as m:
        x = m.register(tensor(8 * UNIT), name="x")
        same = how.endswith("same name")
        m.reserve_nowait("mine", CUDA0, (4 if same else 12) * UNIT)
        kept, reservations, described = m.task_holdings()
        assert kept == () and [(n, str(loc)) for n, loc in reservations] == [("mine", CUDA0)]
        assert "reserve_nowait" in described and "'mine' at cuda:0" in described
        before = m.snapshot()
        name = "mine" if same else "ws"
        with anyio.fail_after(10), pytest.raises(ResidencyPlanError) as info:
            if how.startswith("controller"):
                request = ResidencyRequest(
                    "r",
                    [] if same else [ResidencyRequirement(x, CUDA0)],
                    reservations=[MemoryReservation(name, CUDA0, UNIT)] if same else [],
                )
                async with ResidencyController(m).scope(request, timeout=None):
                    pytest.fail("admitted")
            else:
                plan = (
                    ResidencyPlan(reserve=[MemoryReservation(name, CUDA0, UNIT)])
                    if same
                    else ResidencyPlan(enter=[Materialize(x, CUDA0)])
                )
                async with m.scope(plan, timeout=None):
                    pytest.fail("admitted")
        error = info.value
        assert error.hold_and_wait, error
        message = str(error)
        assert "only what the waiting task holds itself stands in the way" in message, message
        assert "1 reservation made with reserve_nowait ('mine' at cuda:0)" in message, message
        assert "End it with unreserve_nowait first" in message, message
        assert m.snapshot() == before and m.waiting == 0
        # Ended (by whichever task), it is nobody's any more.
        assert m.unreserve_nowait("mine", CUDA0) == (4 if same else 12) * UNIT
        assert m.task_holdings() == ((), (), "")


@pytest.mark.parametrize("op", ["materialize", "move", "execute", "scope", "controller scope"])
async def test_the_reserving_task_does_not_queue_behind_a_scope_waiting_for_its_room(
    op: str,
) -> None:
    """Task A reserved 3 of 4 units with reserve_nowait; task B's scope waits for 2 of them.
    A's own operation that fits the last unit waited its turn behind B's scope, which waited
    for A: neither ever went on. A holds room B may wait for, so it goes ahead, as with a
    lease, hold, scope or reservation block of its own; then A ends its reservation and B
    enters."""
    async with ResidencyManager(budgets={CUDA0: 4 * UNIT}, backend="sim") as m:
        y = m.register(tensor(UNIT, 1), name="y")
        z = m.register(tensor(2 * UNIT, 2), name="z")
        if op == "move":
            await m.materialize(y, "pinned-host")
        order: list[str] = []
        reserved, done = anyio.Event(), anyio.Event()

        async def a() -> None:
            m.reserve_nowait("a", CUDA0, 3 * UNIT)
            reserved.set()
            await until_waiting(m, 1)
            if op == "materialize":
                await m.materialize(y, CUDA0)
            elif op == "move":
                await m.move(y, CUDA0)
            elif op == "execute":
                await m.execute(ResidencyPlan(reserve=[MemoryReservation("ex", CUDA0, UNIT)]))
            elif op == "scope":
                async with m.scope(ResidencyPlan(enter=[Materialize(y, CUDA0)]), timeout=None):
                    pass
            else:
                request = ResidencyRequest("a", [ResidencyRequirement(y, CUDA0)])
                async with ResidencyController(m).scope(request, timeout=None):
                    pass
            order.append(op)
            if op != "execute":
                await m.move(y, "pageable-host")
            m.unreserve_nowait("a", CUDA0)

        async def b() -> None:
            await reserved.wait()
            async with m.scope(ResidencyPlan(enter=[Materialize(z, CUDA0)]), timeout=None):
                order.append("b")
            done.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(a)
                tasks.start_soon(b)
        assert order == [op, "b"]
        await settled(m)
        assert_quiet(m)


async def test_two_tasks_each_waiting_for_the_room_the_other_reserved_are_told() -> None:
    """Each task reserved 2 of 4 units with reserve_nowait, then waits for 2 more: each waits
    for the other's reservation, which ends only when the other goes on. The first waits (the
    other may yet end its own); the second closes the cycle and is refused at once, naming
    the other's wait; the first enters in the room the refused one gives back."""
    async with ResidencyManager(budgets={CUDA0: 4 * UNIT}, backend="sim") as m:
        v = [m.register(tensor(2 * UNIT, i), name=f"v{i}") for i in range(2)]
        reserved = [anyio.Event(), anyio.Event()]
        outcome: dict[int, Any] = {}

        async def task(i: int) -> None:
            m.reserve_nowait(f"r{i}", CUDA0, 2 * UNIT)
            reserved[i].set()
            await reserved[1 - i].wait()
            if i == 1:
                with anyio.fail_after(10):
                    while not m.room_waits():  # task 0 waits first
                        await anyio.wait_all_tasks_blocked()
            try:
                async with m.scope(ResidencyPlan(enter=[Materialize(v[i], CUDA0)])):
                    outcome[i] = "entered"
            except ResidencyPlanError as error:
                outcome[i] = error
                m.unreserve_nowait(f"r{i}", CUDA0)  # going on, it gives its room back
            else:
                await m.move(v[i], "pageable-host")
                m.unreserve_nowait(f"r{i}", CUDA0)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(task, 0)
                tasks.start_soon(task, 1)
        error = outcome[1]
        assert isinstance(error, ResidencyPlanError) and error.hold_and_wait, outcome
        assert "hold and wait" in str(error) and "a scope entering v0" in str(error), error
        assert "2 reservations made with reserve_nowait ('r0' at cuda:0, 'r1' at cuda:0)" in str(
            error
        ), error
        assert outcome[0] == "entered"
        assert m.room_waits() == [] and m.waiting == 0
        await settled(m)
        assert_quiet(m)


async def test_a_reservation_made_for_nobody_is_waited_for() -> None:
    """``task_owned=False`` (a tenant's own room, which it gives back itself, reserved from a
    change listener that runs in whichever task changed the state): the task that made it
    does not hold it, so its scope waits for it, and enters once it ended."""
    async with ResidencyManager(budgets={CUDA0: 16 * UNIT}, backend="sim") as m:
        x = m.register(tensor(8 * UNIT), name="x")
        before = m.snapshot()
        with pytest.raises(TypeError, match="task_owned must be True or False, got 'yes'"):
            m.reserve_nowait("tenant", CUDA0, 12 * UNIT, task_owned="yes")  # type: ignore[arg-type]
        assert m.snapshot() == before
        m.reserve_nowait("tenant", CUDA0, 12 * UNIT, task_owned=False)
        assert m.task_holdings() == ((), (), "")
        entered = anyio.Event()

        async def enter() -> None:
            async with m.scope(ResidencyPlan(enter=[Materialize(x, CUDA0)]), timeout=None):
                entered.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(enter)
                await until_waiting(m, 1)
                assert not entered.is_set()
                m.unreserve_nowait("tenant", CUDA0)
        assert entered.is_set()


@pytest.mark.parametrize("ring", [None, False])
async def test_a_streamed_call_that_only_its_tasks_reserve_nowait_keeps_out_is_refused(
    ring: bool | None,
) -> None:
    """A streamed module waits for room outside the queue, and asks first whether only what
    its task holds keeps it out: its task's own reserve_nowait reservation is such room (its
    call waited for it for ever); it is refused at once, naming it."""
    from torch import nn

    from aresidency import ResidencyBudgetError
    from aresidency.integrations import stream_module

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3)))
    async with ResidencyManager(backend="sim") as m:
        probe = stream_module(m, model, ring=ring)
        block = max(probe.block_bytes)
        await probe.aclose()
        m.set_budget(CUDA0, 2 * block)
        m.reserve_nowait("mine", CUDA0, block + 1)
        before = m.snapshot()
        with anyio.fail_after(10), pytest.raises(ResidencyBudgetError) as info, torch.no_grad():
            # (refused as it is made: its call could never get the room)
            await stream_module(m, model, ring=ring, timeout=None, keep_resident=False)(
                torch.randn(2, 32)
            )
        message = str(info.value)
        assert "only what the waiting task holds itself stands in the way" in message, message
        assert "1 reservation made with reserve_nowait ('mine' at cuda:0)" in message, message
        assert m.snapshot().locations == before.locations
        m.unreserve_nowait("mine", CUDA0)
