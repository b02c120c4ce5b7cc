"""``ModelPool.remove``: a model taken out of a serving pool (unloaded, or swapped for a new
version under the same name) while the others go on. Simulated backend (CUDA simulated in host
memory); every test bounds itself with ``fail_after`` and waits on conditions, never on a
sleep."""

from __future__ import annotations

import anyio
import pytest
import torch

from aresidency import ResidencyManager, ResidencyPlanError
from aresidency.serving import ModelPool

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL, eventually

pytestmark = pytest.mark.anyio


def names_of(m: ResidencyManager) -> set[str]:
    """The models whose values the manager holds (a value is named ``<model>.<group>``)."""
    return {v.handle.name.split(".")[0] for v in m.state.values() if v.handle.name}


async def test_removing_an_idle_model_gives_back_its_memory_and_its_name() -> None:
    async with ResidencyManager(budgets={"cuda:0": 3 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        old, other = TinyLM(seed=1), TinyLM(seed=2)
        pool.add("a", old)
        pool.add("b", other)
        with anyio.fail_after(10):
            for name in ("a", "b"):
                async with pool.use(name) as model:
                    await model(TOKENS)
            assert m.snapshot().location("cuda:0").used_bytes == 2 * TOTAL
            await pool.remove("a")
            assert pool.models == ["b"] and names_of(m) == {"b"}
            assert m.snapshot().location("cuda:0").used_bytes == TOTAL
            with pytest.raises(KeyError, match="no model named 'a'"):
                async with pool.use("a"):
                    pass
            # The module has its own tensors back: it runs on the host as before.
            assert torch.equal(old(TOKENS), reference(TinyLM(seed=1), TOKENS))
            new = TinyLM(seed=3)
            pool.add("a", new)  # a new version under the same name
            async with pool.use("a") as model:
                assert torch.equal(await model(TOKENS), reference(new, TOKENS))
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_removing_a_model_in_use_serves_its_requests_first_and_refuses_new_ones() -> None:
    async with ResidencyManager(budgets={"cuda:0": 3 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        inside, go_on, removed = anyio.Event(), anyio.Event(), anyio.Event()
        served: list[str] = []

        async def request() -> None:
            async with pool.use("a") as model:
                inside.set()
                await go_on.wait()
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                served.append("a")

        async def remove() -> None:
            await pool.remove("a")
            removed.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await inside.wait()
                tasks.start_soon(remove)
                await anyio.wait_all_tasks_blocked()
                assert not removed.is_set() and "a" in pool.models
                with pytest.raises(KeyError, match="'a' is being removed"):
                    async with pool.use("a"):
                        pass
                async with pool.use("b") as model:  # the others go on meanwhile
                    assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                go_on.set()
                await removed.wait()
        assert served == ["a"] and pool.models == ["b"] and names_of(m) == {"b"}
        assert pool.stats()["b"]["requests"] == 1
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_removal_from_inside_a_request_for_the_model_is_refused_at_once() -> None:
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                with pytest.raises(RuntimeError, match="from inside a request for it"):
                    await pool.remove("a")
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
            await pool.remove("a")
        assert pool.models == [] and names_of(m) == set()
        await pool.aclose()


@pytest.mark.parametrize("second", ["cancelled", "another remover"])
async def test_a_removal_cancelled_while_it_waits_leaves_the_model_serving(second: str) -> None:
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        inside, go_on = anyio.Event(), anyio.Event()
        ended: list[str] = []

        async def request() -> None:
            async with pool.use("a"):
                inside.set()
                await go_on.wait()

        async def remove(scope: anyio.CancelScope, label: str) -> None:
            with scope:
                await pool.remove("a")
                ended.append(label)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await inside.wait()
                first = anyio.CancelScope()
                tasks.start_soon(remove, first, "first")
                await anyio.wait_all_tasks_blocked()
                if second == "cancelled":
                    first.cancel()
                    await anyio.wait_all_tasks_blocked()
                    async with pool.use("a") as model:  # serving again: nothing changed
                        assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                else:
                    tasks.start_soon(remove, anyio.CancelScope(), "second")
                    await anyio.wait_all_tasks_blocked()
                go_on.set()
            if second == "cancelled":
                assert ended == [] and pool.models == ["a"]
                await pool.remove("a")
            else:
                assert sorted(ended) == ["first", "second"]
        assert pool.models == [] and names_of(m) == set()
        await eventually(lambda: m.snapshot().location("cuda:0").used_bytes == 0)
        await pool.aclose()


async def test_a_removal_and_the_pools_close_waiting_together_both_end() -> None:
    # Both wait for the same request; when it ends, the model is closed once and both return.
    async with ResidencyManager(budgets={"cuda:0": 3 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        module = TinyLM(seed=1)
        pool.add("a", module)
        pool.add("b", TinyLM(seed=2))
        inside, go_on = anyio.Event(), anyio.Event()
        ended: list[str] = []

        async def request() -> None:
            async with pool.use("a"):
                inside.set()
                await go_on.wait()

        async def remove() -> None:
            await pool.remove("a")
            ended.append("remove")

        async def close() -> None:
            await pool.aclose()
            ended.append("close")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await inside.wait()
                tasks.start_soon(remove)
                await anyio.wait_all_tasks_blocked()
                tasks.start_soon(close)
                await anyio.wait_all_tasks_blocked()
                assert ended == []
                go_on.set()
        assert sorted(ended) == ["close", "remove"]
        assert pool.models == [] and names_of(m) == set()
        assert torch.equal(module(TOKENS), reference(TinyLM(seed=1), TOKENS))


async def test_a_second_removal_ends_when_the_first_was_cancelled() -> None:
    # Two tasks remove 'a' while its request runs; the first removal is cancelled. The second
    # takes over: it ends (the model removed) once the request ended.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        inside, go_on, removed = anyio.Event(), anyio.Event(), anyio.Event()

        async def request() -> None:
            async with pool.use("a") as model:
                inside.set()
                await go_on.wait()
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))

        async def remove(scope: anyio.CancelScope, done: anyio.Event | None) -> None:
            with scope:
                await pool.remove("a")
                if done is not None:
                    done.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await inside.wait()
                first = anyio.CancelScope()
                tasks.start_soon(remove, first, None)
                await anyio.wait_all_tasks_blocked()
                tasks.start_soon(remove, anyio.CancelScope(), removed)
                await anyio.wait_all_tasks_blocked()
                first.cancel()
                await anyio.wait_all_tasks_blocked()
                assert pool.models == ["a"] and not removed.is_set()
                with pytest.raises(KeyError, match="'a' is being removed"):
                    async with pool.use("a"):  # the second removal still waits
                        pass
                go_on.set()
                await removed.wait()
        assert pool.models == [] and names_of(m) == set()
        await pool.aclose()


async def test_a_removal_whose_model_waits_for_the_removers_own_room_is_refused_at_once() -> None:
    # The task inside a request for 'a' removes 'b' while a request for 'b' waits for the
    # room 'a' holds: the removal waits for that request, which waits for 'a', which ends
    # only once the removal returned (hold and wait). Refused at once; nothing changed: the
    # request for 'b' is served once 'a' ended.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        served: list[str] = []

        async def request_b() -> None:
            async with pool.use("b") as model:
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                served.append("b")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks, pool.use("a") as model:
                await model(TOKENS)
                tasks.start_soon(request_b)
                await eventually(lambda: pool.waiting == 1)
                await anyio.wait_all_tasks_blocked()  # parked for the room 'a' holds
                with pytest.raises(ResidencyPlanError, match="removal of model 'b' would wait"):
                    await pool.remove("b")
                assert pool.models == ["a", "b"] and served == []
            assert served == ["b"]
            await pool.remove("b")  # from outside the request: fine
        assert pool.models == ["a"] and names_of(m) == {"a"}
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_removal_is_refused_once_its_models_request_parks_for_the_removers_room() -> None:
    # The request for 'b' first waits for room another task holds ('c'), so the removal from
    # inside a request for 'a' may wait. The budget shrinks meanwhile: once 'c' ended, the
    # request parks again for room only the end of 'a' could give. The removal is refused then
    # (it would wait for ever), not left waiting; the request is served once 'a' ended.
    budget = 3 * TOTAL
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = ModelPool(m)
        for seed, name in enumerate("abc"):
            pool.add(name, TinyLM(seed=seed))
        release_c, holding_c, remove_now = anyio.Event(), anyio.Event(), anyio.Event()
        outcome: list[BaseException] = []
        served: list[str] = []

        async def hold_c() -> None:
            async with pool.use("c"):
                holding_c.set()
                await release_c.wait()

        async def request_b() -> None:
            async with pool.use("b", reserve=TOTAL // 2) as model:
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                served.append("b")

        async def remover() -> None:
            async with pool.use("a"):
                await remove_now.wait()
                try:
                    await pool.remove("b")
                except ResidencyPlanError as error:
                    outcome.append(error)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(remover)
                tasks.start_soon(hold_c)
                await holding_c.wait()
                await eventually(lambda: pool.admitted == 2)
                tasks.start_soon(request_b)
                await eventually(lambda: pool.waiting == 1)
                await anyio.wait_all_tasks_blocked()  # 'b' parked: 'a' and 'c' hold the room
                remove_now.set()
                await anyio.wait_all_tasks_blocked()
                assert outcome == [] and pool.models == ["a", "b", "c"]  # the removal waits
                m.set_budget("cuda:0", 2 * TOTAL + TOTAL // 4)  # 'b' fits only once 'a' ends
                release_c.set()
                await eventually(lambda: len(outcome) == 1)
        assert "removal of model 'b' would wait for ever" in str(outcome[0])
        assert served == ["b"] and pool.models == ["a", "b", "c"]
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a native cancellation: asyncio's
async def test_a_removal_cancelled_natively_while_it_closes_the_model_still_completes(
    anyio_backend: str,
) -> None:
    """Once its requests ended, a removal completes: a ``task.cancel()`` that arrives while
    it discards the model's values (an anyio shield does not stop a native cancellation) is
    raised only once every value left the manager and the name is free."""
    import asyncio

    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        handles = pool.module("a").handles
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                await model(TOKENS)
        task = asyncio.get_running_loop().create_task(pool.remove("a"))

        def cancel_at_the_first_discard() -> None:
            if not task.done() and any(m.state.find_value(h) is None for h in handles):
                unlisten()
                task.cancel()  # (its next await raises CancelledError)

        unlisten = m.add_change_listener(cancel_at_the_first_discard)
        with anyio.fail_after(10):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert pool.models == ["b"] and names_of(m) == {"b"}
        assert all(m.state.find_value(h) is None for h in handles)
        pool.add("a", TinyLM(seed=3))  # the name is free
        await pool.aclose()


async def test_adding_a_new_version_while_the_old_one_is_being_removed_says_to_wait() -> None:
    # A hot swap started as a task: the old version still serves its request, so its name is
    # taken. The refusal says it is being removed and when the name is free (it said "pick
    # another name", as for a model that stays); nothing is registered; after the removal
    # returned, the new version goes in under the name.
    async with ResidencyManager(budgets={"cuda:0": 3 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        new = TinyLM(seed=2)
        inside, go_on = anyio.Event(), anyio.Event()

        async def request() -> None:
            async with pool.use("a") as model:
                inside.set()
                await go_on.wait()
                await model(TOKENS)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await inside.wait()
                tasks.start_soon(pool.remove, "a")
                await anyio.wait_all_tasks_blocked()
                before = len(list(m.state.values()))
                with pytest.raises(ValueError, match=r"'a' is being removed.*once 'await pool"):
                    pool.add("a", new)
                assert len(list(m.state.values())) == before and pool.models == ["a"]
                go_on.set()
            pool.add("a", new)
            async with pool.use("a") as model:
                assert torch.equal(await model(TOKENS), reference(new, TOKENS))
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_removed_models_demand_is_forgotten() -> None:
    # A server that adds and removes uniquely named adapters: the demand tracker kept a count
    # for every name ever removed, growing without bound. A removed name's demand goes with
    # it (a new version under the same name starts with none, as any new model).
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        with anyio.fail_after(10):
            for i in range(3):
                pool.add(f"adapter-{i}", TinyLM(seed=i))
                async with pool.use(f"adapter-{i}") as model:
                    await model(TOKENS)
                assert pool.demand.count(f"adapter-{i}") > 0
                await pool.remove(f"adapter-{i}")
                assert pool.demand.count(f"adapter-{i}") == 0
        assert list(pool.demand._counts) == []
        await pool.aclose()
