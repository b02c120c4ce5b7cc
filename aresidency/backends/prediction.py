"""When an awaited CUDA event should complete: the hybrid waiter's prediction.

Two sources, the first that applies:

* the backend's estimate for a copy of known size (``EventNotes.expected_at``: the bytes
  queued before it on its copy stream at 50 GB/s, plus a launch latency where the stream was
  idle);
* the origin stream's history: the shortest of its last eight waits, each from the wait's start
  until it was seen complete. The shortest, so that a stream whose waits shrink is caught up in
  a few waits, while one whose waits grow costs a few polls more.

The estimate is :class:`CopyQueues`'s: it is made when the copy is issued, and made again when
the wait begins, from the bytes still queued between the stream's last completed event and the
awaited one (so the error of an assumed rate does not add up over a long queue: a task that
awaits the 64th of 64 copies queued at once is told when its own few remaining bytes should be
done, not when 64 copies at the assumed rate would be).

Polls begin a *lead* before the prediction. The waiter thread's lead is 8% + 60 us, since a
hand-over to the loop follows its polls; the loop's own timed polls lead by 2% + 40 us before a
history's prediction, and by at least 15% before an estimate (the estimate assumes 50 GB/s
where the link reaches 55, so a copy may end a tenth sooner). Each lead is capped at the
polling window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Final

from .polling import EventNotes

__all__ = ["CopyQueues", "WaitPredictor"]

_HISTORY: Final = 8  # waits remembered per origin stream
_ESTIMATE_LEAD_FRACTION: Final = 0.15


class WaitPredictor:
    """Predicts, per origin stream, when a wait should end (see the module docstring).

    State: ``_durations`` (origin stream key -> the seconds of its last waits, newest last),
    guarded by ``_lock``; the leads and the window, fixed at construction. Thread-safe.
    """

    def __init__(
        self,
        *,
        lead_fraction: float,
        lead_s: float,
        timer_lead_fraction: float,
        timer_lead_s: float,
        window_s: float,
    ) -> None:
        self.lead_fraction = lead_fraction
        self.lead_s = lead_s
        self.timer_lead_fraction = timer_lead_fraction
        self.timer_lead_s = timer_lead_s
        self.window_s = window_s
        self._durations: dict[Any, list[float]] = {}
        self._lock = threading.Lock()

    def record(self, key: Any, seconds: float) -> None:
        """A wait on ``key``'s stream took ``seconds`` (from its start to seen complete)."""
        with self._lock:
            history = self._durations.setdefault(key, [])
            history.append(seconds)
            del history[:-_HISTORY]

    def history(self, key: Any) -> tuple[float, ...]:
        """The last waits' seconds on ``key``'s stream, oldest first."""
        with self._lock:
            return tuple(self._durations.get(key, ()))

    def delay(self, notes: EventNotes | None, key: Any, now: float, *, timer: bool) -> float:
        """Seconds from ``now`` until the polls of a wait beginning now should start: the
        thread's (``timer=False``) or the loop's timed polls' lead before the prediction; 0
        without one."""
        expected_at = notes.expected_at if notes is not None else None
        if expected_at is not None:
            remaining = max(expected_at - now, 0.0)
            lead = self.estimate_lead(remaining) if timer else self.thread_lead(remaining)
            return max(remaining - lead, 0.0)
        return self.from_history(key, timer=timer)

    def from_history(self, key: Any, *, timer: bool = False) -> float:
        """The lead before the shortest recent wait on ``key``'s stream (0 without history)."""
        with self._lock:
            history = self._durations.get(key)
            if not history:
                return 0.0
            shortest = min(history)
        lead = self.timer_lead(shortest) if timer else self.thread_lead(shortest)
        return max(shortest - lead, 0.0)

    def thread_lead(self, wait: float) -> float:
        """How long before a predicted completion the thread's polls start."""
        return min(self.lead_fraction * wait + self.lead_s, self.window_s)

    def timer_lead(self, wait: float) -> float:
        """How long before a history's prediction the loop's timed polls start: shorter than
        the thread's, since no hand-over to the loop follows them."""
        return min(self.timer_lead_fraction * wait + self.timer_lead_s, self.window_s)

    def estimate_lead(self, wait: float) -> float:
        """How long before the backend's estimate the loop's timed polls start."""
        return min(max(self.timer_lead(wait), _ESTIMATE_LEAD_FRACTION * wait), self.window_s)

    def __repr__(self) -> str:
        with self._lock:
            streams = len(self._durations)
        return f"<WaitPredictor {streams} streams>"


