"""Polling awaited CUDA events on the event loop's own thread, woken by a precise timer.

Handing a completion from another thread to the loop costs a wake-up of the loop thread and a
hand-over of the interpreter lock: on an H200 host the waiter thread's polls woke the awaiting
task 76-120 us after the event (median, uvloop and asyncio), and the process used 15-33% of a
core for back-to-back 2 ms waits. The loop's own timers cannot replace the thread's polls:
asyncio and uvloop round their sleeps to milliseconds. A ``timerfd`` can: the loop watches it
like a socket, and it fires at the microsecond asked for. So :class:`LoopTimerPoller` keeps the
events awaited on its loop, sleeps (inside the loop's ``epoll``, where the loop sleeps anyway)
until the first one is predicted to complete, then queries them every ``poll_s`` from the loop
thread itself: no other thread runs and nothing is handed over. The same H200 woke the task
18-22 us after the event this way, at 8-16% of a core (``benchmarks/diag_wake_loop_timer.py``;
``benchmarks/RESULTS.md``).

The interval between polls grows with how late an event is past the start of its polls (a
tenth of that, at least ``poll_s``), so a misprediction costs a few dozen polls, not one every
20 us; an event still pending when its window closes goes to the waiter thread, whose host
function notification then wakes it (see :mod:`~aresidency.backends.waiter`).

Linux only (``timerfd_create``), on loops that can watch a file descriptor (asyncio's
selector loops and uvloop with a reader callback, trio with a system task in
``wait_readable``); elsewhere :meth:`LoopTimerPoller.create` returns None and the waiter's
thread polls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from .bridge import LoopBridge, LoopClosedError
from .polling import closed_error

__all__ = ["LoopTimerPoller", "Timerfd"]

Callback = Callable[[BaseException | None], None]

_CLOCK_MONOTONIC = 1  # what time.monotonic() reads on Linux
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc: Any = None


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.timerfd_create.restype = ctypes.c_int
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.restype = ctypes.c_int
        libc.timerfd_settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        _libc = libc
    return _libc


class Timerfd:
    """A non-blocking ``timerfd`` on ``CLOCK_MONOTONIC``: :meth:`arm` makes ``fd`` readable at
    an absolute ``time.monotonic()`` time (at once if it is past). Not thread-safe."""

    __slots__ = ("_libc", "_spec", "fd")

    def __init__(self) -> None:
        libc = _load_libc()
        fd = int(libc.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_create failed: {os.strerror(errno)}")
        self.fd = fd
        self._libc = libc
        self._spec = _Itimerspec()

    @classmethod
    def create(cls) -> Timerfd | None:
        """A new timer, or None where the system has none (not Linux)."""
        try:
            return cls()
        except (OSError, AttributeError):
            return None

    def arm(self, at: float) -> None:
        """Fire at ``at``; also consumes an expiry not read yet (setting a timer resets its
        count), so the descriptor is readable again only once ``at`` has come."""
        self._set(max(at, 1e-9))  # zero would disarm it

    def disarm(self) -> None:
        """Stop the timer and consume an expiry not read yet."""
        self._set(0.0)

    def _set(self, at: float) -> None:
        self._spec.it_value.tv_sec = int(at)
        self._spec.it_value.tv_nsec = int((at - int(at)) * 1e9)
        if self._libc.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None):
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_settime failed: {os.strerror(errno)}")

    def clear(self) -> None:
        """Consume the expiry, so that the descriptor is not readable until the next one."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Waiter(Protocol):
    """The part of :class:`~aresidency.backends.waiter.EventWaiter` a timer poller uses."""

    _closed: bool
    timer_hits: int

    def _record_wait(self, key: Any, seconds: float) -> None: ...

    def _watch_thread(
        self,
        event: Any,
        bridge: LoopBridge,
        callback: Callback,
        *,
        started: float | None = None,
        notify_only: bool = False,
    ) -> None: ...


class _TimedWait:
    __slots__ = ("callback", "deadline", "event", "key", "notified", "poll_from", "started")

    def __init__(
        self,
        event: Any,
        callback: Callback,
        key: Any,
        started: float,
        poll_from: float,
        deadline: float,
        notified: bool,
    ) -> None:
        self.event = event
        self.callback = callback
        self.key = key  # the origin stream: its waits' durations feed the prediction (None: not)
        self.started = started  # time.monotonic() when the wait began
        self.poll_from = poll_from  # the first poll (the predicted completion, less a lead)
        self.deadline = deadline  # polls end here; then the waiter thread's notification
        self.notified = notified  # the thread watches it too (its notification is enqueued)

    def next_poll(self, now: float, poll_s: float) -> float:
        if now < self.poll_from:
            return self.poll_from
        return min(now + max(poll_s, 0.1 * (now - self.poll_from)), self.deadline)


