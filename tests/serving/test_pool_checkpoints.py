"""``ModelPool`` serving models rebuilt from a checkpoint under a ``pageable-host`` budget: each
group is read into pageable host memory on its way to the device (temporary storage charged
there), so that budget, not only the device's, bounds how many groups load at once.
Simulated backend (CUDA simulated in host memory); every test bounds itself with
``fail_after``."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file

from aresidency import (
    Location,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyManager,
    ResidencyPlanError,
)
from aresidency.backends.sim import SimBackend
from aresidency.serving import ModelPool
from aresidency.testing import until

from ._models import TinyLM, assert_nothing_leaked, max_charge, reference
from .test_pool import BLOCK, OUTSIDE, TOKENS, TOTAL, model_bytes

pytestmark = pytest.mark.anyio

PAGEABLE = Location.parse("pageable-host")


def checkpoint_of(module: torch.nn.Module, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


@pytest.mark.parametrize(
    ("pageable", "other"),
    [(2 * BLOCK, 0), (TOTAL + BLOCK, 2 * BLOCK)],
    ids=["two groups", "a model but for another value"],
)
async def test_a_model_larger_than_the_pageable_room_loads_resident_a_few_groups_at_a_time(
    tmp_path: Path, pageable: int, other: int
) -> None:
    # The device holds the model whole, pageable-host two of its groups at a time (or the
    # model whole, but for a value registered there that nothing can evict): the request was
    # refused as infeasible at pageable-host (the whole model's temporary storage at once)
    # and waited for room that never comes, for ever.
    original = TinyLM(seed=1)
    path = checkpoint_of(original, tmp_path / "a.safetensors")
    budgets = {"cuda:0": 2 * TOTAL, "pageable-host": pageable}
    async with ResidencyManager(budgets=budgets, backend="sim") as m:
        if other:
            m.register(torch.ones(other // 4), name="other", location="pageable-host")
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1), checkpoint=path)
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                assert model.mode == "resident"
                assert torch.equal(await model(TOKENS), reference(original, TOKENS))
            async with pool.use("a") as model:  # nothing to load again
                assert model.decision.loaded_bytes == 0
        assert max_charge(m.trace(), "pageable-host") <= pageable
        assert pool.stats()["a"]["bytes_copied"] == TOTAL
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_streamed_model_keeps_its_leading_blocks_with_a_small_pageable_budget(
    tmp_path: Path,
) -> None:
    # Eight blocks, a device that holds all but one, pageable-host two groups at a time: the
    # leading blocks the request keeps were all asked for at once, the third refused, the
    # others cancelled, and the same again on every look: the request never got in.
    total, block, _ = model_bytes(n=8)
    original = TinyLM(seed=1, n=8)
    path = checkpoint_of(original, tmp_path / "a.safetensors")
    budgets = {"cuda:0": total - block // 2, "pageable-host": 2 * block}
    async with ResidencyManager(budgets=budgets, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1, n=8), checkpoint=path)
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                assert model.mode == "streamed" and model.decision.kept_groups > 2
                assert torch.equal(await model(TOKENS), reference(original, TOKENS))
        assert max_charge(m.trace(), "pageable-host") <= 2 * block
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_block_its_pageable_budget_can_never_hold_is_refused_at_add_and_at_use(
    tmp_path: Path,
) -> None:
    path = checkpoint_of(TinyLM(seed=1), tmp_path / "a.safetensors")
    async with ResidencyManager(budgets={"pageable-host": BLOCK - 1}, backend="sim") as m:
        pool = ModelPool(m)
        with pytest.raises(ValueError, match=r"'a' can never be loaded: .* pageable-host") as info:
            pool.add("a", TinyLM(seed=1), checkpoint=path)
        assert f"{BLOCK} B" in str(info.value)
        assert pool.models == [] and not m.snapshot().values
        await pool.aclose()
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1), checkpoint=path)
        m.set_budget("pageable-host", OUTSIDE)  # lowered after the model was added
        with anyio.fail_after(10):
            with pytest.raises(ResidencyPlanError, match=r"'a' can never be loaded") as refused:
                async with pool.use("a"):
                    pass
        cause = refused.value.__cause__
        assert isinstance(cause, ResidencyBudgetError)
        assert (cause.kind, str(cause.location)) == ("reconstruction", "pageable-host")
        assert (cause.budget_bytes, cause.requested_bytes) == (OUTSIDE, BLOCK)
        assert pool.stats()["a"]["failures"] == 1
        m.set_budget("pageable-host", None)
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                assert model.mode == "resident"
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("pageable_blocks", [2, 5], ids=["two groups", "a model and a group"])
async def test_a_request_waiting_for_the_room_another_pools_load_reads_into_goes_in(
    tmp_path: Path, pageable_blocks: int
) -> None:
    # Two pools on two devices share the pageable-host budget their checkpoints are read
    # into. A request whose load found that room taken by the other pool's load waited for
    # progress at its own device only, which never came: it waited for ever.
    originals = [TinyLM(seed=1), TinyLM(seed=2)]
    paths = [checkpoint_of(o, tmp_path / f"{i}.safetensors") for i, o in enumerate(originals)]
    budgets = {
        "cuda:0": 2 * TOTAL,
        "cuda:1": 2 * TOTAL,
        "pageable-host": pageable_blocks * BLOCK,
    }
    backend = SimBackend(copy_gbps=0.0002)  # 0.2 MB/s: a model takes about 0.4 s to load
    async with ResidencyManager(budgets=budgets, backend=backend) as m:
        pools = [ModelPool(m, "cuda:0"), ModelPool(m, "cuda:1")]
        for pool, path, name in zip(pools, paths, "ab"):
            pool.add(name, TinyLM(seed=9), checkpoint=path)
        modes: list[str] = []

        async def request(pool: ModelPool, name: str, original: torch.nn.Module) -> None:
            async with pool.use(name) as model:
                assert torch.equal(await model(TOKENS), reference(original, TOKENS))
                modes.append(model.mode)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request, pools[0], "a", originals[0])
                # 'b' asks once 'a' is being read into pageable-host.
                await until(m, lambda: m.state.ledger(PAGEABLE).charged_bytes > 0)
                tasks.start_soon(request, pools[1], "b", originals[1])
        assert modes == ["resident", "resident"]
        for pool in pools:
            assert pool.admitted == pool.waiting == 0
            await pool.aclose()
        assert m.snapshot().location("pageable-host").reserved_bytes == 0


async def test_a_model_loaded_in_rounds_evicts_what_fills_pageable_host(tmp_path: Path) -> None:
    # pageable-host holds two groups, both taken by a replica of a value that stays in pinned
    # memory: the request loads its groups a few at a time (its decision cannot count them
    # all there at once), and each load waited for room that nothing would give back.
    original = TinyLM(seed=1)
    path = checkpoint_of(original, tmp_path / "a.safetensors")
    budgets = {"cuda:0": 2 * TOTAL, "pageable-host": 2 * BLOCK}
    async with ResidencyManager(budgets=budgets, backend="sim") as m:
        cached = m.register(
            torch.ones(2 * BLOCK // 4), name="cached", replica_mode=ReplicaMode.REPLICABLE
        )
        await m.materialize(cached, "pinned-host")
        # protected: waited for, never evicted (the request times out as before)
        with m.hold(cached, "pageable-host"):
            pool = ModelPool(m)
            pool.add("a", TinyLM(seed=1), checkpoint=path)
            with pytest.raises(TimeoutError):
                async with pool.use("a", timeout=0.05):
                    pass
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                assert model.mode == "resident"
                assert torch.equal(await model(TOKENS), reference(original, TOKENS))
        assert max_charge(m.trace(), "pageable-host") <= 2 * BLOCK
        assert [str(loc) for loc in m.snapshot().value(cached).locations] == ["pinned-host"]
        assert m.snapshot().location("pageable-host").used_bytes == 0
        assert_nothing_leaked(m, pool)
        await pool.aclose()