_QUEUE_LIMIT: Final = 4096  # events remembered per stream (older ones are forgotten)


class CopyQueues:
    """When copies queued on a stream should be done: the backend's estimate for the waiter.

    :meth:`expect` is called as each copy is enqueued (its bytes, at the assumed rate, after the
    copies queued before it; a launch latency only where the stream was idle), and
    :meth:`recorded` once the event after it is recorded: the event's notes get the bytes
    queued on its stream up to it (``EventNotes.queued``) and the rate. :meth:`reestimate`, at
    the start of a wait, drops the stream's completed events (oldest first: one stream's events
    complete in record order) and sets ``expected_at`` from the bytes between the last of them
    and the awaited event, if that is sooner.

    State, per stream key (guarded by ``_lock``; any thread): ``_busy_until`` (when the queued
    copies should be done), ``_issued`` (bytes enqueued so far), ``_done`` (bytes before the
    newest event seen complete), ``_events`` (recorded events not yet seen complete, oldest
    first, with the bytes enqueued up to each, at most ``_QUEUE_LIMIT``)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self._lock = threading.Lock()
        self._busy_until: dict[Any, float] = {}
        self._issued: dict[Any, int] = {}
        self._done: dict[Any, int] = {}
        self._events: dict[Any, deque[tuple[Any, int]]] = {}

    def expect(self, key: Any, nbytes: int, bytes_per_s: float, now: float | None = None) -> float:
        """A copy of ``nbytes`` enqueued now on ``key``'s stream: when (``time.monotonic``) it
        should be done (an estimate for the waiter, never a promise)."""
        if now is None:
            now = time.monotonic()
        with self._lock:
            start = max(now + self.latency_s, self._busy_until.get(key, 0.0))
            done = start + nbytes / bytes_per_s
            self._busy_until[key] = done
            self._issued[key] = self._issued.get(key, 0) + nbytes
        return done

    def recorded(self, key: Any, event: Any, bytes_per_s: float, expected_at: float) -> None:
        """``event`` was recorded on ``key``'s stream after the copies :meth:`expect` counted:
        note on it when it should complete and the bytes queued up to it."""
        notes = EventNotes.of(event)
        if notes is None:
            return
        with self._lock:
            queued = self._issued.get(key, 0)
            events = self._events.get(key)
            if events is None:
                events = self._events[key] = deque()
            self._drop_completed(key, events, at_most=2)
            events.append((event, queued))
            if len(events) > _QUEUE_LIMIT:
                events.popleft()
        notes.expected_at = expected_at
        notes.queued = queued
        notes.rate = bytes_per_s

    def reestimate(self, key: Any, event: Any, now: float | None = None) -> None:
        """A wait for ``event`` (recorded through :meth:`recorded`) begins: its ``expected_at``
        becomes ``now`` plus the bytes still queued before it at the assumed rate, if that is
        sooner than the estimate made when it was issued."""
        notes = EventNotes.of(event)
        if notes is None or notes.queued is None or not notes.rate:
            return
        if now is None:
            now = time.monotonic()
        with self._lock:
            events = self._events.get(key)
            if events is not None:
                self._drop_completed(key, events)
            remaining = max(notes.queued - self._done.get(key, 0), 0)
        at = now + remaining / notes.rate
        if notes.expected_at is None or at < notes.expected_at:
            notes.expected_at = at

    def _drop_completed(self, key: Any, events: deque[tuple[Any, int]], at_most: int = -1) -> None:
        """Drop the oldest events seen complete (``at_most`` of them, -1: all; under the lock):
        the bytes before the newest of them are done."""
        while events and at_most:
            event, queued = events[0]
            if not event.query():
                return
            events.popleft()
            self._done[key] = max(self._done.get(key, 0), queued)
            at_most -= 1

    def __repr__(self) -> str:
        with self._lock:
            pending = sum(len(e) for e in self._events.values())
        return f"<CopyQueues {len(self._events)} streams, {pending} events not seen complete>"
