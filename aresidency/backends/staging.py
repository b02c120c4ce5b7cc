"""Exactly-sized pinned host memory, and the pinned staging pool for pageable copies.

Pinned memory
    torch's pinned caching allocator rounds every block up to a power of two, so a 65 MiB
    tensor pins 128 MiB that no budget sees. :class:`PinnedAllocator` instead maps anonymous
    page-aligned memory (``mmap``), wraps it in a tensor of exactly the requested bytes
    (``torch.frombuffer``) and page-locks it with ``cudaHostRegister`` (torch's
    ``torch.cuda.cudart()`` binding, present since torch 1.x; the call releases the GIL). The
    pinned footprint is the tensor's bytes rounded up to one host page. ``free`` unregisters
    at once; memory still referenced elsewhere stays valid as pageable memory and is unmapped
    when its last tensor dies. When ``cudaHostRegister`` is unavailable the allocator falls
    back to ``torch.empty(pin_memory=True)`` (caching allocator, power-of-two rounding) and
    says so in ``exact``.

Staging pool
    ANCHORS.md (H200): a plain pageable copy reaches 9-17 GB/s of a 55 GB/s link; chunked
    double-buffered staging through pinned memory reaches 50.4 GB/s with 32 MB chunks (32.3
    with 8 MB chunks). With two buffers a refill waits out the previous chunk's wake-up and
    memcpy while only one device copy is queued; the CUDA backend's default is three 32 MB
    buffers per lane, which measured 49.5 GB/s against 43.1 for two (benchmarks/RESULTS.md).
    :class:`StagingPool` has two lanes, host-to-device and device-to-host,
    so both copy engines can be fed at once. Each lane owns ``buffers`` pinned buffers of
    ``chunk_bytes`` and one thread that runs its jobs in FIFO order: the host-side memcpy
    between pageable memory and a buffer runs in that thread (torch's ``copy_`` releases the
    GIL and is multi-threaded), never on the event loop; a buffer is refilled only after the
    device copy that last used it completed (:func:`~aresidency.backends.waiter.spin_wait` on
    its event).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from .memory import as_bytes
from .waiter import spin_wait

__all__ = [
    "PAGE_BYTES",
    "PinnedAllocator",
    "StagingLane",
    "StagingPool",
    "copy_d2h_staged",
    "copy_h2d_staged",
    "cuda_event",
    "register_available",
]

PAGE_BYTES: Final = mmap.PAGESIZE
_HUGE_BYTES: Final = 2 << 20
# Fresh pages are faulted in (zeroed by the kernel) before registration; in parallel with
# torch's multi-threaded fill above this size (torch does the same with
# ``pinned_num_register_threads``), by cudaHostRegister itself below it. H200 host, 1 GB:
# 230 ms with the parallel fill, 363 ms without, 364 ms for torch's cudaHostAlloc.
_PREFAULT_BYTES: Final = 4 << 20


def _cudart() -> Any:
    cudart: Any = torch.cuda.cudart  # untyped in torch
    return cudart()


def cuda_event(*, blocking: bool = False) -> torch.cuda.Event:
    """A new ``torch.cuda.Event`` (``blocking=True``: ``synchronize`` sleeps, not spins)."""
    ctor: Any = torch.cuda.Event  # untyped in torch
    event: torch.cuda.Event = ctor(blocking=blocking)
    return event


def register_available() -> bool:
    """Whether ``torch.cuda.cudart().cudaHostRegister`` can be called here."""
    if not torch.cuda.is_available():
        return False
    try:
        return hasattr(_cudart(), "cudaHostRegister")
    except (AssertionError, RuntimeError):
        return False


def _register(ptr: int, nbytes: int) -> None:
    rt = _cudart()
    err = rt.cudaHostRegister(ptr, nbytes, 0)  # default flags: mapped and portable under UVA
    if int(err) != 0:
        raise torch.OutOfMemoryError(
            f"cudaHostRegister could not page-lock {nbytes} B of host memory: "
            f"{rt.cudaGetErrorString(err)}; lower the pinned-host budget or the staging pool"
        )


def _unregister(ptr: int) -> None:
    _cudart().cudaHostUnregister(ptr)


class _Mapping(mmap.mmap):
    """Anonymous page-aligned memory that backs pinned tensors (one at a time).

    ``registered`` is True while page-locked. The mapping outlives each tensor made over it
    (see :meth:`PinnedAllocator._on_tensor_death`); when the mapping itself dies, ``__del__``
    unregisters it before ``mmap`` unmaps it: a registered range must never be unmapped
    (the driver would refuse to register that address range again).
    """

    nbytes: int
    ptr: int
    registered: bool

    def __del__(self) -> None:
        try:
            if getattr(self, "registered", False):
                self.registered = False
                _unregister(self.ptr)
        except Exception:
            pass  # interpreter shutdown or a torn-down CUDA context: nothing left to unpin


def _on_tensor_death(owner: weakref.ref[PinnedAllocator], mapping: _Mapping) -> None:
    allocator = owner()
    if allocator is not None:
        allocator._tensor_died(mapping)


class PinnedAllocator:
    """Exactly-sized page-locked host tensors (see the module docstring).

    Each tensor is made over a fresh buffer exporter (a ``ctypes`` array over the mapping)
    whose death, that is the death of the tensor's last storage reference, is observed with
    ``weakref.finalize``.

    State: ``_live`` (data pointer -> weak mapping, for ``release``), ``_cache`` (exact byte
    size -> registered mappings no tensor uses, at most ``cache_bytes`` in all),
    ``pinned_bytes`` (bytes registered now, cache included), ``timings`` (seconds spent
    faulting in pages, registering and unregistering, for benchmarks).
    Invariant: a cached mapping is registered and referenced by no tensor.
    """

    def __init__(self, *, cache_bytes: int = 0, prefault: bool = True) -> None:
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.cache_bytes = cache_bytes
        self.prefault = prefault
        self.exact = register_available()
        self._lock = threading.Lock()
        self._live: dict[int, weakref.ref[_Mapping]] = {}
        self._cache: dict[int, list[_Mapping]] = {}
        self._cached_bytes = 0
        self.pinned_bytes = 0
        self.cache_hits = 0
        self.timings = {"prefault_s": 0.0, "register_s": 0.0, "unregister_s": 0.0}

    # -- allocation

    def empty(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype, *, pin: bool = True
    ) -> torch.Tensor:
        """A contiguous host tensor of exactly ``numel * itemsize`` bytes, page-locked unless
        ``pin=False`` (then call :meth:`pin` later, off the event loop: registering faults in
        and locks every page). Blocks the calling thread while pinning."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        if not self.exact:
            # Fallback: torch's caching allocator, pinned at once (power-of-two blocks).
            return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
        mapping = self._take_cached(nbytes)
        if mapping is None:
            mapping = _Mapping(-1, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)
            mapping.nbytes = nbytes
            mapping.registered = False
            if nbytes >= _HUGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    mapping.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to fault and lock
                except OSError:
                    pass
        exporter = (ctypes.c_uint8 * nbytes).from_buffer(mapping)
        raw = torch.frombuffer(exporter, dtype=torch.uint8)
        mapping.ptr = raw.data_ptr()
        weakref.finalize(exporter, _on_tensor_death, weakref.ref(self), mapping)
        del exporter  # the tensor's storage holds it now
        with self._lock:
            self._live[mapping.ptr] = weakref.ref(mapping)
        tensor = raw.view(dtype).view(tuple(shape))
        if pin and not mapping.registered:
            self._pin_mapping(mapping, raw)
        return tensor

    def pin(self, tensor: torch.Tensor) -> None:
        """Page-lock a tensor made by ``empty(..., pin=False)``; blocks the calling thread.
        Raises ``torch.OutOfMemoryError`` when the memory cannot be locked."""
        mapping = self._mapping_of(tensor)
        if mapping is None:
            if tensor.numel() and not tensor.is_pinned():
                raise ValueError("pin() takes a tensor made by this allocator")
            return
        if not mapping.registered:
            self._pin_mapping(mapping, as_bytes(tensor))

    def _pin_mapping(self, mapping: _Mapping, raw: torch.Tensor) -> None:
        start = time.perf_counter()
        if self.prefault and mapping.nbytes >= _PREFAULT_BYTES:
            raw.view(torch.uint8).reshape(-1)[: mapping.nbytes].fill_(0)
        mid = time.perf_counter()
        _register(mapping.ptr, mapping.nbytes)
        end = time.perf_counter()
        mapping.registered = True
        with self._lock:
            self.pinned_bytes += mapping.nbytes
            self.timings["prefault_s"] += mid - start
            self.timings["register_s"] += end - mid

    def is_pinned_by_us(self, tensor: torch.Tensor) -> bool:
        mapping = self._mapping_of(tensor)
        return mapping is not None and mapping.registered

    def _mapping_of(self, tensor: torch.Tensor) -> _Mapping | None:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return None
        ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            ref = self._live.get(ptr)
        return ref() if ref is not None else None

    # -- release

    def release(self, tensor: torch.Tensor) -> bool:
        """The caller is done with ``tensor``: unregister its memory now (the data stays
        readable as pageable memory while other references live). With a cache, the memory
        instead stays pinned and is reused for the next allocation of exactly the same size
        once its last tensor dies. Returns whether the tensor was this allocator's."""
        mapping = self._mapping_of(tensor)
        if mapping is None:
            return False
        if self.cache_bytes and mapping.nbytes <= self.cache_bytes:
            return True  # recycled by _tensor_died when the last tensor dies
        self._unpin(mapping)
        return True

    def _unpin(self, mapping: _Mapping) -> None:
        with self._lock:
            was_registered = mapping.registered
            mapping.registered = False
            if was_registered:
                self.pinned_bytes -= mapping.nbytes
        if was_registered:
            start = time.perf_counter()
            _unregister(mapping.ptr)
            with self._lock:
                self.timings["unregister_s"] += time.perf_counter() - start

    def _tensor_died(self, mapping: _Mapping) -> None:
        """The last tensor over ``mapping`` died (any thread): cache it for exact-size reuse
        if it is registered and fits, else unregister it (it is unmapped when dropped)."""
        with self._lock:
            if self._live.get(mapping.ptr, lambda: None)() is mapping:
                del self._live[mapping.ptr]
            keep = (
                mapping.registered
                and self.cache_bytes > 0
                and self._cached_bytes + mapping.nbytes <= self.cache_bytes
            )
            if keep:
                self._cache.setdefault(mapping.nbytes, []).append(mapping)
                self._cached_bytes += mapping.nbytes
        if not keep:
            try:
                self._unpin(mapping)
            except Exception:
                pass  # interpreter shutdown

    def _take_cached(self, nbytes: int) -> _Mapping | None:
        with self._lock:
            free = self._cache.get(nbytes)
            if not free:
                return None
            mapping = free.pop()
            self._cached_bytes -= nbytes
            self.cache_hits += 1
            return mapping

    def trim(self) -> None:
        """Unregister and drop every cached mapping."""
        with self._lock:
            mappings = [m for free in self._cache.values() for m in free]
            self._cache.clear()
            self._cached_bytes = 0
        for m in mappings:
            self._unpin(m)

    def __repr__(self) -> str:
        kind = "exact cudaHostRegister" if self.exact else "torch pin_memory fallback"
        return (
            f"<PinnedAllocator {kind} pinned={self.pinned_bytes} B cached={self._cached_bytes} B"
            f" of {self.cache_bytes} B>"
        )


