"""Scopes that wait for room other scopes hold, and what ends such a wait: two tasks whose
nested scopes each need the room of the other's outer scope (hold and wait, refused at once),
and a scope whose blocker exits but leaves its value resident (nothing moves it on its own:
the waiter is told, instead of sleeping through a change nobody announced). Simulated backend
(CUDA simulated in host memory); every test bounds itself and waits on conditions."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from aresidency import (
    Materialize,
    MemoryReservation,
    Move,
    ResidencyBudgetError,
    ResidencyController,
    ResidencyInUseError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyRequest,
    ResidencyRequirement,
)

pytestmark = pytest.mark.anyio

MIB = 1 << 20


def values(m: ResidencyManager, n: int) -> list:  # type: ignore[type-arg]
    return [m.register(torch.zeros(MIB // 4), name=f"v{i}") for i in range(n)]


async def until_waiting(m: ResidencyManager, count: int) -> None:
    """Until ``count`` scopes wait for room (their waits registered with the manager)."""
    with anyio.fail_after(10):
        while len(m.room_waits()) < count:
            await anyio.wait_all_tasks_blocked()


@pytest.mark.parametrize("back", [True, False], ids=["exit-moves-back", "exit-leaves-it"])
async def test_two_tasks_whose_nested_scopes_need_each_others_room(back: bool) -> None:
    # 3 MiB: each task's outer scope holds 1 MiB, each inner scope needs 2 MiB more. Either
    # inner one fits once the other task's outer scope ended; neither while both hold. The
    # second to wait closes the cycle: refused at once, naming the other's wait.
    async with ResidencyManager(budgets={"cuda:0": 3 * MIB}, backend="sim") as m:
        v = values(m, 6)
        held = [anyio.Event(), anyio.Event()]
        outcome: dict[int, object] = {}

        async def task(i: int) -> None:
            exit_ = [Move(v[i], "pageable-host")] if back else []
            async with m.scope(ResidencyPlan(enter=[Move(v[i], "cuda:0")], exit=exit_)):
                held[i].set()
                await held[1 - i].wait()
                if i == 1:
                    await until_waiting(m, 1)  # task 0's inner scope waits first
                inner = [Move(v[2 + 2 * i], "cuda:0"), Move(v[3 + 2 * i], "cuda:0")]
                try:
                    async with m.scope(
                        ResidencyPlan(
                            enter=inner,
                            exit=exit_
                            and [
                                Move(v[2 + 2 * i], "pageable-host"),
                                Move(v[3 + 2 * i], "pageable-host"),
                            ],
                        )
                    ):
                        outcome[i] = "entered"
                except ResidencyPlanError as error:
                    outcome[i] = error

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(task, 0)
                tasks.start_soon(task, 1)
        error = outcome[1]
        assert isinstance(error, ResidencyPlanError), outcome
        message = str(error)
        assert "hold and wait" in message and "2 waiting tasks" in message, message
        assert "a scope entering v4, v5" in message and "a scope entering v2, v3" in message
        if back:
            assert outcome[0] == "entered", outcome  # in the room task 1 gave back
        else:
            # Task 1's value stays resident once its scope exited: nothing moves it, and
            # task 0's inner scope now fits only once task 0's own outer scope ended.
            assert isinstance(outcome[0], ResidencyPlanError), outcome
            assert "only what the waiting task holds itself" in str(outcome[0])
        assert m.room_waits() == []
        snap = m.snapshot().location("cuda:0")
        assert snap.reserved_bytes == 0 and snap.peak_bytes <= 3 * MIB


async def test_a_scope_waiting_for_a_value_that_stays_once_its_scope_exits_is_told() -> None:
    # The waiter needs 3 MiB of 3; v1's scope holds 1 MiB and exits without moving it. The
    # exit changes no materialization, but v1 is no longer a scope's: nothing will move it
    # now, and the waiter fails at once instead of sleeping for a change that never comes.
    async with ResidencyManager(budgets={"cuda:0": 3 * MIB}, backend="sim") as m:
        v = values(m, 5)
        held, go = anyio.Event(), anyio.Event()
        outcome: list[object] = []

        async def holder() -> None:
            async with m.scope(ResidencyPlan(enter=[Move(v[1], "cuda:0")])):
                held.set()
                await go.wait()

        async def waiter() -> None:
            await held.wait()
            try:
                async with m.scope(ResidencyPlan(enter=[Move(v[k], "cuda:0") for k in (2, 3, 4)])):
                    outcome.append("entered")
            except ResidencyPlanError as error:
                outcome.append(error)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(holder)
                tasks.start_soon(waiter)
                await held.wait()
                await anyio.wait_all_tasks_blocked()
                assert m.waiting == 1 and not outcome  # it waits for v1's scope
                go.set()
        assert len(outcome) == 1 and isinstance(outcome[0], ResidencyPlanError), outcome
        assert isinstance(outcome[0].__cause__, ResidencyBudgetError), outcome
        assert "budget exceeded at cuda:0" in str(outcome[0])
        assert m.waiting == 0


async def test_a_lease_entered_in_a_callback_on_behalf_of_a_task_is_that_tasks() -> None:
    # A tenant enters leases for a task from loop callbacks (a streamed call's pump): with
    # on_behalf_of, the lease is reported as the task's and counted as what it holds itself.
    from aresidency.runtime.leases import current_task_ref

    async with ResidencyManager(budgets={"cuda:0": 2 * MIB}, backend="sim") as m:
        v = values(m, 3)
        await m.materialize(v[0], "cuda:0")
        ref = current_task_ref()
        entered: list[object] = []

        def in_callback() -> None:
            lease = m.acquire(v[0], "cuda:0", on_behalf_of=ref)
            lease.enter_nowait()
            entered.append(lease)

        m.bridge.call_soon(in_callback)
        with anyio.fail_after(10):
            while not entered:
                await anyio.wait_all_tasks_blocked()
        ((_, where, kind, owner),) = [o for o in m.owners() if o[0] == v[0]]
        assert (str(where), kind, owner) == ("cuda:0", "read lease", ref.name)
        # What the task holds itself: 2 MiB more at cuda:0 could come only once it ended.
        stuck = m.waiting_on_itself(2 * MIB, "cuda:0", what="a test's wait")
        assert stuck is not None and "(1 lease (v0 at cuda:0))" in str(stuck)
        with pytest.raises(TypeError, match="on_behalf_of must be a TaskRef"):
            m.acquire(v[0], "cuda:0", on_behalf_of="me")  # type: ignore[arg-type]
        entered[0].exit_nowait()  # type: ignore[attr-defined]
        assert m.owners() == []


@pytest.mark.parametrize("holding", ["lease", "hold"])
@pytest.mark.parametrize("how", ["manual", "controller"])
async def test_a_refusal_of_a_wait_on_itself_says_what_the_task_holds(
    holding: str, how: str
) -> None:
    """A scope (manual or the controller's) that must move a value out of where the entering
    task itself leases it is refused at once (hold and wait). The refusal said
    ``use_count=0, hold_count=1`` (the check's simulation stood the lease in as a hold) and
    then "1 lease(s) or hold(s)": it says what the task holds, a lease or a hold, in both
    halves; the decision is the same."""
    async with ResidencyManager(budgets={"cuda:0": 2 * MIB}, backend="sim") as m:
        (v,) = values(m, 1)
        await m.materialize(v, "cuda:0")
        held = m.acquire(v, "cuda:0") if holding == "lease" else m.hold(v, "cuda:0")
        async with held:
            before = m.snapshot()
            with anyio.fail_after(10), pytest.raises(ResidencyPlanError) as info:
                if how == "manual":
                    async with m.scope(ResidencyPlan(reclaim=[Move(v, "pinned-host")])):
                        pytest.fail("admitted")
                else:
                    request = ResidencyRequest("r", [ResidencyRequirement(v, "pinned-host")])
                    async with ResidencyController(m).scope(request, timeout=None):
                        pytest.fail("admitted")
            assert m.snapshot() == before
        error = info.value
        assert error.hold_and_wait
        counts = "use_count=1, hold_count=0" if holding == "lease" else "use_count=0, hold_count=1"
        assert f"cannot move out of value v0 (#1) at cuda:0: it is protected by {counts}," in str(
            error
        )
        assert f"waiting task holds itself stands in the way (1 {holding} (v0 at cuda:0))" in str(
            error
        )
        assert "lease(s) or hold(s)" not in str(error)
        if how == "manual":
            cause = error.__cause__
            assert isinstance(cause, ResidencyInUseError)
            assert (cause.use_count, cause.hold_count) == ((1, 0) if holding == "lease" else (0, 1))


async def test_reclaimable_changed_wakes_only_while_someone_waits_for_room() -> None:
    # A reclaimer's cache may grow with no transition (a pool's idle model that a request no
    # longer waits for): reclaimable_changed tells the waiting tenants, and only them.
    async with ResidencyManager(budgets={"cuda:0": 2 * MIB}, backend="sim") as m:
        calls: list[int] = []
        m.add_change_listener(lambda: calls.append(1))
        m.reclaimable_changed()
        assert calls == []  # nobody waits for room: nothing to wake
        with m.room_wait(MIB, "cuda:0", what="a test's wait"):
            m.reclaimable_changed()
            assert calls == [1]
        assert m.room_waits() == []


async def test_an_operation_that_cannot_wait_is_never_refused_where_no_budget_applies() -> None:
    """A scope admitted and still entering (its copy to cuda:0 in flight) also reserves at
    pinned-host, which has no budget. A reservation block or a materialize_nowait there was
    refused with ResidencyBudgetError "fits the budget now (... of unlimited), but 1 scope(s)
    waiting for room there come first": room never runs short without a budget, so nobody is
    overtaken. At the budgeted cuda:0 the first-come-first-served refusal stays."""
    async with ResidencyManager(budgets={"cuda:0": 4 * MIB}, backend="sim") as m:
        a, b = values(m, 2)
        gate = threading.Event()
        m.backend._devices[0].h2d.submit(lambda: gate.wait(10))  # holds up the scope's copy
        plan = ResidencyPlan(
            reserve=[MemoryReservation("w", "pinned-host", 4096)], enter=[Materialize(a, "cuda:0")]
        )
        entered = anyio.Event()

        async def enter() -> None:
            async with m.scope(plan):
                entered.set()

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(enter)
                with anyio.fail_after(10):
                    while m.snapshot().location("pinned-host").reserved_bytes == 0:
                        await anyio.wait_all_tasks_blocked()
                assert m.waiting == 1 and not entered.is_set()  # admitted, entering
                async with m.reservation("x", "pinned-host", 4096):
                    assert m.snapshot().location("pinned-host").reserved_bytes == 8192
                await m.materialize_nowait(b, "pinned-host")
                assert "pinned-host" in [str(x) for x in m.snapshot().value(b).locations]
                with pytest.raises(ResidencyBudgetError, match="come first") as caught:
                    async with m.reservation("y", "cuda:0", 4096):
                        pass
                assert caught.value.waiting_scopes == 1
                gate.set()
        finally:
            gate.set()
        assert entered.is_set()


@pytest.mark.parametrize("first", ["controller", "manual"])
async def test_a_controller_scope_and_a_manual_scope_waiting_for_each_others_room(
    first: str,
) -> None:
    # Each task holds 1 MiB of 3 in a reservation block (the controller cannot evict that),
    # then its inner scope needs 2 MiB more: one a manual scope, one a controller's. The
    # controller's wait is registered as a manual scope's is, so whichever of the two waits
    # second closes the cycle and is refused at once, and the other enters in the room given
    # back.
    async with ResidencyManager(budgets={"cuda:0": 3 * MIB}, backend="sim") as m:
        v = values(m, 6)
        controller = ResidencyController(m)
        held = [anyio.Event(), anyio.Event()]
        outcome: dict[str, object] = {}

        async def task(kind: str, i: int) -> None:
            async with m.reservation(f"outer{i}", "cuda:0", MIB):
                held[i].set()
                await held[1 - i].wait()
                if kind != first:
                    await until_waiting(m, 1)  # the other's inner scope waits first
                mine = [v[2 + 2 * i], v[3 + 2 * i]]
                try:
                    if kind == "controller":
                        request = ResidencyRequest("inner", [(h, "cuda:0") for h in mine])
                        async with controller.scope(request, timeout=None):
                            outcome[kind] = "entered"
                    else:
                        plan = ResidencyPlan(
                            enter=[Move(h, "cuda:0") for h in mine],
                            exit=[Move(h, "pageable-host") for h in mine],
                        )
                        async with m.scope(plan):
                            outcome[kind] = "entered"
                except ResidencyPlanError as error:
                    outcome[kind] = error

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(task, "controller", 0)
                tasks.start_soon(task, "manual", 1)
        second = "manual" if first == "controller" else "controller"
        error = outcome[second]
        assert isinstance(error, ResidencyPlanError) and error.hold_and_wait, outcome
        assert "hold and wait" in str(error), str(error)
        other = "request 'inner'" if second == "manual" else "a scope entering v4, v5"
        assert other in str(error), str(error)
        if second == "controller":
            assert error.request.name == "inner"  # type: ignore[attr-defined]
        assert outcome[first] == "entered", outcome
        assert m.room_waits() == []
        snap = m.snapshot().location("cuda:0")
        assert snap.reserved_bytes == 0 and snap.peak_bytes <= 3 * MIB


async def test_plan_wait_registers_the_wait_and_refuses_a_plan_that_is_not_one() -> None:
    async with ResidencyManager(budgets={"cuda:0": 3 * MIB}, backend="sim") as m:
        plan = ResidencyPlan(reserve=[MemoryReservation("kv", "cuda:0", MIB)])
        refused = pytest.raises(TypeError, match="plan_wait needs a ResidencyPlan, got list")
        with refused, m.plan_wait([], what="nothing"):  # type: ignore[arg-type]
            pytest.fail("entered")
        with m.plan_wait(plan, what="the kv cache"):
            [(_, where, need, what)] = m.room_waits()
            assert (str(where), need, what) == ("cuda:0", MIB, "the kv cache")
        assert m.room_waits() == []
