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

Conventions every method keeps (say them again in each implementation's docstrings):

* ``copy`` never blocks the event loop for longer than it takes to enqueue work; the host
  waits for nothing. The returned :class:`Transfer` is awaited by the runtime.
* every event can be awaited with :meth:`Backend.wait_event`, which neither blocks the loop nor
  spins a core.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..core.locations import Location

__all__ = ["Backend", "DeviceEvent", "FaultInjector", "Transfer"]


class DeviceEvent(Protocol):
    """A point in a stream's work (``torch.cuda.Event`` or the simulation's event)."""

    def query(self) -> bool:
        """True once all work before the event has completed. Never blocks."""
        ...


class Transfer(abc.ABC):
    """A copy (or load) that a backend has started.

    ``tensor`` is the destination tensor: allocated at once, holding the data only once
    :meth:`wait` returns (or, on a device, for work ordered after :attr:`event`).
    """

    tensor: torch.Tensor
    nbytes: int

    @abc.abstractmethod
    async def wait_issued(self) -> DeviceEvent:
        """Return once every piece of device work of the copy is enqueued; the returned event
        completes when the data is at the destination. A stream that waits on it (on the
        device) may read :attr:`tensor`. Host-driven copies (pageable staging) take several
        steps to issue; direct copies are issued when ``copy`` returns."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Return once the data is at the destination; raise the copy's error if it failed.

        The host does not block: the task parks until the backend sees the event complete."""

    def issued(self) -> bool:
        """Whether every piece of device work is enqueued now (:meth:`wait_issued` would
        return at once). Direct copies are issued when ``copy`` returns."""
        return True

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop issuing further chunks of a host-driven copy (best effort); already-enqueued
        device work still completes. :meth:`wait` then raises ``asyncio.CancelledError``."""


class FaultInjector:
    """Deterministic fault injection for tests: fail the k-th transfer or allocation.

    ``fail_transfer_at=k`` makes the k-th transfer (1-based, counted from now) raise
    ``RuntimeError("injected transfer failure")`` from :meth:`Transfer.wait`, after its device
    work ran; the destination is left poisoned. ``oom_at_allocation=k`` makes the k-th allocation
    raise ``torch.OutOfMemoryError`` synchronously from ``copy`` / ``allocate``.
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
    """What the runtime needs from a device backend. See the module docstring."""

    name: str
    simulated: bool
    faults: FaultInjector

    @abc.abstractmethod
    def check_location(self, location: Location) -> None:
        """Raise ``ValueError`` naming the location if it does not exist on this backend
        (``cuda:3`` on a machine with two GPUs)."""

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def start(self) -> None:
        """Called on the event loop when the manager starts (creates the event waiter)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop background threads; pending waits are failed with ``RuntimeError``."""

    @abc.abstractmethod
    def staging_nbytes(self) -> int:
        """Bytes of pinned staging buffers this backend uses for pageable copies (charged to
        ``pinned-host`` by the runtime as a named reservation)."""

    @abc.abstractmethod
    def place(self, tensor: torch.Tensor, location: Location) -> torch.Tensor:
        """Return ``tensor``'s data as a tensor at ``location``, synchronously.

        Used only at registration: a tensor already at the location is returned as is; a
        pageable tensor registered as ``pinned-host`` is copied into exactly-sized pinned memory.
        The host may block (it is the caller's own tensor)."""

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
        device. Allocation failure raises ``torch.OutOfMemoryError`` here; a failed copy
        raises from :meth:`Transfer.wait`."""

    @abc.abstractmethod
    def current_stream(self, location: Location) -> Any:
        """The stream a lease at ``location`` uses by default (the device's current stream;
        ``None`` for host locations, whose users run on the CPU)."""

    @abc.abstractmethod
    def stream_wait(self, stream: Any, event: DeviceEvent) -> None:
        """Make ``stream`` wait on the device for ``event``; the host does not wait."""

    @abc.abstractmethod
    def record_event(self, stream: Any) -> DeviceEvent:
        """Record an event on ``stream`` now; the host does not wait."""

    @abc.abstractmethod
    async def wait_event(self, event: DeviceEvent) -> None:
        """Park the task until ``event`` completes, without blocking the loop or spinning."""

    @abc.abstractmethod
    def free(self, tensor: torch.Tensor, location: Location) -> None:
        """The runtime is done with ``tensor`` (every event that used it completed). Unpins
        registered host memory; the simulation poisons the storage first."""
