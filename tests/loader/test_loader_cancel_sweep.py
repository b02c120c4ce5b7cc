"""Cancellation at every point of a pass, swept: the consuming task is cancelled after the
``k``-th turn of the event loop, for ``k`` from the loader's entry to past the end of its exit
(about thirty points spread over a pass; ``SWEEP_STEP=1`` in the environment tries every turn),
with each kind of source and both ways of copying (the simulated backend: a simulation
of CUDA devices in host memory). Whatever the point, the cancellation reaches the task, the
loader ends closed, the source's thread is gone and nothing is left in the manager."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
from _sweep import count_turns, sweep_points

from aresidency import ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.loader import DeviceLoader, ShardSource

from ._support import assert_nothing_left, batches

pytestmark = pytest.mark.anyio


async def turns_of_a_pass(make_source: Callable[[], Any], ring: bool | None) -> int:
    """How many loop turns the consumer below takes, uncancelled: the sweep's range."""
    async with ResidencyManager(backend=SimBackend()) as m:
        return await count_turns(lambda: consume(m, make_source(), ring))


async def consume(m: ResidencyManager, source: Any, ring: bool | None) -> int:
    got = 0
    async with DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring) as loader:
        async for batch in loader.batches():
            async with batch:
                got += 1
                await anyio.lowlevel.checkpoint()  # the step
    return got


async def assert_no_loader_thread_left() -> None:
    """Every loader thread ends: each close waited for its work, and a thread that handed its
    last result to the loop is only returning (joined here, off the loop, for at most 5 s)."""

    def join_all() -> list[str]:
        for thread in threading.enumerate():
            if thread.name.startswith("aresidency-loader"):
                thread.join(5.0)
        return [t.name for t in threading.enumerate() if t.name.startswith("aresidency-loader")]

    assert await anyio.to_thread.run_sync(join_all) == []


def async_source(data: list[torch.Tensor]) -> AsyncIterator[torch.Tensor]:
    async def items() -> AsyncIterator[torch.Tensor]:
        for item in data:
            await anyio.lowlevel.checkpoint()
            yield item

    return items()


def shard_source(tmp_path: Path) -> ShardSource:
    path = tmp_path / "x-0.npy"
    if not path.exists():
        np.save(path, np.arange(24 * 64, dtype=np.float32).reshape(24, 64))
    return ShardSource([path], batch_size=4, workers=2)


class Sources:
    """A new source of the same six batches per call: a list (read by a thread), an async
    generator, or a ``ShardSource`` (staged); :meth:`close` closes the shard sources made."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.data = batches(6)
        self.opened: list[ShardSource] = []

    def __call__(self) -> Any:
        if self.kind == "thread":
            return list(self.data)
        if self.kind == "async":
            return async_source(self.data)
        self.opened.append(shard_source(self.tmp_path))
        return self.opened[-1]

    def close(self) -> None:
        for source in self.opened:
            source.close()


@pytest.mark.parametrize("kind", ["thread", "async", "staged"])
async def test_a_pass_cancelled_at_any_turn_ends_clean(
    kind: str, ring: bool | None, tmp_path: Path
) -> None:
    make_source = Sources(kind, tmp_path)
    total = await turns_of_a_pass(make_source, ring)
    assert total > 5
    cancelled = 0
    for k in sweep_points(total, 30):
        async with ResidencyManager(backend=SimBackend()) as m:
            got: list[int] = []
            with anyio.fail_after(20):  # a hang fails here
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tasks:

                        async def cancel_after(turns: int = k) -> None:
                            for _ in range(turns):
                                await anyio.lowlevel.checkpoint()
                            scope.cancel()

                        tasks.start_soon(cancel_after)
                        got.append(await consume(m, make_source(), ring))
                        tasks.cancel_scope.cancel()  # the pass ended first: stop the timer
            cancelled += scope.cancelled_caught
            assert_nothing_left(m)
            assert not got or got == [6]  # the whole pass, or cut short by the cancellation
    make_source.close()
    assert cancelled > 0  # the sweep cut passes short (the rest ran to their end)
    await assert_no_loader_thread_left()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", ["thread", "async", "staged"])
async def test_a_pass_cancelled_natively_at_any_turn_ends_clean(
    kind: str, ring: bool | None, tmp_path: Path
) -> None:
    """The same sweep with asyncio's own cancellation (``task.cancel()``, what
    ``asyncio.timeout`` and a server's dropped request do), which no anyio shield holds off:
    the loader still finishes its close, then the task ends cancelled."""
    make_source = Sources(kind, tmp_path)
    total = await turns_of_a_pass(make_source, ring)
    cancelled = 0
    for k in sweep_points(total, 30):
        async with ResidencyManager(backend=SimBackend()) as m:
            task = asyncio.ensure_future(consume(m, make_source(), ring))
            for _ in range(k):
                if task.done():
                    break
                await anyio.lowlevel.checkpoint()
            task.cancel()
            with anyio.fail_after(20):  # a hang fails here
                try:
                    assert await asyncio.shield(task) == 6  # it ended before the cancel
                except asyncio.CancelledError:
                    cancelled += 1
                    assert task.cancelled()
            assert_nothing_left(m)
    make_source.close()
    assert cancelled > 0
    await assert_no_loader_thread_left()
