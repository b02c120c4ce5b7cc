"""The CUDA backend: torch streams and events, dedicated copy streams, staged pageable copies.

Per device, three dedicated copy streams (non-blocking, created through the driver so that
no other torch code shares them; torch pool streams when the driver API is unavailable):

* ``h2d``: host-to-device copies (one copy engine),
* ``d2h``: device-to-host copies (the other copy engine, so both directions overlap),
* ``peer``: device-to-device copies; a copy ``cuda:i -> cuda:j`` runs on ``peer[i]`` with
  ``peer[j]`` as the destination device's current stream (torch's cross-device ``copy_``
  synchronizes both), and completes on ``peer[j]``.

Routes taken by :meth:`CudaBackend.copy`:

================================  ==========================================================
pinned-host -> cuda:N             ``copy_(non_blocking=True)`` on ``h2d[N]``, issued inline
pageable-host -> cuda:N           staged: chunks through the pinned staging pool (lane
                                  thread); inline ``copy_`` below ``inline_pageable_bytes``
cuda:N -> pinned-host             exact-size pinned destination, ``copy_`` on ``d2h[N]``;
                                  pinning a large destination (and then issuing) happens in
                                  a worker thread
cuda:N -> pageable-host           staged through the pool (lane thread)
cuda:i -> cuda:j                  ``peer`` streams as above, issued inline
host -> host                      a worker thread (memcpy, pinning when needed)
================================  ==========================================================

Every destination is allocated by ``copy`` itself: on the device under the copy stream
(``torch.cuda.stream``), so the caching allocator associates the block with that stream; the
runtime frees a tensor only after every event that used it completed, so no
``record_stream`` is needed. Host destinations are contiguous; pinned ones are exactly sized
(:class:`~aresidency.backends.staging.PinnedAllocator`).

Why this module is long: one route per copy direction (peer, host-to-device direct or staged,
device-to-host pinned or staged, host-to-host), each with its allocation, issue, fault injection
and failure path; they share the issuing helpers and read best next to each other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ..core.errors import format_bytes
from ..core.locations import Location, LocationLike
from .arena import PinnedArena
from .base import (
    Backend,
    CompletionCallback,
    CopyRequest,
    DeviceEvent,
    FaultInjector,
    Transfer,
)
from .bridge import LoopBridge
from .cudadriver import cuda_driver
from .events import HostEvent, OnceCallbacks
from .memory import as_bytes, host_fill, poison_
from .pageable import PageableCache, default_host_keep_bytes
from .pinned import (
    PinnedAllocator,
    cuda_event,
    flush_unpins,
    register_pinned,
    unpin_later,
    unregister_pinned,
)
from .polling import spin_wait
from .prediction import CopyQueues
from .staging import (
    StagingLane,
    StagingPool,
    copy_d2h_staged,
    copy_h2d_staged,
    pageable_empty,
)
from .waiter import EventWaiter

__all__ = ["CopyStreams", "CudaBackend"]

# Estimates for the waiter (when a copy should be done), not promises: the host link of an H200
# moves about 55 GB/s each way and NVLink about 380 GB/s between two of them; a launch adds
# about 10 us.
_LINK_BYTES_PER_S = 50e9
_PEER_BYTES_PER_S = 350e9
_DEVICE_BYTES_PER_S = 1500e9
_COPY_LATENCY_S = 10e-6


@dataclass(frozen=True)
class CopyStreams:
    """The dedicated copy streams of one device."""

    h2d: torch.cuda.Stream
    d2h: torch.cuda.Stream
    peer: torch.cuda.Stream


# Copy streams are process-wide (one set per device), shared by every CudaBackend: they are
# never destroyed, because the caching allocator keeps blocks associated with them.
_STREAMS: dict[int, CopyStreams] = {}
_STREAMS_LOCK = threading.Lock()


def _done(event: Any) -> bool:
    """``event.query()``: whether the device passed it (torch's method is untyped)."""
    return bool(event.query())


def copy_streams(device: int) -> CopyStreams:
    """The dedicated copy streams of ``cuda:device`` (created on first use)."""
    streams = _STREAMS.get(device)  # never removed: the lock is for the first use only
    if streams is not None:
        return streams
    with _STREAMS_LOCK:
        streams = _STREAMS.get(device)
        if streams is None:
            streams = _STREAMS[device] = CopyStreams(*(_new_stream(device) for _ in range(3)))
        return streams


def _new_stream(device: int) -> torch.cuda.Stream:
    try:
        driver = cuda_driver()
        handle = driver.create_stream(device)
        external: Any = torch.cuda.ExternalStream  # untyped in torch
        stream: torch.cuda.Stream = external(handle, device=torch.device("cuda", device))
    except RuntimeError:
        # No driver API: a torch pool stream (may be shared with other torch code).
        pool: Any = torch.cuda.Stream
        stream = pool(device=device)
    return stream


# The bindings under torch.cuda.current_device / current_stream / set_stream / set_device:
# the public functions add a lazy-init check, a device-index lookup and a Stream object per
# call, which are most of a small copy's stream switch. Every torch this package supports
# (2.4 on) has them; where one is missing, on_stream uses the public functions.
_C: Any = torch._C
_GET_DEVICE = getattr(_C, "_cuda_getDevice", None)
_SET_DEVICE = getattr(_C, "_cuda_setDevice", None)
_GET_STREAM = getattr(_C, "_cuda_getCurrentStream", None)
_SET_STREAM = getattr(_C, "_cuda_setStream", None)
_RAW_STREAMS = None not in (_GET_DEVICE, _SET_DEVICE, _GET_STREAM, _SET_STREAM)


class on_stream:  # a context manager, named like torch's
    """``with torch.cuda.device(stream.device), torch.cuda.stream(stream)``, at a fraction of
    the host cost: the calling thread's current device is ``stream``'s and its current stream
    there is ``stream`` until the block ends, then both are restored.

    torch's context managers look the current device up through ``torch.cuda.is_available()``
    at every construction and entry (two to four calls a block); on a host whose other threads
    hold the GIL that made them the largest single host cost of a small copy. This one calls
    the bindings those functions wrap, with device indices and the streams' ids, and builds
    no ``Stream`` for the stream it restores. It is used where CUDA is initialized already
    (the backend made its copy streams)."""

    __slots__ = ("_prev_device", "_prev_stream", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream

    def __enter__(self) -> None:
        stream = self._stream
        if _RAW_STREAMS:
            assert _GET_DEVICE is not None and _GET_STREAM is not None and _SET_STREAM is not None
            self._prev_device = _GET_DEVICE()
            # (stream_id, device_index, device_type), as torch.cuda.current_stream unpacks it
            self._prev_stream = _GET_STREAM(stream.device_index)
            _SET_STREAM(  # makes the stream's device the current one too
                stream_id=stream.stream_id,
                device_index=stream.device_index,
                device_type=stream.device_type,
            )
            return
        self._prev_device = torch.cuda.current_device()
        self._prev_stream = torch.cuda.current_stream(stream.device_index)
        torch.cuda.set_stream(stream)

    def __exit__(self, *exc: object) -> None:
        previous = self._prev_stream
        if _RAW_STREAMS:
            assert _SET_STREAM is not None and _SET_DEVICE is not None
            stream_id, device_index, device_type = previous
            _SET_STREAM(stream_id=stream_id, device_index=device_index, device_type=device_type)
            if self._prev_device != self._stream.device_index:
                _SET_DEVICE(self._prev_device)
            return
        torch.cuda.set_stream(previous)
        if self._prev_device != self._stream.device_index:
            torch.cuda.set_device(self._prev_device)


_DRIVER: list[Any] = []  # [CudaDriver or None] once looked up


def _driver_or_none() -> Any:
    """The CUDA driver's ctypes bindings, or ``None`` where they cannot be loaded."""
    if not _DRIVER:
        try:
            _DRIVER.append(cuda_driver())
        except (OSError, RuntimeError, AttributeError):
            _DRIVER.append(None)
    return _DRIVER[0]


def _host_wait(event: DeviceEvent) -> None:
    """Block the calling worker thread (never the loop) until ``event`` completes."""
    if isinstance(event, HostEvent):
        event.wait_blocking()
    elif isinstance(event, torch.cuda.Event):
        spin_wait(event)
    else:
        while not event.query():
            threading.Event().wait(0.0005)


class CudaBackend(Backend):
    """Device backend on torch CUDA streams and events (see the module docstring).

    Arguments: ``waiter`` picks the event-waiting strategy (``"auto"``, ``"hybrid"``,
    ``"hostfunc"``, ``"poll"``, ``"blocking"``, or an :class:`EventWaiter`; see
    :mod:`~aresidency.backends.waiter`);
    ``staging_chunk_bytes`` and ``staging_buffers`` size each lane of the staging pool;
    ``pinned_cache_bytes`` keeps up to that many bytes of released pinned memory registered
    for exact-size reuse (0: unpin at ``free``); both are reported by :meth:`staging_nbytes`.
    ``inline_pageable_bytes``: pageable-to-device copies up to this size skip the pool (the
    driver stages them while ``copy`` returns). ``inline_register_bytes``: pinned
    destinations up to this size are page-locked inside ``copy``; larger ones in a worker.
    ``staging_memcpy_threads``: host threads that copy each device-to-host chunk out of its
    pinned buffer; ``staging_streaming_stores``: whether they copy with non-temporal stores
    where they can (:mod:`~aresidency.backends.streamcopy`). ``pageable_mmap_bytes``:
    pageable destinations from this size up are private mappings asked for huge pages
    (``None``: ``torch.empty``).
    ``pinned_arena_bytes``: the most host memory the pinned arena may keep registered (``0``:
    no arena, every fresh pinned destination is registered for itself; ``None``: an eighth of
    the machine's memory, within 4-16 GiB); the runtime lowers it to the pinned-host budget's
    headroom (:meth:`limit_pinned_overhead`). ``arena_slab_bytes``: the size of its shared
    slabs. ``pageable_cache_bytes``: the most memory of freed pageable destinations (mappings,
    from ``pageable_mmap_bytes`` up) kept, faulted in, for destinations of the same size
    (``0``: none; ``None``: an eighth of the machine's memory, at most 16 GiB); the runtime
    lowers it to the pageable-host budget's headroom (:meth:`limit_pageable_overhead`).

    State: the waiter thread, the staging pool (two lane threads and the memcpy threads), a
    worker pool for host copies and deferred issues, the pinned allocator and arena, the
    pageable cache,
    ``_queues`` (per copy stream, when its queued copies should be done: the waiter polls
    short ones on the loop), ``_host_waits`` (completions of host events), ``_closed``.
    """

    name = "cuda"
    simulated = False

    def __init__(
        self,
        *,
        waiter: str | EventWaiter = "auto",
        staging_chunk_bytes: int = 32 << 20,
        staging_buffers: int = 3,
        pinned_cache_bytes: int = 0,
        inline_pageable_bytes: int = 256 << 10,
        inline_register_bytes: int = 1 << 20,
        host_workers: int = 4,
        staging_memcpy_threads: int | None = None,
        staging_streaming_stores: bool = True,
        pageable_mmap_bytes: int | None = 2 << 20,
        pinned_arena_bytes: int | None = None,
        arena_slab_bytes: int = 64 << 20,
        pageable_cache_bytes: int | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaBackend needs a CUDA device; use SimBackend without one")
        self.faults = faults if faults is not None else FaultInjector()
        self.waiter = waiter if isinstance(waiter, EventWaiter) else EventWaiter(waiter)
        self.pinned = PinnedAllocator(cache_bytes=pinned_cache_bytes, unpin_later=True)
        if staging_memcpy_threads is None:
            staging_memcpy_threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.pool = StagingPool(
            self.pinned,
            chunk_bytes=staging_chunk_bytes,
            buffers=staging_buffers,
            memcpy_threads=staging_memcpy_threads,
            streaming_stores=staging_streaming_stores,
        )
        if pinned_arena_bytes is None:
            pinned_arena_bytes = default_host_keep_bytes(at_least=4 << 30)
        if pageable_cache_bytes is None:
            pageable_cache_bytes = default_host_keep_bytes()
        if pinned_arena_bytes < 0:
            raise ValueError(f"pinned_arena_bytes must be >= 0, got {pinned_arena_bytes}")
        if pageable_cache_bytes < 0:
            raise ValueError(f"pageable_cache_bytes must be >= 0, got {pageable_cache_bytes}")
        self.pageable_cache_bytes = pageable_cache_bytes
        self.pageable_cache = PageableCache(pageable_cache_bytes)
        self.pinned_arena_bytes = pinned_arena_bytes
        self.arena: PinnedArena | None = None
        if pinned_arena_bytes and self.pinned.exact:
            self.arena = PinnedArena(
                register_pinned,
                unregister_pinned,
                slab_bytes=arena_slab_bytes,
                limit_bytes=pinned_arena_bytes,
                prefault=_prefault,
                unregister_later=unpin_later,
            )
        self.pageable_mmap_bytes = pageable_mmap_bytes
        self.inline_pageable_bytes = inline_pageable_bytes
        self.inline_register_bytes = inline_register_bytes
        self._queues = CopyQueues(_COPY_LATENCY_S)  # when each copy stream's copies end
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=host_workers, thread_name_prefix="aresidency-host"
        )
        self._num_devices = torch.cuda.device_count()
        self._host_waits = OnceCallbacks()
        self._closed = False
        self._started = False

    # -------------------------------------------------------------- topology

    def check_location(self, location: Location) -> None:
        loc = Location.parse(location)
        if loc.is_cuda and loc.device_index >= self._num_devices:
            raise ValueError(f"{loc} does not exist: torch sees {self._num_devices} CUDA device(s)")

    def device_count(self) -> int:
        return self._num_devices

    def streams(self, location: LocationLike) -> CopyStreams:
        """The dedicated copy streams of a ``cuda:N`` location."""
        loc = Location.parse(location)
        self.check_location(loc)
        return copy_streams(loc.device_index)

    # -------------------------------------------------------------- lifecycle

    def start(self, bridge: LoopBridge | None = None) -> None:
        """Start the event waiter's thread (on the loop)."""
        super().start(bridge)
        self.waiter.start()
        self._started = True

    async def aclose(self) -> None:
        """Fail pending completions with ``BackendClosedError``; stop the waiter, the staging
        lanes (after their queued jobs) and the worker pool, in a worker thread, not on the
        loop."""
        if self._closed:
            return
        self._closed = True
        self._close_waits()

        def close_all() -> None:
            self.waiter.close()
            self.pool.close()
            self._executor.shutdown(wait=True)
            self.pinned.trim()
            if self.arena is not None:
                self.arena.close()
            self.pageable_cache.close()
            flush_unpins()  # closed means unlocked

        await anyio.to_thread.run_sync(close_all)

    def staging_nbytes(self) -> int:
        """Pinned bytes of the staging pool plus the pinned reuse cache (constant)."""
        return self.pool.nbytes + self.pinned.cache_bytes

    def pinned_overhead_bytes(self) -> int:
        """Bytes the pinned arena keeps registered that no value holds (free space and
        alignment padding of its slabs)."""
        return self.arena.free_bytes() if self.arena is not None else 0

    def limit_pinned_overhead(self, headroom: int | None) -> None:
        """Let the arena keep at most ``headroom`` registered bytes beyond its live blocks
        (``None``: only ``pinned_arena_bytes`` bounds it). Slabs left entirely free past the
        new limit are unregistered, and a slab the last requests want is added ahead of need
        if the new limit allows it, in a worker thread. Cheap; on the loop."""
        arena = self.arena
        if arena is None:
            return
        limit = self.pinned_arena_bytes
        if headroom is not None:
            limit = min(limit, arena.value_bytes + max(headroom, 0))
        if limit == arena.limit_bytes or self._closed:
            return
        shrinking = arena.limit_bytes is None or limit < arena.limit_bytes
        arena.limit_bytes = limit
        if shrinking and arena.total_bytes > limit:
            self._executor.submit(arena.trim, keep_within_limit=True)
        elif arena.needs_growth():
            self._executor.submit(arena.grow_ahead)

    def pageable_overhead_bytes(self) -> int:
        """Bytes of freed pageable destinations kept for reuse (:class:`PageableCache`)."""
        return self.pageable_cache.cached_bytes

    def limit_pageable_overhead(self, headroom: int | None) -> None:
        """Let the pageable cache keep at most ``headroom`` bytes (``None``: only
        ``pageable_cache_bytes`` bounds it); what no longer fits is unmapped in a worker
        thread. Cheap; on the loop."""
        cache = self.pageable_cache
        limit = self.pageable_cache_bytes
        if headroom is not None:
            limit = min(limit, max(headroom, 0))
        if limit == cache.limit_bytes or self._closed:
            return
        cache.limit_bytes = limit  # mappings returned from now on are kept within it
        if cache.cached_bytes > limit:
            self._executor.submit(cache.enforce_limit)

    def _carve_pinned(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """A pinned tensor carved from the arena (no registration), or None; grows the arena
        ahead of need in a worker thread."""
        arena = self.arena
        if arena is None:
            return None
        tensor = arena.try_carve(shape, dtype)
        if arena.needs_growth() and not self._closed:
            self._executor.submit(arena.grow_ahead)
        return tensor

    def _pinned_destination(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype, nbytes: int
    ) -> tuple[torch.Tensor | None, Callable[[], None] | None]:
        """A copy's pinned destination from the arena: carved from a registered slab (no
        function), or, for a request too large to register on the loop that found no hole,
        over a new slab with the function that registers it (off the loop; the slab then
        stays in the arena for later requests, where a destination registered on its own
        would be unregistered at its free). ``(None, None)``: no arena, or no room in it."""
        arena = self.arena
        if arena is None or self._closed:
            return None, None
        large = nbytes > self.inline_register_bytes
        tensor = arena.try_carve(shape, dtype, note_miss=not large)
        register = None
        if tensor is None and large:
            made = arena.carve_new(shape, dtype)
            if made is not None:
                tensor, register = made
        if arena.needs_growth():
            self._executor.submit(arena.grow_ahead)
        return tensor, register

    # -------------------------------------------------------------- memory

    def allocate(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype, location: LocationLike
    ) -> torch.Tensor:
        """An uninitialized contiguous tensor at ``location``: on the device's current stream,
        or exactly-sized pinned memory (pinned now: blocks the calling thread), or pageable.
        Raises ``torch.OutOfMemoryError`` (also for an injected failure)."""
        loc = Location.parse(location)
        self.check_location(loc)
        self._maybe_injected_oom(math.prod(shape), dtype, loc)
        if loc.is_cuda:
            return torch.empty(tuple(shape), dtype=dtype, device=_device(loc))
        if loc.is_pinned:
            carved = self._carve_pinned(shape, dtype)
            return carved if carved is not None else self.pinned.empty(shape, dtype)
        return torch.empty(tuple(shape), dtype=dtype)

    def _maybe_injected_oom(self, numel: int, dtype: torch.dtype, loc: Location) -> None:
        if self.faults.next_allocation_fails():
            raise torch.OutOfMemoryError(f"injected allocation failure: {numel} x {dtype} at {loc}")

    def place(self, tensor: torch.Tensor, location: Location) -> torch.Tensor:
        """``tensor``'s data at ``location``, synchronously (registration; blocks the host):
        as is when already there, else copied (device copies on the device's current stream,
        then that stream is synchronized)."""
        loc = Location.parse(location)
        self.check_location(loc)
        here = _location_of(tensor)
        if here == loc:
            return tensor
        out = self.allocate(tensor.shape, tensor.dtype, loc)
        out.copy_(tensor)
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        if loc.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()
        return out

    def free(self, tensor: torch.Tensor, location: Location) -> None:
        """Drop ``tensor``; page-locked memory this backend pinned is unregistered (in a worker
        thread from ``inline_register_bytes`` up), or kept for exact-size reuse when
        ``pinned_cache_bytes`` allows. Device memory returns to the caching allocator when its
        last reference dies. The host does not wait."""
        loc = Location.parse(location)
        if not loc.is_pinned:
            return
        if self.arena is not None and self.arena.owns(tensor):
            return  # the block returns to its slab when its last tensor dies
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes >= self.inline_register_bytes and not self._closed:
            # Unlocking a large range takes milliseconds: do it off the loop.
            self._executor.submit(self.pinned.release, tensor)
        else:
            self.pinned.release(tensor)

    # -------------------------------------------------------------- streams and events

    def current_stream(self, location: Location) -> torch.cuda.Stream | None:
        """``torch.cuda.current_stream`` of the device; None for host locations."""
        loc = Location.parse(location)
        self.check_location(loc)
        return torch.cuda.current_stream(loc.device_index) if loc.is_cuda else None

    def record_event(self, stream: Any) -> DeviceEvent:
        """Record a ``torch.cuda.Event`` on ``stream`` (``cudaEventRecord``) and arm its
        notification; ``None`` (host users) gives a completed event. The host does not wait."""
        if stream is None:
            return HostEvent(done=True, label="host")
        return self._record(stream)

    def _record(
        self,
        stream: torch.cuda.Stream,
        expected_at: float | None = None,
        bytes_per_s: float | None = None,
    ) -> torch.cuda.Event:
        """An event recorded on ``stream`` now and armed; ``expected_at``: from :meth:`_expect`
        for the copies before it, at ``bytes_per_s`` (the host link's by default)."""
        event = cuda_event(blocking=self.waiter.blocking_events)
        event.record(stream)
        self.waiter.arm(event, stream, expected_at)
        if expected_at is not None:
            rate = _LINK_BYTES_PER_S if bytes_per_s is None else bytes_per_s
            self._queues.recorded(int(stream.cuda_stream), event, rate, expected_at)
        return event

    def _expect(self, stream: torch.cuda.Stream, nbytes: int, bytes_per_s: float) -> float:
        """When a copy of ``nbytes`` enqueued on ``stream`` now should be done: after the
        copies queued before it, at ``bytes_per_s``, plus the launch latency if the stream was
        idle (an estimate for the waiter, never a promise; made again when the wait begins:
        :class:`~aresidency.backends.prediction.CopyQueues`)."""
        return self._queues.expect(int(stream.cuda_stream), nbytes, bytes_per_s)

    def stream_wait(self, stream: Any, event: DeviceEvent) -> None:
        """``cudaStreamWaitEvent``: later work on ``stream`` waits for ``event`` on the
        device; the host does not wait. A host event must already be complete (host-side
        completions are awaited, not waited on by a device stream)."""
        if stream is None:
            raise ValueError("stream_wait needs a CUDA stream (host users await wait_event)")
        if isinstance(event, torch.cuda.Event):
            stream.wait_event(event)
        elif not event.query():
            raise ValueError(
                f"a device stream cannot wait for the incomplete host event {event!r}; "
                "await backend.wait_event(event) first"
            )

    def check_stream(self, stream: Any, location: Location) -> None:
        """A lease at ``cuda:N`` needs a ``torch.cuda.Stream`` of device N; host locations take
        ``None`` (their users run on the CPU)."""
        loc = Location.parse(location)
        if not loc.is_cuda:  # None (CPU users) or a device stream reading host memory
            if stream is not None and not isinstance(stream, torch.cuda.Stream):
                raise TypeError(
                    f"a reader of {loc} runs on the CPU (None) or a stream, got {stream!r}"
                )
            return
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"a lease at {loc} needs a torch.cuda.Stream, got {stream!r}")
        if stream.device_index != loc.device_index:
            raise ValueError(f"{stream!r} belongs to cuda:{stream.device_index}, not to {loc}")

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """``torch.cuda.stream(stream)``: kernels the calling thread enqueues go to it."""
        if stream is None:
            return contextlib.nullcontext()
        return on_stream(stream)

    def _notify_device(self, event: DeviceEvent, callback: CompletionCallback) -> None:
        """CUDA events go to the waiter thread (see :mod:`~aresidency.backends.waiter`)."""
        if not isinstance(event, torch.cuda.Event):
            raise TypeError(
                f"the CUDA backend awaits torch.cuda.Event and host events, not {event!r}"
            )
        assert self._bridge is not None
        notes = getattr(event, "_aresidency", None)
        if notes is not None and notes.queued is not None and notes.origin is not None:
            self._queues.reestimate(notes.origin[1], event)
        self.waiter.watch(event, self._bridge, callback)

    # -------------------------------------------------------------- copies

    def copy(
        self,
        src: torch.Tensor,
        src_location: Location,
        dst_location: Location,
        *,
        wait_events: Sequence[DeviceEvent] = (),
    ) -> Transfer:
        """Allocate the destination and start the copy; the host waits for nothing (see the
        module docstring for the stream and thread each route uses).

        The copy waits, on the device, for ``wait_events`` and for the current stream of the
        source device (an event recorded on it now); events that are host-side completions
        (or a host source) are waited for by the worker or lane thread that issues the copy.
        Raises ``torch.OutOfMemoryError`` when the destination cannot be allocated."""
        checked = self._check_copy(src, src_location, dst_location, wait_events)
        return self._copy_checked(src, *checked)

    def _copy_checked(
        self,
        src: torch.Tensor,
        src_loc: Location,
        dst_loc: Location,
        nbytes: int,
        device_waits: list[torch.cuda.Event],
        host_waits: list[DeviceEvent],
    ) -> Transfer:
        """:meth:`copy` after :meth:`_check_copy`: the route for the two locations."""
        if dst_loc.is_cuda and src_loc.is_cuda:
            return self._copy_peer(src, src_loc, dst_loc, nbytes, device_waits, host_waits)
        if dst_loc.is_cuda:
            return self._copy_h2d(src, src_loc, dst_loc, nbytes, device_waits, host_waits)
        if src_loc.is_cuda:
            return self._copy_d2h(src, src_loc, dst_loc, nbytes, device_waits, host_waits)
        return self._copy_host(src, src_loc, dst_loc, nbytes, [*device_waits, *host_waits])

    def _check_copy(
        self,
        src: torch.Tensor,
        src_location: Location,
        dst_location: Location,
        wait_events: Sequence[DeviceEvent],
    ) -> tuple[Location, Location, int, list[torch.cuda.Event], list[DeviceEvent]]:
        """What every copy checks and needs first: its locations, its size, and the events it
        waits for on the device and on the host (raises as :meth:`copy` does)."""
        src_loc = Location.parse(src_location)
        dst_loc = Location.parse(dst_location)
        self.check_location(src_loc)
        self.check_location(dst_loc)
        if self._closed:
            raise RuntimeError("the CUDA backend is closed")
        if _location_kind_of(src) != ("cuda" if src_loc.is_cuda else "host") or (
            src_loc.is_cuda and src.device.index != src_loc.device_index
        ):
            raise ValueError(f"the source tensor is on {src.device}, not at {src_loc}")
        nbytes = src.numel() * src.element_size()
        self._maybe_injected_oom(src.numel(), src.dtype, dst_loc)

        # An event already complete orders nothing: skip its device-side wait.
        device_waits = [e for e in wait_events if isinstance(e, torch.cuda.Event) and not _done(e)]
        host_waits = [e for e in wait_events if not isinstance(e, torch.cuda.Event)]
        if src_loc.is_cuda:
            # Work already queued on the source device's current stream comes first.
            marker = cuda_event()
            marker.record(torch.cuda.current_stream(src_loc.device_index))
            device_waits.append(marker)
        return src_loc, dst_loc, nbytes, device_waits, host_waits

    def copy_many(self, requests: Sequence[CopyRequest]) -> list[Transfer | BaseException]:
        """See :meth:`Backend.copy_many`. Copies from pinned memory to a device, one after
        the other in ``requests``, are issued together in the calling thread: each one as
        soon as it is checked (the link starts on the first while the host checks the next),
        on the device's host-to-device copy stream, and one event after the last, which their
        transfers share. Every other copy goes through :meth:`copy`."""
        out: list[Transfer | BaseException] = []
        group: _DirectGroup | None = None
        try:
            for request in requests:
                src = request.src
                try:
                    src_loc, dst_loc, nbytes, device_waits, host_waits = self._check_copy(
                        src, request.src_location, request.dst_location, request.wait_events
                    )
                except BaseException as error:  # that request fails alone, as copy would raise
                    out.append(error)
                    continue
                direct = (
                    dst_loc.is_cuda
                    and not src_loc.is_cuda
                    and all(e.query() for e in host_waits)
                    # (the runtime's pinned-host tensors are page-locked: is_pinned() costs a
                    # driver query, asked only of a tensor said to be pageable)
                    and (src_loc.is_pinned or src.is_pinned())
                )
                if group is not None and not (direct and group.dst_loc == dst_loc):
                    group.close()
                    group = None
                if direct:
                    if group is None:
                        group = _DirectGroup(self, dst_loc)
                    out.append(group.issue(src, src_loc, nbytes, device_waits))
                    continue
                try:
                    out.append(
                        self._copy_checked(src, src_loc, dst_loc, nbytes, device_waits, host_waits)
                    )
                except BaseException as error:
                    out.append(error)
        finally:
            if group is not None:
                group.close()
        return out

    def copy_into(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        dst_location: Location,
        *,
        wait_events: Sequence[DeviceEvent] = (),
        event: Any = None,
    ) -> DeviceEvent:
        """See :meth:`Backend.copy_into`: ``dst.copy_(src, non_blocking=True)`` on the
        device's host-to-device copy stream, in the calling thread. A pageable ``src`` goes
        through the driver's own staging: the call returns once the driver took its bytes,
        after the stream's earlier work (the driver synchronizes the stream first)."""
        if not dst_location.is_cuda or src.device.type != "cpu":
            raise ValueError(
                f"copy_into copies host memory to a device, got a {src.device.type} source "
                f"and {dst_location}"
            )
        if self.faults.next_transfer_fails():
            raise RuntimeError("injected transfer failure")
        j = dst_location.device_index
        stream = copy_streams(j).h2d
        for waited in wait_events:
            if isinstance(waited, torch.cuda.Event):
                stream.wait_event(waited)
            elif not waited.query():
                raise ValueError(f"copy_into cannot wait on the device for {waited!r}")
        nbytes = src.numel() * src.element_size()
        if nbytes != dst.numel() * dst.element_size():
            raise ValueError(f"copy_into needs equal sizes, got {nbytes} B into a smaller dst")
        driver = _driver_or_none()
        if driver is not None and src.is_contiguous() and dst.is_contiguous():
            # One driver call (a few microseconds) instead of switching the thread's current
            # stream and dispatching copy_ (tens): this runs once per streamed block.
            driver.memcpy_htod_async(
                j, dst.data_ptr(), src.data_ptr(), nbytes, int(stream.cuda_stream)
            )
        else:
            with on_stream(stream):
                dst.copy_(src, non_blocking=True)
        if event is None:
            event = cuda_event()
        event.record(stream)
        done: DeviceEvent = event
        return done

    def device_event(self, stream: Any, event: Any = None) -> DeviceEvent:
        """See :meth:`Backend.device_event`: a ``torch.cuda.Event`` not given to the waiter."""
        if stream is None:
            return HostEvent(done=True, label="host")
        if event is None:
            event = cuda_event()
        event.record(stream)
        notes = getattr(event, "_aresidency", None)
        if notes is not None:  # recorded again: a notification armed before is for the old one
            notes.armed = False
        recorded: DeviceEvent = event
        return recorded

    # -- helpers shared by the routes

    def _defer(self, transfer: Transfer, fn: Callable[[], DeviceEvent]) -> None:
        """Run ``fn`` (which issues the work and returns its event) in a worker thread."""

        def run() -> None:
            try:
                event = fn()
            except BaseException as exc:
                transfer._finish_issue(HostEvent(done=True, label="failed"), exc)
            else:
                transfer._finish_issue(event)

        self._executor.submit(run)

    def _issue_inline_or_deferred(
        self,
        transfer: Transfer,
        host_waits: list[DeviceEvent],
        issue: Callable[[], DeviceEvent],
        *,
        defer: bool = False,
    ) -> None:
        if defer or any(not e.query() for e in host_waits):

            def deferred() -> DeviceEvent:
                for event in host_waits:
                    _host_wait(event)
                return issue()

            self._defer(transfer, deferred)
            return
        try:
            event = issue()
        except BaseException as exc:
            transfer._finish_issue(HostEvent(done=True, label="failed"), exc)
        else:
            transfer._finish_issue(event)

    # -- routes

    def _copy_peer(
        self,
        src: torch.Tensor,
        src_loc: Location,
        dst_loc: Location,
        nbytes: int,
        device_waits: list[torch.cuda.Event],
        host_waits: list[DeviceEvent],
    ) -> Transfer:
        i, j = src_loc.device_index, dst_loc.device_index
        s_i, s_j = copy_streams(i).peer, copy_streams(j).peer
        with on_stream(s_j):
            dst = torch.empty(src.shape, dtype=src.dtype, device=_device(dst_loc))
        fail = self.faults.next_transfer_fails()
        route = "peer" if i != j else "device"
        transfer = Transfer(self, dst, nbytes, src_loc, dst_loc, route, fail=fail)

        def issue() -> DeviceEvent:
            for event in device_waits:
                s_i.wait_event(event)
            if i == j:
                with on_stream(s_i):
                    dst.copy_(src, non_blocking=True)
            else:
                # torch's cross-device copy_ runs on the source device's current stream and
                # makes the destination's current stream wait for it: set both to ours.
                with on_stream(s_i), on_stream(s_j):
                    dst.copy_(src, non_blocking=True)
            if fail:
                with on_stream(s_j):
                    poison_(dst)
            rate = _PEER_BYTES_PER_S if i != j else _DEVICE_BYTES_PER_S
            return self._record(s_j, self._expect(s_j, nbytes, rate), rate)

        self._issue_inline_or_deferred(transfer, host_waits, issue)
        return transfer

    def _copy_h2d(
        self,
        src: torch.Tensor,
        src_loc: Location,
        dst_loc: Location,
        nbytes: int,
        device_waits: list[torch.cuda.Event],
        host_waits: list[DeviceEvent],
    ) -> Transfer:
        j = dst_loc.device_index
        stream = copy_streams(j).h2d
        with on_stream(stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=_device(dst_loc))
        fail = self.faults.next_transfer_fails()
        pinned = src_loc.is_pinned or src.is_pinned()
        direct = pinned or nbytes <= self.inline_pageable_bytes
        route = "direct" if pinned else "inline-pageable" if direct else "staged"
        transfer = Transfer(self, dst, nbytes, src_loc, dst_loc, route, fail=fail)

        if direct:

            def issue() -> DeviceEvent:
                with on_stream(stream):
                    for event in device_waits:
                        stream.wait_event(event)
                    dst.copy_(src, non_blocking=True)
                    if fail:
                        poison_(dst)
                return self._record(stream, self._expect(stream, nbytes, _LINK_BYTES_PER_S))

            self._issue_inline_or_deferred(transfer, host_waits, issue)
            return transfer

        def job(lane: StagingLane) -> None:
            error: BaseException | None = None
            try:
                for event in host_waits:
                    _host_wait(event)
                with on_stream(stream):
                    for event in device_waits:
                        stream.wait_event(event)
                    flat = src if src.is_contiguous() else src.contiguous()
                    copy_h2d_staged(lane, as_bytes(flat), as_bytes(dst), stream, transfer.cancelled)
                    if fail:
                        poison_(dst)
            except BaseException as exc:
                error = exc
            # The event covers every chunk already enqueued, whatever happened.
            transfer._finish_issue(self._record(stream), error)

        self.pool.h2d.submit(job)
        return transfer

    def _copy_d2h(
        self,
        src: torch.Tensor,
        src_loc: Location,
        dst_loc: Location,
        nbytes: int,
        device_waits: list[torch.cuda.Event],
        host_waits: list[DeviceEvent],
    ) -> Transfer:
        i = src_loc.device_index
        stream = copy_streams(i).d2h
        if dst_loc.is_pinned:
            carved, register = self._pinned_destination(src.shape, src.dtype, nbytes)
            pin_now = carved is not None or nbytes <= self.inline_register_bytes
            dst = (
                carved
                if carved is not None
                else self.pinned.empty(src.shape, src.dtype, pin=pin_now)
            )
            fail = self.faults.next_transfer_fails()
            route = "arena" if carved is not None else "direct"
            transfer = Transfer(self, dst, nbytes, src_loc, dst_loc, route, fail=fail)
            needs_pin = not (pin_now or self.pinned.is_pinned_by_us(dst) or nbytes == 0)

            def issue() -> DeviceEvent:
                if register is not None:
                    register()  # worker thread: faults in and locks the new slab
                if needs_pin:
                    self.pinned.pin(dst)  # worker thread: faults in and locks the pages
                with on_stream(stream):
                    for event in device_waits:
                        stream.wait_event(event)
                    dst.copy_(src, non_blocking=True)
                event = self._record(stream, self._expect(stream, nbytes, _LINK_BYTES_PER_S))
                if fail:
                    spin_wait(event)
                    poison_(dst)
                    return HostEvent(done=True, label="failed")
                return event

            defer = needs_pin or register is not None or (fail and nbytes > 0)
            self._issue_inline_or_deferred(transfer, host_waits, issue, defer=defer)
            return transfer

        dst = pageable_empty(
            src.shape, src.dtype, mmap_from=self.pageable_mmap_bytes, cache=self.pageable_cache
        )
        fail = self.faults.next_transfer_fails()
        transfer = Transfer(self, dst, nbytes, src_loc, dst_loc, "staged", fail=fail)
        # Enqueued now, in stream order before the lane's chunks.
        for event in device_waits:
            stream.wait_event(event)

        def job(lane: StagingLane) -> None:
            error: BaseException | None = None
            try:
                for event in host_waits:
                    _host_wait(event)
                with on_stream(stream):
                    flat = src if src.is_contiguous() else src.contiguous()
                    copy_d2h_staged(lane, as_bytes(flat), as_bytes(dst), stream, transfer.cancelled)
                if fail:
                    poison_(dst)
            except BaseException as exc:
                error = exc
                # Wait for enqueued chunks before reporting: the runtime may then free dst.
                with torch.cuda.device(i):
                    spin_wait(self._record(stream))
            transfer._finish_issue(HostEvent(done=True, label="staged d2h"), error)

        self.pool.d2h.submit(job)
        return transfer

    def _copy_host(
        self,
        src: torch.Tensor,
        src_loc: Location,
        dst_loc: Location,
        nbytes: int,
        waits: list[DeviceEvent],
    ) -> Transfer:
        carved, register = (
            self._pinned_destination(src.shape, src.dtype, nbytes)
            if dst_loc.is_pinned
            else (None, None)
        )
        if carved is not None:
            dst = carved
        elif dst_loc.is_pinned:
            dst = self.pinned.empty(src.shape, src.dtype, pin=False)
        else:
            dst = pageable_empty(
                src.shape,
                src.dtype,
                mmap_from=self.pageable_mmap_bytes,
                cache=self.pageable_cache,
            )
        fail = self.faults.next_transfer_fails()
        transfer = Transfer(self, dst, nbytes, src_loc, dst_loc, "host", fail=fail)

        def issue() -> DeviceEvent:
            for event in waits:
                _host_wait(event)
            if register is not None:
                register()
            if dst_loc.is_pinned and carved is None:
                self.pinned.pin(dst)
            dst.copy_(src)
            if fail:
                poison_(dst)
            return HostEvent(done=True, label="host copy")

        self._issue_inline_or_deferred(transfer, [], issue, defer=True)
        return transfer

    def __repr__(self) -> str:
        state = "closed" if self._closed else "started" if self._started else "idle"
        arena = self.arena
        carved = (
            "off"
            if arena is None
            else (f"{format_bytes(arena.value_bytes)} of {format_bytes(arena.total_bytes)}")
        )
        return (
            f"<CudaBackend {state} devices={self._num_devices} waiter={self.waiter.strategy} "
            f"staging={self.pool.buffers}x{format_bytes(self.pool.chunk_bytes)} per direction "
            f"pinned={format_bytes(self.pinned.pinned_bytes)} arena={carved}>"
        )


class _DirectGroup:
    """Pinned-to-device copies of :meth:`CudaBackend.copy_many` to one device: each issued on
    the device's host-to-device copy stream as it comes (:meth:`issue`), then one event after
    the last, which their transfers share (:meth:`close`, once); the host waits for none of
    them. A copy whose destination cannot be allocated, or whose issue raises, has that error
    as its outcome alone."""

    __slots__ = ("backend", "device", "dst_loc", "expected_at", "issued", "stream")

    def __init__(self, backend: CudaBackend, dst_loc: Location) -> None:
        self.backend = backend
        self.dst_loc = dst_loc
        self.stream = copy_streams(dst_loc.device_index).h2d
        self.device = _device(dst_loc)
        self.issued: list[Transfer] = []
        self.expected_at: float | None = None

    def issue(
        self,
        src: torch.Tensor,
        src_loc: Location,
        nbytes: int,
        device_waits: list[torch.cuda.Event],
    ) -> Transfer | BaseException:
        backend, stream = self.backend, self.stream
        with on_stream(stream):
            try:
                dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            except BaseException as error:
                return error
            fail = backend.faults.next_transfer_fails()
            transfer = Transfer(backend, dst, nbytes, src_loc, self.dst_loc, "direct", fail=fail)
            try:
                for waited in device_waits:
                    stream.wait_event(waited)
                dst.copy_(src, non_blocking=True)
                if fail:
                    poison_(dst)
            except BaseException as error:  # the copy's own error is its outcome
                transfer._finish_issue(HostEvent(done=True, label="failed"), error)
                return transfer
        self.expected_at = backend._expect(stream, nbytes, _LINK_BYTES_PER_S)
        self.issued.append(transfer)
        return transfer

    def close(self) -> None:
        """Record the event after the copies issued and give it to their transfers."""
        issued, self.issued = self.issued, []
        if not issued:
            return
        try:
            event = self.backend._record(self.stream, self.expected_at)
        except BaseException as error:  # no event to wait for: each copy failed with it
            for transfer in issued:
                transfer._finish_issue(HostEvent(done=True, label="failed"), error)
            return
        for transfer in issued:
            transfer._finish_issue(event)


def _prefault(raw: torch.Tensor) -> None:
    """Fault in a new slab before registering it (a few threads of our own: see
    :func:`~aresidency.backends.memory.host_fill`)."""
    host_fill(raw.data_ptr(), raw.numel() * raw.element_size())


def _device(loc: Location) -> torch.device:
    return torch.device("cuda", loc.device_index)


def _location_kind_of(tensor: torch.Tensor) -> str:
    return "cuda" if tensor.is_cuda else "host"


def _location_of(tensor: torch.Tensor) -> Location:
    if tensor.is_cuda:
        return Location("cuda", tensor.device.index or 0)
    return Location("pinned-host") if tensor.is_pinned() else Location("pageable-host")
