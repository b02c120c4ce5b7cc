"""When an awaited CUDA event should complete: the hybrid waiter's prediction.

Two sources, the first that applies:

* the backend's estimate for a copy of known size (``EventNotes.expected_at``: the bytes
  queued before it on its copy stream at 50 GB/s, plus a launch latency);
* the origin stream's history: the shortest of its last eight waits, each from the wait's start
  until it was seen complete. The shortest, so that a stream whose waits shrink is caught up in
  a few waits, while one whose waits grow costs a few polls more.

Polls begin a *lead* before the prediction. The waiter thread's lead is 8% + 60 us, since a
hand-over to the loop follows its polls; the loop's own timed polls lead by 2% + 40 us before a
history's prediction, and by at least 15% before an estimate (the estimate assumes 50 GB/s
where the link reaches 55, so a copy may end a tenth sooner). Each lead is capped at the
polling window.
"""

from __future__ import annotations

import threading
from typing import Any, Final

from .polling import EventNotes

__all__ = ["WaitPredictor"]

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
