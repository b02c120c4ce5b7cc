"""The pinned staging pool for pageable copies, and pageable destinations.

On an H200 host a plain pageable copy reaches 9-17 GB/s of a 55 GB/s link; chunked staging
through pinned buffers recovers almost all of it in the host-to-device direction (49.5 GB/s
with three 32 MB buffers per lane, 38.9-45.9 with two: with two, a refill waits out the
previous chunk's wake-up and memcpy while only one device copy is queued; see
``benchmarks/RESULTS.md``). :class:`StagingPool` has two lanes, host-to-device and
device-to-host, so both copy engines are fed at once. Each lane owns ``buffers`` pinned buffers
of ``chunk_bytes`` and one thread that runs its jobs in FIFO order, never on the event loop; a
buffer is refilled only after the device copy that last used it completed
(:func:`~aresidency.backends.polling.spin_wait` on its event).

Host-to-device, the lane thread copies each chunk into a buffer (torch's ``copy_``, which
releases the GIL and runs on several threads). Device-to-host, the host side is the limit: a
fresh pageable destination is faulted in page by page as it is first written (about 19 GB/s on
that host with 4 KiB pages, 24 GB/s with transparent huge pages), and even into memory already
faulted in a pinned-to-pageable memcpy reaches only 35-41 GB/s there, with any number of
threads. So the device-to-host lane keeps up to ``buffers`` chunk copies in flight and copies
each completed chunk out with ``memcpy_threads`` threads (without the GIL) while later chunks
cross the link; pageable destinations are private mappings asked for transparent huge pages
(:func:`pageable_empty`), which makes the faults few and large. Those threads copy with
non-temporal stores where they can (:mod:`~aresidency.backends.streamcopy`): a plain
``memmove`` of a 4 MiB piece reads every destination line before writing it (8 threads on an
H100 host: 27.1 GB/s plain, 44.3 with streaming stores, ``benchmarks/diag_host_memcpy.py``);
in the lane, with the link writing the buffers at the same time, a 1 GB device-to-pageable copy
went from 32.0 to 35.9 GB/s (``benchmarks/bench_copy.py --staging-only``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from .arena import private_mapping
from .memory import tensor_over
from .pageable import PageableCache
from .pinned import PAGE_BYTES, PinnedAllocator, cuda_event
from .polling import spin_wait
from .streamcopy import streaming_memmove

__all__ = [
    "StagingLane",
    "StagingPool",
    "copy_d2h_staged",
    "copy_h2d_staged",
    "pageable_empty",
]


class StagingLane:
    """One direction of the staging pool: pinned buffers and the thread that uses them.

    State: ``buffers`` (allocated by the first job, in the lane thread), ``free_after[b]``
    (the device event after which buffer ``b`` may be overwritten, host-to-device only),
    ``cursor`` (the next buffer, round robin across jobs).
    Invariant: a buffer is overwritten by the host only after ``free_after`` completed, and
    read by the host only after the device copy into it completed.
    """

    def __init__(
        self,
        allocator: PinnedAllocator,
        direction: str,
        chunk_bytes: int,
        buffers: int,
        memcpy_threads: int = 1,
        streaming_stores: bool = True,
    ) -> None:
        self.allocator = allocator
        self.direction = direction
        self.chunk_bytes = chunk_bytes
        self.num_buffers = buffers
        self.memcpy_threads = memcpy_threads
        self.streaming_stores = streaming_stores
        self._memmove: Callable[[int, int, int], object] | None = None
        self._copiers: concurrent.futures.ThreadPoolExecutor | None = None
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

    def memmove(self) -> Callable[[int, int, int], object]:
        """The copy :meth:`host_copy` runs in each thread: the non-temporal one of
        :mod:`~aresidency.backends.streamcopy` when ``streaming_stores`` and it can be had
        (built on the first call: lane thread), else ``ctypes.memmove``."""
        if self._memmove is None:
            fast = streaming_memmove() if self.streaming_stores else None
            self._memmove = fast if fast is not None else ctypes.memmove
        return self._memmove

    def host_copy(
        self, dst: torch.Tensor, src: torch.Tensor
    ) -> list[concurrent.futures.Future[Any]]:
        """Start copying the bytes of host ``src`` into host ``dst`` (flat ``uint8``, same
        size), split across ``memcpy_threads`` threads (:meth:`memmove` in each, without the
        GIL); returns the futures to wait on. With one thread (torch's ``copy_``), copies now
        and returns nothing."""
        n = src.numel()
        if self.memcpy_threads <= 1 or n < _PARALLEL_MEMCPY_BYTES:
            dst.copy_(src)
            return []
        copy = self.memmove()
        if self._copiers is None:
            self._copiers = concurrent.futures.ThreadPoolExecutor(
                self.memcpy_threads, thread_name_prefix=f"aresidency-memcpy-{self.direction}"
            )
        step = -(-n // self.memcpy_threads)
        step = -(-step // PAGE_BYTES) * PAGE_BYTES
        d, s_ = dst.data_ptr(), src.data_ptr()
        return [
            self._copiers.submit(copy, d + off, s_ + off, min(step, n - off))
            for off in range(0, n, step)
        ]

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
        if self._copiers is not None:  # (also made by a host_copy called outside a job)
            self._copiers.shutdown(wait=True)
        if thread is not None and not thread.is_alive():
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
        memcpy_threads: int = 1,
        streaming_stores: bool = True,
    ) -> None:
        if chunk_bytes <= 0 or buffers < 1 or memcpy_threads < 1:
            raise ValueError(
                "need chunk_bytes > 0, buffers >= 1 and memcpy_threads >= 1, got "
                f"{chunk_bytes}, {buffers}, {memcpy_threads}"
            )
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        self.h2d = StagingLane(allocator, "h2d", chunk_bytes, buffers, streaming_stores=False)
        # Host-to-device fills the lane's few buffers, which stay in the cache for the DMA to
        # read: plain stores. Device-to-host writes each destination once: streaming stores.
        self.d2h = StagingLane(
            allocator, "d2h", chunk_bytes, buffers, memcpy_threads, streaming_stores
        )

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
    ``stream`` (current); each chunk is copied out by ``memcpy_threads`` host threads once its
    event completed, while later chunks cross the link. A buffer takes a new device copy only
    after its host copy finished. Returns when every enqueued chunk is in ``dst``; False if
    ``cancelled()`` stopped it early."""
    lane.ensure_buffers()
    n = src.numel()
    chunk = lane.chunk_bytes
    inflight: deque[tuple[Any, int, int, int]] = deque()
    reading: dict[int, list[concurrent.futures.Future[Any]]] = {}  # buffer -> host copies
    completed = True

    def drain_one() -> None:
        event, b, off, length = inflight.popleft()
        spin_wait(event)
        reading[b] = lane.host_copy(dst[off : off + length], lane.buffers[b][:length])

    def drain_arrived() -> None:
        # Copy out every chunk that has crossed already, before waiting for anything: the
        # memcpy threads then always have the next chunk queued.
        while inflight and inflight[0][0].query():
            drain_one()

    try:
        for off in range(0, n, chunk):
            drain_arrived()
            if len(inflight) == lane.num_buffers:
                drain_one()
            if cancelled():
                completed = False
                break
            length = min(chunk, n - off)
            b = lane.next_buffer()
            pending = reading.pop(b, ())
            if pending and not all(f.done() for f in pending):
                drain_arrived()
            for future in pending:
                future.result()
            lane.buffers[b][:length].copy_(src[off : off + length], non_blocking=True)
            event = cuda_event(blocking=True)
            event.record(stream)
            inflight.append((event, b, off, length))
        while inflight:
            drain_one()
    finally:
        for futures in reading.values():
            for future in futures:
                future.result()
    return completed


def pageable_empty(
    shape: Sequence[int] | torch.Size,
    dtype: torch.dtype,
    *,
    mmap_from: int | None,
    cache: PageableCache | None = None,
) -> torch.Tensor:
    """An uninitialized pageable host tensor; from ``mmap_from`` bytes up, over a private
    anonymous mapping asked for transparent huge pages (fewer, larger page faults when a copy
    first writes it), taken from ``cache`` when it keeps one of that size (its pages are
    faulted in already), else ``torch.empty``."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if mmap_from is None or nbytes < mmap_from:
        return torch.empty(tuple(shape), dtype=dtype)
    if cache is not None:
        return cache.empty(shape, dtype)
    mapping = private_mapping(nbytes)
    exporter = (ctypes.c_uint8 * nbytes).from_buffer(mapping)
    return tensor_over(exporter, nbytes, dtype, shape)


_PARALLEL_MEMCPY_BYTES: Final = 1 << 20
