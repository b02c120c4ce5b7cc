"""A waiting ``controller.scope`` takes its turn in the manager's admission queue, first come,
first served with the manual scopes: what arrives later for the same room (a manual scope,
another controller scope, a direct operation, an operation that cannot wait) does not get
ahead of it; it is admitted when the room frees; cancelled at any await, it leaves nothing
behind and does not block the queue. Simulated backend (CUDA simulated in host memory); every
test bounds itself and waits on conditions."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from _sweep import count_turns, sweep_points

from aresidency import (
    Materialize,
    MemoryReservation,
    ResidencyBudgetError,
    ResidencyController,
    ResidencyManager,
    ResidencyPlan,
    ResidencyRequest,
    ResidencyRequirement,
)
from aresidency.testing import assert_quiet, settled

pytestmark = pytest.mark.anyio

UNIT = 4096
CUDA0 = "cuda:0"


def tensor(nbytes: int = UNIT, seed: int = 0) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


class Wall:
    """``manager.reservation`` blocks of other tasks, each held until its ``end(name)``: room
    that frees on its own (transient), so that scopes wait for it."""

    def __init__(self, m: ResidencyManager, tasks: Any) -> None:
        self.m = m
        self.tasks = tasks
        self._ends: dict[str, anyio.Event] = {}

    async def build(self, name: str, nbytes: int) -> None:
        end = self._ends[name] = anyio.Event()
        up = anyio.Event()

        async def block() -> None:
            async with self.m.reservation(name, CUDA0, nbytes):
                up.set()
                await end.wait()

        self.tasks.start_soon(block)
        await up.wait()

    def end(self, name: str) -> None:
        self._ends[name].set()


async def until_waiting(m: ResidencyManager, count: int) -> None:
    """Until ``count`` scopes and operations wait in the admission queue."""
    with anyio.fail_after(10):
        while m.waiting < count:
            await anyio.wait_all_tasks_blocked()


async def test_later_arrivals_do_not_get_ahead_of_a_waiting_controller_scope() -> None:
    # 8 units; walls of 5 and 2 leave 1 free. The controller scope needs 2 (x): it waits.
    # Then, in this order: a materialize of y (1, it fits now), an execute reserving 1 (it
    # fits now), a manual scope needing 4 (z), and another controller scope needing 1 (w, it
    # fits now). None gets ahead: each waits its turn. The first wall ends (6 free): the
    # controller scope enters first, then the direct operations have their turns, with room; the
    # manual scope does not fit yet (3 free), and the second controller scope, which would,
    # waits behind it (first come, first served for the same room). The second wall ends:
    # both enter, in order.
    async with ResidencyManager(budgets={CUDA0: 8 * UNIT}, backend="sim") as m:
        x = m.register(tensor(2 * UNIT, 1), name="x")
        y = m.register(tensor(UNIT, 2), name="y")
        z = m.register(tensor(4 * UNIT, 3), name="z")
        w = m.register(tensor(UNIT, 4), name="w")
        controller = ResidencyController(m)
        order: list[str] = []
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                wall = Wall(m, tasks)
                await wall.build("wall-a", 5 * UNIT)
                await wall.build("wall-b", 2 * UNIT)

                async def decided(name: str, handle: Any) -> None:
                    request = ResidencyRequest(name, [ResidencyRequirement(handle, CUDA0)])
                    async with controller.scope(request, timeout=None):
                        order.append(name)

                async def materialize() -> None:
                    await m.materialize(y, CUDA0)
                    order.append("materialize")

                async def execute() -> None:
                    plan = ResidencyPlan(reserve=[MemoryReservation("ex", CUDA0, UNIT)])
                    await m.execute(plan)
                    order.append("execute")

                async def manual() -> None:
                    plan = ResidencyPlan(enter=[Materialize(z, CUDA0)])
                    async with m.scope(plan, timeout=None):
                        order.append("manual")

                arrivals = [
                    lambda: decided("controller", x),
                    materialize,
                    execute,
                    manual,
                    lambda: decided("controller-2", w),
                ]
                for count, arrival in enumerate(arrivals, start=1):
                    tasks.start_soon(arrival)
                    await until_waiting(m, count)
                assert order == [] and m.waiting_for_room(CUDA0)
                wall.end("wall-a")
                with anyio.fail_after(10):
                    while len(order) < 3:  # the controller scope and both direct operations
                        await anyio.wait_all_tasks_blocked()
                await until_waiting(m, 2)  # the manual scope, and the controller scope behind it
                # (the two direct operations had their turns one after the other, and the
                # execute, which copies nothing, may finish first)
                assert order[0] == "controller" and sorted(order[1:]) == ["execute", "materialize"]
                wall.end("wall-b")
        assert order[3:] == ["manual", "controller-2"]
        assert m.waiting == 0 and not m.waiting_for_room(CUDA0)
        await settled(m)
        assert_quiet(m)


async def test_what_cannot_wait_is_refused_while_a_controller_scope_waits_for_room() -> None:
    # 4 units; a wall of 3 leaves 1 free, which fits each of these but not the controller
    # scope waiting for 2: they would take room it waits for, so they are refused (as while
    # a manual scope waits), changing nothing; once it entered, they are served.
    async with ResidencyManager(budgets={CUDA0: 4 * UNIT}, backend="sim") as m:
        x = m.register(tensor(2 * UNIT, 1), name="x")
        y = m.register(tensor(UNIT, 2), name="y")
        controller = ResidencyController(m)
        entered = anyio.Event()
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                wall = Wall(m, tasks)
                await wall.build("wall", 3 * UNIT)

                async def decided() -> None:
                    request = ResidencyRequest("r", [ResidencyRequirement(x, CUDA0)])
                    async with controller.scope(request, timeout=None):
                        entered.set()

                tasks.start_soon(decided)
                await until_waiting(m, 1)
                before = m.snapshot()
                refusals = [
                    lambda: m.reserve_nowait("late", CUDA0, UNIT),
                    lambda: m.materialize_nowait(y, CUDA0),
                    lambda: m.register(tensor(UNIT, 5), name="v", location=CUDA0),
                ]
                for refused in refusals:
                    with pytest.raises(ResidencyBudgetError) as caught:
                        refused()
                    assert caught.value.waiting_scopes == 1, caught.value
                with pytest.raises(ResidencyBudgetError, match="waiting") as caught:
                    async with m.reservation("late", CUDA0, UNIT):
                        pytest.fail("the block overtook the waiting controller scope")
                assert caught.value.waiting_scopes == 1
                assert m.snapshot() == before
                wall.end("wall")
                await entered.wait()
        assert m.waiting == 0
        m.reserve_nowait("late", CUDA0, UNIT)  # served now that nobody waits
        assert m.unreserve_nowait("late", CUDA0) == UNIT
        await settled(m)
        assert_quiet(m)


async def test_a_controller_scope_that_comes_after_a_waiting_scope_waits_behind_it() -> None:
    # A manual scope waits for 3 of the 4 units a wall keeps. The controller scope that comes
    # next would fit now (1 unit): it waits behind it, and enters after it.
    async with ResidencyManager(budgets={CUDA0: 4 * UNIT}, backend="sim") as m:
        x = m.register(tensor(UNIT, 1), name="x")
        controller = ResidencyController(m)
        order: list[str] = []
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                wall = Wall(m, tasks)
                await wall.build("wall", 3 * UNIT)

                async def manual() -> None:
                    plan = ResidencyPlan(reserve=[MemoryReservation("ws", CUDA0, 3 * UNIT)])
                    async with m.scope(plan, timeout=None):
                        order.append("manual")

                async def decided() -> None:
                    request = ResidencyRequest("r", [ResidencyRequirement(x, CUDA0)])
                    async with controller.scope(request, timeout=None):
                        order.append("controller")

                tasks.start_soon(manual)
                await until_waiting(m, 1)
                tasks.start_soon(decided)
                await until_waiting(m, 2)
                assert order == []
                with pytest.raises(TimeoutError, match="2 earlier waiter"):
                    async with controller.scope(
                        ResidencyRequest("r2", [ResidencyRequirement(x, CUDA0)]), timeout=0
                    ):
                        pytest.fail("it overtook the waiting scopes")
                assert m.waiting == 2
                wall.end("wall")
        assert order == ["manual", "controller"]
        assert m.waiting == 0


async def test_a_turn_of_another_manager_or_that_ended_is_refused_changing_nothing() -> None:
    async with (
        ResidencyManager(budgets={CUDA0: 4 * UNIT}, backend="sim") as m,
        ResidencyManager(budgets={CUDA0: 4 * UNIT}, backend="sim") as other,
    ):
        plan = ResidencyPlan(reserve=[MemoryReservation("ws", CUDA0, UNIT)])
        assert m.take_turn([CUDA0], only_behind_others=True) is None  # nobody waits
        with pytest.raises(ValueError, match="cuda:7"):
            m.take_turn(["cuda:7"])
        assert m.waiting == 0
        turn = m.take_turn([CUDA0])
        assert turn is not None and turn.first and m.waiting == 1
        with pytest.raises(ValueError, match="not a place in this manager's admission queue"):
            other.scope(plan, turn=turn)
        with pytest.raises(TypeError, match="turn must be an AdmissionTurn"):
            m.scope(plan, turn="first")  # type: ignore[arg-type]
        assert m.waiting == 1 and other.waiting == 0
        async with m.scope(plan, turn=turn):  # admitted in it: the turn ends
            assert m.waiting == 0 and not turn.active
        with pytest.raises(ValueError, match="was left, or a scope was admitted in it already"):
            m.scope(plan, turn=turn)
        turn.leave()  # nothing: it ended
        with pytest.raises(RuntimeError, match="left the admission queue"):
            await turn.wait(None)
        assert m.snapshot().location(CUDA0).reserved_bytes == 0


async def test_a_task_never_waits_behind_its_own_turn() -> None:
    """A task holds a turn for cuda:0 (``manager.take_turn``) and then, before it enters in
    it, runs a direct operation, a scope, a controller scope or a reservation there: the only
    waiter ahead of them is the task's own turn, which moves only when the task goes on. They
    waited behind it for ever (a reservation was refused for overtaking it); they go ahead,
    and the turn keeps its place. Another task's operation still waits behind it."""
    async with ResidencyManager(budgets={CUDA0: 4 * UNIT}, backend="sim") as m:
        y = m.register(tensor(UNIT, 1), name="y")
        plan = ResidencyPlan(reserve=[MemoryReservation("ws", CUDA0, UNIT)])
        turn = m.take_turn([CUDA0])
        assert turn is not None
        with anyio.fail_after(10):
            await m.materialize(y, CUDA0)
            await m.move(y, "pageable-host")
            await m.execute(plan)
            async with m.scope(plan, timeout=None):
                pass
            request = ResidencyRequest("mine", [ResidencyRequirement(y, CUDA0)])
            async with ResidencyController(m).scope(request, timeout=None):
                pass
            m.reserve_nowait("r", CUDA0, UNIT)
            async with m.reservation("block", CUDA0, UNIT):
                pass
        assert m.unreserve_nowait("r", CUDA0) == UNIT
        assert turn.active and turn.first and m.waiting == 1
        done = anyio.Event()

        async def other() -> None:
            await m.move(y, "pageable-host")  # y is at cuda:0: it charges the host only
            await m.materialize(y, CUDA0)
            done.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(other)
                await until_waiting(m, 2)  # behind the turn
                assert not done.is_set()
                turn.leave()
        assert done.is_set() and m.waiting == 0


