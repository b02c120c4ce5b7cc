"""Protection held by another task: what a waiting scope may wait for (it ends on its own),
unlike protection of the waiting task itself (see ``test_scope``'s self-wait tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from aresidency import ResidencyManager
from aresidency.core.values import ValueHandle


@asynccontextmanager
async def held_by_another_task(
    m: ResidencyManager, handle: ValueHandle, location: str
) -> AsyncIterator[None]:
    """A hold on ``handle`` at ``location``, made by another task and released by it when the
    block ends."""
    held, done = anyio.Event(), anyio.Event()

    async def holder() -> None:
        hold = m.hold(handle, location)
        held.set()
        try:
            await done.wait()
        finally:
            hold.release()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(holder, name="holder")
        await held.wait()
        try:
            yield
        finally:
            done.set()
