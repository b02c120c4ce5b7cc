"""The interface between the runtime and a device backend.

The runtime (``aresidency.runtime``) is the only caller. A backend owns streams, events,
allocation at each location, and the transfers between locations; it keeps no residency state
(that is the model's, in ``aresidency.core``). Two backends implement this interface:

* ``CudaBackend`` (``backends/cuda.py``): torch CUDA streams and events, dedicated host-to-device
  and device-to-host copy streams per device, peer copies, a pinned staging pool for pageable
  memory, exactly-sized pinned allocations.
* ``SimBackend`` (``backends/sim.py``): a **simulation** of CUDA devices made of host memory,
  with in-order streams run by worker threads and events that complete like real ones. Released
  storage is poisoned so that a read after release shows up in tests.

Callers never ask which backend they have: what differs is a capability of the interface
(:meth:`Backend.location_of`, :attr:`Backend.host_compute`, :meth:`Backend.run_in_stream_order`,
:meth:`Backend.stream_context`, :meth:`Backend.check_stream`).

Conventions every method keeps (each implementation's docstrings say them again):

* ``copy`` never blocks the event loop for longer than it takes to enqueue work; the host
  waits for nothing. The returned :class:`Transfer` completes on the device.
* completion reaches the event loop through :meth:`Backend.notify`: a callback, run on the loop
  (through the :class:`~aresidency.backends.bridge.LoopBridge` given to :meth:`Backend.start`),
  exactly once. Nothing polls on the loop and no task is created per event. :meth:`Backend.wait`
  is the awaitable form.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import anyio
import torch

from ..core.locations import Location, LocationLike
from .bridge import LoopBridge
from .events import HostEvent, OnceCallbacks

__all__ = [
    "Backend",
    "BackendClosedError",
    "CompletionCallback",
    "CopyRequest",
    "DeviceEvent",
    "FaultInjector",
    "Transfer",
    "TransferCancelledError",
]

CompletionCallback = Callable[[BaseException | None], None]


class CopyRequest(NamedTuple):
    """One copy of :meth:`Backend.copy_many`: the arguments of :meth:`Backend.copy`."""

    src: torch.Tensor
    src_location: Location
    dst_location: Location
    wait_events: Sequence[DeviceEvent] = ()


class DeviceEvent(Protocol):
    """A point in a stream's work (``torch.cuda.Event``, a simulated or a host event)."""

    def query(self) -> bool:
        """True once all work before the event has completed. Never blocks."""
        ...


class BackendClosedError(RuntimeError):
    """The backend closed while a completion was awaited: the device work may never be seen."""


class TransferCancelledError(Exception):
    """The transfer was cancelled (:meth:`Transfer.cancel`) before all of it was issued: the
    destination does not hold the value."""


