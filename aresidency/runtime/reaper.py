"""The reaper: completed device work, seen on the loop, becomes state.

Two kinds of device work end here:

* transfers (the driver asks :meth:`Reaper.watch` to call it back when a copy completes);
* consumer events that leases recorded on their reader streams (:meth:`Reaper.track_readers`
  counts them as ``pending_event_count`` of the materialization and commits an
  ``event_reaped`` transition as each completes, so a materialization is never removed while a
  kernel may still read it).

Completions arrive as callbacks from the backend (no task per event, batched per sweep of the
CUDA waiter). Because a lost wake-up must delay reaping but never hang it, the reaper also runs
one background task that, while anything is watched, queries the watched work every
``safety_interval`` seconds and completes what it finds done: whichever comes first wins, and
every callback runs exactly once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from ..backends.base import DeviceEvent, Transfer
from ..core.locations import Location
from ..core.values import ValueHandle

if TYPE_CHECKING:
    from .context import Runtime

__all__ = ["Reaper"]

Callback = Callable[[BaseException | None], None]


class _Watch:
    """One watched completion; :meth:`fire` runs its callback once."""

    __slots__ = ("callback", "reaper", "token", "waitable")

    def __init__(
        self, reaper: Reaper, token: int, waitable: DeviceEvent | Transfer, callback: Callback
    ) -> None:
        self.reaper = reaper
        self.token = token
        self.waitable: DeviceEvent | Transfer | None = waitable
        self.callback = callback

    def done(self) -> bool:
        """Whether the watched work completed (queried now; never blocks)."""
        waitable = self.waitable
        return waitable is not None and waitable.query()

    def fire(self, error: BaseException | None) -> None:
        if self.reaper._watched.pop(self.token, None) is None:
            return  # the other path (notification or safety sweep) was first
        # The callback may free what the waitable holds (a transfer's destination) and what
        # that wakes may allocate again: nothing here may keep it alive meanwhile.
        self.waitable = None
        try:
            self.callback(error)
        finally:
            self.reaper._runtime.check_idle()


class Reaper:
    """Completions of device work, delivered on the loop. See the module docstring.

    State: ``_watched`` (token -> watch, every completion not delivered yet), ``_wake`` (set
    when something is watched while the safety task sleeps without work).
    """

    def __init__(self, runtime: Runtime, *, safety_interval: float = 0.05) -> None:
        self._runtime = runtime
        self._watched: dict[int, _Watch] = {}
        self._next = 0
        self._wake: anyio.Event | None = None
        self.safety_interval = safety_interval
        self.safety_hits = 0  # completions the safety sweep delivered first (diagnostics)

    def watch(self, waitable: DeviceEvent | Transfer, callback: Callback) -> None:
        """Call ``callback(None)`` on the loop once ``waitable`` completes (or
        ``callback(error)`` if the backend closes first); exactly once, never in this call."""
        self._next += 1
        watch = _Watch(self, self._next, waitable, callback)
        self._watched[self._next] = watch
        target: DeviceEvent | Transfer | None = waitable
        if isinstance(waitable, Transfer) and waitable.issued():
            target = waitable.event  # issued already: its event is what completes it
        assert target is not None
        self._runtime.backend.notify(target, watch.fire)
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()

    @property
    def watched(self) -> int:
        return len(self._watched)

    # -- consumer events

    def track_readers(
        self, handle: ValueHandle, location: Location, events: list[DeviceEvent]
    ) -> None:
        """Count ``events`` as pending consumers of the materialization (one transition) and
        reap each one as it completes."""
        runtime = self._runtime
        payload = runtime.payloads.get(handle, location)
        assert payload is not None, "readers of a materialization without data"
        runtime.state.record_events(handle, location, len(events))
        payload.readers.extend(events)
        for event in events:
            self.watch(event, functools.partial(self._reaped, handle, location, event))

    def _reaped(
        self,
        handle: ValueHandle,
        location: Location,
        event: DeviceEvent,
        error: BaseException | None,
    ) -> None:
        # An event is counted done even when the backend closed before seeing it: the manager
        # is closing then, and waits for nothing more.
        runtime = self._runtime
        payload = runtime.payloads.get(handle, location)
        if payload is not None:
            try:
                payload.readers.remove(event)
            except ValueError:
                pass
            # No local may hold the payload across settle(): the reap may free its tensor, and
            # what settle() wakes may allocate again in this very frame's lifetime.
            del payload
        value = runtime.state.find_value(handle)
        mat = None if value is None else value.materializations.get(location)
        if mat is not None and mat.pending_event_count > 0:
            runtime.state.reap_events(handle, location, 1)
        runtime.settle()

    # -- the safety net

    async def run_safety_net(self) -> None:
        """Forever (until cancelled with the manager): while something is watched, query it
        every ``safety_interval`` seconds and deliver what completed."""
        while True:
            if not self._watched:
                self._wake = anyio.Event()
                await self._wake.wait()
            # Woken by a watch: sweep one interval later, whatever completed meanwhile (not at
            # once: a completion delivered in the same turn would make every short wait cost
            # a wake-up and a new event).
            await anyio.sleep(self.safety_interval)
            for watch in list(self._watched.values()):
                if watch.done():
                    self.safety_hits += 1
                    watch.fire(None)
