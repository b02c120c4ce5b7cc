"""Work that must finish even when the task awaiting it is cancelled.

``anyio.CancelScope(shield=True)`` keeps anyio's own cancellations out (``anyio.fail_after``,
a task group's ``cancel_scope.cancel()``) and, on trio, every cancellation. On asyncio (and
uvloop) it does not stop a *native* one: ``task.cancel()``, ``asyncio.timeout`` and
``asyncio.wait_for`` throw ``CancelledError`` into whatever the task awaits, shield or not.
The runtime's must-finish waits (a scope's exit, the clean-up wait of a cancelled phase, the
manager's close) therefore go through the two functions here, which hold on through native
cancellations too and raise the cancellation once the work is done, as ``asyncio.shield``
plus ``Task.uncancel`` bookkeeping would: the task's cancellation count is left as asyncio
set it, so ``asyncio.timeout`` still turns the re-raised ``CancelledError`` into its
``TimeoutError``, and a ``task.cancel()`` is never lost.

* :func:`wait_shielded` parks until an ``anyio.Event`` is set (the work is callback-driven,
  as the driver's phase runs are) and returns the cancellation it swallowed, if any, for the
  caller to raise after its own bookkeeping;
* :func:`finish_shielded` runs a coroutine function to the end (on asyncio in a task of its
  own, so that nothing inside it sees the cancellation either) and then raises the
  cancellation, if one arrived.

Neither spins: while the task is parked in a shielded anyio scope, anyio delivers nothing to
it, and each native cancellation is caught once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["finish_shielded", "wait_shielded"]

T = TypeVar("T")


async def wait_shielded(event: anyio.Event) -> BaseException | None:
    """Park until ``event`` is set, whatever cancels the task meanwhile (anyio's and trio's
    cancellations are held off by a shield; a native asyncio cancellation is caught). Returns
    the cancellation that arrived (the caller raises it once its work is done) or ``None``.
    The host does not block."""
    caught: BaseException | None = None
    with anyio.CancelScope(shield=True):
        while not event.is_set():
            try:
                await event.wait()
            except anyio.get_cancelled_exc_class() as cancelled:
                # Only a native asyncio cancellation gets through the shield: keep waiting
                # and hand it back to be raised after the work finished.
                caught = cancelled
    return caught


async def finish_shielded(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await fn(*args)`` to the end even if the calling task is cancelled meanwhile, then
    raise that cancellation (the result, or ``fn``'s own error, when none arrived). On trio a
    shielded cancel scope suffices; on asyncio ``fn`` runs in a task of its own (its context
    copied), which no cancellation of the caller reaches."""
    try:
        asyncio.current_task()  # raises RuntimeError where no asyncio loop runs (trio)
    except RuntimeError:
        with anyio.CancelScope(shield=True):
            return await fn(*args)

    async def call() -> T:
        return await fn(*args)

    task = asyncio.get_running_loop().create_task(call())
    done = anyio.Event()
    task.add_done_callback(lambda _task: done.set())
    caught = await wait_shielded(done)
    if caught is not None:
        if not task.cancelled() and task.exception() is not None:
            raise caught from task.exception()
        raise caught
    return task.result()
