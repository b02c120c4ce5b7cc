"""A streamed call cancelled *natively* on asyncio (``task.cancel()`` twice, as a client that
goes away and a timeout may both do): the call does not end while its worker thread still
runs the module on the device replicas (they are released when it ends), and nothing leaks.
On trio the same test cancels through a cancel scope (trio has no other kind)."""

from __future__ import annotations

import asyncio
import threading

import anyio
import anyio.lowlevel
import pytest
import torch
from _native import on_asyncio
from torch import nn

from aresidency import ResidencyManager
from aresidency.integrations import stream_module

pytestmark = pytest.mark.anyio


class Gated(nn.Module):
    """Blocks whose forward waits for the test's gate (in the streaming worker thread)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.inside = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            self.inside += 1
            try:
                self.entered.set()
                assert self.gate.wait(10)
                x = torch.tanh(layer(x))
            finally:
                self.inside -= 1
        return x


@pytest.mark.parametrize("ring", [None, False], ids=["ring", "no-ring"])
async def test_a_call_cancelled_twice_waits_for_its_worker_thread(ring: bool | None) -> None:
    model = Gated()
    x = torch.randn(2, 8)
    async with ResidencyManager(backend="sim", budgets={"cuda:0": 1 << 20}) as m:
        streamed = stream_module(m, model, prefetch=1, ring=ring, keep_resident=False)
        ended_inside: list[int] = []

        async def call() -> None:
            try:
                with torch.no_grad():
                    await streamed(x)
            finally:
                ended_inside.append(model.inside)  # the thread's state as the call ends

        if on_asyncio():
            task = asyncio.get_running_loop().create_task(call())
            await anyio.to_thread.run_sync(model.entered.wait)
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()  # a second, native, cancellation while the call unwinds
            for _ in range(20):
                await asyncio.sleep(0)
            assert not task.done(), "the call ended while its thread ran the module"
            model.gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            scope = anyio.CancelScope()

            async def cancellable() -> None:
                with scope:
                    await call()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(cancellable)
                await anyio.to_thread.run_sync(model.entered.wait)
                scope.cancel()
                await anyio.lowlevel.checkpoint()
                model.gate.set()
        assert ended_inside == [0]
        await streamed.drain()
        assert m.snapshot().location("cuda:0").used_bytes == 0
        model.entered.clear()
        with torch.no_grad():
            y = await streamed(x)  # the module is whole and usable
        with torch.no_grad():
            assert torch.equal(y, model(x))
        await streamed.aclose()
