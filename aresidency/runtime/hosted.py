"""The manager's background task group, hosted so that any task may close the manager.

An anyio task group must be left by the task that entered it. The manager's group was entered
by the task that entered the manager, so a manager entered by one task and left by another
(pytest-asyncio runs an async generator fixture's setup and teardown in two tasks; a
notebook runs each cell in a task of its own; an ``AsyncExitStack`` may be closed elsewhere)
could not close: anyio raised "Attempted to exit cancel scope in a different task than it
was entered in" after half a close.

On asyncio (uvloop included) the group therefore lives in a task of its own, made with the
loop's ``create_task``: :meth:`HostedTaskGroup.open` starts that task and returns the group
once the task entered it; :meth:`HostedTaskGroup.close` cancels the group and waits for the
task to leave it, from whichever task calls it. On trio the group stays in the entering task:
a task of its own there would be a system task, whose error ends the whole run, and trio's
nurseries are left by their own task anyway; :meth:`HostedTaskGroup.check_closer` refuses an
exit by another task there before anything closes.
"""

from __future__ import annotations

import asyncio

import anyio
import anyio.abc

from .shield import finish_shielded

__all__ = ["HostedTaskGroup"]


class HostedTaskGroup:
    """One task group for a manager's background work (see the module docstring).

    State: ``group`` (the anyio task group, once open), ``_host`` (the asyncio task it lives
    in; ``None`` on trio, where the opening task holds it), ``_opener`` (that task, on trio),
    ``_error`` (what the host task's group raised, if a background task failed)."""

    def __init__(self) -> None:
        self.group: anyio.abc.TaskGroup | None = None
        self._host: asyncio.Task[None] | None = None
        self._opener: object = None
        self._error: BaseException | None = None
        self._left = anyio.Event()

    async def open(self) -> anyio.abc.TaskGroup:
        """Start the group (on asyncio in a task of its own) and return it. Cancelled while
        the host task starts, it leaves nothing running."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio: the group is the opening task's
            group = anyio.create_task_group()
            await group.__aenter__()
            self._opener = anyio.get_current_task().id
            self.group = group
            return group
        entered = anyio.Event()

        async def host() -> None:
            try:
                async with anyio.create_task_group() as group:
                    self.group = group
                    entered.set()
                    await anyio.sleep_forever()  # until close() cancels the group
            except Exception as error:  # a background task failed: close() raises it
                self._error = error
            finally:
                entered.set()
                self._left.set()

        self._host = loop.create_task(host(), name="aresidency background tasks")
        try:
            await entered.wait()
        except BaseException:
            self._host.cancel()
            raise
        if self.group is None:  # the host task ended before it entered the group
            raise RuntimeError("the manager's background task group could not start")
        return self.group

    def check_closer(self) -> None:
        """Raise ``RuntimeError`` where only the opening task may close the group (trio) and
        the calling task is another; nothing is closed then."""
        opener = self._opener
        if self._host is None and opener is not None and anyio.get_current_task().id != opener:
            raise RuntimeError(
                "on trio a ResidencyManager must be exited by the task that entered it "
                "(its background tasks are a nursery of that task): leave its 'async with' "
                "block in that task"
            )

    async def close(self) -> None:
        """Cancel the group and wait until it has ended, from any task (on asyncio); on trio
        from the opening task only (:meth:`check_closer`). A background task's error is
        raised here. On asyncio the wait goes on through a cancellation of the caller, which
        is raised once the group has ended."""
        group = self.group
        if group is None:
            return
        group.cancel_scope.cancel()
        if self._host is not None:
            await finish_shielded(self._left.wait)
            if self._error is not None:
                raise self._error
            return
        await group.__aexit__(None, None, None)
