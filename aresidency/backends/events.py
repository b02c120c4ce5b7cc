"""Host-side completions: :class:`HostEvent`, and one-shot callbacks a closing backend can fail.

A :class:`HostEvent` is a flag that a host thread sets once (a staging lane issued the last
chunk of a copy, a simulated stream reached its marker). It is a ``DeviceEvent`` (it has
``query``). Its callbacks run in the thread that sets it; the backends forward them to the event
loop through a :class:`~aresidency.backends.bridge.LoopBridge`, so nothing polls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["HostEvent", "OnceCallbacks"]

_log = logging.getLogger("aresidency")


class HostEvent:
    """A completion flag set once by a host thread; a ``DeviceEvent`` (it has ``query``).

    State: ``_done`` (set once, under ``_lock``) and ``_callbacks`` (run once, in the thread
    that sets the flag, outside the lock). Invariant: every callback added before or after
    :meth:`set` runs exactly once; one that raises during :meth:`set` is logged (logger
    ``aresidency``) and the others still run.
    """

    __slots__ = ("__weakref__", "_callbacks", "_done", "_lock", "label")

    def __init__(self, *, done: bool = False, label: str = "") -> None:
        self._lock = threading.Lock()
        self._done = done
        self._callbacks: list[Callable[[], None]] = []
        self.label = label

    def query(self) -> bool:
        """True once set. Never blocks."""
        return self._done

    def set(self) -> None:
        """Mark complete and run the callbacks (any thread; idempotent)."""
        with self._lock:
            if self._done:
                return
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # the setter (a lane, a stream's thread) is not the culprit,
                _log.exception("a callback of %r raised", self)  # and the rest still run

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the event is set: now, in this thread, if it already is."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback()

    def wait_blocking(self, timeout: float | None = None) -> bool:
        """Block the calling thread (never the loop) until set; False on timeout."""
        if self._done:
            return True
        flag = threading.Event()
        self.add_done_callback(flag.set)
        return flag.wait(timeout)

    def __repr__(self) -> str:
        label = f" {self.label}" if self.label else ""
        return f"<HostEvent{label} {'done' if self._done else 'pending'}>"


Callback = Callable[[BaseException | None], None]


class OnceCallbacks:
    """Completion callbacks that run exactly once: when their event completes (``None``) or
    when :meth:`fail_all` fails the ones still pending (a closing backend). Thread-safe.

    State: ``_pending`` (token -> callback, under ``_lock``).
    """

    __slots__ = ("_lock", "_next", "_pending")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Callback] = {}
        self._next = 0

    def add(self, callback: Callback) -> int:
        with self._lock:
            self._next += 1
            self._pending[self._next] = callback
            return self._next

    def take(self, token: int) -> Callback | None:
        """The callback for ``token`` if it has not run yet (it will not run again)."""
        with self._lock:
            return self._pending.pop(token, None)

    def fail_all(self) -> list[Callback]:
        """Every callback still pending (to be called with an error); none will run again."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        return pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
