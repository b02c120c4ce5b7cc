"""Direct calls: a resident request's calls run the module on the held device replicas, with
no streaming pipeline and no lease per block (``ModelPool(direct_calls=True)``, the default).

On the simulated backend (CUDA simulated in host memory; released memory is poisoned, so a
call that read weights after their release would give a wrong output)."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import anyio
import anyio.abc
import pytest
import torch

from aresidency import ResidencyManager
from aresidency.serving import ModelPool

from ._models import TinyLM, assert_nothing_leaked, reference, tiny_llama
from .test_pool import TOTAL
from .test_pool_shared import TOKENS, Gated, host_pointers

pytestmark = pytest.mark.anyio


def leases(m: ResidencyManager) -> int:
    return sum(1 for t in m.trace().transitions if t.kind == "lease")


@pytest.mark.parametrize("direct", [True, False])
async def test_resident_calls_take_no_lease_per_block(direct: bool) -> None:
    """Three calls in one resident request: direct, none takes a lease; through the pipeline,
    each takes one per group. The outputs are the module's either way."""
    module = TinyLM(seed=1)
    expected = reference(module, TOKENS)
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, direct_calls=direct)
        pool.add("m", module)
        groups = len(pool.module("m").all_groups)
        before = host_pointers(module)
        async with pool.use("m") as model:
            assert model.mode == "resident"
            leased = leases(m)
            for _ in range(3):
                assert torch.equal(await model(TOKENS), expected)
            leased = leases(m) - leased
        stats = pool.stats()["m"]
        assert stats["calls"] == 3
        if direct:
            assert stats["direct_calls"] == 3 and leased == 0
        else:
            assert stats["direct_calls"] == 0 and leased == 3 * groups
        assert host_pointers(module) == before, "the module's own tensors are back"
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_cancelled_direct_call_waits_for_its_forward() -> None:
    """Cancelled while its forward runs, a direct call returns only once the thread is done
    with the module's tensors (they point at the device replicas until then), then raises;
    nothing is left behind and the next request runs as usual."""
    module = Gated()
    expected = reference(module, TOKENS)
    module.entered.clear()
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m)
        pool.add("m", module)
        before = host_pointers(module)
        module.gate = threading.Event()
        ended = anyio.Event()
        outcome: list[str] = []

        async def request(scope_box: list[anyio.CancelScope]) -> None:
            with anyio.CancelScope() as scope:
                scope_box.append(scope)
                try:
                    async with pool.use("m") as model:
                        await model(TOKENS)
                        outcome.append("returned")
                finally:
                    ended.set()
            outcome.append("cancelled" if scope.cancelled_caught else "not cancelled")

        box: list[anyio.CancelScope] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(request, box)
            await anyio.to_thread.run_sync(module.entered.wait, 10)
            box[0].cancel()
            await anyio.wait_all_tasks_blocked()
            assert not ended.is_set(), "the call returned while its forward still ran"
            assert host_pointers(module) != before  # still on the device replicas
            module.gate.set()
        assert outcome == ["cancelled"]
        assert host_pointers(module) == before
        assert_nothing_leaked(m, pool)
        module.gate = None
        async with pool.use("m") as model:
            assert torch.equal(await model(TOKENS), expected)
        assert pool.stats()["m"]["direct_calls"] == 2
        await pool.aclose()


async def test_a_failing_direct_call_raises_and_leaves_the_module_as_it_was() -> None:
    module = Gated()
    expected = reference(module, TOKENS)
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m)
        pool.add("m", module)
        before = host_pointers(module)
        module.fail_next = True
        with pytest.raises(ValueError, match="a forward that fails"):
            async with pool.use("m") as model:
                await model(TOKENS)
        assert host_pointers(module) == before
        assert_nothing_leaked(m, pool)
        async with pool.use("m") as model:
            assert torch.equal(await model(TOKENS), expected)
        await pool.aclose()


async def test_the_views_of_a_replica_go_with_its_last_hold() -> None:
    """The views a direct call swaps in are kept between calls while the request holds the
    replicas, and dropped when the last hold ends: an evicted replica's memory is freed, not
    kept alive by them."""
    modules = {name: TinyLM(seed=seed) for seed, name in enumerate("ab")}
    expected = {name: reference(module, TOKENS) for name, module in modules.items()}
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = ModelPool(m)
        for name, module in modules.items():
            pool.add(name, module)
        streamed = pool.module("a")
        async with pool.use("a") as model:
            assert torch.equal(await model(TOKENS), expected["a"])
            views = streamed.held_views()
            assert views is not None
            first = views[0][0]
            assert torch.equal(await model(TOKENS), expected["a"])
            again = streamed.held_views()
            assert again is not None and again[0][0] is first  # made once per replica
            replicas = {h: weakref.ref(m.tensor(h, "cuda:0")) for h in streamed.handles}
            del views, again, first
        async with pool.use("b") as model:  # evicts (some of) 'a': both do not fit
            assert torch.equal(await model(TOKENS), expected["b"])
        snap = m.snapshot()
        evicted = [
            h
            for h in streamed.handles
            if all(str(r.location) != "cuda:0" for r in snap.values[h].materializations)
        ]
        assert evicted and pool.stats()["a"]["evictions"] >= 1
        assert all(replicas[h]() is None for h in evicted), "an evicted replica is still alive"
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.fixture(scope="module")
def generation_warmed_up() -> None:
    """The first ``generate`` in a process imports and sets up much of transformers while
    holding the interpreter lock (over a second): done here, outside any event loop."""
    pytest.importorskip("transformers.models.llama.modeling_llama")
    tiny_llama(seed=0).generate(torch.arange(3).reshape(1, 3), max_new_tokens=1, pad_token_id=0)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.usefixtures("generation_warmed_up")
