"""Pageable host destinations whose pages are already faulted in: freed mappings kept for reuse.

A device-to-pageable copy lands in fresh memory, and on an H200 host the kernel faults fresh
pages in at 19-24 GB/s whatever the number of threads (the link moves 55 GB/s), while a copy
into pages already faulted in reaches 35-41 GB/s (``benchmarks/RESULTS.md``). The CUDA
backend's large pageable destinations are private anonymous mappings
(:func:`~aresidency.backends.arena.private_mapping`, asked for transparent huge pages);
:class:`PageableCache` keeps the mappings of freed destinations, up to ``limit_bytes``, and
hands them out again to destinations of the same rounded size, the way torch's caching
allocator keeps device memory.

* **Lifetimes.** A mapping returns to the cache when the last tensor over it dies (a
  finalizer on the tensor's buffer exporter), never earlier: a tensor the user kept keeps its
  data. A reused mapping still holds the old bytes; a destination is written whole by its copy
  before anyone reads it.
* **Sizes.** A destination of ``n`` bytes takes a mapping of ``n`` rounded up to 2 MiB (a huge
  page): the rounding is at most one huge page per value and is never charged; only mappings
  of the same rounded size are reused.
* **Bounds.** The cache never keeps more than ``limit_bytes`` (``0``: nothing is kept). The
  runtime lowers the limit to the pageable-host budget's headroom and shows what is kept as
  that ledger's spare bytes; lowering the limit unmaps what no longer fits, largest first.
  ``close`` unmaps everything kept, and mappings returned after it are unmapped at once.

Thread-safe: destinations are made on the loop or a lane thread, mappings come back on
whichever thread drops the last tensor. Unmapping a large mapping takes milliseconds: it runs
on that thread, outside the lock.

State: ``_free`` (rounded size -> kept mappings, most recently returned last),
``cached_bytes`` (their sum), ``limit_bytes``, ``_closed``; counters ``reuses`` (destinations
given a kept mapping) and ``fresh`` (destinations given a new one). Invariant:
``cached_bytes == sum of the kept mappings' sizes <= limit_bytes`` once a call returns.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Final

import torch

from .arena import private_mapping
from .memory import tensor_over

__all__ = ["MAPPING_ROUND", "PageableCache", "default_host_keep_bytes"]

MAPPING_ROUND: Final = 2 << 20  # a transparent huge page


def default_host_keep_bytes(*, at_least: int = 0) -> int:
    """How much freed host memory a backend keeps ready by default: an eighth of the
    machine's memory, at most 16 GiB and at least ``at_least`` (the pinned arena asks for 4
    GiB, its limit before it scaled with memory; ``at_least`` when the size of memory is
    unknown)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return at_least
    return max(min(total // 8, 16 << 30), at_least)


def _rounded(nbytes: int) -> int:
    return -(-max(nbytes, 1) // MAPPING_ROUND) * MAPPING_ROUND


class PageableCache:
    """Freed pageable mappings kept for destinations of the same size (module docstring)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._closed = False
        self.cached_bytes = 0
        self.reuses = 0
        self.fresh = 0

    def empty(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized pageable tensor over a kept mapping of its rounded size, or over a
        new one (see the module docstring)."""
        numel = math.prod(int(d) for d in shape)
        nbytes = numel * dtype.itemsize
        size = _rounded(nbytes)
        mapping = None
        with self._lock:
            kept = self._free.get(size)
            if kept:
                mapping = kept.pop()
                if not kept:
                    del self._free[size]
                self.cached_bytes -= size
                self.reuses += 1
            else:
                self.fresh += 1
        if mapping is None:
            mapping = private_mapping(size)
        exporter = (ctypes.c_uint8 * max(nbytes, 1)).from_buffer(mapping)
        tensor = tensor_over(exporter, nbytes, dtype, shape)
        done = weakref.finalize(exporter, _give_back, weakref.ref(self), mapping, size)
        done.atexit = False
        del exporter  # the tensor's storage holds it now
        return tensor

    def set_limit(self, limit_bytes: int) -> None:
        """Keep at most ``limit_bytes`` from now on; unmaps what no longer fits (blocking for
        as long as that takes)."""
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.enforce_limit()

    def enforce_limit(self) -> None:
        """Unmap kept mappings, largest first, until they fit ``limit_bytes`` (blocking for as
        long as that takes: a worker thread when the limit was lowered on the loop)."""
        with self._lock:
            dropped = self._evict_locked(self.limit_bytes)
        _unmap_all(dropped)

    def trim(self) -> int:
        """Unmap every kept mapping; returns the bytes given back."""
        with self._lock:
            freed = self.cached_bytes
            dropped = self._evict_locked(0)
        _unmap_all(dropped)
        return freed

    def close(self) -> None:
        """Unmap every kept mapping and keep none from now on."""
        with self._lock:
            self._closed = True
        self.trim()

    def _returned(self, mapping: mmap.mmap, size: int) -> None:
        """The last tensor over ``mapping`` died (any thread): keep it if it fits."""
        with self._lock:
            keep = not self._closed and self.cached_bytes + size <= self.limit_bytes
            if keep:
                self._free.setdefault(size, []).append(mapping)
                self.cached_bytes += size
        if not keep:
            _unmap_all([mapping])

    def _evict_locked(self, target: int) -> list[mmap.mmap]:
        """Take kept mappings out, largest first, until at most ``target`` bytes remain."""
        dropped: list[mmap.mmap] = []
        for size in sorted(self._free, reverse=True):
            kept = self._free[size]
            while kept and self.cached_bytes > target:
                dropped.append(kept.pop(0))
                self.cached_bytes -= size
            if not kept:
                del self._free[size]
        return dropped

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (
            f"<PageableCache{state} kept={self.cached_bytes} B limit={self.limit_bytes} B "
            f"reuses={self.reuses} fresh={self.fresh}>"
        )


def _give_back(owner: weakref.ref[PageableCache], mapping: mmap.mmap, size: int) -> None:
    cache = owner()
    if cache is None:
        _unmap_all([mapping])
    else:
        cache._returned(mapping, size)


def _unmap_all(mappings: list[mmap.mmap]) -> None:
    for mapping in mappings:
        try:
            mapping.close()
        except BufferError:
            pass  # cannot happen (no tensor is over a returned mapping); unmapped at death