# ------------------------------------------------------------------ staging lanes


class StagingLane:
    """One direction of the staging pool: pinned buffers and the thread that uses them.

    State: ``buffers`` (allocated by the first job, in the lane thread), ``free_after[b]``
    (the device event after which buffer ``b`` may be overwritten, host-to-device only),
    ``cursor`` (the next buffer, round robin across jobs).
    Invariant: a buffer is overwritten by the host only after ``free_after`` completed, and
    read by the host only after the device copy into it completed.
    """

    def __init__(
        self, allocator: PinnedAllocator, direction: str, chunk_bytes: int, buffers: int
    ) -> None:
        self.allocator = allocator
        self.direction = direction
        self.chunk_bytes = chunk_bytes
        self.num_buffers = buffers
        self.buffers: list[torch.Tensor] = []
        self.free_after: list[Any] = [None] * buffers
        self.cursor = 0
        self.jobs_run = 0
        self._queue: queue.SimpleQueue[Callable[[StagingLane], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[StagingLane], None]) -> None:
        """Run ``job(lane)`` in the lane thread after the jobs before it. The job reports its
        own outcome; it must not raise."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.direction} staging lane is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"aresidency-staging-{self.direction}", daemon=True
                )
                self._thread.start()
        self._queue.put(job)

    def ensure_buffers(self) -> None:
        """Allocate the pinned buffers (lane thread; pins ``num_buffers * chunk_bytes``)."""
        while len(self.buffers) < self.num_buffers:
            self.buffers.append(self.allocator.empty((self.chunk_bytes,), torch.uint8))

    def next_buffer(self) -> int:
        b = self.cursor
        self.cursor = (b + 1) % self.num_buffers
        return b

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.jobs_run += 1  # counted when started: the job reports its own completion
            job(self)
            # The job's closure holds its tensors: drop it now, not when the next job arrives
            # (an idle lane would otherwise keep the last destination alive).
            del job

    def close(self, join_timeout: float = 5.0) -> None:
        """Finish the queued jobs, then stop the thread (call off the event loop)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._queue.put(None)
        if thread is not None:
            thread.join(join_timeout)
            if not thread.is_alive():
                for buffer in self.buffers:  # unpin now rather than at garbage collection
                    self.allocator.release(buffer)
                self.buffers.clear()


