"""Released memory is really given back: nothing the runtime keeps after an operation finished
(its run, its transfers, the handle's records) holds a released copy's tensor alive. On a GPU
such a reference keeps device memory allocated past the budget the ledger already freed. No
``gc.collect()``: the memory must go when its last reference does, not at the next collection."""

from __future__ import annotations

import threading
import weakref

import anyio
import pytest
import torch

from aresidency import ReplicaMode, ResidencyManager

pytestmark = pytest.mark.anyio


class Death:
    """Notes when a tensor dies, in whatever thread drops its last reference."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event = threading.Event()
        self.ref = weakref.ref(tensor, lambda _ref: self.event.set())

    async def happened(self) -> bool:
        """Whether it died (waiting up to 5 s: a device thread drops its last work item just
        after the completion it reported, so the loop may ask a moment too early)."""
        return await anyio.to_thread.run_sync(self.event.wait, 5.0)


async def test_a_finished_operation_does_not_keep_the_released_copy_alive() -> None:
    async with ResidencyManager(budgets={"cuda:0": 1 << 20}, backend="sim") as m:
        h = m.register(torch.ones(4096), name="w", replica_mode=ReplicaMode.REPLICABLE)
        op = m.materialize_nowait(h, "cuda:0")  # the caller keeps its operation object
        await op
        copy = Death(m.tensor(h, "cuda:0"))
        await m.release(h, "cuda:0")
        assert await copy.happened(), "the finished operation still holds the released device copy"
        assert op.done() and op.exception() is None


async def test_a_move_keeps_neither_end_alive_once_released() -> None:
    async with ResidencyManager(budgets={"cuda:0": 1 << 20}, backend="sim") as m:
        h = m.register(torch.arange(4096.0), name="w", replica_mode=ReplicaMode.REPLICABLE)
        ops = []
        for loc in ("cuda:0", "pinned-host", "cuda:0"):
            op = m.materialize_nowait(h, loc)
            ops.append(op)
            await op
        on_device = Death(m.tensor(h, "cuda:0"))
        pinned = Death(m.tensor(h, "pinned-host"))
        await m.release(h, "cuda:0")
        await m.release(h, "pinned-host")
        assert await on_device.happened() and await pinned.happened()
        async with m.acquire(h, "pageable-host") as lease:
            assert torch.equal(lease.tensor, torch.arange(4096.0))
        assert all(op.done() for op in ops)
