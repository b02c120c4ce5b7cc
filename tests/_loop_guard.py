"""The loop-stall guard shared by the runtime and streaming tests (as anyio's test suite does).

A ticker task runs beside every async test and records the longest gap between its wake-ups;
a gap over ``MAX_LOOP_STALL`` means something ran on the loop for that long without awaiting
(a synchronize, a blocking copy, a busy wait). The threshold is loose enough for a slow CI
machine and tight enough to catch a blocking wait on the 300 ms simulated kernels of the tests.
Tests marked ``cuda`` are exempt: they synchronize the device on purpose. ``NO_LOOP_GUARD=1``
turns the guard off (to tell a stall from another failure).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

MAX_LOOP_STALL = 0.1  # seconds


@pytest_asyncio.fixture(autouse=True)
async def loop_never_blocked(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    if (
        not inspect.iscoroutinefunction(request.function)
        or request.node.get_closest_marker("cuda")
        or os.environ.get("NO_LOOP_GUARD")
    ):
        yield
        return
    worst = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.002)
            last = now

    # Automatic garbage collection is paused during the test: a full collection under pytest
    # can stall any Python code for 0.1 s or more, and that is not the runtime blocking.
    gc.disable()
    task = asyncio.ensure_future(ticker())
    try:
        yield
    finally:
        stop = True
        await task
        gc.enable()
    assert worst < MAX_LOOP_STALL, f"the event loop was blocked for {worst * 1e3:.0f} ms"
