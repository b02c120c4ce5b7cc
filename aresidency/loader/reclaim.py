"""Giving back a ``DataLoader`` batch's shared memory without holding the interpreter lock.

A ``DataLoader`` with worker processes hands each batch over in shared memory: every tensor's
storage is a mapping of a shared-memory file the worker created and this process received as
a file descriptor (torch's default ``file_descriptor`` sharing strategy on Linux). When the last
reference to such a tensor goes, torch unmaps it (tearing down a page-table entry per page) and
closes the descriptor (the file's last reference: the kernel frees its pages), inside the
decref, with the interpreter lock held: about 1.2 + 1.8 ms per 16 MiB on the development
machine. Every other Python thread, the event loop's included, waits that long; behind a loader
fed by a ``DataLoader`` that was the event loop's lag.

:func:`release_shared` does that work with the lock released, for tensors nobody else holds:
``madvise(MADV_DONTNEED)`` over the mapping drops its page-table entries (the memory stays
valid: a read after it faults the same shared pages back in), a duplicate of the descriptor
keeps the file alive while torch's own clean-up runs (an unmap with nothing mapped, a close
that is not the last), and closing that duplicate frees the pages. ``madvise`` and ``close``
go through ``ctypes``, which releases the lock during foreign calls. Nothing is ever made
inaccessible and no descriptor but our own duplicate is touched, so a thread that picked the
same storage up meanwhile (torch caches received storages by file) still reads the right data.

Only tensors that qualify are treated this way; the others are dropped as usual: Linux with
``libc``, the ``file_descriptor`` sharing strategy, a CPU tensor that is not page-locked, whose
storage is shared memory, starts on a page and is exactly the tensor (no other view), and whose
only references are the caller's (its Python reference count and its storage's use count say
so; with other references the work would only be moved, not saved).

What the host waits on: the calling thread (the loader's ring thread, never the event loop)
for the page-table teardown and the freeing, without the interpreter lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
from typing import Any

import torch

__all__ = ["release_shared"]

_MADV_DONTNEED = 4  # Linux


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.close.restype = ctypes.c_int
        libc.close.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def release_shared(parts: list[Any]) -> int:
    """Empty ``parts`` (set each entry to ``None``) and give back the shared memory of the
    tensors only the list held, with the interpreter lock released (see the module
    docstring); the others are just dropped. Returns the bytes of the tensors treated so."""
    released = 0
    for number in range(len(parts)):
        tensor, parts[number] = parts[number], None
        # The references now: ``tensor`` and getrefcount's argument.
        if tensor is None or sys.getrefcount(tensor) > 2:
            continue
        duplicate = None
        nbytes = 0
        with contextlib.suppress(Exception):  # anything unexpected: dropped as usual
            duplicate, nbytes = _drop_page_tables(tensor)
        del tensor  # torch unmaps (no page tables left) and closes its descriptor (not the last)
        if duplicate is not None:
            _LIBC.close(duplicate)  # the file's last reference here: its pages are freed
            released += nbytes
    return released


def _drop_page_tables(tensor: torch.Tensor) -> tuple[int | None, int]:
    """For a tensor that qualifies: its page-table entries dropped, and a duplicate of its
    storage's descriptor with its size; ``(None, 0)`` for any other."""
    libc = _LIBC
    if (
        libc is None
        or _USE_COUNT is None
        or not isinstance(tensor, torch.Tensor)
        or tensor.device.type != "cpu"
        or tensor.storage_offset() != 0
        or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"  # type: ignore[no-untyped-call]
    ):
        return None, 0
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if (
        not storage.is_shared()
        or nbytes != tensor.numel() * tensor.element_size()
        or nbytes < mmap.PAGESIZE
        or storage.data_ptr() % mmap.PAGESIZE
        or _USE_COUNT(storage._cdata) != 2  # the tensor's and this wrapper's
        or tensor.is_pinned()  # last: a driver query on a machine with CUDA
    ):
        return None, 0
    fd, size = storage._share_fd_cpu_()[:2]  # shared already: its own descriptor, no copy
    if size != nbytes:
        return None, 0
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if libc.madvise(storage.data_ptr(), length, _MADV_DONTNEED) != 0:
        return None, 0
    return os.dup(fd), nbytes
