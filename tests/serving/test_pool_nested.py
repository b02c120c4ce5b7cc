"""``ModelPool``: a task that makes a request while it holds one (nested ``pool.use`` blocks: a
draft model beside a target model, a router beside an expert). Simulated backend (CUDA
simulated in host memory); every test bounds itself with ``fail_after`` and waits on
conditions, never on a sleep.

The outer request ends only when the task goes on, so the inner one must never wait for it:
it is given the room the outer one leaves (streamed when the whole model does not fit beside
it), refused at once when not even that fits, and it does not queue behind another task's
request that waits for the outer one's room."""

from __future__ import annotations

import anyio
import pytest
import torch

from aresidency import (
    MemoryReservation,
    ResidencyBudgetError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
)
from aresidency.loader import DeviceLoader
from aresidency.serving import ModelPool
from aresidency.testing import settled

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import BLOCK, OUTSIDE, TOKENS, TOTAL, eventually

pytestmark = pytest.mark.anyio


def pool_of(m: ResidencyManager, names: str) -> ModelPool:
    pool = ModelPool(m)
    for seed, name in enumerate(names):
        pool.add(name, TinyLM(seed=seed))
    return pool


async def test_a_nested_request_streams_in_the_room_the_outer_one_leaves() -> None:
    # Room for one model and a half: 'b' alone would be resident, but beside 'a' it streams.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = pool_of(m, "ab")
        with anyio.fail_after(10):
            async with pool.use("a") as a:
                assert a.mode == "resident"
                async with pool.use("b") as b:
                    assert b.mode == "streamed"
                    assert torch.equal(await b(TOKENS), reference(b.module, TOKENS))
                    assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))
                async with pool.use("a") as again:  # the same model: joins the outer request
                    assert again.mode == "resident"
            async with pool.use("b") as b:  # alone again: resident
                assert b.mode == "resident"
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("outer_streams", [False, True])
async def test_a_nested_request_that_cannot_fit_beside_the_outer_one_fails_at_once(
    outer_streams: bool,
) -> None:
    # Not even the smallest streaming footprint of 'b' fits beside what 'a' keeps: waiting
    # would never end (it waits for its own task), so it is refused at once, naming 'a'.
    budget = (OUTSIDE + 2 * BLOCK + OUTSIDE + BLOCK // 2) if outer_streams else TOTAL + BLOCK
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = pool_of(m, "ab")
        with anyio.fail_after(10):
            async with pool.use("a") as a:
                assert a.mode == ("streamed" if outer_streams else "resident")
                with pytest.raises(ResidencyPlanError, match="while this task holds") as caught:
                    async with pool.use("b", timeout=None):
                        pass
                assert "'a'" in str(caught.value)
                assert pool.waiting == 0 and pool.admitted == 1
                assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))
            assert pool.stats()["b"]["failures"] == 1
            async with pool.use("b") as b:  # the outer request ended: 'b' fits now
                assert torch.equal(await b(TOKENS), reference(b.module, TOKENS))
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_nested_request_does_not_queue_behind_a_head_that_waits_for_its_task() -> None:
    # Task 1 holds 'a'; task 2's request for 'c' is at the head of the line, waiting for the
    # room 'a' holds. Task 1 then asks for 'b': in the line, it would wait behind task 2, which
    # waits for task 1. It is admitted past the line; once task 1 ends, 'c' is admitted.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = pool_of(m, "abc")
        holding, nested_done, c_admitted = anyio.Event(), anyio.Event(), anyio.Event()
        order: list[str] = []

        async def task_1() -> None:
            async with pool.use("a") as a:
                holding.set()
                await eventually(lambda: pool.waiting == 1)  # task 2 waits in line
                async with pool.use("b") as b:
                    order.append(f"b {b.mode}")
                    assert torch.equal(await b(TOKENS), reference(b.module, TOKENS))
                assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))
                nested_done.set()

        async def task_2() -> None:
            await holding.wait()
            async with pool.use("c") as c:
                order.append(f"c {c.mode}")
                assert torch.equal(await c(TOKENS), reference(c.module, TOKENS))
                c_admitted.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(task_1)
                tasks.start_soon(task_2)
                await c_admitted.wait()
        assert nested_done.is_set()
        assert order == ["b streamed", "c resident"]
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("ending", ["the other request ends", "cancelled", "timeout"])
async def test_a_nested_request_that_waits_for_another_task(ending: str) -> None:
    # Task 1 holds 'a' resident; task 2 holds 'b' (resident too): the room 'c' needs beside
    # 'a' is 'b''s, which ends on its own. Task 1's nested request for 'c' waits for it (it
    # parks: the line's head may decide meanwhile), and is admitted resident when 'b' ends,
    # or leaves nothing behind when cancelled or timed out; 'a' stays usable throughout.
    budget = 2 * TOTAL + OUTSIDE + 2 * BLOCK
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = pool_of(m, "abc")
        b_held, release_b, nested_started = anyio.Event(), anyio.Event(), anyio.Event()
        outcome: list[str] = []

        async def holder() -> None:
            async with pool.use("b") as b:
                assert b.mode == "resident"
                b_held.set()
                await release_b.wait()

        async def nested(cancel: anyio.CancelScope) -> None:
            await b_held.wait()
            async with pool.use("a") as a:
                assert a.mode == "resident"
                nested_started.set()
                timeout = 0.05 if ending == "timeout" else None
                with cancel:
                    try:
                        async with pool.use("c", timeout=timeout) as c:
                            outcome.append(c.mode)
                            assert torch.equal(await c(TOKENS), reference(c.module, TOKENS))
                    except TimeoutError as error:
                        outcome.append(f"timeout: {error}")
                if cancel.cancelled_caught:
                    outcome.append("cancelled")
                assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(holder)
                cancel = anyio.CancelScope()
                tasks.start_soon(nested, cancel)
                await nested_started.wait()
                if ending != "timeout":
                    # (With a 0.05 s timeout the request may end before the park is seen on
                    # a loaded machine; its error then says it waited the whole timeout.)
                    await eventually(lambda: pool.waiting == 1)  # the nested request parked
                    await anyio.wait_all_tasks_blocked()
                    assert pool.waiting == 1 and not outcome
                if ending == "the other request ends":
                    release_b.set()
                elif ending == "cancelled":
                    cancel.cancel()
                if ending != "the other request ends":
                    await eventually(lambda: bool(outcome))
                    release_b.set()
        if ending == "the other request ends":
            assert outcome == ["resident"]
        elif ending == "cancelled":
            assert outcome == ["cancelled"]
        else:
            assert len(outcome) == 1 and "'c' was not admitted within 0.05 s" in outcome[0]
        assert_nothing_leaked(m, pool)
        async with pool.use("c") as c:  # the pool still decides (its lock was given back)
            assert torch.equal(await c(TOKENS), reference(c.module, TOKENS))
        await pool.aclose()


