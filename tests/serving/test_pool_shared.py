"""Shared calls: requests on a resident model run their calls at the same time, each in a
worker thread, on the model's device replicas (``ModelPool(shared_calls=True)``; off by default).

On the simulated backend (CUDA simulated in host memory; released memory is poisoned, so a
call that read weights after their release would give a wrong output)."""

from __future__ import annotations

import functools
import threading
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from aresidency import ResidencyManager
from aresidency.serving import ModelPool

from ._models import TinyLM, assert_nothing_leaked, greedy, reference, tiny_llama
from .test_pool import BLOCK, OUTSIDE

pytestmark = pytest.mark.anyio

TOKENS = torch.arange(10).reshape(2, 5) % 24


class Gated(TinyLM):
    """A TinyLM whose forward waits at ``gate`` (a threading barrier or event) first, and
    notes which thread ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: Any = None
        self.threads: list[int] = []
        self.fail_next = False
        self.entered = threading.Event()  # set once a forward began

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.get_ident())
        self.entered.set()
        if self.fail_next:
            self.fail_next = False
            raise ValueError("a forward that fails")
        if isinstance(self.gate, threading.Barrier):
            self.gate.wait()  # for as long as the barrier was made to wait
        elif isinstance(self.gate, threading.Event):
            assert self.gate.wait(10), "the gate was never opened"
        return super().forward(tokens)


def host_pointers(module: nn.Module) -> list[int]:
    return [t.data_ptr() for t in module.state_dict().values()]


@pytest.mark.parametrize("shared", [True, False])
async def test_calls_on_a_resident_model_run_at_the_same_time(shared: bool) -> None:
    """Four requests on one model: with shared calls their forwards meet at a barrier of four
    (so they ran at the same time); one after the other, the barrier breaks."""
    module = Gated()
    expected = reference(module, TOKENS)
    module.threads.clear()
    module.entered.clear()
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, shared_calls=shared)
        pool.add("m", module)
        before = host_pointers(module)  # its tensors, now views of the pool's host copy
        module.gate = threading.Barrier(4, timeout=0.5 if not shared else 10)
        outputs: list[torch.Tensor] = []
        errors: list[BaseException] = []

        async def request() -> None:
            try:
                async with pool.use("m") as model:
                    outputs.append(await model(TOKENS))
            except Exception as error:  # the barrier broken: calls ran one after the other
                errors.append(error)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(request)
        if shared:
            assert not errors, errors
            assert len(set(module.threads)) == 4
            assert all(torch.equal(y, expected) for y in outputs)
            stats = pool.stats()["m"]
            assert stats["calls"] == 4 and stats["shared_calls"] == 4
            assert pool.module("m").shared_peak == 4
        else:
            assert errors and all(isinstance(e, threading.BrokenBarrierError) for e in errors)
            assert pool.stats()["m"]["shared_calls"] == 0
        assert_nothing_leaked(m, pool)
        assert pool.module("m").shared_calls == 0
        assert host_pointers(module) == before, "the module's own tensors are back"
        await pool.aclose()


async def test_a_hugging_face_model_decodes_the_same_with_shared_calls() -> None:
    """Prefill and decode with the KV cache on a Llama, two requests at once, shared: the
    tokens are those of the plain module."""
    module = await anyio.to_thread.run_sync(functools.partial(tiny_llama, seed=3))
    prompt = torch.arange(6).reshape(1, 6)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    async def plain(*args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(functools.partial(forward, *args, **kwargs))

    expected = await greedy(plain, module, prompt, 4)
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, shared_calls=True)
        pool.add("llama", module)
        got: list[list[int]] = []

        async def request() -> None:
            async with pool.use("llama") as model:
                got.append(await greedy(model, model.module, prompt, 4))

        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(request)
        assert got == [expected, expected]
        assert pool.stats()["llama"]["shared_calls"] == 10
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_pipeline_call_waits_for_the_shared_calls_and_none_starts_meanwhile() -> None:
    """While a shared call runs, a pipeline call on the same module waits (it would swap the
    module's tensors under the shared call); a shared call asked for meanwhile goes the
    pipeline way, after it."""
    module = Gated()
    expected = reference(module, TOKENS)
    module.threads.clear()
    module.entered.clear()
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, shared_calls=True)
        pool.add("m", module)
        streamed = pool.module("m")
        gate = module.gate = threading.Event()
        order: list[str] = []

        async def shared_request() -> None:
            async with pool.use("m") as model:
                y = await model(TOKENS)
                order.append("shared")
                assert torch.equal(y, expected)

        async with anyio.create_task_group() as tg:
            tg.start_soon(shared_request)
            # The shared call is in its forward, at the gate.
            assert await anyio.to_thread.run_sync(module.entered.wait, 10)
            assert streamed.shared_calls == 1

            async def pipeline_call() -> None:
                y = await streamed(TOKENS)
                order.append("pipeline")
                assert torch.equal(y, expected)

            tg.start_soon(pipeline_call)
            await anyio.wait_all_tasks_blocked()
            # The pipeline call waits; a new shared call cannot start beside it.
            assert streamed._exclusive == 1 and order == []
            assert streamed.current_call is None, "the pipeline call started beside it"
            assert streamed.begin_shared() is None
            gate.set()
        assert order == ["shared", "pipeline"]
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_cancelling_a_shared_call_waits_for_its_forward_and_leaves_nothing() -> None:
    module = Gated()
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, shared_calls=True)
        pool.add("m", module)
        before = host_pointers(module)  # its tensors, now views of the pool's host copy
        gate = module.gate = threading.Event()
        finished = anyio.Event()
        cancelled = False
        scope = anyio.CancelScope()

        async def request() -> None:
            nonlocal cancelled
            with scope:
                try:
                    async with pool.use("m") as model:
                        await model(TOKENS)
                except anyio.get_cancelled_exc_class():
                    cancelled = True
                    raise
                finally:
                    finished.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            assert await anyio.to_thread.run_sync(module.entered.wait, 10)
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            # The forward still runs in its thread: its leases stay until it returns.
            assert not finished.is_set() and pool.module("m").shared_calls == 1
            gate.set()
        assert cancelled
        assert pool.module("m").shared_calls == 0
        assert host_pointers(module) == before
        assert_nothing_leaked(m, pool)
        assert pool.stats()["m"]["failures"] == 1
        await pool.aclose()


async def test_a_shared_call_that_raises_gives_its_error_and_leaves_nothing() -> None:
    module = Gated()
    expected = reference(module, TOKENS)
    module.threads.clear()
    module.entered.clear()
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, shared_calls=True)
        pool.add("m", module)
        before = host_pointers(module)  # its tensors, now views of the pool's host copy
        module.fail_next = True
        with pytest.raises(ValueError, match="a forward that fails"):
            async with pool.use("m") as model:
                await model(TOKENS)
        assert host_pointers(module) == before
        assert_nothing_leaked(m, pool)
        async with pool.use("m") as model:  # the next request runs as usual
            assert torch.equal(await model(TOKENS), expected)
        assert pool.stats()["m"]["shared_calls"] == 2
        await pool.aclose()


# ------------------------------------------------------------------------- one thread


class Named(TinyLM):
    """A TinyLM that notes the name of the thread that ran each forward."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed)
        self.ran_in: list[str] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.ran_in.append(threading.current_thread().name)
        return super().forward(tokens)


@pytest.mark.parametrize("one_thread", [True, False])
async def test_calls_on_resident_models_run_in_the_pools_one_thread(one_thread: bool) -> None:
    """``one_thread=True``: the calls on every resident model run in one thread of the pool;
    otherwise each model's calls run in that model's own thread."""
    modules = {name: Named(seed) for seed, name in enumerate("ab")}
    expected = {name: reference(module, TOKENS) for name, module in modules.items()}
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m, one_thread=one_thread)
        for name, module in modules.items():
            pool.add(name, module)
            module.ran_in.clear()

        async def request(name: str) -> None:
            async with pool.use(name) as model:
                assert torch.equal(await model(TOKENS), expected[name])

        async with anyio.create_task_group() as tg:
            for name in "abab":
                tg.start_soon(request, name)
        names = {name: set(module.ran_in) for name, module in modules.items()}
        if one_thread:
            assert names["a"] == names["b"] and len(names["a"]) == 1
            assert next(iter(names["a"])).startswith("aresidency-pool")
        else:
            assert names["a"].isdisjoint(names["b"])
            assert all(n.startswith("aresidency-stream-a") for n in names["a"])
        assert_nothing_leaked(m, pool)
        await pool.aclose()
        assert pool._executor is None


async def test_a_streamed_call_keeps_its_own_thread_with_one_thread() -> None:
    """A streamed call may wait in its thread for room that another model's call gives back:
    it never runs in the pool's one thread, where it would keep that call from running."""
    module = Named(1)
    expected = reference(module, TOKENS)
    async with ResidencyManager(budgets={"cuda:0": OUTSIDE + 2 * BLOCK}, backend="sim") as m:
        pool = ModelPool(m, one_thread=True)
        pool.add("big", module)
        module.ran_in.clear()
        async with pool.use("big") as model:
            assert model.mode == "streamed"
            assert torch.equal(await model(TOKENS), expected)
        assert module.ran_in and all(n.startswith("aresidency-stream-big") for n in module.ran_in)
        assert_nothing_leaked(m, pool)
        await pool.aclose()