# ----------------------------------------------------------- cancellation, swept


class Spy(ResidencyController):
    """Counts the requests found infeasible (the scope is about to wait for room)."""

    infeasible = 0

    def would_fit_alone(self, request: ResidencyRequest) -> bool:
        self.infeasible += 1
        return super().would_fit_alone(request)


def world(m: ResidencyManager) -> dict[str, Any]:
    """v (1 unit, on the device, a victim), x (2 units, on the host)."""
    return {
        "v": m.register(tensor(UNIT, 1), name="v", location=CUDA0),
        "x": m.register(tensor(2 * UNIT, 2), name="x"),
    }


async def until_true(predicate: Any) -> None:
    """Turn the loop until ``predicate()`` (no wait_all_tasks_blocked: the sweep's counter
    never blocks)."""
    with anyio.fail_after(10):
        while not predicate():
            await anyio.lowlevel.checkpoint()


async def story(m: ResidencyManager, h: dict[str, Any], outer: Any, later: list[str]) -> None:
    """8 units; v takes 1, a wall 5. A manual scope waits for 6. The controller scope (x: 2
    and a reservation of 6: all the room, once v is evicted) comes next: its turn is behind
    it. Then a later manual scope (2, in ``outer``, which no cut reaches) queues behind the
    controller scope. The wall ends: the first scope enters (6), and the controller scope,
    first now, finds no room and waits for it; the first scope ends: the controller scope
    evicts v, enters, and leaves. Every await of its entry is on the way: its turn behind the
    first scope, the slices of its decisions, its wait for room, its admission, the
    transfers."""
    controller = Spy(m)
    wall_end, first_end = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tasks:

        async def wall() -> None:
            async with m.reservation("wall", CUDA0, 5 * UNIT):
                await wall_end.wait()

        async def first() -> None:
            plan = ResidencyPlan(reserve=[MemoryReservation("first", CUDA0, 6 * UNIT)])
            async with m.scope(plan, timeout=None):
                await first_end.wait()

        async def decided() -> None:
            request = ResidencyRequest(
                "r",
                [ResidencyRequirement(h["x"], CUDA0)],
                reservations=[MemoryReservation("kv", CUDA0, 6 * UNIT)],
            )
            async with controller.scope(request, timeout=None):
                await anyio.lowlevel.checkpoint()

        async def late() -> None:
            plan = ResidencyPlan(reserve=[MemoryReservation("late", CUDA0, 2 * UNIT)])
            async with m.scope(plan, timeout=None):
                later.append("entered")

        tasks.start_soon(wall)
        await until_true(lambda: m.snapshot().location(CUDA0).reserved_bytes == 5 * UNIT)
        tasks.start_soon(first)
        await until_true(lambda: m.waiting == 1)
        tasks.start_soon(decided)
        await until_true(lambda: m.waiting == 2)
        outer.start_soon(late)
        await until_true(lambda: m.waiting == 3)
        wall_end.set()
        await until_true(lambda: controller.infeasible > 0)
        first_end.set()


