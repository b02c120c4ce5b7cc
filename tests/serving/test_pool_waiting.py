"""``ModelPool``: what wakes a waiting request, and how waiting ends (the pool or the manager
closing, ``timeout``). Simulated backend; every test bounds itself with ``fail_after`` and
waits on conditions, never on a sleep."""

from __future__ import annotations

import re
from typing import Any

import anyio
import pytest
import torch

from aresidency import ReplicaMode, ResidencyManager
from aresidency.runtime import ManagerClosedError
from aresidency.runtime.leases import Hold, TaskRef
from aresidency.serving import ModelPool

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL, eventually

pytestmark = pytest.mark.anyio


def tenant_hold(m: ResidencyManager, handle: Any) -> Hold:
    """A hold of another tenant (no task of this test's: it runs inside the pool's decision,
    in the request's task, but stands for someone else's)."""
    return m.hold(handle, "cuda:0", on_behalf_of=TaskRef("another tenant", None))


def hold_during_decisions(pool: ModelPool, take: Any) -> anyio.Event:
    """Make the pool's controller run ``take()`` before its first search (another tenant
    takes a hold meanwhile); the returned event is set once that search returned."""
    decided = anyio.Event()
    decide = pool.controller.decide

    async def deciding(request: Any) -> Any:
        if not decided.is_set():
            take()
        try:
            return await decide(request)
        finally:
            decided.set()

    pool.controller.decide = deciding  # type: ignore[method-assign]
    return decided


