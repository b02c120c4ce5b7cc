"""Reads a hold protects (``held_tensor``) and their reader events (``track_readers``), on the
simulated backend (CUDA simulated in host memory): the tensor is handed out only once its copy
landed, and a release waits for the reported readers' work."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from aresidency import (
    ReplicaMode,
    ResidencyInUseError,
    ResidencyManager,
    ResidencyUnavailableError,
)

pytestmark = pytest.mark.anyio


def places(m: ResidencyManager, handle: object) -> set[str]:
    return {str(r.location) for r in m.snapshot().values[handle].materializations}


async def test_held_tensor_needs_a_hold_and_waits_for_no_copy() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.arange(1024.0), name="w", replica_mode=ReplicaMode.REPLICABLE)
        gate = threading.Event()
        m.backend._devices[0].h2d.submit(lambda: gate.wait(10))  # holds up the copy
        operation = m.materialize_nowait(h, "cuda:0")
        with pytest.raises(ValueError, match="no hold"):
            m.held_tensor(h, "cuda:0")
        hold = m.hold(h, "cuda:0")
        assert m.held_tensor(h, "cuda:0") is None  # the copy is still in flight
        gate.set()
        await operation
        tensor = m.held_tensor(h, "cuda:0")
        assert tensor is not None and torch.equal(tensor, torch.arange(1024.0))
        hold.release()
        with pytest.raises(ValueError, match="no hold"):
            m.held_tensor(h, "cuda:0")
        with pytest.raises(ResidencyUnavailableError):
            m.held_tensor(h, "cuda:1")


async def test_a_release_waits_for_the_reported_readers() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.ones(1024), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        hold = m.hold(h, "cuda:0")
        assert m.held_tensor(h, "cuda:0") is not None
        stream = m.backend.current_stream("cuda:0")
        gate = threading.Event()
        m.backend.run_in_stream_order(stream, lambda: gate.wait(10))  # a long kernel
        reader = m.backend.record_event(stream)
        m.track_readers(h, "cuda:0", [reader, m.backend.record_event(None)])  # done: not counted
        record = m.snapshot().values[h].materialization("cuda:0")
        assert record is not None and record.pending_event_count == 1
        hold.release()
        released = anyio.Event()

        async def release() -> None:
            await m.release(h, "cuda:0")
            released.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            await anyio.wait_all_tasks_blocked()
            assert not released.is_set()  # the reader's kernel has not run yet
            assert "cuda:0" in places(m, h)
            gate.set()
        assert places(m, h) == {"pageable-host"}


async def test_track_readers_checks_the_materialization() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.ones(16), name="w")
        with pytest.raises(ResidencyUnavailableError):
            m.track_readers(h, "cuda:0", [])


async def test_a_write_lease_waits_for_the_readers_of_the_replicas_it_invalidates() -> None:
    """Read a REPLICABLE value on one device, then write it on another: the read lease's
    reader event keeps its replica until the kernel ran. The write lease, which invalidates
    that replica, used to raise ResidencyInUseError (pending_event_count=1) where release
    waits; it now waits for those readers, then invalidates and enters. A lease or hold on
    another replica is still refused at once."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.ones(1024), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        await m.materialize(h, "cuda:1")
        gate = threading.Event()
        async with m.acquire(h, "cuda:1") as read:
            m.backend.run_in_stream_order(read.stream, lambda: gate.wait(10))  # a long kernel
        record = m.snapshot().values[h].materialization("cuda:1")
        assert record is not None and record.pending_event_count == 1
        entered = anyio.Event()

        async def writer() -> None:
            async with m.acquire(h, "cuda:0", mode="write") as lease:
                assert places(m, h) == {"cuda:0"}  # the others were invalidated
                lease.tensor.add_(1)
                entered.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                await anyio.wait_all_tasks_blocked()
                assert not entered.is_set()  # the reader's kernel has not run yet
                assert "cuda:1" in places(m, h)
                gate.set()
        finally:
            gate.set()
        assert entered.is_set() and places(m, h) == {"cuda:0"}
        await m.materialize(h, "cuda:1")
        with m.hold(h, "cuda:1"), pytest.raises(ResidencyInUseError, match="hold_count=1"):
            async with m.acquire(h, "cuda:0", mode="write"):
                pass
        assert places(m, h) == {"cuda:0", "cuda:1"}