class Transfer:
    """A copy (or load) that a backend has started.

    ``tensor`` is the destination: allocated at once, holding the data once the transfer
    completed (or, on a device, for work ordered after :meth:`wait_issued`'s event).

    A transfer is *issued* once every piece of its device work is enqueued (direct copies at
    once; host-driven copies, such as pageable staging, after their worker thread enqueued the
    last chunk) and *complete* once that work ran. Its outcome is then the copy's error, the
    injected fault, :class:`TransferCancelledError` after :meth:`cancel`, or nothing.

    State: ``_issued`` (a :class:`HostEvent` set by the issuing thread), ``_event`` (after which
    the data is at the destination; set before ``_issued``), ``_error``, ``_cancelled``,
    ``_fail`` (fault injection).
    """

    def __init__(
        self,
        backend: Backend,
        tensor: torch.Tensor,
        nbytes: int,
        src_location: Location,
        dst_location: Location,
        route: str,
        *,
        fail: bool = False,
    ) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.src_location = src_location
        self.dst_location = dst_location
        self.route = route
        self._backend = backend
        self._fail = fail
        self._cancelled = False
        self._error: BaseException | None = None
        self._event: DeviceEvent | None = None
        self._issued = HostEvent(label="issued")

    def _finish_issue(self, event: DeviceEvent, error: BaseException | None = None) -> None:
        """Any thread: every piece of device work is enqueued (``event`` covers it)."""
        self._event = event
        self._error = error
        self._issued.set()

    def issued(self) -> bool:
        """Whether every piece of device work is enqueued now."""
        return self._issued.query()

    def query(self) -> bool:
        """Whether the transfer is complete (issued, and its device work ran). Never blocks."""
        event = self._event
        return self._issued.query() and event is not None and event.query()

    @property
    def event(self) -> DeviceEvent | None:
        """The event after which the data is at the destination (``None`` until issued)."""
        return self._event

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop issuing further chunks of a host-driven copy (best effort); work already
        enqueued still completes, and the outcome is :class:`TransferCancelledError`."""
        self._cancelled = True

    def outcome(self) -> BaseException | None:
        """The error of a complete transfer, or ``None`` when the destination holds the value."""
        if self._error is not None:
            return self._error
        if self._cancelled:
            return TransferCancelledError(f"{self!r} was cancelled")
        if self._fail:
            return RuntimeError("injected transfer failure")
        return None

    def when_issued(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once issued: now in this thread if it is, else in the issuing one."""
        self._issued.add_done_callback(callback)

    async def wait_issued(self) -> DeviceEvent:
        """Return once every piece of device work is enqueued; the returned event completes
        when the data is at the destination, and a stream that waits on it (on the device) may
        read :attr:`tensor`. The host does not block."""
        if not self._issued.query():
            await self._backend.wait(self._issued)
        assert self._event is not None
        return self._event

    async def wait(self) -> None:
        """Return once the transfer is complete; raise its outcome. The host does not block:
        the task parks until the backend sees the event complete."""
        await self._backend.wait(self)
        error = self.outcome()
        if error is not None:
            raise error

    def _state(self) -> str:
        if not self._issued.query():
            return "issuing"
        return "done" if self.query() else "in flight"

    def __repr__(self) -> str:
        return (
            f"<Transfer {self.src_location}->{self.dst_location} {self.nbytes} B {self.route} "
            f"{self._state()}>"
        )


class FaultInjector:
    """Deterministic fault injection for tests: fail the k-th transfer or allocation.

    ``fail_transfer_at=k`` makes the k-th transfer (1-based, counted from now) complete with
    ``RuntimeError("injected transfer failure")`` after its device work ran; the destination is
    left poisoned. ``oom_at_allocation=k`` makes the k-th allocation raise
    ``torch.OutOfMemoryError`` synchronously from ``copy`` / ``allocate``.
    """

    def __init__(self) -> None:
        self.transfers = 0
        self.allocations = 0
        self._fail_transfer: int | None = None  # absolute count at which to fail
        self._oom_allocation: int | None = None

    @property
    def fail_transfer_at(self) -> int | None:
        return None if self._fail_transfer is None else self._fail_transfer - self.transfers

    @fail_transfer_at.setter
    def fail_transfer_at(self, k: int | None) -> None:
        self._fail_transfer = None if k is None else self.transfers + k

    @property
    def oom_at_allocation(self) -> int | None:
        return None if self._oom_allocation is None else self._oom_allocation - self.allocations

    @oom_at_allocation.setter
    def oom_at_allocation(self, k: int | None) -> None:
        self._oom_allocation = None if k is None else self.allocations + k

    def next_transfer_fails(self) -> bool:
        self.transfers += 1
        if self._fail_transfer is not None and self.transfers == self._fail_transfer:
            self._fail_transfer = None
            return True
        return False

    def next_allocation_fails(self) -> bool:
        self.allocations += 1
        if self._oom_allocation is not None and self.allocations == self._oom_allocation:
            self._oom_allocation = None
            return True
        return False


