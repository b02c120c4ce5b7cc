"""``ModelPool`` beside other tenants of its manager: another pool on the same device, and
code that releases what nothing protects. Simulated backend."""

from __future__ import annotations

import random

import anyio
import pytest
import torch

from aresidency import MaterializationState, ReplicaMode, ResidencyManager
from aresidency.serving import ModelPool

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL

pytestmark = pytest.mark.anyio


async def test_a_group_another_tenant_releases_as_it_lands_is_copied_again() -> None:
    # A change listener of another tenant releases the model's first group the moment its
    # copy commits, before anything of the pool's runs (legal: nothing protects it yet). The
    # request is still admitted, with every group there: the taken one is copied again.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        first = pool.module("a").handles[0]
        taken: list[int] = []

        def tenant() -> None:
            mat = m.state.value(first).materializations.get(pool.device)
            if (
                not taken
                and mat is not None
                and mat.state is MaterializationState.RESIDENT
                and not mat.protected
            ):
                taken.append(m.state_version)
                m.release_nowait(first, "cuda:0")

        unlisten = m.add_change_listener(tenant)
        try:
            with anyio.fail_after(10):
                async with pool.use("a") as model:
                    assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                    assert model.decision.loaded_bytes > TOTAL  # the taken group twice
        finally:
            unlisten()
        assert taken and pool.stats()["a"]["failures"] == 0
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("seed", [1, 7])
async def test_two_pools_on_one_device_serve_every_request_and_fail_none(seed: int) -> None:
    # Two pools share one device budget: each evicts the other's idle models, and the other
    # loads them back, while its own copies land one by one. Every request is served, with the
    # right output, and none fails (neither with a group gone under it nor in a reclaim).
    rng = random.Random(seed)
    budget = TOTAL + TOTAL // 3
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim", trace_capacity=0) as m:
        pools = {"A": ModelPool(m), "B": ModelPool(m)}
        refs = {}
        for i in range(2):
            for which, pool in pools.items():
                name = f"{which.lower()}{i}"
                module = TinyLM(seed=10 * (which == "B") + i)
                refs[(which, name)] = reference(module, TOKENS)
                pool.add(name, module)
                await anyio.lowlevel.checkpoint()  # the test's set-up must not stall the loop
        plan = [
            [(rng.choice(list(refs)), rng.choice([0, 4096, TOTAL // 2])) for _ in range(8)]
            for _ in range(6)
        ]
        served: list[str] = []

        async def client(requests: list[tuple[tuple[str, str], int]]) -> None:
            for (which, name), reserve in requests:
                async with pools[which].use(name, reserve=reserve) as model:
                    assert torch.equal(await model(TOKENS), refs[(which, name)])
                served.append(name)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tasks:
                for requests in plan:
                    tasks.start_soon(client, requests)
        assert len(served) == 48
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        for pool in pools.values():
            assert sum(row["failures"] for row in pool.stats().values()) == 0
            assert_nothing_leaked(m, pool)
            await pool.aclose()


@pytest.mark.parametrize("mode", [ReplicaMode.REPLICABLE, ReplicaMode.EXCLUSIVE])
async def test_a_search_past_its_limit_makes_room_from_other_tenants_values(
    mode: ReplicaMode,
) -> None:
    # The room must come from another tenant's many small unprotected values (no idle model
    # to evict), and the search reaches its limit before it settles which: the pool moves the
    # least recently used of them off the device (a replica is released, a sole copy moved to
    # the host), as many bytes as the request lacks, and decides again. The request is served,
    # never failed; the budget holds; the other values stay.
    kib = 1 << 10
    budget = TOTAL + 20 * kib
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = ModelPool(m, search_state_limit=10)
        pool.add("a", TinyLM(seed=1))
        tenant = []
        for i in range(30):
            handle = m.register(torch.full((256,), float(i)), name=f"kv{i}", replica_mode=mode)
            await m.materialize(handle, "cuda:0")
            tenant.append(handle)
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                assert model.mode == "resident"
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
        assert pool.stats()["a"]["failures"] == 0
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        on_device = [
            "cuda:0" in {str(loc) for loc in m.state.value(h).materializations} for h in tenant
        ]
        assert on_device == [False] * 10 + [True] * 20  # oldest first, only what it lacked
        for i, handle in enumerate(tenant):  # nothing was lost
            where = next(iter(m.state.value(handle).materializations))
            assert torch.equal(m.tensor(handle, where).cpu(), torch.full((256,), float(i)))
        assert_nothing_leaked(m, pool)
        await pool.aclose()