class LoopTimerPoller:
    """The events awaited on one loop, polled by that loop when its timer fires (see the
    module docstring). One per loop; every method but :meth:`create` on the loop thread.

    State: ``entries`` (the waits, each with its first poll and its deadline), ``armed_for``
    (when the timer fires next; ``inf``: not armed), ``closed``.
    Invariant: while ``entries`` is not empty the timer is armed for no later than the
    earliest next poll of an entry, so every wait is polled by its deadline and then either
    resolved or handed to the waiter thread.
    """

    __slots__ = ("armed_for", "bridge", "closed", "entries", "poll_s", "timer", "waiter")

    def __init__(self, waiter: _Waiter, bridge: LoopBridge, timer: Timerfd, poll_s: float):
        self.waiter = waiter
        self.bridge = bridge
        self.timer = timer
        self.poll_s = poll_s
        self.entries: list[_TimedWait] = []
        self.armed_for = float("inf")
        self.closed = False

    @classmethod
    def create(cls, waiter: _Waiter, bridge: LoopBridge, poll_s: float) -> LoopTimerPoller | None:
        """A poller on ``bridge``'s loop (call on that loop), or None where the system has no
        ``timerfd`` or the loop cannot watch one."""
        timer = Timerfd.create()
        if timer is None:
            return None
        poller = cls(waiter, bridge, timer, poll_s)
        if not bridge.add_reader(timer.fd, poller._fired):
            timer.close()
            return None
        return poller

    def add(
        self,
        event: Any,
        callback: Callback,
        key: Any,
        started: float,
        poll_from: float,
        deadline: float,
        notified: bool = False,
    ) -> None:
        """Poll ``event`` from ``poll_from`` until ``deadline``; ``callback(None)`` on the loop
        once it completed (never in this call). ``notified``: the waiter thread watches it
        too (``callback`` then runs once, for whichever sees it first); else it is handed to
        the thread at ``deadline``."""
        wait = _TimedWait(event, callback, key, started, poll_from, deadline, notified)
        self.entries.append(wait)
        first = wait.next_poll(time.monotonic(), self.poll_s)
        if first < self.armed_for:
            self._arm(first)

    def _arm(self, at: float) -> None:
        self.armed_for = at
        self.timer.arm(at)

    def _fired(self) -> None:
        """The timer fired (the loop's reader callback): query every entry; resolve the
        completed ones, hand the ones past their deadline to the waiter thread, re-arm (or
        disarm: either consumes the expiry, one system call per poll)."""
        self.armed_for = float("inf")
        if self.closed:
            return
        waiter = self.waiter
        now = time.monotonic()
        entries, self.entries = self.entries, []
        done: list[tuple[Callback, BaseException | None]] = []
        for wait in entries:
            try:
                if waiter._closed:
                    done.append((wait.callback, closed_error()))
                elif wait.event.query():
                    if not (wait.notified and getattr(wait.callback, "done", False)):
                        waiter.timer_hits += 1  # seen first here, not by its notification
                        if wait.key is not None:
                            waiter._record_wait(wait.key, now - wait.started)
                    done.append((wait.callback, None))
                elif now >= wait.deadline:
                    if not wait.notified:  # else the thread has it already
                        waiter._watch_thread(
                            wait.event,
                            self.bridge,
                            wait.callback,
                            started=wait.started,
                            notify_only=True,
                        )
                else:
                    self.entries.append(wait)
            except Exception as exc:  # a query that raises ends that wait with the error,
                done.append((wait.callback, exc))  # not the poll (the others stay watched)
        del entries
        if self.entries:
            self._arm(min(w.next_poll(now, self.poll_s) for w in self.entries))
        else:
            self.timer.disarm()
        failure: Exception | None = None
        for callback, error in done:  # last: a callback may add a wait (it arms as needed)
            try:
                callback(error)
            except Exception as exc:  # every other waiter is still called back
                failure = failure or exc
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Fail the waits left with the waiter's closed error and free the timer (loop
        thread)."""
        if self.closed:
            return
        self.closed = True
        entries, self.entries = self.entries, []
        self.bridge.remove_reader(self.timer.fd)
        self.timer.close()
        for wait in entries:
            wait.callback(closed_error())

    def close_from_any_thread(self) -> None:
        """:meth:`close` on the loop, or at once if that loop has finished (nobody is left to
        call back, and its descriptor must not leak)."""
        try:
            self.bridge.call_soon(self.close)
        except LoopClosedError:
            self.closed = True
            self.entries = []
            self.timer.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.entries)} waits"
        return f"<LoopTimerPoller {state} fd={self.timer.fd}>"
