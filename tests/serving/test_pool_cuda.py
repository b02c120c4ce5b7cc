"""``ModelPool`` on a real GPU (marked ``cuda``; skipped without one): requests on resident
models run as shared calls (each in a worker thread, on the device replicas) or as direct
calls, and decode the same tokens, bit for bit, as the model run on the GPU on its own; two
models in a budget that holds one are loaded and evicted in turn without a wrong token and
within the budget, and an evicted model's memory is not reused before the kernels of its
last direct call have read it."""

from __future__ import annotations

import copy
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from aresidency import ResidencyManager
from aresidency.serving import ModelPool

from ._models import assert_nothing_leaked, greedy, tiny_llama

pytest.importorskip("transformers.models.llama.modeling_llama")

pytestmark = [pytest.mark.anyio, pytest.mark.cuda]

STEPS = 6


def build(seed: int) -> nn.Module:
    return tiny_llama(seed=seed, layers=4).to(torch.bfloat16)


def prompt(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, 12), generator=g).to("cuda:0")


async def budget_for_one(module: nn.Module) -> int:
    """A budget that holds one pooled copy of ``module`` (its groups as the pool charges
    them) and half of another: two such models cannot both be resident."""
    async with ResidencyManager(backend="cuda") as probe_manager:
        probe = ModelPool(probe_manager)
        probe.add("probe", module)
        model_bytes = sum(g.charge_bytes for g in probe.module("probe").all_groups)
        await probe.aclose()
    return model_bytes + model_bytes // 2 + (64 << 10)


def on_gpu(module: nn.Module, ids: torch.Tensor) -> list[int]:
    """The greedy tokens of a copy of ``module`` run on the GPU on its own (worker thread)."""
    gpu = copy.deepcopy(module).to("cuda:0")

    async def call(*args: Any, **kwargs: Any) -> Any:
        return gpu(*args, **kwargs)

    return anyio.run(greedy, call, gpu, ids, STEPS)


