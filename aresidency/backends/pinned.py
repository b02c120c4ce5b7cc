"""Exactly-sized pinned host memory.

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
"""

from __future__ import annotations

import atexit
import ctypes
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from .memory import as_bytes, host_fill

__all__ = [
    "PAGE_BYTES",
    "PinnedAllocator",
    "cuda_event",
    "flush_unpins",
    "register_available",
    "register_pinned",
    "unpin_later",
    "unregister_pinned",
]

PAGE_BYTES: Final = mmap.PAGESIZE
_HUGE_BYTES: Final = 2 << 20
# Fresh pages are faulted in (zeroed by the kernel) before registration; in parallel above
# this size (``host_fill``: a few threads of our own; torch does the same with
# ``pinned_num_register_threads``), by cudaHostRegister itself below it. H200 host, 1 GB:
# 230 ms with a 16-thread fill, 363 ms without, 364 ms for torch's cudaHostAlloc.
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


def register_pinned(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``ptr`` (``cudaHostRegister``); ``torch.OutOfMemoryError``
    when the driver refuses."""
    _register(ptr, nbytes)


def unregister_pinned(ptr: int) -> None:
    """Unlock a range :func:`register_pinned` locked."""
    _unregister(ptr)


def _register(ptr: int, nbytes: int) -> None:
    rt = _cudart()
    err = rt.cudaHostRegister(ptr, nbytes, 0)  # default flags: mapped and portable under UVA
    if int(err) != 0:
        raise torch.OutOfMemoryError(
            f"cudaHostRegister could not page-lock {nbytes} B of host memory: "
            f"{rt.cudaGetErrorString(err)}; lower the pinned-host budget or the staging pool"
        )


_OWNER_PID = os.getpid()


def _unregister(ptr: int) -> None:
    # In a process forked after CUDA was initialized (a DataLoader worker), the registration
    # belongs to the parent and any CUDA call aborts the child: a mapping the child drops is
    # only unmapped (its copy of the pages was never registered in the child's context).
    if os.getpid() != _OWNER_PID:
        return
    _cudart().cudaHostUnregister(ptr)


class _Unpinner:
    """One daemon thread that unlocks page-locked ranges for whoever asks (:func:`unpin_later`).

    ``cudaHostUnregister`` waits until the device is idle, and while it waits every other
    thread's CUDA call waits too (measured on an H200 with
    ``benchmarks/diag_register_stall.py``: behind a 500 ms kernel the unregister took 491 ms
    and an event record + query on another thread 486 ms). Called on the event loop it would
    stall the loop for as long as the GPU is busy; called anywhere while kernels run it stalls
    every thread's CUDA calls. So it runs here, and this thread first waits for the devices
    itself (``torch.cuda.synchronize`` blocks only the calling thread), so that the unregister
    finds them idle or nearly so. A range stays mapped (``keep`` referenced) until unlocked:
    a registered range must never be unmapped.

    At interpreter exit (:func:`atexit`) the thread finishes what was submitted and stops
    (:meth:`shutdown`): a daemon thread still inside a CUDA call when the interpreter
    finalizes is ended by Python as it takes the GIL back, and ending it through torch's C++
    frames aborts the process ("terminate called without an active exception").

    State: ``_queue`` (ranges not unlocked yet: pointer, what keeps it mapped, a callback),
    ``_pending`` (queued or being unlocked), ``_thread``, ``_stopping``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[int, object, Callable[[], None] | None]] = []
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    def submit(self, ptr: int, keep: object, then: Callable[[], None] | None) -> None:
        if os.getpid() != _OWNER_PID:
            # A forked child never calls CUDA (see _unregister): nothing to wait for.
            if then is not None:
                then()
            return
        with self._cond:
            if self._stopping:
                # Interpreter exit: unlocked here, no thread left to hand it to.
                self._unlock(ptr, then)
                return
            self._queue.append((ptr, keep, then))
            self._pending += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="aresidency-unpin", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every range submitted so far is unlocked; ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Unlock what was submitted, then stop the thread (at interpreter exit). Later
        submissions unlock on the caller's thread. ``False`` if the thread was still busy after
        ``timeout`` seconds (a device that never goes idle)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    @staticmethod
    def _unlock(ptr: int, then: Callable[[], None] | None) -> None:
        try:
            _unregister(ptr)
        except Exception:
            pass  # a torn-down CUDA context: nothing left to unlock
        if then is not None:
            try:
                then()
            except Exception:
                pass

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._stopping:
                        return
                    self._cond.wait()
                batch, self._queue = self._queue, []
            _wait_for_devices()
            for ptr, _keep, then in batch:
                self._unlock(ptr, then)
            done = len(batch)
            del batch, _keep, then  # the ranges may be unmapped now
            with self._cond:
                self._pending -= done
                self._cond.notify_all()


def _wait_for_devices() -> None:
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return
    try:
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
    except Exception:
        pass  # the unregister below then waits itself


_UNPINNER = _Unpinner()
atexit.register(_UNPINNER.shutdown)


def unpin_later(ptr: int, keep: object, then: Callable[[], None] | None = None) -> None:
    """Unlock the range at ``ptr`` on the unpinner thread, after the devices' work queued so
    far (see :class:`_Unpinner`); ``keep`` (what keeps the range mapped) is referenced until
    then, and ``then()`` runs after, on that thread. Returns at once."""
    _UNPINNER.submit(ptr, keep, then)


def flush_unpins(timeout: float | None = None) -> bool:
    """Block until every :func:`unpin_later` so far has run (off the event loop: this waits
    for the devices). ``False`` on timeout."""
    return _UNPINNER.flush(timeout)


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

    def __init__(
        self, *, cache_bytes: int = 0, prefault: bool = True, unpin_later: bool = False
    ) -> None:
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.cache_bytes = cache_bytes
        # Unlock on the unpinner thread (see _Unpinner), never on the caller's: the runtime's
        # allocator, whose releases happen on the event loop while kernels run.
        self.unpin_later = unpin_later
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
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        if not self.exact:
            # Fallback: torch's caching allocator, pinned at once (power-of-two blocks).
            return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
        mapping = self._take_cached(nbytes)
        if mapping is None:
            mapping = _Mapping(
                -1,
                -(-nbytes // PAGE_BYTES) * PAGE_BYTES,
                # Private: mmap's default shares anonymous memory through shmem, whose page
                # faults are several times slower (H200 host: 5 GB/s against 21).
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
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
            host_fill(mapping.ptr, mapping.nbytes)
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
        if was_registered and self.unpin_later:
            unpin_later(mapping.ptr, mapping)  # the mapping stays mapped until unlocked
        elif was_registered:
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
