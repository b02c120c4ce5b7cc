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
* fault injection (:class:`~aresidency.backends.base.FaultInjector`) behaves as in the CUDA
  backend.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import format_bytes
from ..core.locations import Location, LocationLike
from .base import Backend, DeviceEvent, FaultInjector, Transfer
from .staging import as_bytes
from .waiter import HostEvent, park_host_event, resolve_threadsafe

__all__ = [
    "POISON_BYTE",
    "SimBackend",
    "SimDeviceStreams",
    "SimEvent",
    "SimStream",
    "is_poisoned",
    "poison_",
]

POISON_BYTE = 0xA5


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Overwrite the whole storage under ``tensor`` (not just its view) with poison: NaN for
    floating and complex dtypes, the byte 0xA5 otherwise. Synchronous on the tensor's device's
    current stream (the simulation's tensors are on the CPU)."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return tensor
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    raw.fill_(POISON_BYTE)
    if tensor.is_floating_point() or tensor.is_complex():
        itemsize = tensor.element_size()
        count = nbytes // itemsize
        typed = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        typed.set_(storage, 0, (count,), (1,))
        try:
            typed.fill_(float("nan"))
        except RuntimeError:
            pass  # a float format without NaN keeps the byte pattern
    return tensor


def is_poisoned(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise: does ``tensor`` hold the poison pattern (NaN, or 0xA5 bytes)?"""
    if tensor.is_floating_point() or tensor.is_complex():
        return torch.isnan(tensor)
    raw = as_bytes(tensor.contiguous())
    per_elem = (raw == POISON_BYTE).view(-1, tensor.element_size()).all(dim=1)
    return per_elem.view(tensor.shape)


class SimEvent(HostEvent):
    """A SIMULATED CUDA event: complete once its stream's worker reached it."""

    __slots__ = ()


class _StreamClosed(Exception):
    pass


class SimStream:
    """A SIMULATED in-order CUDA stream: work runs in submission order on one worker thread.

    State: ``_queue`` (work not yet run), ``_closing``, ``errors`` (exceptions raised by
    submitted work, kept for tests). Invariant: an item runs only after every item submitted
    before it has finished; after ``close`` no further item starts.
    """

    def __init__(self, backend_label: str, device: int | None, kind: str) -> None:
        self.device_index = device
        self.kind = kind
        where = f"cuda:{device}" if device is not None else "host"
        self.name = f"{backend_label}-{where}/{kind}"
        self.errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._queue: list[Callable[[], object]] = []
        self._closing = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._seq = itertools.count(1)

    def submit(self, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` to run on the stream's worker thread after everything before it.
        The host does not wait."""
        with self._cond:
            if self._closing:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.append(fn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def sleep(self, seconds: float) -> None:
        """Enqueue ``seconds`` of simulated device work (the worker sleeps)."""
        self.submit(functools.partial(time.sleep, seconds))

    def record_event(self) -> SimEvent:
        """An event that completes when the worker reaches this point. Host does not wait."""
        event = SimEvent(label=f"{self.name}#{next(self._seq)}")
        self.submit(event.set)
        return event

    def wait_event(self, event: DeviceEvent) -> None:
        """Make later work on this stream wait for ``event``; the host does not wait."""
        if event.query():
            return
        self.submit(functools.partial(self._block_until, event))

    def _block_until(self, event: DeviceEvent) -> None:
        while True:
            if isinstance(event, HostEvent):
                if event.wait_blocking(0.05):
                    return
            elif event.query():
                return
            else:
                time.sleep(0.001)
            if self._closing:
                raise _StreamClosed

    def synchronize(self, timeout: float | None = None) -> None:
        """Block the calling thread until the stream's queued work ran (tests and ``place``;
        never call it on the event loop)."""
        if not self.record_event().wait_blocking(timeout):
            raise TimeoutError(f"{self.name} did not drain within {timeout} s")

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue) + (1 if self._running else 0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    self._queue.clear()
                    return
                fn = self._queue.pop(0)
                self._running = True
            try:
                fn()
            except _StreamClosed:
                return
            except BaseException as exc:  # a failed "kernel": keep it for the test to see
                self.errors.append(exc)
            finally:
                del fn  # an idle stream must not keep the last work item's tensors alive
                with self._cond:
                    self._running = False

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop the worker; queued work that has not started is dropped."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    def __repr__(self) -> str:
        return f"<SimStream {self.name} (simulated) queued={self.queued}>"


@dataclass(frozen=True)
class SimDeviceStreams:
    """The streams of one simulated device."""

    compute: SimStream
    h2d: SimStream
    d2h: SimStream
    peer: SimStream


class _SimTransfer(Transfer):
    """A SIMULATED copy: its chunks are enqueued on one stream when ``copy`` returns."""

    def __init__(
        self,
        backend: SimBackend,
        tensor: torch.Tensor,
        nbytes: int,
        src_location: Location,
        dst_location: Location,
        stream: SimStream,
        *,
        fail: bool,
        chunks: int,
    ) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.src_location = src_location
        self.dst_location = dst_location
        self.stream = stream
        self.chunks = chunks
        self._backend = backend
        self._fail = fail
        self._cancelled = False
        self._error: BaseException | None = None
        self._src_bytes: torch.Tensor | None = None
        self.event: SimEvent = SimEvent(done=True)  # replaced before copy() returns

    async def wait_issued(self) -> DeviceEvent:
        return self.event

    async def wait(self) -> None:
        """Park until the simulated stream reached the end of the copy; raise its error."""
        await self._backend.wait_event(self.event)
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise asyncio.CancelledError(f"{self!r} was cancelled")
        if self._fail:
            raise RuntimeError("injected transfer failure")

    def cancel(self) -> None:
        """Chunks not yet run are skipped; :meth:`wait` raises ``CancelledError``."""
        self._cancelled = True

    def __repr__(self) -> str:
        state = "done" if self.event.query() else "in flight"
        return (
            f"<SimTransfer (simulated) {self.src_location}->{self.dst_location} "
            f"{format_bytes(self.nbytes)} on {self.stream.name} chunks={self.chunks} {state}>"
        )


class SimBackend(Backend):
    """A SIMULATION of ``num_devices`` CUDA devices in host memory (see the module docstring).

    ``copy_gbps`` throttles every simulated copy to that many GB/s (None: as fast as a host
    memcpy). ``chunk_bytes`` is the chunk size of pageable copies (cancellation stops between
    chunks). ``staging_nbytes`` is what :meth:`staging_nbytes` reports: 0 by default, so that
    small test budgets are not consumed; pass a size to exercise the runtime's staging
    reservation.

    State: the streams of every device, ``_owned`` (storage data pointer -> the location of
    memory this backend handed out), ``_waits`` (futures of tasks parked in
    :meth:`wait_event`), ``_closed``.
    """

    name = "sim"
    simulated = True

    def __init__(
        self,
        num_devices: int = 2,
        copy_gbps: float | None = None,
        *,
        chunk_bytes: int = 1 << 20,
        staging_nbytes: int = 0,
        faults: FaultInjector | None = None,
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
        label = "sim"
        self._devices = [
            SimDeviceStreams(*(SimStream(label, i, k) for k in ("compute", "h2d", "d2h", "peer")))
            for i in range(num_devices)
        ]
        self._host_stream = SimStream(label, None, "host-copy")
        self._extra_streams: list[SimStream] = []
        self._lock = threading.Lock()
        self._owned: dict[int, Location] = {}
        self._waits: set[asyncio.Future[None]] = set()
        self._closed = False
        self._started = False

    # -------------------------------------------------------------- topology

    def check_location(self, location: Location) -> None:
        loc = Location.parse(location)
        if loc.is_cuda and loc.device_index >= self.num_devices:
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

    def start(self) -> None:
        """Nothing to create: stream workers start on their first work. On the loop."""
        if self._closed:
            raise RuntimeError("this SimBackend is closed; create a new one")
        self._started = True

    async def aclose(self) -> None:
        """Fail pending waits with ``RuntimeError``, stop every stream's worker (queued work
        that has not started is dropped). Joins the workers in a thread, not on the loop."""
        if self._closed:
            return
        self._closed = True
        error = RuntimeError("the simulated backend closed while a task was waiting for an event")
        for fut in list(self._waits):
            resolve_threadsafe(fut.get_loop(), fut, error)
        self._waits.clear()
        streams = self._all_streams()

        def close_all() -> None:
            for stream in streams:
                stream.close()

        await asyncio.get_running_loop().run_in_executor(None, close_all)

    def staging_nbytes(self) -> int:
        return self._staging_nbytes

    # -------------------------------------------------------------- memory

    def location_of(self, tensor: torch.Tensor) -> Location | None:
        """Where the simulation placed ``tensor``'s storage (None: not its memory)."""
        if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() == 0:
            return None
        with self._lock:
            return self._owned.get(tensor.untyped_storage().data_ptr())

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
        if tensor.untyped_storage().nbytes():
            with self._lock:
                self._owned[tensor.untyped_storage().data_ptr()] = loc
        return tensor

    def place(self, tensor: torch.Tensor, location: Location) -> torch.Tensor:
        """Return ``tensor``'s data at ``location``, synchronously (registration only): as is
        when already there, else copied into a new simulated allocation."""
        loc = Location.parse(location)
        self.check_location(loc)
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        here = self.location_of(tensor)
        if here is None:
            here = Location("pinned-host") if tensor.is_pinned() else Location("pageable-host")
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

    def record_event(self, stream: Any) -> DeviceEvent:
        """An event on ``stream`` (completes when its worker reaches it); ``None`` (host
        users run on the CPU) gives a completed event. The host does not wait."""
        if stream is None:
            return SimEvent(done=True, label="host")
        if not isinstance(stream, SimStream):
            raise TypeError(f"the simulated backend records on SimStreams, got {stream!r}")
        return stream.record_event()

    def stream_wait(self, stream: Any, event: DeviceEvent) -> None:
        """Later work on ``stream`` waits for ``event``; the host does not wait."""
        if not isinstance(stream, SimStream):
            raise TypeError(
                f"stream_wait needs a SimStream, got {stream!r} (host users await wait_event)"
            )
        stream.wait_event(event)

    async def wait_event(self, event: DeviceEvent) -> None:
        """Park until ``event`` completes; its worker wakes the loop with
        ``call_soon_threadsafe``. Raises ``RuntimeError`` if the backend closes first."""
        if event.query():
            return
        if self._closed:
            raise RuntimeError("the simulated backend is closed")
        if not isinstance(event, HostEvent):
            while True:  # a foreign event type: poll gently
                if event.query():
                    return
                await asyncio.sleep(0.001)
        await park_host_event(event, self._waits)

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
        transfer = _SimTransfer(
            self, dst, nbytes, src_loc, dst_loc, stream, fail=fail, chunks=len(offsets)
        )
        for event in wait_events:
            stream.wait_event(event)
        if src_loc.is_cuda:
            stream.wait_event(self._devices[src_loc.device_index].compute.record_event())
        stream.submit(functools.partial(self._prepare, transfer, src))
        for off in offsets:
            length = min(chunk, nbytes - off)
            stream.submit(functools.partial(self._copy_chunk, transfer, off, length))
        if fail:
            stream.submit(functools.partial(poison_, dst))
        transfer.event = stream.record_event()
        return transfer

    def _prepare(self, transfer: _SimTransfer, src: torch.Tensor) -> None:
        # Runs on the stream, after the waits: only now may the source be read.
        try:
            transfer._src_bytes = as_bytes(src.contiguous())
        except BaseException as exc:
            transfer._error = exc

    def _copy_chunk(self, transfer: _SimTransfer, off: int, length: int) -> None:
        if transfer._cancelled or transfer._error is not None:
            return
        src = transfer._src_bytes
        assert src is not None
        start = time.perf_counter()
        try:
            as_bytes(transfer.tensor)[off : off + length].copy_(src[off : off + length])
        except BaseException as exc:
            transfer._error = exc
            return
        if self.copy_gbps is not None:
            remaining = length / (self.copy_gbps * 1e9) - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)

    def __repr__(self) -> str:
        with self._lock:
            count = len(self._owned)
        state = "closed" if self._closed else "started" if self._started else "idle"
        return (
            f"<SimBackend SIMULATION of {self.num_devices} cuda device(s) in host memory "
            f"{state} copy_gbps={self.copy_gbps} chunk={format_bytes(self.chunk_bytes)} "
            f"allocations={count}>"
        )