class Backend(abc.ABC):
    """What the runtime needs from a device backend. See the module docstring.

    ``host_compute`` is true when the "device" computes on the host (the simulation): work
    handed to :meth:`run_in_stream_order` then runs on a host thread, and a host reader must
    await a copy rather than order a stream after it.

    State kept here for every backend: ``_bridge`` (the loop, from :meth:`start`),
    ``_host_waits`` (callbacks of host events still pending, failed by :meth:`_close_waits`),
    ``_closed``.
    """

    name: str
    simulated: bool = False
    host_compute: bool = False
    faults: FaultInjector
    _bridge: LoopBridge | None = None
    _closed: bool = False
    _host_waits: OnceCallbacks

    # -------------------------------------------------------------- topology

    @abc.abstractmethod
    def check_location(self, location: Location) -> None:
        """Raise ``ValueError`` naming the location if it does not exist on this backend
        (``cuda:3`` on a machine with two GPUs)."""

    @abc.abstractmethod
    def device_count(self) -> int: ...

    def location_of(self, tensor: torch.Tensor) -> Location:
        """Where ``tensor``'s storage lives, as this backend sees it: ``cuda:N`` for device
        memory, ``pinned-host`` for page-locked host memory, else ``pageable-host``.
        ``ValueError`` for a device this package does not manage (``mps``, ``meta``...)."""
        device = tensor.device
        if device.type == "cuda":
            return Location("cuda", device.index or 0)
        if device.type != "cpu":
            raise ValueError(
                f"cannot manage a tensor on device {device}: aresidency manages host memory "
                "and cuda devices"
            )
        return Location("pinned-host") if tensor.is_pinned() else Location("pageable-host")

    # -------------------------------------------------------------- lifecycle

    def start(self, bridge: LoopBridge | None = None) -> None:
        """Called on the event loop when the manager starts: completions are delivered to that
        loop. Subclasses start their threads here (and call this)."""
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; create a new one")
        self._bridge = bridge if bridge is not None else LoopBridge.current()
        if not hasattr(self, "_host_waits"):
            self._host_waits = OnceCallbacks()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop background threads; pending completions are failed with
        :class:`BackendClosedError`."""

    def _close_waits(self) -> None:
        """Fail every host-event completion still pending (part of ``aclose``)."""
        error = BackendClosedError(f"the {self.name} backend closed before the event completed")
        bridge = self._bridge
        for callback in self._host_waits.fail_all() if hasattr(self, "_host_waits") else []:
            if bridge is not None:
                bridge.call_soon_quietly(callback, error)

    @abc.abstractmethod
    def staging_nbytes(self) -> int:
        """Bytes of pinned staging buffers this backend uses for pageable copies (charged to
        ``pinned-host`` by the runtime as a named reservation)."""

    def pinned_overhead_bytes(self) -> int:
        """Page-locked bytes this backend keeps ready for pinned destinations that no value
        holds (a pinned arena's free space); the runtime shows them as the backend's own
        reservation at ``pinned-host``. None by default."""
        return 0

    def limit_pinned_overhead(self, headroom: int | None) -> None:
        """The runtime's bound on :meth:`pinned_overhead_bytes`: the pinned-host budget less
        everything charged there (``None``: no budget). Nothing to bound by default."""
        del headroom

    def pageable_overhead_bytes(self) -> int:
        """Pageable bytes this backend keeps ready for pageable destinations that no value
        holds (freed destinations kept with their pages faulted in); the runtime shows them
        as spare bytes at ``pageable-host``. None by default."""
        return 0

    def limit_pageable_overhead(self, headroom: int | None) -> None:
        """The runtime's bound on :meth:`pageable_overhead_bytes`: the pageable-host budget
        less everything charged there (``None``: no budget). Nothing to bound by default."""
        del headroom

    # -------------------------------------------------------------- memory

    @abc.abstractmethod
    def place(self, tensor: torch.Tensor, location: Location) -> torch.Tensor:
        """Return ``tensor``'s data as a tensor at ``location``, synchronously.

        Used at registration and for loads from a source (in a worker thread): a tensor already
        at the location is returned as is; a pageable tensor placed at ``pinned-host`` is
        copied into exactly-sized pinned memory. The calling thread may block."""

    @abc.abstractmethod
    def copy(
        self,
        src: torch.Tensor,
        src_location: Location,
        dst_location: Location,
        *,
        wait_events: Sequence[DeviceEvent] = (),
    ) -> Transfer:
        """Allocate the destination and start the copy; the host does not wait.

        The copy runs on the dedicated copy stream for the direction (host-to-device,
        device-to-host, peer), after waiting on the device for ``wait_events`` (writers and
        readers of ``src`` that must come first) and for the current stream of the source
        device. Allocation failure raises ``torch.OutOfMemoryError`` here; a failed copy is the
        transfer's outcome."""

    def copy_many(self, requests: Sequence[CopyRequest]) -> list[Transfer | BaseException]:
        """Start several copies at once, in order: per request, what :meth:`copy` would
        return, or the exception it would raise (a failed allocation fails its own request
        only). A backend may issue them together: the transfers it issues on one stream, one
        after the other, may then share one completion event (each is complete once all of
        them are), so that a burst of small copies costs one stream switch, one event and one
        completion to watch. The default calls :meth:`copy` for each."""
        out: list[Transfer | BaseException] = []
        for request in requests:
            try:
                out.append(
                    self.copy(
                        request.src,
                        request.src_location,
                        request.dst_location,
                        wait_events=request.wait_events,
                    )
                )
            except BaseException as error:  # the caller completes that request with it
                out.append(error)
        return out

    def allocate(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype, location: LocationLike
    ) -> torch.Tensor:
        """An uninitialized contiguous tensor at ``location`` that the caller owns (the
        runtime never sees it: charge it yourself, as a reservation). ``torch.OutOfMemoryError``
        when it cannot be had (also an injected failure)."""
        raise NotImplementedError(f"{type(self).__name__} has no allocate")

    def copy_into(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        dst_location: Location,
        *,
        wait_events: Sequence[DeviceEvent] = (),
        event: Any = None,
    ) -> DeviceEvent:
        """Enqueue a copy of ``src`` (host memory) into ``dst`` (memory the caller owns at
        ``dst_location``, a device: the same number of bytes) on the device's host-to-device
        copy stream, after ``wait_events`` on the device; return an event after it (recorded
        into ``event`` when given: CUDA reuses event objects). Any thread; nothing is allocated
        and no state changes: the caller owns ``dst``. Page-locked ``src``: the host does not
        wait, and the caller keeps ``src`` alive and unchanged until the event completed.
        Pageable ``src`` (slower): the call returns once the bytes were taken (on CUDA the
        driver stages them, after the stream's earlier work), and ``src`` is free again. An
        injected transfer failure raises here, before anything is enqueued. The hot path of
        weight streaming's ring (see :mod:`aresidency.integrations.streaming.ring`) and of the
        loader's (:mod:`aresidency.loader.ring`); a backend without it goes through managed
        values instead."""
        raise NotImplementedError(f"{type(self).__name__} has no copy_into")

    @property
    def has_copy_into(self) -> bool:
        """Whether :meth:`copy_into` is implemented (a capability, not a backend test)."""
        return type(self).copy_into is not Backend.copy_into

    def device_event(self, stream: Any, event: Any = None) -> DeviceEvent:
        """Record an event on ``stream`` (into ``event`` when given) that the host will not
        wait for: only other streams wait on it (no completion tracking, cheaper than
        :meth:`record_event`). ``None`` (host compute) gives a completed event."""
        del event
        return self.record_event(stream)

    @abc.abstractmethod
    def free(self, tensor: torch.Tensor, location: Location) -> None:
        """The runtime is done with ``tensor`` (every event that used it completed). Unpins
        registered host memory; the simulation poisons the storage first."""

    # -------------------------------------------------------------- streams and events

    @abc.abstractmethod
    def current_stream(self, location: Location) -> Any:
        """The stream a lease at ``location`` uses by default (the device's current stream;
        ``None`` for host locations, whose users run on the CPU)."""

    @abc.abstractmethod
    def check_stream(self, stream: Any, location: Location) -> None:
        """Raise ``TypeError``/``ValueError`` naming ``stream`` unless a lease or reader at
        ``location`` may use it (a stream of that device; ``None`` only for host locations)."""

    @abc.abstractmethod
    def stream_wait(self, stream: Any, event: DeviceEvent) -> None:
        """Make ``stream`` wait on the device for ``event``; the host does not wait."""

    @abc.abstractmethod
    def record_event(self, stream: Any) -> DeviceEvent:
        """Record an event on ``stream`` now; the host does not wait."""

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A context in which work the calling thread enqueues goes to ``stream`` (CUDA:
        ``torch.cuda.stream``; where compute runs on the host, nothing to set)."""
        return contextlib.nullcontext()

    def run_in_stream_order(self, stream: Any, fn: Callable[[], object]) -> None:
        """Run ``fn`` so that its work is ordered after the work queued on ``stream`` and
        before work queued later: on CUDA now, in the calling thread, with ``stream`` current
        (its kernels are enqueued there); where compute runs on the host, on the stream's worker
        thread when it reaches this point. The caller does not wait."""
        with self.stream_context(stream):
            fn()

    # -------------------------------------------------------------- completion

    def notify(self, waitable: DeviceEvent | Transfer, callback: CompletionCallback) -> None:
        """Run ``callback(None)`` on the loop once ``waitable`` (an event, or a transfer:
        issued and complete) completes, or ``callback(error)`` if the backend closes first.
        Exactly once, never in this call (always later, on the loop); any thread.

        Host events are followed through their setter (no polling); device events through the
        backend's own mechanism (:meth:`_notify_device`)."""
        if isinstance(waitable, Transfer):
            transfer = waitable

            def issued() -> None:
                event = transfer.event
                assert event is not None
                self.notify(event, callback)

            transfer.when_issued(issued)
            return
        bridge = self._bridge
        if bridge is None:
            raise RuntimeError(f"the {self.name} backend was not started")
        if waitable.query():
            bridge.call_soon_quietly(callback, None)
            return
        if self._closed:
            bridge.call_soon_quietly(
                callback, BackendClosedError(f"the {self.name} backend is closed")
            )
            return
        if isinstance(waitable, HostEvent):
            token = self._host_waits.add(callback)

            def fire() -> None:
                pending = self._host_waits.take(token)
                if pending is not None:
                    bridge.call_soon_quietly(pending, None)

            waitable.add_done_callback(fire)
            return
        self._notify_device(waitable, callback)

    @abc.abstractmethod
    def _notify_device(self, event: DeviceEvent, callback: CompletionCallback) -> None:
        """:meth:`notify` for the backend's own (non-host) events."""

    async def wait(self, waitable: DeviceEvent | Transfer) -> None:
        """Park the task until ``waitable`` completes, without blocking the loop or spinning.
        Raises :class:`BackendClosedError` if the backend closes first. (A transfer's own
        error is its :meth:`Transfer.outcome`; see :meth:`Transfer.wait`.)"""
        if waitable.query():
            return
        done = anyio.Event()
        outcome: list[BaseException | None] = []

        def complete(error: BaseException | None) -> None:
            outcome.append(error)
            done.set()

        self.notify(waitable, complete)
        await done.wait()
        if outcome[0] is not None:
            raise outcome[0]

    async def wait_event(self, event: DeviceEvent) -> None:
        """:meth:`wait` for an event (kept for readability at call sites)."""
        await self.wait(event)
