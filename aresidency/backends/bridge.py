"""Calling back into the event loop from device threads, on asyncio, uvloop and trio.

Device work completes on other threads: the CUDA event waiter, the staging lanes, the
simulation's stream workers. Each completion must run a short callback *on the event loop that
owns the manager's state*, without the device thread waiting for it. anyio's
``anyio.from_thread.run_sync`` blocks the calling thread until the loop ran the callback, which
would stall a copy pipeline; this module is the non-blocking twin: it keeps the native handle of
the running loop (the asyncio loop, or trio's ``TrioToken``) and hands callbacks to it with
``call_soon_threadsafe`` / ``run_sync_soon``. :meth:`LoopBridge.run_async` is the
blocking form, for a caller thread that wants a coroutine's result. That is all it does;
every other concurrency primitive of the runtime is anyio's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["LoopBridge", "LoopClosedError"]

_log = logging.getLogger("aresidency")


class LoopClosedError(RuntimeError):
    """The event loop behind a bridge has finished: nobody is left to run the callback."""


class LoopBridge:
    """The running event loop, reachable from any thread. Make one on the loop's thread.

    ``call_soon(fn, *args)`` runs ``fn(*args)`` on the loop soon, from any thread; the caller
    never waits. ``on_loop()`` says whether the calling thread is the loop's. ``library`` is
    ``"asyncio"`` (uvloop included) or ``"trio"``.

    State: the loop's native handle and thread identity, fixed at construction.
    """

    __slots__ = ("_loop", "_soon", "_soon_here", "library", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        try:
            loop: Any = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self.library = "asyncio"
            self._loop = loop
            self._soon: Callable[..., Any] = loop.call_soon_threadsafe
            self._soon_here: Callable[..., Any] = loop.call_soon
            return
        token: Any = None
        try:
            import trio
        except ImportError:  # pragma: no cover - trio is optional
            pass
        else:
            try:
                token = trio.lowlevel.current_trio_token()
            except RuntimeError:
                token = None
        if token is not None:
            self.library = "trio"
            self._loop = token
            self._soon = token.run_sync_soon
            self._soon_here = token.run_sync_soon
            return
        raise RuntimeError(
            "no running event loop: aresidency runs under asyncio, uvloop or trio (directly or "
            "through anyio); create the manager inside 'async with' in a running loop"
        )

    @classmethod
    def current(cls) -> LoopBridge:
        """A bridge to the loop running in this thread (``RuntimeError`` without one)."""
        return cls()

    def on_loop(self) -> bool:
        return threading.get_ident() == self.thread

    def running_here(self) -> bool:
        """Whether this bridge's loop is the one running in the calling thread now (another
        loop of the same thread, a second ``asyncio.run()`` say, is not; nor is no loop)."""
        if self.library == "asyncio":
            try:
                return asyncio.get_running_loop() is self._loop
            except RuntimeError:
                return False
        import trio

        try:
            return trio.lowlevel.current_trio_token() is self._loop
        except RuntimeError:
            return False

    def finished(self) -> bool:
        """Whether the loop has finished (an asyncio loop closed; trio's run ended)."""
        if self.library == "asyncio":
            return bool(self._loop.is_closed())
        try:
            self._loop.run_sync_soon(lambda: None)
        except RuntimeError:  # trio.RunFinishedError
            return True
        return False

    # Two bridges to one loop are equal (a waiter keeps one poller per loop, not per bridge).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoopBridge) and other._loop is self._loop

    def __hash__(self) -> int:
        return id(self._loop)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> bool:
        """Run ``callback()`` on the loop whenever ``fd`` is readable: the loop's own
        ``add_reader`` (asyncio's selector loops, uvloop), or on trio a system task in
        ``wait_readable``. ``callback`` must make ``fd`` unreadable (consume what it reads), or
        it is called again at once. Loop thread only. False, doing nothing, where the loop
        cannot watch a file descriptor (asyncio's proactor loop)."""
        if self.library == "trio":
            import trio

            async def watch() -> None:
                while True:
                    try:
                        await trio.lowlevel.wait_readable(fd)
                    except (trio.ClosedResourceError, OSError):
                        return  # remove_reader: the descriptor is closing
                    try:
                        callback()
                    except Exception:  # a system task that raises would end the whole run
                        _log.exception("a reader callback on the trio loop failed")

            trio.lowlevel.spawn_system_task(watch, name=f"aresidency reader fd={fd}")
            return True
        try:
            self._loop.add_reader(fd, callback)
        except NotImplementedError:
            return False
        return True

    def remove_reader(self, fd: int) -> None:
        """Undo :meth:`add_reader`, before ``fd`` is closed (loop thread only; nothing if the
        loop is closed)."""
        if self.library == "trio":
            import trio

            trio.lowlevel.notify_closing(fd)  # the watching task's wait ends, and so does it
        elif not self._loop.is_closed():
            self._loop.remove_reader(fd)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon; any thread; never waits. Raises
        :class:`LoopClosedError` when the loop has finished."""
        try:
            if threading.get_ident() == self.thread:
                self._soon_here(fn, *args)
            else:
                self._soon(fn, *args)
        except RuntimeError as exc:  # asyncio: loop closed; trio: RunFinishedError
            raise LoopClosedError(f"the event loop has finished: {exc}") from None

    def call_soon_quietly(self, fn: Callable[..., Any], *args: Any) -> None:
        """:meth:`call_soon`, dropping the call when the loop has finished (a completion that
        arrives after the program ended has nobody to tell)."""
        try:
            self.call_soon(fn, *args)
        except LoopClosedError:
            pass

    def run_async(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``await fn(*args, **kwargs)`` on the loop and return its result, blocking the
        calling thread (which must not be the loop's) until it finished."""
        if self.on_loop():
            raise RuntimeError("run_async from the loop's own thread would deadlock")
        call = functools.partial(fn, *args, **kwargs)
        if self.library == "asyncio":

            async def run() -> T:
                return await call()

            return asyncio.run_coroutine_threadsafe(run(), self._loop).result()
        import trio

        return trio.from_thread.run(call, trio_token=self._loop)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<LoopBridge {self.library} thread={self.thread}>"
