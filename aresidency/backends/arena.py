"""Pinned host memory carved from large registered slabs: fresh pinned destinations at once.

Page-locking memory costs its page faults plus ``cudaHostRegister``: about 0.2 s per GB on an
H200 host, so a copy into a *fresh* exactly-sized pinned destination runs at a few GB/s however
fast the link is. :class:`PinnedArena` pays that cost once per slab, ahead of need, and carves
destinations out of registered slabs:

* **Exact charges.** A block is the tensor's own bytes rounded up to ``ALIGN`` (256 B, the
  alignment CUDA gives its own allocations); the runtime charges a value its own bytes, never
  a power-of-two rounding. Slab bytes not carved (free space and alignment padding) are the
  arena's *overhead*, which the runtime shows as the backend's own reservation at
  ``pinned-host`` (``aresidency.pinned-arena``); see :meth:`PinnedArena.free_bytes`.
* **Slabs.** A request of at least half a slab gets a slab of its own (rounded up to 2 MiB);
  smaller ones share ``slab_bytes`` slabs, best fit, with neighbouring free blocks merged.
* **Grown ahead of need.** After a carve leaves less than ``ahead_bytes`` (the largest recent
  request) free, :meth:`PinnedArena.grow_ahead` adds a slab in a worker thread, so the next
  fresh destination is carved, not registered. A request that found no hole either gets a
  new slab at once (:meth:`PinnedArena.carve_new`: mapped on the loop, registered by the
  worker that issues its copy; the CUDA backend does this for destinations too large to
  register on the loop), so that a burst of concurrent copies (64 of 64 MB) builds the room
  the next burst carves, instead of registering each destination for itself and unregistering
  it at its free; or it is remembered as a *miss*, and the next growth adds room for all of
  them at once. Growth never takes the arena past ``limit_bytes``, which
  the runtime keeps at the pinned-host budget's headroom (the budget less every other charge);
  to make room under it, growth releases slabs that are entirely free and smaller than the slab
  it adds (a size the recent requests do not use), and slabs left entirely free beyond the
  limit are unregistered.
* **Lifetimes.** A block returns to its slab when the last tensor over it dies (a finalizer on
  the tensor's buffer exporter), never earlier: a reference the user kept reads the old data,
  not somebody else's. Slabs are unregistered when trimmed or when the arena closes; a slab
  still carved when the arena closes stays registered until its last block dies.

Registration is injected (``register``/``unregister``), so the carving logic is tested on the
CPU with a fake registry; the CUDA backend passes ``cudaHostRegister``.

State: ``_slabs`` (every slab: its mapping, its free list ``[(offset, length)]`` sorted by
offset), ``total_bytes`` (bytes of registered slabs), ``carved_bytes`` (bytes of live blocks,
alignment included), ``value_bytes`` (bytes asked for by live blocks), ``limit_bytes``,
``ahead_bytes``, counters for benchmarks and tests (``slabs_made``, ``carves``, ``misses``).
Invariant: per slab, the free list and the live blocks tile the slab exactly, without overlap;
``total_bytes - carved_bytes`` is the sum of every free list.

Blocks come back from tensors' finalizers, on whichever thread drops the last tensor, and that
may be in the middle of the arena's own locked section (a garbage collection there): a
returned block is queued and taken back as the section holding the lock ends.

Why this module is long: carving, growth ahead of need, trimming to the limit and the return of
blocks all change the same slabs and counters under one lock; split apart, each would need the
others' invariants restated.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import mmap
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Final

import torch

from .memory import tensor_over

__all__ = ["ALIGN", "PinnedArena", "private_mapping"]

ALIGN: Final = 256
_SLAB_ROUND: Final = 2 << 20
_MISSES_KEPT: Final = 1024  # misses remembered between two growths (the rest wait for the next)


def private_mapping(nbytes: int) -> mmap.mmap:
    """Anonymous, private, page-aligned memory (``MAP_PRIVATE``: ``mmap``'s default shares
    anonymous memory through shmem, whose page faults are several times slower), asked to use
    transparent huge pages when large."""
    mapping = mmap.mmap(
        -1,
        nbytes,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    if nbytes >= _SLAB_ROUND and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mapping


class _Slab:
    __slots__ = (
        "detached",
        "free",
        "live",
        "mapping",
        "nbytes",
        "ptr",
        "ready",
        "registered",
        "unregister",
    )

    def __init__(
        self, mapping: mmap.mmap, nbytes: int, ptr: int, unregister: Callable[[int], None]
    ) -> None:
        self.mapping = mapping
        self.unregister = unregister
        self.nbytes = nbytes
        self.ptr = ptr
        self.free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), by offset
        self.live = 0  # blocks carved from it and not yet returned
        self.registered = True  # page-locked: unlock before unmapping
        self.ready = True  # False while its first block's worker registers it (carve nothing)
        self.detached = False  # its registration failed: out of the arena, unmapped at return

    def largest(self) -> int:
        return max((length for _, length in self.free), default=0)

    def take(self, nbytes: int) -> int | None:
        """Best fit: the offset of a free block of ``nbytes`` carved from the smallest hole."""
        best = None
        for index, (_offset, length) in enumerate(self.free):
            if length >= nbytes and (best is None or length < self.free[best][1]):
                best = index
        if best is None:
            return None
        offset, length = self.free[best]
        if length == nbytes:
            del self.free[best]
        else:
            self.free[best] = (offset + nbytes, length - nbytes)
        self.live += 1
        return offset

    def give_back(self, offset: int, nbytes: int) -> None:
        """Return a block, merging it with free neighbours."""
        index = bisect.bisect(self.free, (offset, 0))
        start, end = offset, offset + nbytes
        if index < len(self.free) and self.free[index][0] == end:
            end += self.free[index][1]
            del self.free[index]
        if index > 0 and sum(self.free[index - 1]) == start:
            start = self.free[index - 1][0]
            del self.free[index - 1]
            index -= 1
        self.free.insert(index, (start, end - start))
        self.live -= 1

    def empty(self) -> bool:
        return self.live == 0

    def unlock(self) -> None:
        if self.registered:
            self.registered = False
            try:
                self.unregister(self.ptr)
            except Exception:
                pass  # a torn-down CUDA context: nothing left to unlock

    def __del__(self) -> None:
        # A registered range must never be unmapped (the driver would refuse to register the
        # address range again): a slab dropped while registered unlocks itself first.
        if getattr(self, "registered", False):
            self.unlock()


def _unmap(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a view still exists (cannot happen for an empty slab); unmapped at death


def _return_block(owner: weakref.ref[PinnedArena], slab: _Slab, offset: int, nbytes: int) -> None:
    arena = owner()
    if arena is not None:
        arena._returned(slab, offset, nbytes)


class _Section:
    """The arena's locked section, a context manager (a class: a generator-based one cost
    more than the work it guards, a dozen times per small copy). No state of its own, so one
    instance serves every thread: the lock makes the sections exclusive."""

    __slots__ = ("_arena",)

    def __init__(self, arena: PinnedArena) -> None:
        self._arena = arena

    def __enter__(self) -> None:
        arena = self._arena
        arena._lock.acquire()
        arena._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        arena = self._arena
        leaving: list[_Slab] = []
        try:
            returns = arena._returns
            while returns:
                slab, offset, nbytes = returns.popleft()
                if arena._take_back_locked(slab, offset, nbytes):
                    leaving.append(slab)
        finally:
            arena._owner = None
            arena._lock.release()
        for slab in leaving:
            arena._release(slab)


class PinnedArena:
    """Registered slabs carved into exactly charged pinned tensors (see the module docstring).

    ``register(ptr, nbytes)`` page-locks a range (raising ``torch.OutOfMemoryError`` when it
    cannot), ``unregister(ptr)`` unlocks it. ``limit_bytes`` bounds ``total_bytes`` (``None``:
    no bound). Thread-safe: carving happens on the loop, growth in a worker, blocks return on
    whichever thread drops the last tensor.
    """

    def __init__(
        self,
        register: Callable[[int, int], None],
        unregister: Callable[[int], None],
        *,
        slab_bytes: int = 64 << 20,
        limit_bytes: int | None = None,
        prefault: Callable[[torch.Tensor], None] | None = None,
        unregister_later: Callable[[int, object, Callable[[], None]], None] | None = None,
    ) -> None:
        if slab_bytes <= 0 or slab_bytes % mmap.PAGESIZE:
            raise ValueError(
                f"slab_bytes must be a positive multiple of the page size, got {slab_bytes}"
            )
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0 or None, got {limit_bytes}")
        self._register = register
        self._unregister = unregister
        # unregister_later(ptr, keep, then): unlock off the calling thread, keeping ``keep``
        # (the slab's mapping) alive until then (the CUDA backend's unpinner); None: at once.
        self._unregister_later = unregister_later
        self._prefault = prefault
        self.slab_bytes = slab_bytes
        self.limit_bytes = limit_bytes
        self.ahead_bytes = 0
        self._missed: list[int] = []  # block bytes of the misses since the last growth
        self._lock = threading.Lock()
        self._section = _Section(self)
        # The thread inside a locked section, and the blocks returned while it was (see
        # _returned): a tensor's finalizer may run in a section (a garbage collection there),
        # and taking the lock again would deadlock that thread.
        self._owner: int | None = None
        self._returns: collections.deque[tuple[_Slab, int, int]] = collections.deque()
        self._slabs: list[_Slab] = []
        self._growing = False
        self._closed = False
        self.total_bytes = 0
        self.carved_bytes = 0
        self.value_bytes = 0
        self.slabs_made = 0
        self.carves = 0
        self.misses = 0

    # -- accounting

    @staticmethod
    def block_bytes(nbytes: int) -> int:
        """The bytes a request of ``nbytes`` occupies in a slab."""
        return -(-max(nbytes, 1) // ALIGN) * ALIGN

    def free_bytes(self) -> int:
        """Registered bytes no live block holds: free space plus alignment padding."""
        with self._locked():
            return self.total_bytes - self.value_bytes

    def set_limit(self, limit_bytes: int | None) -> None:
        """Bound the arena's registered bytes; slabs entirely free beyond it are released
        (blocking: call off the event loop when slabs may go)."""
        with self._locked():
            self.limit_bytes = limit_bytes
        self.trim(keep_within_limit=True)

    # -- carving

    def try_carve(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype, *, note_miss: bool = True
    ) -> torch.Tensor | None:
        """A pinned tensor from a registered slab, or None when no hole is large enough. Never
        registers memory (cheap enough for the event loop). A miss is remembered for the next
        growth unless ``note_miss`` is false (the caller then calls :meth:`carve_new`)."""
        nbytes = _nbytes(shape, dtype)
        with self._locked():
            if self._closed:
                return None
            self.ahead_bytes = max(self.ahead_bytes, self.block_bytes(nbytes))
            found = self._take_locked(self.block_bytes(nbytes))
            if found is None:
                self.misses += 1
                if note_miss and len(self._missed) < _MISSES_KEPT:
                    self._missed.append(self.block_bytes(nbytes))
                return None
            slab, offset = found
            self._carved_locked(nbytes)
        return self._tensor(slab, offset, nbytes, shape, dtype)

    def carve(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`try_carve`, adding a slab when no hole fits (blocks while it registers:
        call off the event loop). Raises ``torch.OutOfMemoryError`` when the slab would pass
        ``limit_bytes`` or registration fails."""
        tensor = self.try_carve(shape, dtype)
        if tensor is not None:
            return tensor
        nbytes = _nbytes(shape, dtype)
        need = self.block_bytes(nbytes)
        slab = self._new_slab(self._slab_size_for(need), need)
        with self._locked():
            if self._closed:
                self._add_locked(slab)  # released by close's sweep below
                raise RuntimeError("the pinned arena is closed")
            self._add_locked(slab)
            offset = slab.take(need)
            assert offset is not None
            self._carved_locked(nbytes)
        return self._tensor(slab, offset, nbytes, shape, dtype)

    def carve_new(
        self, shape: Sequence[int] | torch.Size, dtype: torch.dtype
    ) -> tuple[torch.Tensor, Callable[[], None]] | None:
        """A tensor over a new slab, not registered yet, or None when that slab would pass
        ``limit_bytes`` (or the arena is closed). Cheap (one ``mmap``): for the event loop,
        when :meth:`try_carve` found no hole. Call the returned function off the loop before
        the device writes the tensor: it faults the slab in and registers it (blocking), so
        that the block returns to the arena when its tensor dies and later requests carve
        the slab, where registering a destination of its own would be undone at its free. It
        raises ``torch.OutOfMemoryError`` when registration fails; the slab then leaves the
        arena and is unmapped with its tensor."""
        nbytes = _nbytes(shape, dtype)
        need = self.block_bytes(nbytes)
        size = self._slab_size_for(need)
        with self._locked():
            if self._closed or self._room_locked(size) < 0:
                return None
        mapping = private_mapping(size)
        exporter = (ctypes.c_uint8 * size).from_buffer(mapping)
        ptr = torch.frombuffer(exporter, dtype=torch.uint8).data_ptr()
        del exporter
        slab = _Slab(mapping, size, ptr, self._unregister)
        slab.registered = slab.ready = False
        with self._locked():
            if self._closed or self._room_locked(size) < 0:
                _unmap(mapping)
                return None
            self._add_locked(slab)  # counted now: concurrent requests see the limit's use
            offset = slab.take(need)
            assert offset == 0
            self._carved_locked(nbytes)
        tensor = self._tensor(slab, offset, nbytes, shape, dtype)
        return tensor, functools.partial(self._register_new, slab, nbytes)

    def _register_new(self, slab: _Slab, nbytes: int) -> None:
        """Fault in and register a slab made by :meth:`carve_new` (a worker thread)."""
        try:
            exporter = (ctypes.c_uint8 * slab.nbytes).from_buffer(slab.mapping)
            raw = torch.frombuffer(exporter, dtype=torch.uint8)
            if self._prefault is not None:
                self._prefault(raw)
            del raw, exporter
            self._register(slab.ptr, slab.nbytes)
        except BaseException:
            with self._locked():
                if slab in self._slabs:
                    self._slabs.remove(slab)
                    self.total_bytes -= slab.nbytes
                self.carved_bytes -= self.block_bytes(nbytes)
                self.value_bytes -= nbytes
                self.carves -= 1
                slab.detached = True
            raise
        with self._locked():
            slab.registered = slab.ready = True
            self.slabs_made += 1

    def needs_growth(self) -> bool:
        """Whether no hole holds ``ahead_bytes`` and a slab for it would fit the limit (then
        call :meth:`grow_ahead` off the loop)."""
        with self._locked():
            return not self._growing and self._should_grow_locked()

    def grow_ahead(self) -> bool:
        """Add the slabs the arena needs, if any (blocking; a worker thread): one for every
        request that missed since the last growth (small ones share slabs), or else one
        large enough for ``ahead_bytes``. Returns whether a slab was added; a failed
        registration is not an error here (the next copy then registers its own
        destination)."""
        with self._locked():
            if self._growing or not self._should_grow_locked():
                return False
            self._growing = True
            sizes = self._growth_sizes_locked()
        added = False
        try:
            for size in sizes:
                if not self._make_room(size):
                    continue  # too large for the limit: a smaller one may still fit
                try:
                    slab = self._new_slab(size, size)
                except (torch.OutOfMemoryError, OSError):
                    break
                with self._locked():
                    # The limit may have dropped while the slab was registered: then it goes.
                    fits = (
                        self.limit_bytes is None
                        or self.total_bytes + slab.nbytes <= self.limit_bytes
                    )
                    if fits and not self._closed:
                        self._add_locked(slab)
                if not fits or self._closed:
                    self._release(slab)
                    break
                added = True
        finally:
            with self._locked():
                self._growing = False
        return added

    def _should_grow_locked(self) -> bool:
        if self._closed or not self.ahead_bytes:
            return False
        if self._missed:
            if any(self._room_locked(self._slab_size_for(need)) >= 0 for need in set(self._missed)):
                return True
            # None of them can fit under the limit now: forget them (later misses count
            # afresh), so that they never stand in the way of growth for the others.
            self._missed.clear()
        if any(slab.largest() >= self.ahead_bytes for slab in self._slabs):
            return False
        return self._room_locked(self._slab_size_for(self.ahead_bytes)) >= 0

    def _growth_sizes_locked(self) -> list[int]:
        """The slabs to add for the misses since the last growth (and forget them), largest
        first; or one for ``ahead_bytes``."""
        sizes: list[int] = []
        small = 0
        for need in self._missed:
            if need * 2 >= self.slab_bytes:
                sizes.append(self._slab_size_for(need))
            else:
                small += need
        self._missed.clear()
        sizes.sort(reverse=True)
        sizes.extend([self.slab_bytes] * -(-small // self.slab_bytes))
        return sizes or [self._slab_size_for(self.ahead_bytes)]

    def _room_locked(self, size: int) -> int:
        """Bytes to spare under the limit once a slab of ``size`` is added and the entirely
        free slabs smaller than it are released (negative: it does not fit)."""
        if self.limit_bytes is None:
            return 1
        spare = sum(s.nbytes for s in self._slabs if s.empty() and s.nbytes < size)
        return self.limit_bytes - (self.total_bytes - spare + size)

    def _make_room(self, size: int) -> bool:
        """Release entirely free slabs smaller than ``size``, smallest first, until a slab of
        ``size`` fits the limit; whether it fits (nothing is released if it cannot). Blocking
        while it unregisters: called by :meth:`grow_ahead`, in a worker thread."""
        with self._locked():
            if self._closed or self._room_locked(size) < 0:
                return False
            smaller = sorted((s for s in self._slabs if s.nbytes < size), key=lambda s: s.nbytes)
            target = None if self.limit_bytes is None else self.limit_bytes - size
            released = self._remove_empty_locked(smaller, target)
        for slab in released:
            self._release(slab)
        return True

    def _remove_empty_locked(self, slabs: list[_Slab], target: int | None) -> list[_Slab]:
        """Take the entirely free ones of ``slabs`` out of the arena, in order, until
        ``total_bytes`` is at most ``target`` (``None``: all of them); the caller releases
        them once the lock is dropped."""
        removed: list[_Slab] = []
        for slab in slabs:
            if target is not None and self.total_bytes <= target:
                break
            if not slab.empty():
                continue
            self._slabs.remove(slab)
            self.total_bytes -= slab.nbytes
            removed.append(slab)
        return removed

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in one of the arena's slabs."""
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        ptr = tensor.untyped_storage().data_ptr()
        with self._locked():
            return any(s.ptr <= ptr < s.ptr + s.nbytes for s in self._slabs)

    # -- release

    def trim(self, *, keep_within_limit: bool = False) -> int:
        """Unregister slabs with no live block: all of them, or (``keep_within_limit``) only
        as many as needed to bring ``total_bytes`` within ``limit_bytes``. Returns the bytes
        released. Blocking (unregistering takes milliseconds per GB)."""
        with self._locked():
            if keep_within_limit and self.limit_bytes is None:
                return 0
            largest_first = sorted(self._slabs, key=lambda s: s.nbytes, reverse=True)
            target = self.limit_bytes if keep_within_limit else None
            released = self._remove_empty_locked(largest_first, target)
        for slab in released:
            self._release(slab)
        return sum(slab.nbytes for slab in released)

    def close(self) -> None:
        """Release every empty slab now, and each other one when its last block returns."""
        with self._locked():
            self._closed = True
        self.trim()

    # -- internals

    def _slab_size_for(self, need: int) -> int:
        if need * 2 >= self.slab_bytes:
            return -(-need // _SLAB_ROUND) * _SLAB_ROUND
        return self.slab_bytes

    def _new_slab(self, size: int, need: int) -> _Slab:
        with self._locked():
            limit = self.limit_bytes
            total = self.total_bytes
        if limit is not None and total + size > limit:
            # Within the limit, a slab just large enough may still fit.
            size = -(-need // mmap.PAGESIZE) * mmap.PAGESIZE
            if total + size > limit:
                raise torch.OutOfMemoryError(
                    f"the pinned arena cannot add {size} B: it holds {total} B of a {limit} B "
                    "limit (the pinned-host budget less everything else charged there)"
                )
        mapping = private_mapping(size)
        exporter = (ctypes.c_uint8 * size).from_buffer(mapping)
        raw = torch.frombuffer(exporter, dtype=torch.uint8)
        if self._prefault is not None:
            self._prefault(raw)
        ptr = raw.data_ptr()
        del raw, exporter
        self._register(ptr, size)
        self.slabs_made += 1
        return _Slab(mapping, size, ptr, self._unregister)

    def _add_locked(self, slab: _Slab) -> None:
        self._slabs.append(slab)
        self.total_bytes += slab.nbytes

    def _take_locked(self, need: int) -> tuple[_Slab, int] | None:
        best: tuple[_Slab, int] | None = None
        best_hole = 0
        for slab in self._slabs:
            if not slab.ready:
                continue  # being registered for the block carved from it
            for _, length in slab.free:
                if length >= need and (best is None or length < best_hole):
                    best, best_hole = (slab, 0), length
        if best is None:
            return None
        slab = best[0]
        offset = slab.take(need)
        assert offset is not None
        return slab, offset

    def _carved_locked(self, nbytes: int) -> None:
        self.carved_bytes += self.block_bytes(nbytes)
        self.value_bytes += nbytes
        self.carves += 1

    def _tensor(
        self,
        slab: _Slab,
        offset: int,
        nbytes: int,
        shape: Sequence[int] | torch.Size,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        exporter = (ctypes.c_uint8 * max(nbytes, 1)).from_buffer(slab.mapping, offset)
        tensor = tensor_over(exporter, nbytes, dtype, shape)
        weakref.finalize(exporter, _return_block, weakref.ref(self), slab, offset, nbytes)
        del exporter  # the tensor's storage holds it now
        return tensor

    def _locked(self) -> _Section:
        """Hold the lock; on the way out, take back the blocks returned meanwhile (and release,
        without the lock, the slabs that leave with them). See :class:`_Section`."""
        return self._section

    def _returned(self, slab: _Slab, offset: int, nbytes: int) -> None:
        """The last tensor over a block died (any thread; a finalizer, so possibly in the
        middle of a locked section of this very thread, when a garbage collection ran there:
        the block is then taken back as that section ends)."""
        self._returns.append((slab, offset, nbytes))
        if self._owner == threading.get_ident():
            return
        with self._locked():
            pass

    def _take_back_locked(self, slab: _Slab, offset: int, nbytes: int) -> bool:
        """A returned block back in its slab; whether the slab now leaves the arena."""
        if slab.detached:
            slab.detached = False
            return True  # its registration failed: its only block, never counted
        return self._give_back_locked(slab, offset, nbytes)

    def _give_back_locked(self, slab: _Slab, offset: int, nbytes: int) -> bool:
        """Return a block to its slab; whether the slab now leaves the arena (then the caller
        releases it, without the lock)."""
        slab.give_back(offset, self.block_bytes(nbytes))
        self.carved_bytes -= self.block_bytes(nbytes)
        self.value_bytes -= nbytes
        over = self.limit_bytes is not None and self.total_bytes > self.limit_bytes
        if slab.empty() and (self._closed or over) and slab in self._slabs:
            self._slabs.remove(slab)
            self.total_bytes -= slab.nbytes
            return True
        return False

    def _release(self, slab: _Slab) -> None:
        later = self._unregister_later
        if later is not None and slab.registered:
            slab.registered = False
            later(slab.ptr, slab.mapping, functools.partial(_unmap, slab.mapping))
            return
        slab.unlock()
        _unmap(slab.mapping)

    def __repr__(self) -> str:
        return (
            f"<PinnedArena slabs={len(self._slabs)} total={self.total_bytes} B "
            f"values={self.value_bytes} B limit={self.limit_bytes}>"
        )


def _nbytes(shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * dtype.itemsize