@pytest.mark.parametrize("budget", [TOTAL + TOTAL // 2, 3 * TOTAL], ids=["streams", "resident"])
async def test_cancelling_a_nested_request_at_each_of_its_steps_leaks_nothing(
    budget: int,
) -> None:
    # The nested request cancelled after each number of loop steps (deciding, loading,
    # calling, leaving): the outer request keeps working, and once it ends nothing stays
    # admitted, held or reserved.
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = pool_of(m, "ab")
        admitted = 0
        for steps in range(40):
            async with pool.use("a") as a:
                scope = anyio.CancelScope()

                async def nested(scope: anyio.CancelScope) -> None:
                    nonlocal admitted
                    with scope:
                        async with pool.use("b") as b:
                            admitted += 1
                            assert torch.equal(await b(TOKENS), reference(b.module, TOKENS))

                with anyio.fail_after(10):
                    async with anyio.create_task_group() as tasks:
                        # The nested request is this task's: run it here, cancelled by a
                        # sibling after ``steps`` steps.
                        async def cancel_after(
                            scope: anyio.CancelScope = scope, steps: int = steps
                        ) -> None:
                            for _ in range(steps):
                                await anyio.lowlevel.checkpoint()
                            scope.cancel()

                        tasks.start_soon(cancel_after)
                        await nested(scope)
                assert pool.admitted == 1 and pool.waiting == 0
                assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))
            # A copy the cancelled call had issued may still be landing (its completion not
            # yet reaped): once it lands it is the pool's cache, not a leak.
            await settled(m)
            assert_nothing_leaked(m, pool)
        assert 0 < admitted < 40, "cancelled before, during and after the admission"
        async with pool.use("b") as b:
            assert torch.equal(await b(TOKENS), reference(b.module, TOKENS))
        await pool.aclose()


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_a_loader_or_scope_that_only_the_tasks_request_keeps_out_fails_at_once(
    ring: bool,
) -> None:
    # Inside a request, the same task iterates a loader, or enters a scope, that could fit
    # only once the request's model left the device: the request ends only when the task
    # goes on, so each fails at once naming the pool's request (they waited for ever: the
    # request's holds, taken in its copies' callbacks, were nobody's). With room beside the
    # model, both run.
    data = [torch.randn(1024) for _ in range(3)]  # 4 KiB each
    for extra, fits in ((1024, False), (3 * 4096, True)):
        async with ResidencyManager(budgets={"cuda:0": TOTAL + extra}, backend="sim") as m:
            pool = pool_of(m, "a")
            with anyio.fail_after(10):
                async with pool.use("a") as a:
                    assert a.mode == "resident"
                    got = []
                    try:
                        async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring) as lo:
                            async for batch in lo:
                                got.append(batch.clone())
                        assert fits
                    except ResidencyBudgetError as error:
                        assert not fits
                        assert "request(s) of the model pool (1 for 'a'" in str(error)
                    plan = ResidencyPlan(reserve=[MemoryReservation("ws", "cuda:0", 4096)])
                    try:
                        async with m.scope(plan):
                            pass
                        assert fits
                    except ResidencyPlanError as error:
                        assert not fits
                        assert "request(s) of the model pool (1 for 'a'" in str(error)
                    assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))
            assert len(got) == (3 if fits else 0)
            assert_nothing_leaked(m, pool)
            await pool.aclose()