async def test_resident_requests_run_as_shared_calls_and_decode_the_same_tokens() -> None:
    module = await anyio.to_thread.run_sync(build, 1)
    prompts = [prompt(seed) for seed in range(4)]
    expected = [await anyio.to_thread.run_sync(on_gpu, module, p) for p in prompts]
    async with ResidencyManager(backend="cuda") as m:
        pool = ModelPool(m, shared_calls=True)
        pool.add("llama", module)
        got: dict[int, list[int]] = {}

        async def request(i: int) -> None:
            async with pool.use("llama", reserve="8MiB") as model:
                assert model.mode == "resident"
                got[i] = await greedy(model, model.module, prompts[i], STEPS)

        for _ in range(2):  # the first round loads the model, the second finds it there
            got.clear()
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(request, i)
            assert [got[i] for i in range(4)] == expected
        stats = pool.stats()["llama"]
        assert stats["calls"] == 8 * (STEPS + 1)
        assert stats["shared_calls"] == stats["calls"]
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_two_models_in_turn_in_a_budget_that_holds_one() -> None:
    modules = [await anyio.to_thread.run_sync(build, seed) for seed in (2, 3)]
    ids = prompt(7)
    expected = [await anyio.to_thread.run_sync(on_gpu, module, ids) for module in modules]
    budget = await budget_for_one(modules[0])
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="cuda") as m:
        pool = ModelPool(m)
        for name, module in zip("ab", modules):
            pool.add(name, module)
        got: list[tuple[str, list[int]]] = []

        async def request(name: str) -> None:
            async with pool.use(name, reserve="64KiB") as model:
                got.append((name, await greedy(model, model.module, ids, STEPS)))

        async with anyio.create_task_group() as tg:
            for name in "abab" * 2:
                tg.start_soon(request, name)
        assert sorted(got) == sorted((name, expected["ab".index(name)]) for name in "abab" * 2)
        stats = pool.stats()
        assert stats["a"]["loads"] >= 1 and stats["b"]["loads"] >= 1
        assert all(s["direct_calls"] == s["calls"] for s in stats.values())
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_two_resident_models_decode_the_same_tokens_in_the_pools_one_thread() -> None:
    modules = [await anyio.to_thread.run_sync(build, seed) for seed in (4, 5)]
    ids = prompt(9)
    expected = [await anyio.to_thread.run_sync(on_gpu, module, ids) for module in modules]
    async with ResidencyManager(backend="cuda") as m:
        pool = ModelPool(m, one_thread=True)
        for name, module in zip("ab", modules):
            pool.add(name, module)
        got: list[tuple[str, list[int]]] = []

        async def request(name: str) -> None:
            async with pool.use(name, reserve="1MiB") as model:
                assert model.mode == "resident"
                got.append((name, await greedy(model, model.module, ids, STEPS)))

        async with anyio.create_task_group() as tg:
            for name in "abab":
                tg.start_soon(request, name)
        assert sorted(got) == sorted((name, expected["ab".index(name)]) for name in "abab")
        stats = pool.stats()
        assert all(s["direct_calls"] == s["calls"] == 2 * (STEPS + 1) for s in stats.values())
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_an_evicted_model_outlives_the_kernels_of_its_last_direct_call() -> None:
    """A direct call's kernels are held up behind a long kernel on the compute stream; the
    request ends at once (nothing waits for them) and the next request, for another model,
    needs the first one's room. The eviction waits for the call's event (reported when the
    request ended), so the second model's copy never overwrites weights not read yet: the
    first call's logits are those of the model run on its own."""
    modules = [await anyio.to_thread.run_sync(build, seed) for seed in (6, 7)]
    ids = prompt(11)

    def logits_on_gpu(module: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return copy.deepcopy(module).to("cuda:0")(ids).logits.cpu()

    expected = await anyio.to_thread.run_sync(logits_on_gpu, modules[0])
    budget = await budget_for_one(modules[0])
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="cuda") as m:
        pool = ModelPool(m)
        for name, module in zip("ab", modules):
            pool.add(name, module)
        async with pool.use("a", reserve="64KiB") as model:
            await model(ids)  # loads it; the copies have landed
            torch.cuda._sleep(400_000_000)  # a long kernel ahead of the next call's
            logits = (await model(ids)).logits  # enqueued behind it, not run yet
            # one event kept for both calls: the current stream's objects, made at each
            # call, are the same device stream
            assert len(model._request.readers) == 1
        async with pool.use("b", reserve="64KiB") as model:  # evicts 'a' (both do not fit)
            await model(ids)
        assert pool.stats()["a"]["evictions"] >= 1
        assert pool.stats()["a"]["direct_calls"] == 2
        torch.cuda.synchronize()
        assert torch.equal(logits.cpu(), expected)
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_generation_in_the_pool_gives_the_tokens_of_the_model_on_its_own() -> None:
    """``await model.generate(...)`` on a resident request (direct: the whole loop on the
    held replicas, one thread hop) and on a streamed one (the pipeline's window wrapping
    around), against ``generate`` of the model run on the GPU on its own."""
    module = await anyio.to_thread.run_sync(build, 8)
    ids = prompt(13)
    options: dict[str, Any] = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}

    def on_its_own() -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = copy.deepcopy(module).to("cuda:0").generate(ids, **options)
            return out.cpu()

    expected = await anyio.to_thread.run_sync(on_its_own)
    async with ResidencyManager(backend="cuda") as m:
        pool = ModelPool(m)
        pool.add("llama", module)
        async with pool.use("llama") as model:
            assert model.mode == "resident"
            got = await model.generate(ids, **options)
        assert torch.equal(got.cpu(), expected)
        assert pool.stats()["llama"]["direct_calls"] == 1
        assert_nothing_leaked(m, pool)
        await pool.aclose()
