"""The runtime's behaviours on a real GPU (marked ``cuda``; skipped without one)."""

from __future__ import annotations

import gc
import time

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import (
    Materialize,
    MemoryReservation,
    Move,
    ReplicaMode,
    ResidencyInUseError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanExecutionError,
)

pytestmark = [pytest.mark.anyio, pytest.mark.cuda]

MiB = 1 << 20


def data(nbytes: int = 8 * MiB, seed: int = 0) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


def spin_cycles(ms: float) -> int:
    """GPU clock cycles for about ``ms`` milliseconds (torch.cuda._sleep spins that long)."""
    return int(ms * 1e-3 * 1.98e9)


@pytest.fixture
def no_gpu_leak() -> object:
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    yield None
    gc.collect()  # tensors kept alive only by reference cycles (tracebacks) are not leaks
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


async def test_cuda_moves_keep_data_bit_for_bit(no_gpu_leak: object) -> None:
    async with ResidencyManager(backend="cuda") as m:
        original = data(64 * MiB + 4096)  # not a multiple of any chunk size
        h = m.register(original.clone(), name="w")
        for loc in [
            "cuda:0",
            "pinned-host",
            "cuda:0",
            "pageable-host",
            "pinned-host",
            "cuda:0",
            "pageable-host",
        ]:
            await m.move(h, loc)
            async with m.acquire(h, loc) as lease:
                assert torch.equal(lease.tensor.cpu(), original), loc
                if loc.startswith("cuda"):
                    assert lease.tensor.device == torch.device(loc)
                elif loc == "pinned-host":
                    assert lease.tensor.is_pinned()
        snap = m.snapshot()
        assert snap.location("cuda:0").used_bytes == 0
        await m.discard(h)


async def test_cuda_release_waits_for_a_readers_event(no_gpu_leak: object) -> None:
    async with ResidencyManager(backend="cuda") as m:
        h = m.register(data(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        side = torch.cuda.Stream()
        torch.cuda._sleep(1000)  # load the spin kernel first (lazy module loading)
        torch.cuda.synchronize()
        launched = time.perf_counter()
        async with m.acquire(h, "cuda:0", stream=side) as lease:
            with torch.cuda.stream(side):
                torch.cuda._sleep(spin_cycles(1000))  # a 1 s kernel, then a real read
                total = lease.tensor.sum()
        assert m.snapshot().value(h).materialization("cuda:0").pending_event_count == 1
        assert not side.query(), (
            "the reader's kernel should still run when the release starts; "
            f"{time.perf_counter() - launched:.3f} s passed since its launch"
        )
        await m.release(h, "cuda:0")
        # The property itself, not a duration: the release returned only once the reader's
        # kernel had completed (freeing earlier would let the allocator reuse memory it reads).
        assert side.query(), "the release returned while a reader still ran"
        assert torch.isfinite(total)
        await m.discard(h)


async def test_cuda_lease_on_an_incoming_copy_waits_on_the_device_not_the_host(
    no_gpu_leak: object,
) -> None:
    async with ResidencyManager(backend="cuda") as m:
        original = data(256 * MiB)
        h = m.register(
            original.clone(), name="w", location="pinned-host", replica_mode=ReplicaMode.REPLICABLE
        )
        compute = torch.cuda.Stream()
        task = m.materialize_nowait(h, "cuda:0")
        assert m.snapshot().value(h).materialization("cuda:0").state.value == "incoming"
        async with m.acquire(h, "cuda:0", stream=compute) as lease:
            with torch.cuda.stream(compute):
                seen = lease.tensor.clone()  # read on the compute stream, ordered after the copy
        await task
        compute.synchronize()
        assert torch.equal(seen.cpu(), original)
        await m.discard(h)


async def test_cuda_failed_copy_leaves_source_intact(no_gpu_leak: object) -> None:
    async with ResidencyManager(backend="cuda") as m:
        original = data()
        h = m.register(original.clone(), name="w", location="pinned-host")
        m.backend.faults.fail_transfer_at = 1
        with pytest.raises(RuntimeError, match="injected"):
            await m.move(h, "cuda:0")
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pinned-host"]
        assert m.snapshot().location("cuda:0").used_bytes == 0
        async with m.acquire(h, "pinned-host") as lease:
            assert torch.equal(lease.tensor, original)
        await m.discard(h)


async def test_cuda_scope_failure_and_cancellation_leak_nothing(no_gpu_leak: object) -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}, backend="cuda") as m:
        a = m.register(data(seed=1), name="a", location="pinned-host")
        b = m.register(data(seed=2), name="b", location="pinned-host")
        plan = ResidencyPlan(
            reserve=[MemoryReservation("ws", "cuda:0", 8 * MiB)],
            enter=[Move(a, "cuda:0"), Move(b, "cuda:0")],
            exit=[Move(a, "pinned-host"), Move(b, "pinned-host")],
        )
        m.backend.faults.fail_transfer_at = 2
        with pytest.raises(ResidencyPlanExecutionError) as info:
            async with m.scope(plan):
                pass
        assert info.value.phase == "enter" and info.value.failed_action_index == 1
        assert m.snapshot().location("cuda:0").charged_bytes == 8 * MiB  # a is in, committed
        await m.move(a, "pinned-host")

        async def execute(cancel: anyio.CancelScope) -> None:
            with cancel:
                await m.execute(plan)

        for cancel_after in range(6):
            cancel = anyio.CancelScope()
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(execute, cancel)
                for _ in range(cancel_after):
                    await anyio.lowlevel.checkpoint()
                cancel.cancel()
            for h in (a, b):
                for loc in list(m.snapshot().value(h).locations):
                    if loc.is_cuda:
                        await m.move(h, "pinned-host")
            snap = m.snapshot()
            assert snap.location("cuda:0").charged_bytes == 0, cancel_after
        await m.discard(a)
        await m.discard(b)