async def test_a_controller_scope_cancelled_at_any_await_leaves_its_turn_and_nothing_else() -> None:
    async def uncut() -> int:
        async with ResidencyManager(budgets={CUDA0: 8 * UNIT}, backend="sim") as m:
            h = world(m)
            later: list[str] = []
            async with anyio.create_task_group() as outer:
                turns = await count_turns(lambda: story(m, h, outer, later))
            assert later == ["entered"]
            # The controller scope entered before the later scope, evicting v.
            assert CUDA0 in {str(loc) for loc in m.snapshot().value(h["x"]).locations}
            assert CUDA0 not in {str(loc) for loc in m.snapshot().value(h["v"]).locations}
        return turns

    total = await uncut()
    cancelled = 0
    for k in sweep_points(total, 12):
        async with ResidencyManager(budgets={CUDA0: 8 * UNIT}, backend="sim") as m:
            h = world(m)
            later: list[str] = []
            with anyio.fail_after(20):
                async with anyio.create_task_group() as outer:
                    with anyio.CancelScope() as cut:
                        async with anyio.create_task_group() as tasks:

                            async def cut_after(turns: int = k) -> None:
                                for _ in range(turns):
                                    await anyio.lowlevel.checkpoint()
                                cut.cancel()

                            tasks.start_soon(cut_after)
                            await story(m, h, outer, later)
                            tasks.cancel_scope.cancel()  # it ended first: stop the cut
                    cancelled += cut.cancelled_caught
                    # The later scope (if it came) is not blocked by a turn left behind.
            assert later in ([], ["entered"]), (k, later)
            assert m.waiting == 0 and not m.waiting_for_room(CUDA0), k
            assert m.room_waits() == [], k
            await settled(m)
            assert_quiet(m)
            snap = m.snapshot().location(CUDA0)
            assert snap.reserved_bytes == 0 and snap.peak_bytes <= 8 * UNIT, (k, snap)
            # And the manager still serves a controller scope.
            request = ResidencyRequest("again", [ResidencyRequirement(h["x"], CUDA0)])
            async with ResidencyController(m).scope(request, timeout=0):
                pass
    assert cancelled > 0
