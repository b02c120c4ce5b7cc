"""Shared by the cancellation-and-close sweeps: a story (some public async calls) is run once
to count the loop turns it takes, then again from scratch with a cut after the ``k``-th turn,
for ``k`` spread over that range (``SWEEP_STEP=1`` in the environment tries every turn). The
cut is a cancellation of the story, or an action of the test's (closing the manager, closing
a pool), after which the story runs on to its end. A story that never ends fails after
``HANG_S`` seconds."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

#: What a story may take, cut or not, before it counts as hung.
HANG_S = 20

#: How many points a sweep tries by default.
POINTS = 5


def sweep_points(total: int, points: int = POINTS) -> range:
    """The turns to cut after: about ``points`` spread over ``total`` and past it (every one
    with ``SWEEP_STEP=1``)."""
    step = int(os.environ.get("SWEEP_STEP", "0")) or max(1, total // points)
    return range(0, total + 2, step)


async def count_turns(story: Callable[[], Awaitable[Any]]) -> int:
    """How many loop turns ``story()`` takes, uncut: the sweep's range."""
    turns = 0
    done = False

    async def count() -> None:
        nonlocal turns
        while not done:
            await anyio.lowlevel.checkpoint()
            turns += 1

    with anyio.fail_after(HANG_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(count)
            try:
                await story()
            finally:
                done = True
    return turns


async def cut_after(
    turns: int, story: Callable[[], Awaitable[Any]], cut: Callable[[], Any] | None = None
) -> bool:
    """Run ``story()``; after ``turns`` loop turns (if it has not ended), cut it: cancel it
    (``cut`` None), or call ``cut()`` (awaited if it returns an awaitable) and let the story
    run on. Returns whether the cancellation reached the story (always False for another
    cut). A story still running after ``HANG_S`` seconds fails with ``TimeoutError``."""
    with anyio.fail_after(HANG_S):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:

                async def cutter() -> None:
                    for _ in range(turns):
                        await anyio.lowlevel.checkpoint()
                    if cut is None:
                        scope.cancel()
                        return
                    result = cut()
                    if result is not None:
                        await result

                tasks.start_soon(cutter)
                await story()
                if cut is None:
                    tasks.cancel_scope.cancel()  # the story ended first: stop the timer
        return scope.cancelled_caught