async def test_cuda_protected_materialization_refuses_removal(no_gpu_leak: object) -> None:
    async with ResidencyManager(backend="cuda") as m:
        h = m.register(data(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.execute(ResidencyPlan(enter=[Materialize(h, "cuda:0")]))
        with m.hold(h, "cuda:0"), pytest.raises(ResidencyInUseError):
            await m.release(h, "cuda:0")
        await m.discard(h)


@pytest.mark.cuda2
async def test_cuda_peer_copies_between_two_gpus(no_gpu_leak: object) -> None:
    async with ResidencyManager(backend="cuda") as m:
        original = data(32 * MiB)
        h = m.register(original.clone(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        await m.materialize(h, "cuda:1")  # peer copy: the source preference picks cuda:0
        kinds = [(t.kind, str(t.location)) for t in m.trace().transitions]
        assert ("copy_begin", "cuda:1") in kinds
        async with m.acquire(h, "cuda:1") as lease:
            assert lease.tensor.device == torch.device("cuda:1")
            assert torch.equal(lease.tensor.cpu(), original)
        await m.move(h, "cuda:1")
        await m.discard(h)


async def test_cuda_pageable_destinations_are_reused_within_the_pageable_budget(
    no_gpu_leak: object,
) -> None:
    from aresidency.backends import CudaBackend

    backend = CudaBackend()
    cache = backend.pageable_cache
    budget = 40 * MiB
    async with ResidencyManager(budgets={"pageable-host": budget}, backend=backend) as m:
        values = [data(8 * MiB, seed=i) for i in range(3)]
        handles = [
            m.register(v.clone().cuda(), None, ReplicaMode.REPLICABLE, location="cuda:0")
            for v in values
        ]
        for _ in range(3):
            for h in handles:
                await m.materialize(h, "pageable-host")
            for h, v in zip(handles, values, strict=True):
                async with m.acquire(h, "pageable-host") as lease:
                    assert torch.equal(lease.tensor, v), "a reused mapping holds the new data"
            assert m.state.ledger("pageable-host").charged_bytes <= budget
            for h in handles:
                await m.release(h, "pageable-host")
            gc.collect()
            record = m.snapshot().location("pageable-host")
            assert record.spare_bytes == cache.cached_bytes > 0
            assert record.spare_bytes <= budget - record.charged_bytes
        assert cache.reuses >= 6, "the later rounds' destinations were the earlier ones'"
        # A tensor the user keeps is never handed out again while it lives.
        await m.materialize(handles[0], "pageable-host")
        async with m.acquire(handles[0], "pageable-host") as lease:
            kept = lease.tensor
        await m.release(handles[0], "pageable-host")
        for h in handles[1:]:
            await m.materialize(h, "pageable-host")
        assert torch.equal(kept, values[0])
        del kept
        for h in handles:
            await m.discard(h)
    gc.collect()
    assert cache.cached_bytes == 0, "closing the manager unmapped what the cache kept"


async def test_cuda_pinned_arena_stays_within_the_pinned_budget(no_gpu_leak: object) -> None:
    from aresidency.backends import CudaBackend

    backend = CudaBackend(arena_slab_bytes=4 * MiB)
    arena = backend.arena
    assert arena is not None
    staging = backend.staging_nbytes()  # reserved at pinned-host by the manager
    budget = staging + 32 * MiB
    async with ResidencyManager(budgets={"pinned-host": budget}, backend=backend) as m:
        values = [data(3 * MiB, seed=i) for i in range(4)]
        handles = [
            m.register(v.clone().cuda(), None, ReplicaMode.REPLICABLE, location="cuda:0")
            for v in values
        ]
        for _ in range(4):
            for h in handles:
                await m.materialize(h, "pinned-host")
            for h, v in zip(handles, values, strict=True):
                async with m.acquire(h, "pinned-host") as lease:
                    assert torch.equal(lease.tensor, v)
            ledger = m.state.ledger("pinned-host")
            assert ledger.charged_bytes <= budget
            # Registered memory: the arena's slabs plus what was pinned outside it (the
            # staging buffers are pinned on first use; the reservation covers them).
            lanes = (backend.pool.h2d, backend.pool.d2h)
            buffers = sum(b.numel() for lane in lanes for b in lane.buffers)
            outside = backend.pinned.pinned_bytes - buffers
            assert arena.total_bytes + outside <= budget - staging
            for h in handles:
                await m.release(h, "pinned-host")
            gc.collect()
            record = m.snapshot().location("pinned-host")
            assert record.spare_bytes == arena.free_bytes()
            assert record.spare_bytes <= budget - record.charged_bytes
        assert arena.carves > 0, "later rounds carved their destinations"
        for h in handles:
            await m.discard(h)
    gc.collect()
    assert arena.total_bytes == 0, "closing the manager released the slabs"