@pytest.mark.parametrize("timeout", [None, 30.0])
async def test_a_request_refused_while_a_tenant_held_its_victim_goes_in_when_the_hold_ends(
    timeout: float | None,
) -> None:
    # Another tenant's replica (evictable once nothing holds it) is held while the pool's
    # controller searches: the request parks for room. The hold ends: the room the request
    # could evict grew back only to where it was before the search, which is progress for
    # a request refused on the held state.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 4}, backend="sim") as m:
        other = m.register(
            torch.zeros(TOTAL // 8), name="tenant-x", replica_mode=ReplicaMode.REPLICABLE
        )
        await m.materialize(other, "cuda:0")
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        holds = []
        decided = hold_during_decisions(pool, lambda: holds.append(tenant_hold(m, other)))
        admitted = anyio.Event()

        async def request() -> None:
            async with pool.use("a", timeout=timeout) as model:
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                admitted.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await decided.wait()
                await anyio.wait_all_tasks_blocked()
                assert pool.waiting == 1 and not admitted.is_set()  # parked: 'tenant-x' held
                holds[0].release()
                await admitted.wait()
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_closing_the_pool_serves_the_request_that_waited_for_a_hold_to_end() -> None:
    # The same wait with no timeout, and the server shuts down meanwhile: aclose waits for the
    # waiting request, which is served once the hold ends; then aclose returns.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 4}, backend="sim") as m:
        other = m.register(
            torch.zeros(TOTAL // 8), name="tenant-x", replica_mode=ReplicaMode.REPLICABLE
        )
        await m.materialize(other, "cuda:0")
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        holds = []
        decided = hold_during_decisions(pool, lambda: holds.append(tenant_hold(m, other)))
        served: list[str] = []
        closed = anyio.Event()

        async def request() -> None:
            async with pool.use("a") as model:
                served.append(model.mode)

        async def close() -> None:
            await pool.aclose()
            closed.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await decided.wait()
                tasks.start_soon(close)
                await anyio.wait_all_tasks_blocked()
                assert not closed.is_set() and pool.waiting == 1
                holds[0].release()
                await closed.wait()
        assert served == ["resident"]


async def test_closing_the_manager_fails_the_waiting_requests_at_once() -> None:
    # One request is in its body (holding 'a', which leaves no room for 'b' or 'c'); two wait
    # behind it, the first at the head of the line. The manager closes: both waiting requests
    # get ManagerClosedError at once, not when the request in its body ends. That one ends
    # later, quietly, with the pool's bookkeeping done.
    ready, close_now, admitted, release = (anyio.Event() for _ in range(4))
    box: dict[str, Any] = {}
    results: dict[str, Any] = {}

    async def owner() -> None:
        async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
            pool = ModelPool(m)
            for seed, name in enumerate("abc"):
                pool.add(name, TinyLM(seed=seed))
            box.update(manager=m, pool=pool)
            ready.set()
            await close_now.wait()

    async def body() -> None:
        async with box["pool"].use("a") as model:
            await model(TOKENS)
            admitted.set()
            await release.wait()
        results["a"] = "ended"

    async def waiting(name: str) -> None:
        try:
            async with box["pool"].use(name):
                results[name] = "admitted"
        except ManagerClosedError as error:
            results[name] = error

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(owner)
            await ready.wait()
            pool = box["pool"]
            tasks.start_soon(body)
            await admitted.wait()
            tasks.start_soon(waiting, "b")
            await eventually(lambda: pool.waiting == 1)
            tasks.start_soon(waiting, "c")
            await eventually(lambda: pool.waiting == 2)
            await anyio.wait_all_tasks_blocked()
            close_now.set()
            await eventually(lambda: "b" in results and "c" in results)
            assert "a" not in results  # still in its body
            release.set()
    assert isinstance(results["b"], ManagerClosedError)
    assert isinstance(results["c"], ManagerClosedError)
    assert results["a"] == "ended"
    assert pool.admitted == 0 and pool.waiting == 0
    assert pool.stats()["a"]["active"] == 0  # readable after the manager closed
    assert "its manager closed" in repr(pool)
    await pool.aclose()


async def test_timeout_zero_admits_what_it_can_at_once_and_never_waits() -> None:
    # timeout=0 is "never wait", as with manager.scope: a hit (or a load with room) is
    # admitted; a request that would have to wait for room, or for its turn, fails at once
    # saying what it would have waited for. (The requests that would wait are made by other
    # tasks: a nested request of the task holding 'a' would be given the room 'a' leaves.)
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        refused: list[BaseException] = []

        async def no_wait() -> None:
            try:
                async with pool.use("b", timeout=0):
                    pass
            except TimeoutError as error:
                refused.append(error)

        async def head() -> None:
            async with pool.use("b"):
                pass

        async with pool.use("a", timeout=0) as model:  # a load into free room
            assert model.decision.loaded_bytes == TOTAL
        async with pool.use("a", timeout=0) as model:  # a hit
            assert model.decision.decision is None
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(no_wait)  # 'a' is held: it would wait for room
                assert len(refused) == 1
                assert re.search(r"at once.*room", str(refused[0]))
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(head)
                    await eventually(lambda: pool.waiting == 1)
                    async with anyio.create_task_group() as inner:
                        inner.start_soon(no_wait)
                    assert len(refused) == 2
                    assert re.search(r"at once.*its turn", str(refused[1]))
                    tasks.cancel_scope.cancel()
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("timeout", ["1", True, -1.0])
async def test_a_timeout_that_is_not_seconds_is_refused_by_name(timeout: Any) -> None:
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        with pytest.raises((TypeError, ValueError), match="timeout must be None or a number"):
            async with pool.use("a", timeout=timeout):
                pass
        await pool.aclose()


@pytest.mark.parametrize("budget", [3 * TOTAL, None], ids=["raised", "lifted"])
async def test_raising_or_lifting_the_budget_wakes_a_request_waiting_for_room(
    budget: int | None,
) -> None:
    # 'a' is in use and leaves no room for 'b'. The budget is raised, or lifted
    # (set_budget(device, None): no budget at all, more room than any): the waiting request
    # is admitted at once, while 'a' is still in use.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        inside, admitted, release = anyio.Event(), anyio.Event(), anyio.Event()

        async def hold_a() -> None:
            async with pool.use("a"):
                inside.set()
                await release.wait()

        async def want_b() -> None:
            async with pool.use("b") as model:
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                admitted.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(hold_a)
                await inside.wait()
                tasks.start_soon(want_b)
                await eventually(lambda: pool.waiting == 1)
                await anyio.wait_all_tasks_blocked()  # parked for the room 'a' holds
                m.set_budget("cuda:0", budget)
                await admitted.wait()  # (never, if the change is not seen as room)
                release.set()
        assert_nothing_leaked(m, pool)
        await pool.aclose()
