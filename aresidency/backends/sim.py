"""A SIMULATION of CUDA devices made of host memory, for machines without a GPU.

``SimBackend`` (``name = "sim"``, ``simulated = True``) implements the backend interface with
the semantics of the CUDA one, so that the whole runtime runs and is tested on a CPU:

* ``cuda:N`` tensors are ordinary CPU tensors that the backend allocated and remembers
  (:meth:`SimBackend.location_of`); ``pinned-host`` tensors are ordinary CPU tensors too.
* every simulated device has in-order streams (:class:`SimStream`): ``compute`` (the device's
  current stream, which leases use by default), ``h2d``, ``d2h`` and ``peer``; each runs its
  work on one worker thread. Events recorded on a stream complete when its worker reaches
  them; ``stream_wait`` enqueues a wait. Tests submit slow work (``stream.sleep(0.05)``) to
  keep events pending.
* copies run on the worker threads, chunked for pageable memory (as the staging pool does),
  optionally throttled to ``copy_gbps`` so that overlap is visible in wall-clock time.
* memory the simulation hands out starts poisoned and is poisoned again by ``free``: NaN for
  floating and complex dtypes, the byte 0xA5 otherwise. A read that is not ordered after the
  copy that fills a tensor, or that runs after the tensor was released, sees the poison.
* event completion wakes the event loop with ``loop.call_soon_threadsafe``; nothing polls.
  With ``waiter=`` the device events are awaited through the CUDA backend's event waiter
  instead (its driver simulated by :mod:`~aresidency.backends.simdriver`), with copy estimates
  as that backend makes them and pageable copies issued by a worker, as its staging lane does.
* fault injection (:class:`~aresidency.backends.base.FaultInjector`) behaves as in the CUDA
  backend.

Why this module is long: it is one backend, the simulated twin of ``cuda``, and its routes
share the state they simulate (the streams, the memory counted per device, the poison); the
streams and events themselves live in ``simstreams``.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..core.errors import format_bytes
from ..core.locations import Location, LocationLike
from .base import (
    Backend,
    BackendClosedError,
    CompletionCallback,
    CopyRequest,
    DeviceEvent,
    FaultInjector,
    Transfer,
)
from .bridge import LoopBridge
from .events import OnceCallbacks
from .memory import POISON_BYTE, as_bytes, is_poisoned, poison_
from .prediction import CopyQueues
from .simstreams import SimDeviceStreams, SimEvent, SimStream

if TYPE_CHECKING:
    from .waiter import EventWaiter

__all__ = [
    "POISON_BYTE",
    "SimBackend",
    "SimDeviceStreams",
    "SimEvent",
    "SimStream",
    "is_poisoned",
    "poison_",
]


class _SimCopy:
    """Host-side state of one SIMULATED copy, touched by its stream's worker thread only: the
    source bytes (captured once the stream reaches the copy), the error of a chunk."""

    __slots__ = ("error", "src_bytes", "transfer")

    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer
        self.src_bytes: torch.Tensor | None = None
        self.error: BaseException | None = None


class SimBackend(Backend):
    """A SIMULATION of ``num_devices`` CUDA devices in host memory (see the module docstring).

    ``copy_gbps`` throttles every simulated copy to that many GB/s (None: as fast as a host
    memcpy). ``chunk_bytes`` is the chunk size of pageable copies (cancellation stops between
    chunks). ``staging_nbytes`` is what :meth:`staging_nbytes` reports: 0 by default, so that
    small test budgets are not consumed; pass a size to exercise the runtime's staging
    reservation. ``waiter``: the CUDA backend's
    :class:`~aresidency.backends.waiter.EventWaiter`, built with a
    :class:`~aresidency.backends.simdriver.SimNotifyDriver`, through which the simulated device
    events are then awaited (so the waiter's logic runs under the simulation's tests); without
    one they call back from the thread that completes them.

    State: the streams of every device, ``_owned`` (storage data pointer -> the location of
    memory this backend handed out), ``_host_waits`` (completions still to deliver),
    ``_closed``.
    """

    name = "sim"
    simulated = True
    host_compute = True

    def __init__(
        self,
        num_devices: int = 2,
        copy_gbps: float | None = None,
        *,
        chunk_bytes: int = 1 << 20,
        staging_nbytes: int = 0,
        faults: FaultInjector | None = None,
        waiter: EventWaiter | None = None,
    ) -> None:
        if num_devices < 0:
            raise ValueError(f"num_devices must be >= 0, got {num_devices}")
        if copy_gbps is not None and copy_gbps <= 0:
            raise ValueError(f"copy_gbps must be positive or None, got {copy_gbps}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.num_devices = num_devices
        self.copy_gbps = copy_gbps
        self.chunk_bytes = chunk_bytes
        self._staging_nbytes = staging_nbytes
        self.faults = faults if faults is not None else FaultInjector()
        if waiter is not None:
            _check_waiter(waiter)
        self.waiter = waiter
        self._queues = CopyQueues(10e-6)  # with a waiter: when each stream's copies end
        self._unissued: set[Transfer] = set()  # with a waiter: pageable copies issued later
        self.issued_late = 0  # how many were (tests)
        label = "sim"
        self._devices = [
            SimDeviceStreams(*(SimStream(label, i, k) for k in ("compute", "h2d", "d2h", "peer")))
            for i in range(num_devices)
        ]
        self._host_stream = SimStream(label, None, "host-copy")
        self._extra_streams: list[SimStream] = []
        self._lock = threading.Lock()
        self._owned: dict[int, Location] = {}
        # Simulated device memory in use, as torch.cuda.memory_allocated counts it: the bytes of
        # every live tensor this backend allocated at a cuda location (until its last reference
        # dies, not when the runtime frees it), and the peak since the last reset.
        self._device_bytes: dict[Location, int] = {}
        self._device_peak: dict[Location, int] = {}
        self._host_waits = OnceCallbacks()
        self._closed = False
        self._started = False

    # -------------------------------------------------------------- topology

    def check_location(self, location: Location) -> None:
        loc = location if type(location) is Location else Location.parse(location)
        if loc.index is not None and loc.index >= self.num_devices:  # (only cuda has one)
            raise ValueError(
                f"{loc} does not exist on the simulated backend, which has "
                f"{self.num_devices} simulated cuda device(s) (cuda:0..cuda:{self.num_devices - 1})"
            )

    def device_count(self) -> int:
        return self.num_devices

    def device_streams(self, index: int) -> SimDeviceStreams:
        """The simulated streams of ``cuda:index``."""
        self.check_location(Location("cuda", index))
        return self._devices[index]

    def new_stream(self, location: LocationLike) -> SimStream:
        """A new simulated stream on a device (as ``torch.cuda.Stream(device)`` would be)."""
        loc = Location.parse(location)
        self.check_location(loc)
        if not loc.is_cuda:
            raise ValueError(f"streams live on cuda devices, not on {loc}")
        stream = SimStream("sim", loc.device_index, f"user{len(self._extra_streams)}")
        self._extra_streams.append(stream)
        return stream

    def _all_streams(self) -> list[SimStream]:
        streams = [s for d in self._devices for s in (d.compute, d.h2d, d.d2h, d.peer)]
        return [*streams, self._host_stream, *self._extra_streams]

    # -------------------------------------------------------------- lifecycle

    def start(self, bridge: LoopBridge | None = None) -> None:
        """Nothing to create: stream workers start on their first work (and the waiter's
        thread, with a waiter). On the loop."""
        super().start(bridge)
        if self.waiter is not None:
            self.waiter.start()
        self._started = True

    async def aclose(self) -> None:
        """Fail pending completions with ``BackendClosedError``, stop every stream's worker
        (queued work that has not started is dropped). Joins the workers in a worker thread,
        not on the loop."""
        if self._closed:
            return
        self._closed = True
        self._close_waits()
        with self._lock:
            unissued, self._unissued = list(self._unissued), set()
        for transfer in unissued:  # never issued now: they fail, as their watchers learn
            transfer._finish_issue(
                SimEvent(done=True, label="closed"),
                BackendClosedError("the simulated backend closed before the copy was issued"),
            )
        streams = self._all_streams()

        def close_all() -> None:
            if self.waiter is not None:
                self.waiter.close()
            for stream in streams:
                stream.close()

        await anyio.to_thread.run_sync(close_all)

    def staging_nbytes(self) -> int:
        return self._staging_nbytes

    # -------------------------------------------------------------- memory

    def owned_location(self, tensor: torch.Tensor) -> Location | None:
        """Where the simulation placed ``tensor``'s storage (None: not its memory)."""
        if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() == 0:
            return None
        with self._lock:
            return self._owned.get(tensor.untyped_storage().data_ptr())

    def location_of(self, tensor: torch.Tensor) -> Location:
        """Where ``tensor`` lives in the simulation: the location the simulation allocated it
        at (its ``cuda:N`` tensors are host memory), else as for any host tensor."""
        owned = self.owned_location(tensor)
        return owned if owned is not None else super().location_of(tensor)

    def allocate(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype, location: LocationLike
    ) -> torch.Tensor:
        """A poisoned contiguous tensor at ``location`` (host memory, whatever the location).
        Counts as an allocation for fault injection (``torch.OutOfMemoryError``)."""
        loc = Location.parse(location)
        self.check_location(loc)
        if self.faults.next_allocation_fails():
            raise torch.OutOfMemoryError(
                f"injected allocation failure: {math.prod(shape)} x {dtype} at {loc} (simulated)"
            )
        tensor = torch.empty(tuple(shape), dtype=dtype)
        poison_(tensor)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes:
            ptr = storage.data_ptr()
            with self._lock:
                self._owned[ptr] = loc
                if loc.is_cuda:
                    used = self._device_bytes.get(loc, 0) + nbytes
                    self._device_bytes[loc] = used
                    if used > self._device_peak.get(loc, 0):
                        self._device_peak[loc] = used
            # The storage's Python object lives as long as the memory does (every tensor that
            # shares it, a view, a ``.view(dtype)``, a ``.detach()``, a ``set_`` alias keeps
            # it), so this runs when the memory is given back, in whatever thread drops the
            # last reference. A buffer dropped without :meth:`free` is forgotten then: the
            # allocator may hand its address to a new host tensor, which must not be taken
            # for this simulation's memory.
            weakref.finalize(storage, self._storage_died, ptr, loc, nbytes)
        return tensor

    def _storage_died(self, ptr: int, location: Location, nbytes: int) -> None:
        with self._lock:
            # The address cannot have been handed out again while this storage lived, so an
            # entry for it is this allocation's (unless free() forgot it already).
            if self._owned.get(ptr) is location:
                del self._owned[ptr]
            if location.is_cuda:
                self._device_bytes[location] -= nbytes

    def memory_allocated(self, location: LocationLike) -> int:
        """SIMULATED device memory in use at a cuda location: the bytes of the live tensors
        this backend allocated there (as ``torch.cuda.memory_allocated``: memory counts until
        its last reference dies, whatever the ledger says)."""
        loc = Location.parse(location)
        self.check_location(loc)
        with self._lock:
            return self._device_bytes.get(loc, 0)

    def max_memory_allocated(self, location: LocationLike) -> int:
        """The peak of :meth:`memory_allocated` since the start or the last
        :meth:`reset_peak_memory_allocated` (as ``torch.cuda.max_memory_allocated``)."""
        loc = Location.parse(location)
        self.check_location(loc)
        with self._lock:
            return self._device_peak.get(loc, 0)

    def reset_peak_memory_allocated(self, location: LocationLike) -> None:
        loc = Location.parse(location)
        self.check_location(loc)
        with self._lock:
            self._device_peak[loc] = self._device_bytes.get(loc, 0)

    def place(self, tensor: torch.Tensor, location: Location) -> torch.Tensor:
        """Return ``tensor``'s data at ``location``, synchronously (registration only): as is
        when already there, else copied into a new simulated allocation."""
        loc = Location.parse(location)
        self.check_location(loc)
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        here = self.location_of(tensor)
        if here == loc:
            return tensor
        out = self.allocate(tensor.shape, tensor.dtype, loc)
        out.copy_(tensor)
        return out

    def free(self, tensor: torch.Tensor, location: Location) -> None:
        """Poison the storage of memory this simulation handed out and forget it; tensors it
        did not allocate (a user's pageable tensor) are left alone. The runtime calls it only
        after every event that used the tensor completed; a later read sees the poison."""
        if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() == 0:
            return
        ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            owned = self._owned.pop(ptr, None)
        if owned is not None:
            poison_(tensor)

    # -------------------------------------------------------------- streams and events

    def current_stream(self, location: Location) -> SimStream | None:
        """The device's simulated ``compute`` stream; None for host locations."""
        loc = Location.parse(location)
        self.check_location(loc)
        return self._devices[loc.device_index].compute if loc.is_cuda else None

    def check_stream(self, stream: Any, location: Location) -> None:
        """A lease at a simulated ``cuda:N`` needs a :class:`SimStream` of that device; host
        locations take ``None`` (their users run on the CPU)."""
        loc = Location.parse(location)
        if not loc.is_cuda:  # None (CPU users) or a device stream reading host memory
            if stream is not None and not isinstance(stream, SimStream):
                raise TypeError(
                    f"a reader of {loc} runs on the CPU (None) or a stream, got {stream!r}"
                )
            return
        if not isinstance(stream, SimStream):
            raise TypeError(
                f"the simulated backend needs a SimStream for {loc}, got {stream!r} "
                f"(use backend.current_stream({str(loc)!r}) or backend.new_stream(...))"
            )
        if stream.device_index != loc.device_index:
            raise ValueError(f"{stream.name} belongs to cuda:{stream.device_index}, not to {loc}")

    def record_event(self, stream: Any) -> DeviceEvent:
        """An event on ``stream`` (completes when its worker reaches it); ``None`` (host
        users run on the CPU) gives a completed event. The host does not wait."""
        if stream is None:
            return SimEvent(done=True, label="host")
        if not isinstance(stream, SimStream):
            raise TypeError(f"the simulated backend records on SimStreams, got {stream!r}")
        return self._recorded(stream)

    def _recorded(self, stream: SimStream, nbytes: int | None = None) -> SimEvent:
        """An event recorded on ``stream`` now, noted by the waiter if there is one (its origin
        stream and record order, and for a copy of ``nbytes`` when it should complete, as the
        CUDA backend notes them: from the bytes queued on the stream at ``copy_gbps``, or 20
        GB/s, an estimate that is often wrong here, which the waiter must survive)."""
        event = stream.record_event()
        if self.waiter is not None:
            expected_at = None
            rate = (self.copy_gbps or 20.0) * 1e9
            if nbytes is not None:
                expected_at = self._queues.expect(stream.cuda_stream, nbytes, rate)
            origin = stream if stream.device_index is not None else None
            self.waiter.arm(event, origin, expected_at)
            if expected_at is not None:
                self._queues.recorded(stream.cuda_stream, event, rate, expected_at)
        return event

    def notify(self, waitable: DeviceEvent | Transfer, callback: CompletionCallback) -> None:
        """See :meth:`Backend.notify`; with a waiter, simulated device events are awaited
        through it (as the CUDA backend's events are), host events as ever."""
        if (
            self.waiter is not None
            and isinstance(waitable, SimEvent)
            and not waitable.query()
            and not self._closed
            and self._bridge is not None
        ):
            notes = getattr(waitable, "_aresidency", None)
            if notes is not None and notes.queued is not None and notes.origin is not None:
                self._queues.reestimate(notes.origin[1], waitable)
            self.waiter.watch(waitable, self._bridge, callback)
            return
        super().notify(waitable, callback)

    def stream_wait(self, stream: Any, event: DeviceEvent) -> None:
        """Later work on ``stream`` waits for ``event``; the host does not wait."""
        if not isinstance(stream, SimStream):
            raise TypeError(
                f"stream_wait needs a SimStream, got {stream!r} (host users await the event)"
            )
        stream.wait_event(event)

    def run_in_stream_order(self, stream: Any, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` on the simulated ``stream``: its worker thread runs it after the
        work queued before, as a device would run kernels. The caller does not wait."""
        if not isinstance(stream, SimStream):
            raise TypeError(f"run_in_stream_order needs a SimStream, got {stream!r}")
        stream.submit(fn)

    def _notify_device(self, event: DeviceEvent, callback: CompletionCallback) -> None:
        raise TypeError(f"the simulated backend completes SimEvents and host events, not {event!r}")

    # -------------------------------------------------------------- copies

    def copy(
        self,
        src: torch.Tensor,
        src_location: Location,
        dst_location: Location,
        *,
        wait_events: Sequence[DeviceEvent] = (),
    ) -> Transfer:
        """Allocate the (poisoned) destination and enqueue the simulated copy; the host does
        not wait.

        Stream: ``h2d`` of the destination device (host to device), ``d2h`` of the source
        device (device to host), ``peer`` of the destination device (device to device), a
        host-copy stream (host to host). It first waits for ``wait_events`` and for the
        source device's ``compute`` stream. Pageable copies run in ``chunk_bytes`` chunks.
        Raises ``torch.OutOfMemoryError`` for an injected allocation failure."""
        transfer, stream = self._enqueue_copy(src, src_location, dst_location, wait_events)
        if self._issues_late(transfer):
            self._issue_later(transfer, stream)
        else:
            transfer._finish_issue(self._recorded(stream, transfer.nbytes))
        return transfer

    def _issues_late(self, transfer: Transfer) -> bool:
        """With a waiter, a pageable copy is issued by its stream's worker once its chunks are
        enqueued, as the CUDA backend's staging lane issues one: its transfer's completion is
        then watched from that thread, not the loop."""
        return self.waiter is not None and transfer.route.endswith("staged")

    def _issue_later(self, transfer: Transfer, stream: SimStream) -> None:
        with self._lock:
            self._unissued.add(transfer)

        def issue() -> None:  # the stream's worker thread
            with self._lock:
                if transfer not in self._unissued:
                    return  # the backend closed first
                self._unissued.discard(transfer)
                self.issued_late += 1
            transfer._finish_issue(self._recorded(stream, transfer.nbytes))

        stream.submit(issue)

    def copy_many(self, requests: Sequence[CopyRequest]) -> list[Transfer | BaseException]:
        """See :meth:`Backend.copy_many`: each copy is enqueued as :meth:`copy` does, and the
        transfers enqueued one after the other on one simulated stream share the event
        recorded after the last of them."""
        out: list[Transfer | BaseException] = []
        group: list[Transfer] = []
        group_stream: SimStream | None = None

        def close_group() -> None:
            if group_stream is not None and group:
                event = self._recorded(group_stream, sum(t.nbytes for t in group))
                for transfer in group:
                    transfer._finish_issue(event)
                group.clear()

        for request in requests:
            try:
                transfer, stream = self._enqueue_copy(*request)
            except BaseException as error:  # that request fails alone, as copy would raise
                out.append(error)
                continue
            if self._issues_late(transfer):
                close_group()
                group_stream = None
                self._issue_later(transfer, stream)
                out.append(transfer)
                continue
            if stream is not group_stream:
                close_group()
                group_stream = stream
            group.append(transfer)
            out.append(transfer)
        close_group()
        return out

    def _enqueue_copy(
        self,
        src: torch.Tensor,
        src_location: Location,
        dst_location: Location,
        wait_events: Sequence[DeviceEvent],
    ) -> tuple[Transfer, SimStream]:
        """Allocate and enqueue one copy; the caller finishes its issue with an event."""
        src_loc = Location.parse(src_location)
        dst_loc = Location.parse(dst_location)
        self.check_location(src_loc)
        self.check_location(dst_loc)
        if self._closed:
            raise RuntimeError("the simulated backend is closed")
        if src.device.type != "cpu":
            raise ValueError(f"the simulation's tensors live in host memory, got {src.device}")
        dst = self.allocate(src.shape, src.dtype, dst_loc)
        fail = self.faults.next_transfer_fails()
        if dst_loc.is_cuda and src_loc.is_cuda:
            stream = self._devices[dst_loc.device_index].peer
        elif dst_loc.is_cuda:
            stream = self._devices[dst_loc.device_index].h2d
        elif src_loc.is_cuda:
            stream = self._devices[src_loc.device_index].d2h
        else:
            stream = self._host_stream
        nbytes = src.numel() * src.element_size()
        staged = "pageable-host" in (src_loc.kind, dst_loc.kind) and (
            src_loc.is_cuda or dst_loc.is_cuda
        )
        chunk = self.chunk_bytes if staged else max(nbytes, 1)
        offsets = list(range(0, nbytes, chunk))
        route = f"simulated {stream.kind}, {len(offsets)} chunk(s)" + (", staged" if staged else "")
        transfer = Transfer(self, dst, nbytes, src_loc, dst_loc, route, fail=fail)
        copy = _SimCopy(transfer)
        for event in wait_events:
            stream.wait_event(event)
        if src_loc.is_cuda:
            stream.wait_event(self._devices[src_loc.device_index].compute.record_event())
        stream.submit(functools.partial(self._prepare, copy, src))
        for off in offsets:
            length = min(chunk, nbytes - off)
            stream.submit(functools.partial(self._copy_chunk, copy, off, length))
        stream.submit(functools.partial(self._finish, copy))
        if fail:
            stream.submit(functools.partial(poison_, dst))
        return transfer, stream

    def copy_into(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        dst_location: Location,
        *,
        wait_events: Sequence[DeviceEvent] = (),
        event: Any = None,
    ) -> DeviceEvent:
        """See :meth:`Backend.copy_into`: the copy runs on the simulated device's ``h2d``
        stream after ``wait_events`` (throttled to ``copy_gbps``); ``event`` is ignored (a
        new simulated event each time)."""
        del event
        self.check_location(dst_location)
        if not dst_location.is_cuda:
            raise ValueError(f"copy_into copies to a device, got {dst_location}")
        if self._closed:
            raise RuntimeError("the simulated backend is closed")
        if self.faults.next_transfer_fails():
            raise RuntimeError("injected transfer failure")
        stream = self._devices[dst_location.device_index].h2d
        for waited in wait_events:
            stream.wait_event(waited)
        stream.submit(functools.partial(self._copy_whole, src, dst))
        return stream.record_event()

    def _copy_whole(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        start = time.perf_counter()
        dst.copy_(src)
        if self.copy_gbps is not None:
            nbytes = src.numel() * src.element_size()
            remaining = nbytes / (self.copy_gbps * 1e9) - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)

    def device_event(self, stream: Any, event: Any = None) -> DeviceEvent:
        """See :meth:`Backend.device_event` (the same as :meth:`record_event` here)."""
        del event
        return self.record_event(stream)

    @staticmethod
    def _prepare(copy: _SimCopy, src: torch.Tensor) -> None:
        # Runs on the stream, after the waits: only now may the source be read.
        try:
            copy.src_bytes = as_bytes(src.contiguous())
        except BaseException as exc:
            copy.error = exc

    def _copy_chunk(self, copy: _SimCopy, off: int, length: int) -> None:
        if copy.transfer.cancelled() or copy.error is not None:
            return
        src = copy.src_bytes
        assert src is not None
        start = time.perf_counter()
        try:
            as_bytes(copy.transfer.tensor)[off : off + length].copy_(src[off : off + length])
        except BaseException as exc:
            copy.error = exc
            return
        if self.copy_gbps is not None:
            remaining = length / (self.copy_gbps * 1e9) - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)

    @staticmethod
    def _finish(copy: _SimCopy) -> None:
        # Before the completion event: the outcome is known when the event completes.
        copy.src_bytes = None
        if copy.error is not None:
            copy.transfer._error = copy.error

    def __repr__(self) -> str:
        with self._lock:
            count = len(self._owned)
        state = "closed" if self._closed else "started" if self._started else "idle"
        return (
            f"<SimBackend SIMULATION of {self.num_devices} cuda device(s) in host memory "
            f"{state} copy_gbps={self.copy_gbps} chunk={format_bytes(self.chunk_bytes)} "
            f"allocations={count}>"
        )


def _check_waiter(waiter: object) -> None:
    """A waiter the simulation can use: one whose notifications a simulated driver posts
    (the real driver would be handed simulated events), or one that polls."""
    from .simdriver import SimNotifyDriver
    from .waiter import EventWaiter

    if not isinstance(waiter, EventWaiter):
        raise TypeError(f"waiter must be an EventWaiter, got {waiter!r}")
    if waiter.strategy == "blocking":
        raise ValueError(
            "the simulation's events cannot be synchronized on: use a waiter that polls or is "
            "notified (EventWaiter('hybrid', driver=SimNotifyDriver()))"
        )
    if waiter.strategy in ("hybrid", "hostfunc") and not isinstance(waiter.driver, SimNotifyDriver):
        raise ValueError(
            f"a {waiter.strategy!r} waiter on the simulation needs driver=SimNotifyDriver() "
            "(aresidency.backends.simdriver): the CUDA driver cannot notify simulated events"
        )