class StagingPool:
    """Two :class:`StagingLane` (``h2d``, ``d2h``) of ``buffers`` x ``chunk_bytes`` each.

    ``nbytes`` is fixed at construction (the runtime charges it to ``pinned-host``); the
    buffers themselves are pinned on each lane's first job, in the lane thread.
    """

    def __init__(
        self,
        allocator: PinnedAllocator,
        *,
        chunk_bytes: int = 32 << 20,
        buffers: int = 2,
    ) -> None:
        if chunk_bytes <= 0 or buffers < 1:
            raise ValueError(f"need chunk_bytes > 0 and buffers >= 1, got {chunk_bytes}, {buffers}")
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        self.h2d = StagingLane(allocator, "h2d", chunk_bytes, buffers)
        self.d2h = StagingLane(allocator, "d2h", chunk_bytes, buffers)

    @property
    def nbytes(self) -> int:
        return 2 * self.buffers * self.chunk_bytes

    def close(self) -> None:
        self.h2d.close()
        self.d2h.close()

    def __repr__(self) -> str:
        return (
            f"<StagingPool 2 lanes x {self.buffers} x {self.chunk_bytes} B = {self.nbytes} B "
            f"jobs h2d={self.h2d.jobs_run} d2h={self.d2h.jobs_run}>"
        )


