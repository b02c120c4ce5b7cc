"""``ModelPool.remove``: a model taken out of a serving pool (unloaded, or swapped for a new
version under the same name) while the others go on. Simulated backend (CUDA simulated in host
memory); every test bounds itself with ``fail_after`` and waits on conditions, never on a
sleep."""

from __future__ import annotations

import anyio
import pytest
import torch

from aresidency import ResidencyManager
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
