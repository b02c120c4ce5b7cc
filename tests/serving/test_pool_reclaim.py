"""A model pool's idle models on the device are a cache: a ``DeviceLoader`` sharing the budget
gets its batches by asking for that room back (``manager.reclaim``), instead of waiting for
ever behind models nobody uses. Simulated backend (CUDA simulated in host memory); every test
bounds itself with ``fail_after``."""

from __future__ import annotations

import anyio
import pytest
import torch

from aresidency import (
    MemoryReservation,
    Move,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
)
from aresidency.integrations import stream_module
from aresidency.loader import DeviceLoader
from aresidency.serving import ModelPool

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL

pytestmark = pytest.mark.anyio

BATCH = 1024  # float32 elements: 4 KiB a batch


def at_device(m: ResidencyManager, model: str) -> int:
    """Bytes of ``model``'s groups on cuda:0."""
    snap = m.snapshot()
    return sum(
        record.charged_bytes
        for value in snap.values.values()
        if value.name.startswith(f"{model}.")
        for record in value.materializations
        if str(record.location) == "cuda:0"
    )


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_a_loader_gets_room_that_idle_pooled_models_cached(ring: bool) -> None:
    # Two models fill the budget but for 2 KiB; nobody uses them. The loader's batches need
    # more: the least demanded model gives back as much as they need, the other stays.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL + 2048}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        with anyio.fail_after(10):
            for name in ("b", "a", "a"):  # 'a' is in more demand
                async with pool.use(name) as model:
                    await model(TOKENS)
            assert at_device(m, "a") == at_device(m, "b") == TOTAL
            data = [torch.randn(BATCH) for _ in range(4)]
            got = []
            async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring) as loader:
                async for batch in loader:
                    got.append(batch.clone())
            assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True))
            assert at_device(m, "a") == TOTAL  # the hotter model stayed whole
            assert 0 < TOTAL - at_device(m, "b") < TOTAL  # part of the colder one left
            assert m.snapshot().location("cuda:0").peak_bytes <= 2 * TOTAL + 2048
            for name in ("a", "b"):  # both serve again (what left is copied back)
                async with pool.use(name) as model:
                    assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_a_model_in_use_is_never_given_back(ring: bool) -> None:
    # 'a' is in use by another task for the whole pass; only 'b' (idle) may give room back.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL + 2048}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        holding, done = anyio.Event(), anyio.Event()

        async def serve() -> None:
            async with pool.use("a") as model:
                holding.set()
                await done.wait()
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))

        with anyio.fail_after(10):
            async with pool.use("b") as model:
                await model(TOKENS)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(serve)
                await holding.wait()
                data = [torch.randn(BATCH) for _ in range(4)]
                async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring) as loader:
                    count = 0
                    async for _ in loader:
                        count += 1
                        assert at_device(m, "a") == TOTAL
                assert count == 4 and at_device(m, "b") < TOTAL
                done.set()
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("ring", [None, False], ids=["ring", "values"])
async def test_a_streamed_model_gets_room_that_idle_pooled_models_cached(
    ring: bool | None,
) -> None:
    # A model streamed beside the pool (stream_module) waited for ever for a block's room
    # that only the pool's idle models took (or was refused at once, blamed on the pool's
    # host copies, which its task had registered): it asks for the room back too.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL + 2048}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        with anyio.fail_after(10):
            for name in ("a", "b"):
                async with pool.use(name) as model:
                    await model(TOKENS)
            other = TinyLM(seed=5)
            streamed = stream_module(m, other, "cuda:0", prefetch=1, ring=ring)
            with torch.no_grad():
                assert torch.equal(await streamed(TOKENS), reference(other, TOKENS))
            await streamed.aclose()
            assert m.snapshot().location("cuda:0").peak_bytes <= 2 * TOTAL + 2048
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_what_the_task_holds_elsewhere_is_not_blamed_for_room_a_cache_takes() -> None:
    # The task holds a value at pinned-host; cuda:0 is full of a value nobody protects. A
    # wait for room at cuda:0 may end (another tenant may release that value): it is not
    # "waiting on itself", which only the task's own holdings at cuda:0 would make it.
    async with ResidencyManager(budgets={"cuda:0": 8 * 1024}, backend="sim") as m:
        pinned = m.register(torch.zeros(256), name="mine", location="pinned-host")
        cached = m.register(torch.zeros(2048), name="cache", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(cached, "cuda:0")
        with m.hold(pinned, "pinned-host"):
            assert m.waiting_on_itself(4096, "cuda:0", what="a block") is None
            with m.hold(cached, "cuda:0"):  # now the task's own hold is what keeps it out
                error = m.waiting_on_itself(4096, "cuda:0", what="a block")
                assert error is not None and "only what the waiting task holds" in str(error)


async def test_a_scope_gets_room_that_idle_pooled_models_cached() -> None:
    # A scope whose workspace only the pool's idle models keep out was refused at once
    # ("release or move values"): its admission asks for the room back first. A plan derived
    # from a state (an expected_state_version) is not: its decision chose what to evict.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL + 2048}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        with anyio.fail_after(10):
            for name in ("b", "a", "a"):
                async with pool.use(name) as model:
                    await model(TOKENS)
            workspace = [MemoryReservation("ws", "cuda:0", 32 * 1024)]
            derived = ResidencyPlan(reserve=workspace, expected_state_version=m.state_version)
            with pytest.raises(ResidencyPlanError):
                async with m.scope(derived):
                    pass
            assert at_device(m, "a") == at_device(m, "b") == TOTAL  # nothing given back
            async with m.scope(ResidencyPlan(reserve=workspace)):
                assert at_device(m, "a") == TOTAL and at_device(m, "b") < TOTAL
            assert m.snapshot().location("cuda:0").peak_bytes <= 2 * TOTAL + 2048
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_waiting_scope_gets_room_an_idle_model_caches_before_the_holder_leaves() -> None:
    # A scope needs room that another task's scope holds (it would fit once that scope
    # ended) and that an idle pooled model caches (it fits once the model is given back). It
    # asks for the cache as it waits: admitted while the other scope is still entered.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + 48 * 1024}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        x = m.register(torch.zeros(8 * 1024), name="x")  # 32 KiB
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                await model(TOKENS)
            assert at_device(m, "a") == TOTAL  # idle, cached
            held, entered, release = anyio.Event(), anyio.Event(), anyio.Event()
            order: list[str] = []

            async def holder() -> None:
                plan = ResidencyPlan(enter=[Move(x, "cuda:0")], exit=[Move(x, "pageable-host")])
                async with m.scope(plan):
                    held.set()
                    await release.wait()
                    order.append("holder left")

            async def waiter() -> None:
                await held.wait()
                workspace = [MemoryReservation("ws", "cuda:0", 40 * 1024)]
                async with m.scope(ResidencyPlan(reserve=workspace)):
                    order.append("waiter entered")
                    entered.set()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(holder)
                tasks.start_soon(waiter)
                # Admitted while the holder stays (without asking for the cache it would wait
                # for the holder, which waits for this: the bound above would end the test).
                await entered.wait()
                release.set()
            assert order == ["waiter entered", "holder left"], order
            assert at_device(m, "a") < TOTAL  # given back for it
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_room_given_back_counts_in_the_models_evictions() -> None:
    # The stats must add up with what happened: a model whose groups the pool gave back to
    # another tenant (manager.reclaim) is copied in again at its next request (a load), so
    # its evictions and evicted_bytes count what left, as for a decision's eviction; before,
    # they stayed at 0 and the load seemed to come from nowhere.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        with anyio.fail_after(10):
            for name in ("b", "a", "a"):  # 'b' is the colder one
                async with pool.use(name) as model:
                    await model(TOKENS)
            given = m.reclaim("cuda:0", 4096)
            assert 4096 <= given < TOTAL
            while at_device(m, "b") != TOTAL - given:  # (the releases began; they commit)
                await m.wait_for_change()
            stats = pool.stats()
            assert (stats["b"]["evictions"], stats["b"]["evicted_bytes"]) == (1, given)
            assert (stats["a"]["evictions"], stats["a"]["evicted_bytes"]) == (0, 0)
            async with pool.use("b") as model:
                await model(TOKENS)
            stats = pool.stats()
            assert stats["b"]["loads"] == 2 and stats["b"]["bytes_copied"] == TOTAL + given
        assert_nothing_leaked(m, pool)
        await pool.aclose()