def copy_h2d_staged(
    lane: StagingLane,
    src: torch.Tensor,
    dst: torch.Tensor,
    stream: Any,
    cancelled: Callable[[], bool],
) -> bool:
    """Copy the bytes of pageable ``src`` into device ``dst`` (both flat ``uint8``, same size)
    chunk by chunk through ``lane``'s buffers, in the lane thread. The device copies are
    enqueued on ``stream``, which must be current. The host waits only for a buffer's previous
    device copy before refilling it. Returns False if ``cancelled()`` stopped it early (the
    chunks already enqueued still complete)."""
    lane.ensure_buffers()
    n = src.numel()
    chunk = lane.chunk_bytes
    for off in range(0, n, chunk):
        if cancelled():
            return False
        length = min(chunk, n - off)
        b = lane.next_buffer()
        previous = lane.free_after[b]
        if previous is not None:
            spin_wait(previous)
        buf = lane.buffers[b][:length]
        buf.copy_(src[off : off + length])
        dst[off : off + length].copy_(buf, non_blocking=True)
        event = cuda_event(blocking=True)
        event.record(stream)
        lane.free_after[b] = event
    return True


def copy_d2h_staged(
    lane: StagingLane,
    src: torch.Tensor,
    dst: torch.Tensor,
    stream: Any,
    cancelled: Callable[[], bool],
) -> bool:
    """Copy the bytes of device ``src`` into pageable ``dst`` (both flat ``uint8``) through
    ``lane``'s buffers, in the lane thread: up to ``num_buffers`` device copies in flight on
    ``stream`` (current), each copied out by the host once its event completed. Returns when
    every enqueued chunk is in ``dst``; False if ``cancelled()`` stopped it early."""
    lane.ensure_buffers()
    n = src.numel()
    chunk = lane.chunk_bytes
    inflight: deque[tuple[Any, int, int, int]] = deque()
    completed = True

    def drain_one() -> None:
        event, b, off, length = inflight.popleft()
        spin_wait(event)
        dst[off : off + length].copy_(lane.buffers[b][:length])

    for off in range(0, n, chunk):
        if len(inflight) == lane.num_buffers:
            drain_one()
        if cancelled():
            completed = False
            break
        length = min(chunk, n - off)
        b = lane.next_buffer()
        lane.buffers[b][:length].copy_(src[off : off + length], non_blocking=True)
        event = cuda_event(blocking=True)
        event.record(stream)
        inflight.append((event, b, off, length))
    while inflight:
        drain_one()
    return completed