async def test_a_requests_holds_are_its_tasks_even_those_taken_as_its_copies_land() -> None:
    # The groups copied in for a request are held in the copies' completions (no task runs
    # there): each hold still names the request's task, as diagnose and the manager's
    # "waiting on itself" checks read it.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = pool_of(m, "a")
        names: list[set[str]] = []

        async def serve() -> None:
            async with pool.use("a") as a:
                assert a.decision.loaded_bytes == TOTAL  # copied in for this request
                names.append(
                    {
                        owner
                        for _, where, kind, owner in m.owners()
                        if kind == "hold" and str(where) == "cuda:0"
                    }
                )

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(serve, name="request-task")
        assert names == [{"request-task"}]
        assert not [o for o in m.owners() if str(o[1]) == "cuda:0"]
        await pool.aclose()


@pytest.mark.parametrize("holding", ["block", "scope"])
async def test_a_request_that_only_its_tasks_other_holdings_keep_out_fails_at_once(
    holding: str,
) -> None:
    # The task holds room outside the pool (a reservation block, a scope's workspace) that
    # leaves too little for the model: the request would wait for ever (it parked until its
    # timeout). It fails at once naming what the task holds; with room, it is admitted.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + 4096}, backend="sim") as m:
        pool = pool_of(m, "a")
        for size, fits in ((TOTAL, False), (2048, True)):
            held = (
                m.reservation("kv", "cuda:0", size)
                if holding == "block"
                else m.scope(ResidencyPlan(reserve=[MemoryReservation("kv", "cuda:0", size)]))
            )
            with anyio.fail_after(10):
                async with held:
                    try:
                        async with pool.use("a") as a:
                            assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))
                        assert fits
                    except ResidencyPlanError as error:
                        assert not fits
                        assert "would wait for ever" in str(error)
                        assert ("'kv'" in str(error)) == (holding == "block"), str(error)
            assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_nested_request_never_defers_to_its_own_tasks_colder_model() -> None:
    # The nested request for 'c' must evict the idle 'b', hotter than 'a', which the same task
    # holds: the pool defers such an eviction until the colder model in use ends, and that
    # one is this task's, so the request waited for ever. A nested request does not defer.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = pool_of(m, "abc")
        with anyio.fail_after(10):
            for name in ("a", "b", "b", "b"):  # 'b' is hot, 'a' cold; 'b' stays on the device
                async with pool.use(name) as model:
                    await model(TOKENS)
            async with pool.use("a") as a:
                async with pool.use("c") as c:
                    assert c.mode == "streamed"
                    assert torch.equal(await c(TOKENS), reference(c.module, TOKENS))
                assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_two_tasks_whose_nested_requests_wait_for_each_other_are_told_at_once() -> None:
    # Task 1 holds 'a' and asks for 'c'; task 2 holds 'b' and asks for 'd'. Each nested
    # request needs room only the other task's outer request keeps, and each outer request
    # ends only once its nested one is admitted (hold and wait). The second to park closes
    # the cycle: refused at once (no timeout ends it otherwise), naming the other request;
    # its task unwinds, and the first one is admitted in the room it gives back.
    budget = 2 * TOTAL + OUTSIDE + 2 * BLOCK
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = pool_of(m, "abcd")
        both_held = [anyio.Event(), anyio.Event()]
        first_parked = anyio.Event()
        outcome: dict[str, object] = {}

        async def task(index: int, outer: str, inner: str) -> None:
            async with pool.use(outer) as held:
                assert held.mode == "resident"
                both_held[index].set()
                for event in both_held:
                    await event.wait()
                if index == 1:
                    await first_parked.wait()
                try:
                    async with pool.use(inner) as model:
                        outcome[inner] = model.mode
                        assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                except ResidencyPlanError as error:
                    outcome[inner] = error

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(task, 0, "a", "c")
                tasks.start_soon(task, 1, "b", "d")
                await eventually(lambda: pool.waiting == 1)  # task 1's request for 'c' parked
                first_parked.set()
        assert outcome["c"] == "resident", outcome
        error = outcome["d"]
        assert isinstance(error, ResidencyPlanError), outcome
        message = str(error)
        assert "would wait for ever" in message and "hold and wait" in message
        assert "for 'c'" in message and "for 'a'" in message  # the request it would wait for
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_nested_requests_that_wait_for_a_third_tasks_room_are_not_refused() -> None:
    # Tasks 1 and 2 hold 'a' and 'b' and each ask for 'd'; task 3 holds 'c', and ends on its
    # own. Neither nested request waits for the other: the room 'c' keeps is enough for
    # either. Both park, neither is refused, and both are admitted once 'c' ends.
    budget = 3 * TOTAL + OUTSIDE + 2 * BLOCK
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = pool_of(m, "abcd")
        held = [anyio.Event() for _ in range(3)]
        release_c = anyio.Event()
        modes: list[str] = []

        async def waiting(index: int, outer: str) -> None:
            async with pool.use(outer):
                held[index].set()
                # Every outer request is held before either nested one is made: otherwise one
                # task's nested request could take the room first, its task end, and the other
                # outer request then wait for 'c' (colder, in use) rather than evict the idle
                # ones (defer_hot_evictions), which this test does not look at.
                for event in held:
                    await event.wait()
                async with pool.use("d") as d:
                    modes.append(d.mode)
                    assert torch.equal(await d(TOKENS), reference(d.module, TOKENS))

        async def third() -> None:
            async with pool.use("c"):
                held[2].set()
                await release_c.wait()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(third)
                tasks.start_soon(waiting, 0, "a")
                tasks.start_soon(waiting, 1, "b")
                await eventually(lambda: pool.waiting == 2)  # both nested requests parked
                await anyio.wait_all_tasks_blocked()
                assert pool.waiting == 2 and not modes
                release_c.set()
        assert modes == ["resident", "resident"], modes
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a native cancellation: asyncio's
async def test_a_head_cancelled_natively_while_a_nested_request_decides_ends_cancelled(
    anyio_backend: str,
) -> None:
    """The head of the line parks for room; a nested request of another task then decides
    and loads its model, holding the pool's decision lock. The head's task is cancelled
    twice with ``task.cancel()`` (a client gone, then its deadline): the first ends its park,
    the second arrives while it takes the lock back (an anyio shield does not stop a native
    cancellation). The head ends with ``CancelledError`` once it holds the lock again, never
    with a lock error, and the pool goes on serving."""
    import asyncio
    import threading

    from .test_pool import hold_copies

    async with ResidencyManager(budgets={"cuda:0": 3 * TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = pool_of(m, "abcd")
        gate = threading.Event()
        go_nested, release = anyio.Event(), anyio.Event()
        inner_done = anyio.Event()

        async def outer(name: str, nested: str | None) -> None:
            async with pool.use(name) as model:
                await model(TOKENS)
                if nested is not None:
                    await go_nested.wait()
                    async with pool.use(nested) as inner:  # loads it, holding the lock
                        assert torch.equal(await inner(TOKENS), reference(inner.module, TOKENS))
                    inner_done.set()
                await release.wait()

        async def head() -> None:
            async with pool.use("c", reserve=TOTAL):  # waits for the room 'a' or 'b' holds
                pass

        loop = asyncio.get_running_loop()
        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(outer, "a", "d")
                    tasks.start_soon(outer, "b", None)
                    await eventually(lambda: pool.admitted == 2)
                    task = loop.create_task(head())
                    await eventually(lambda: pool.waiting == 1)
                    await anyio.wait_all_tasks_blocked()  # the head parked
                    hold_copies(m.backend, gate)
                    go_nested.set()
                    await eventually(lambda: pool.waiting == 2 and pool._deciding.locked())
                    await anyio.wait_all_tasks_blocked()  # 'd' loads, its copies held up
                    task.cancel()
                    await eventually(lambda: pool._deciding.statistics().tasks_waiting == 1)
                    task.cancel()  # while it waits for the lock
                    await anyio.wait_all_tasks_blocked()
                    gate.set()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    await inner_done.wait()
                    release.set()
        finally:
            gate.set()
        assert not pool._deciding.locked()
        assert_nothing_leaked(m, pool)
        with anyio.fail_after(10):
            async with pool.use("c") as model:  # still serving
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
        await pool.aclose()
