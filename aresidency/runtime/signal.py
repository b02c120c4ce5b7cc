"""``ChangeSignal``: the one way to learn that a manager's state changed.

Everything that waits for the state to move (a scope waiting for admission, the controller
waiting to decide again, a streamed module's prefetch pipeline, a release waiting for its
readers) uses this signal, in one of two forms:

* ``await signal.wait(deadline)`` parks a task until the next :meth:`ChangeSignal.notify`
  (anyio, so asyncio, uvloop and trio alike);
* ``signal.add_listener(fn)`` calls ``fn()`` synchronously, on the loop, after every notify:
  for state machines that advance without a task of their own (the driver's transfers, the
  admission queue's head, the streaming pipeline).

The runtime notifies once per batch of committed transitions, not once per transition.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, NoReturn

import anyio

__all__ = ["ChangeSignal", "ManagerClosedError", "check_callback", "refuse_copy"]

_log = logging.getLogger("aresidency")


def check_callback(callback: Any, where: str) -> None:
    """Refuse (``TypeError`` naming ``where``) what cannot be called as a synchronous
    callback: anything not callable (it would fail at every call, long after it was added),
    and a coroutine function (each call would make a coroutine that nobody awaits)."""
    if not callable(callback):
        raise TypeError(
            f"{where} takes a function to call, got {callback!r} "
            f"({type(callback).__name__}), which is not callable"
        )
    if inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(
        getattr(callback, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    ):
        raise TypeError(
            f"{where} takes a plain function, called on the loop and never awaited; "
            f"{callback!r} is a coroutine function, whose calls would only make coroutines "
            "that nobody awaits: pass a plain function (one that starts a task of yours if "
            "it must await)"
        )


def refuse_copy(obj: object, why: str, instead: str) -> NoReturn:
    """The ``__reduce_ex__`` of a live object of the runtime (a manager, a lease, a hold, a
    scope, a pending operation): ``copy.copy``, ``copy.deepcopy`` and ``pickle`` go through
    it, and each is refused with a ``TypeError`` saying ``why`` and what to do ``instead``
    (a copy would share or repeat what the original alone may do: close the runtime, end a
    hold twice, accept the other's handles)."""
    raise TypeError(f"a {type(obj).__name__} cannot be copied or pickled: {why}; {instead}")


class ManagerClosedError(RuntimeError):
    """The manager closed (or is closing): it carries out nothing more, and whoever waited for
    its state to change was woken with this error."""


class ChangeSignal:
    """Wakes waiters and listeners when the state changed. Loop thread only.

    State: ``_event`` (the ``anyio.Event`` current waiters park on; made lazily, replaced at
    each notify), ``_listeners`` (token -> callback), ``_closed`` (the message of the error
    waiters get once the manager closes), ``_notifying``/``_again`` (a listener that changes
    the state notifies again: that notify is folded into the running one instead of
    recursing).
    """

    __slots__ = (
        "_again",
        "_closed",
        "_event",
        "_listeners",
        "_next",
        "_notifying",
        "count",
    )

    def __init__(self) -> None:
        self._event: anyio.Event | None = None
        self._listeners: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._closed: str | None = None
        self._notifying = False
        self._again = False
        self.count = 0  # notifications so far (diagnostics)

    def notify(self) -> None:
        """The state changed: wake every task parked in :meth:`wait`, then call every
        listener (a listener registered during the calls runs from the next notify on)."""
        if self._notifying:
            self._again = True
            return
        if self._event is None and not self._listeners:
            self.count += 1  # nobody to wake (most changes): no loop to run
            return
        self._notifying = True
        try:
            while True:
                self._again = False
                self.count += 1
                event, self._event = self._event, None
                if event is not None:
                    event.set()
                for callback in list(self._listeners.values()):
                    try:
                        callback()
                    except Exception:
                        # A listener must not raise; one that does must not leave the caller
                        # (a phase run committing, a reap) half done, which would leave every
                        # task waiting on it parked forever. Logged; the others still run.
                        _log.exception("a listener of the manager's change signal raised")
                if not self._again:
                    return
        finally:
            self._notifying = False

    def add_listener(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` after every notify until the returned function is called.
        The callback runs on the loop, must not raise and must not await."""
        self._next += 1
        token = self._next
        self._listeners[token] = callback

        def remove() -> None:
            self._listeners.pop(token, None)

        return remove

    async def wait(self, deadline: float | None = None) -> bool:
        """Park until the next notify; ``False`` if ``deadline`` (``anyio.current_time()``
        clock) passes first. Raises :class:`ManagerClosedError` once the manager closed."""
        if self._closed is not None:
            raise ManagerClosedError(self._closed)
        if self._event is None:
            self._event = anyio.Event()
        event = self._event
        if deadline is None or math.isinf(deadline):
            await event.wait()
        else:
            with anyio.move_on_at(deadline):
                await event.wait()
        if self._closed is not None:
            raise ManagerClosedError(self._closed)
        return event.is_set()

    def close(self, message: str) -> None:
        """Wake every waiter with ``ManagerClosedError(message)`` (every later :meth:`wait`
        raises it too)."""
        self._closed = message
        event, self._event = self._event, None
        if event is not None:
            event.set()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def __repr__(self) -> str:
        state = "closed" if self._closed is not None else "open"
        return f"<ChangeSignal {state} notified={self.count} listeners={len(self._listeners)}>"
