"""Leases (active uses) and holds (protection without use)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import ResidencyUnavailableError
from ..core.locations import Location
from ..core.state import ValueHandle

if TYPE_CHECKING:
    from .manager import ResidencyManager

__all__ = ["Hold", "Lease"]


class Lease:
    """An active use of one materialization: ``async with manager.acquire(h, loc) as lease``.

    Entering never places a value (a missing materialization is ``ResidencyUnavailableError``).
    For a ``cuda`` location the lease's stream (``stream=``, default the device's current
    stream) is made to wait *on the device* for the transfer that brought the value there, so
    the host never waits: kernels the body enqueues on that stream see the data. For a host
    location the host awaits (without blocking the loop) any transfer still writing it.

    Exiting records an event on every reader stream (the lease's own and each one given to
    :meth:`register_stream`); the materialization keeps ``pending_event_count`` until the
    reaper sees them complete, so it cannot be removed while a kernel may still read it.
    State: ``handle``, ``location``, ``mode``, ``stream``, ``tensor`` (while entered).
    """

    def __init__(
        self,
        manager: ResidencyManager,
        handle: ValueHandle,
        location: Location,
        *,
        stream: Any = None,
        mode: str = "read",
    ) -> None:
        if mode not in ("read", "write"):
            raise ValueError(f"lease mode must be 'read' or 'write', got {mode!r}")
        self._manager = manager
        self.handle = handle
        self.location = location
        self.mode = mode
        self.stream = stream
        self._streams: list[Any] = []
        self._tensor: torch.Tensor | None = None
        self._entered = False
        self._exited = False

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("the lease's tensor is available only inside 'async with'")
        return self._tensor

    def register_stream(self, stream: Any) -> None:
        """Also record a reader event on ``stream`` when the lease exits (a stream other than the
        lease's own that reads the tensor). Registering a stream twice records it once."""
        if self._exited:
            raise RuntimeError("register_stream after the lease exited protects nothing")
        if stream is None:
            raise ValueError("register_stream needs a stream")
        if all(stream is not s for s in self._streams):
            self._streams.append(stream)

    async def __aenter__(self) -> Lease:
        if self._entered:
            raise RuntimeError("a lease is single use; call manager.acquire again")
        self._entered = True
        manager = self._manager
        manager._check_loop()
        if self.location.is_cuda and self.stream is None:
            self.stream = manager.backend.current_stream(self.location)
        manager._state.lease(self.handle, self.location, self.mode)
        try:
            key = (self.handle, self.location)
            while key not in manager._payloads:  # a load from the source is still running
                manager._state.materialization(self.handle, self.location)
                await manager._wait_change()
            payload = manager._payloads[key]
            if payload.transfer is not None:
                if self.location.is_cuda:
                    event = await payload.transfer.wait_issued()
                    manager.backend.stream_wait(self.stream, event)
                else:
                    await payload.transfer.wait()
            elif payload.ready_event is not None and self.location.is_cuda:
                manager.backend.stream_wait(self.stream, payload.ready_event)
            # A writer's or reader's work still pending on other streams: order after writers.
            if self.location.is_cuda and self.mode == "write":
                for event in payload.events:
                    manager.backend.stream_wait(self.stream, event)
            self._tensor = payload.tensor
        except BaseException:
            self._unlease_quietly()
            raise
        if self.stream is not None:
            self.register_stream(self.stream)
        return self

    def _unlease_quietly(self) -> None:
        try:
            self._manager._state.unlease(self.handle, self.location, self.mode)
        except (ResidencyUnavailableError, ValueError):
            pass
        self._manager._notify()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exited = True
        manager = self._manager
        self._tensor = None
        state = manager._state
        value = state.value(self.handle, allow_discarded=True)
        mat = value.materializations.get(self.location)
        if mat is None:
            return  # the transfer that was bringing it failed; its error was reported there
        if self._streams:
            events = [manager.backend.record_event(stream) for stream in self._streams]
            manager._track_events(self.handle, self.location, events)
        self._unlease_quietly()

    def __repr__(self) -> str:
        state = "entered" if self._entered and not self._exited else "idle"
        return f"<Lease {self.handle.name!r} @ {self.location} {self.mode} {state}>"


class Hold:
    """Protects a materialization from removal without using it. ``release()`` ends it; also a
    context manager (``with`` or ``async with``). Releasing twice is an error."""

    def __init__(self, manager: ResidencyManager, handle: ValueHandle, location: Location):
        self._manager = manager
        self.handle = handle
        self.location = location
        self.active = True

    def release(self) -> None:
        if not self.active:
            raise RuntimeError(f"{self!r} was already released")
        self._manager._check_loop()
        self._manager._state.unhold(self.handle, self.location)
        self.active = False
        self._manager._notify()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self.release()

    async def __aenter__(self) -> Hold:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.active:
            self.release()

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"<Hold {self.handle.name!r} @ {self.location} {state}>"
