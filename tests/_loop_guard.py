"""The loop-stall guard shared by the runtime and streaming tests (as anyio's test suite does).

A ticker task runs beside every async test and records the longest gap between its wake-ups;
a gap over ``MAX_LOOP_STALL`` means something ran on the loop for that long without awaiting
(a synchronize, a blocking copy, a busy wait). The threshold is loose enough for a slow CI
machine and tight enough to catch a blocking wait on the 300 ms simulated kernels of the tests.
Tests marked ``cuda`` are exempt: they synchronize the device on purpose. ``NO_LOOP_GUARD=1``
turns the guard off (to tell a stall from another failure).

It works on every loop the tests run on (asyncio, uvloop, trio): :func:`loop_stall_guard` is an
anyio async-generator fixture that opens a task group, starts the ticker in it, yields for the
test and closes the group at teardown. anyio's pytest plugin runs an async generator fixture's
set-up, the test and the fixture's teardown one after the other in one and the same task, so
the group is entered and exited by that task, with the test nested inside it.
:func:`loop_never_blocked` (autouse) requests it for the async tests only: a sync test cannot
use an async fixture.
"""

from __future__ import annotations

import gc
import inspect
import os
import time
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest

MAX_LOOP_STALL = 0.1  # seconds
TICK = 0.002  # seconds between the ticker's wake-ups


@pytest.fixture
async def loop_stall_guard() -> AsyncIterator[None]:
    """Fail the test if the event loop was blocked for more than ``MAX_LOOP_STALL``."""
    worst = 0.0
    stop = False

    async def ticker(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        nonlocal worst
        last = time.perf_counter()
        task_status.started()
        while not stop:
            await anyio.sleep(TICK)
            now = time.perf_counter()
            worst = max(worst, now - last - TICK)
            last = now

    # Automatic garbage collection is paused during the test: a full collection under pytest
    # can stall any Python code for 0.1 s or more, and that is not the runtime blocking.
    gc.disable()
    try:
        async with anyio.create_task_group() as tasks:
            # Started (its clock running) before the test: a test that blocks the loop at
            # once is measured too (start_soon may let the test run first, as on trio).
            await tasks.start(ticker)
            try:
                yield
            finally:
                # The ticker ends after its current sleep, so the last stretch (up to the
                # teardown) is measured too.
                stop = True
    finally:
        gc.enable()
    assert worst < MAX_LOOP_STALL, f"the event loop was blocked for {worst * 1e3:.0f} ms"


@pytest.fixture(autouse=True)
def loop_never_blocked(request: pytest.FixtureRequest) -> None:
    """The guard for every async test of the directory, except tests marked ``cuda`` and
    runs with ``NO_LOOP_GUARD`` set."""
    if (
        inspect.iscoroutinefunction(request.function)
        and "anyio_backend" in request.fixturenames  # run by anyio's plugin
        and request.node.get_closest_marker("cuda") is None
        and not os.environ.get("NO_LOOP_GUARD")
    ):
        request.getfixturevalue("loop_stall_guard")