async def test_hugging_face_generation_in_the_pool(direct: bool) -> None:
    """``await model.generate(...)``: the whole generate loop in one call of the model, on
    the held replicas (direct) or through the pipeline; the tokens of the plain module."""
    module = await anyio.to_thread.run_sync(functools.partial(tiny_llama, seed=4))
    prompt = torch.arange(7).reshape(1, 7)
    options: dict[str, Any] = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}

    def plain() -> torch.Tensor:
        out: torch.Tensor = module.generate(prompt, **options)
        return out

    expected = await anyio.to_thread.run_sync(plain)
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, direct_calls=direct)
        pool.add("llama", module)
        async with pool.use("llama") as model:
            got = await model.generate(prompt, **options)
        assert torch.equal(got, expected)
        stats = pool.stats()["llama"]
        assert stats["calls"] == 1 and stats["direct_calls"] == (1 if direct else 0)
        assert_nothing_leaked(m, pool)
        pool.add("tiny", TinyLM())
        async with pool.use("tiny") as model:
            with pytest.raises(TypeError, match="no generate"):
                await model.generate(TOKENS)
        await pool.aclose()


@pytest.mark.parametrize("direct", [True, False])
async def test_a_call_that_outlives_its_block_keeps_the_model_until_it_returns(
    direct: bool,
) -> None:
    """A call made inside the block, in a task of an outer task group, is still running when
    the block ends; another model then needs the room. The block's exit waits for the call
    (a direct call reads the held replicas with no lease of its own: released, their memory
    would be poisoned under it), so the call's output is right and the other model is
    admitted only after it."""
    gated = Gated()
    expected = reference(gated, TOKENS)
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = ModelPool(m, direct_calls=direct)
        pool.add("a", gated)
        pool.add("b", TinyLM(seed=2))
        order: list[str] = []
        gate = threading.Event()

        async def straggler(model: Any) -> None:
            y = await model(TOKENS)
            order.append("call returned")
            assert torch.equal(y, expected)

        async def request_b() -> None:
            async with pool.use("b"):
                order.append("b admitted")

        async def open_when_all_blocked() -> None:
            await anyio.wait_all_tasks_blocked()
            gate.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                async with pool.use("a") as model:
                    assert torch.equal(await model(TOKENS), expected)  # its copies landed
                    gated.entered.clear()
                    gated.gate = gate
                    tasks.start_soon(straggler, model)
                    while not gated.entered.is_set():
                        await anyio.wait_all_tasks_blocked()
                    tasks.start_soon(request_b)
                    await anyio.wait_all_tasks_blocked()
                    assert pool.waiting == 1  # 'b' needs the room 'a' holds
                    tasks.start_soon(open_when_all_blocked)  # the exit below parks first
                order.append("a ended")
        assert order == ["call returned", "a ended", "b admitted"]
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a native cancellation: asyncio's
async def test_a_block_exit_cancelled_natively_still_waits_for_its_call(anyio_backend: str) -> None:
    """The block's exit waits for a call that outlives it; the request's task is cancelled
    twice (``task.cancel()``) meanwhile: the exit still waits, then raises the cancellation,
    and the held groups are not released under the running call."""
    import asyncio

    gated = Gated()
    expected = reference(gated, TOKENS)
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        pool = ModelPool(m, direct_calls=True)
        pool.add("a", gated)
        order: list[str] = []
        gate = threading.Event()
        calls: list[asyncio.Task[None]] = []

        async def straggler(model: Any) -> None:
            y = await model(TOKENS)
            order.append("call returned")
            assert torch.equal(y, expected)

        async def request() -> None:
            try:
                async with pool.use("a") as model:
                    assert torch.equal(await model(TOKENS), expected)
                    gated.entered.clear()
                    gated.gate = gate
                    calls.append(asyncio.get_running_loop().create_task(straggler(model)))
                    await anyio.to_thread.run_sync(gated.entered.wait)
                    straggling.set()
            finally:
                order.append("a ended")

        straggling = asyncio.Event()
        task = asyncio.get_running_loop().create_task(request())
        with anyio.fail_after(10):
            await straggling.wait()  # the call runs in the worker thread, held by the gate
            for _ in range(5):
                await asyncio.sleep(0)  # the block's exit parks, waiting for the call
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()
            for _ in range(20):
                await asyncio.sleep(0)
            assert not task.done() and order == [], "the exit ended under the running call"
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await calls[0]
        assert order == ["call returned", "a ended"]
        assert_nothing_leaked(m, pool)
        await pool.aclose()
