"""What the event waiter keeps per event and per loop, and the waits it hands to threads.

:class:`EventNotes` is what the waiter knows of one event, kept on the event object itself (a
weak-keyed table of ``torch.cuda.Event`` objects corrupted memory on an H200). :class:`LoopPoller`
queries events expected within a fraction of a millisecond on their own loop, once per loop
iteration, so that a short copy is seen without a hop from another thread. :func:`spin_wait`
blocks a worker thread (never the loop) on one event.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from .base import BackendClosedError
from .bridge import LoopBridge

__all__ = ["EventNotes", "LoopPoller", "closed_error", "set_timer_slack", "spin_wait"]

Callback = Callable[[BaseException | None], None]

_log = logging.getLogger("aresidency")


class _Waiter(Protocol):
    """The part of :class:`~aresidency.backends.waiter.EventWaiter` a loop poller uses."""

    _closed: bool
    loop_hits: int

    def _watch_late(self, event: Any, bridge: LoopBridge, callback: Callback) -> None: ...


class EventNotes:
    """What the waiter knows of one event, kept on the event (attribute ``_aresidency``):
    ``origin`` (the stream it was recorded on, as ``(device, handle)``), ``expected_at`` (when
    the backend expects it to complete, ``time.monotonic``), ``armed`` (its notification is
    enqueued), ``seq`` (when it was last recorded, in the order of :func:`next_record`: events
    of one stream complete in that order; 0: unknown), and for a copy's event the bytes queued
    on its stream up to it and the rate assumed (``queued``, ``rate``: see
    :class:`~aresidency.backends.prediction.CopyQueues`). Events that take no attributes get
    none (and are waited for without them)."""

    __slots__ = ("armed", "expected_at", "origin", "queued", "rate", "seq")

    def __init__(self) -> None:
        self.origin: tuple[int, int | None] | None = None
        self.expected_at: float | None = None
        self.armed = False
        self.seq = 0
        self.queued: int | None = None
        self.rate = 0.0

    @classmethod
    def of(cls, event: Any) -> EventNotes | None:
        notes = getattr(event, "_aresidency", None)
        if notes is None:
            notes = cls()
            try:
                event._aresidency = notes
            except AttributeError:
                return None
        return notes  # type: ignore[no-any-return]


_records = itertools.count(1)


def next_record() -> int:
    """A number larger than every one given before (thread-safe: ``next`` on an
    ``itertools.count`` is atomic in CPython)."""
    return next(_records)


class LoopPoller:
    """Events due within ``loop_poll_s``, queried on their loop once per loop iteration (a
    callback that reschedules itself while any remain). One per loop; loop thread only.
    An event still pending at its deadline goes on being watched by the loop's timed polls
    where it has them, else by the waiter thread."""

    __slots__ = ("bridge", "entries", "scheduled", "waiter")

    def __init__(self, waiter: _Waiter, bridge: LoopBridge) -> None:
        self.waiter = waiter
        self.bridge = bridge
        self.entries: list[tuple[Any, Callback, float]] = []
        self.scheduled = False

    def add(self, event: Any, callback: Callback, deadline: float) -> None:
        self.entries.append((event, callback, deadline))
        if not self.scheduled:
            self.scheduled = True
            self.bridge.call_soon_quietly(self.tick)

    def tick(self) -> None:
        """Query every entry once: call back the completed ones, hand on the late ones, keep
        the others. A query that raises ends that wait with its error; a callback that raises
        is logged (logger ``aresidency``) and does not cost the other waits theirs (raised
        here it would end a trio run: this runs through ``run_sync_soon``)."""
        self.scheduled = False
        entries, self.entries = self.entries, []
        closed = self.waiter._closed
        now = time.monotonic()
        done: list[tuple[Callback, BaseException | None]] = []
        for event, callback, deadline in entries:
            try:
                if closed:
                    done.append((callback, closed_error()))
                elif event.query():
                    self.waiter.loop_hits += 1
                    done.append((callback, None))
                elif now >= deadline:
                    self.waiter._watch_late(event, self.bridge, callback)
                else:
                    self.entries.append((event, callback, deadline))
            except Exception as exc:
                done.append((callback, exc))
        if self.entries and not self.scheduled:
            self.scheduled = True
            self.bridge.call_soon_quietly(self.tick)
        for callback, error in done:  # last: a callback may add a wait (it schedules a tick)
            try:
                callback(error)
            except Exception:
                _log.exception("a callback of a wait polled on the loop raised")


def set_timer_slack(nanoseconds: int = 1000) -> None:
    """Make this thread's timed sleeps precise (Linux ``PR_SET_TIMERSLACK``; the default slack
    of 50 us would dominate a 40 us polling interval). Best effort."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(29, ctypes.c_ulong(nanoseconds), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def closed_error() -> BaseException:
    return BackendClosedError("the event waiter closed before the event completed")


def spin_wait(event: Any, spin_s: float = 200e-6) -> None:
    """Block the calling thread (never the loop) until ``event`` completes: query it for up to
    ``spin_s`` (a chunk copy usually finishes that soon), then ``synchronize()``, which sleeps
    for a blocking-sync event."""
    if event.query():
        return
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        if event.query():
            return
        os.sched_yield()
    event.synchronize()
