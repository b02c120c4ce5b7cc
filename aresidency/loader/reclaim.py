"""Giving back a ``DataLoader`` batch's shared memory without holding the interpreter lock.

A ``DataLoader`` with worker processes hands each batch over in shared memory: every tensor's
storage is a mapping of a shared-memory file the worker created and this process received as
a file descriptor (torch's default ``file_descriptor`` sharing strategy on Linux). When the last
reference to such a tensor goes, torch unmaps it and closes the descriptor, which frees the
file's pages, inside the decref, with the interpreter lock held: about 3 ms per 16 MiB on the
development machine, 12 ms per 64 MiB. Every other Python thread, the event loop's included,
waits that long; behind a loader fed by a ``DataLoader`` that was the event loop's lag.

:func:`release_shared` does that work with the lock released, for tensors nobody else holds:
it replaces the mapping with an inaccessible anonymous placeholder of the same size
(``mmap(MAP_FIXED)``, one call that drops the shared pages from this process) and the
descriptor with one of ``/dev/null`` (``dup2``, which closes the shared file's last reference,
so the kernel frees its pages there), both through ``ctypes`` (which releases the lock during
foreign calls). Torch's own clean-up then unmaps the placeholder and closes the ``/dev/null``
descriptor: cheap, and never touching memory or descriptors that are not the tensor's.

A tensor is released this way only if all of this holds; otherwise it is dropped as usual:
Linux with ``libc``, the ``file_descriptor`` sharing strategy, a CPU tensor that is not page-
locked, whose storage is shared memory, starts on a page and is exactly the tensor (no other
view), and whose only references are the caller's (its Python reference count and its
storage's use count say so). The caller must know that nothing reads the memory any more (no
copy in flight from it).

What the host waits on: the calling thread (the loader's ring thread, never the event loop)
for the unmapping and the freeing, without the interpreter lock.
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

_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.dup2.restype = ctypes.c_int
        libc.dup2.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
_DEVNULL: int | None = None
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _devnull() -> int:
    global _DEVNULL
    if _DEVNULL is None:
        _DEVNULL = os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    return _DEVNULL


def release_shared(parts: list[Any]) -> int:
    """Empty ``parts`` (set each entry to ``None``) and give back the shared memory of the
    tensors only the list held, with the interpreter lock released (see the module
    docstring); the others are just dropped. Returns the bytes given back that way."""
    released = 0
    for number in range(len(parts)):
        tensor, parts[number] = parts[number], None
        # The references now: ``tensor`` and getrefcount's argument.
        if tensor is None or sys.getrefcount(tensor) > 2:
            continue
        with contextlib.suppress(Exception):  # anything unexpected: dropped as usual
            released += _release(tensor)
        del tensor
    return released


def _release(tensor: torch.Tensor) -> int:
    libc = _LIBC
    if (
        libc is None
        or _USE_COUNT is None
        or not isinstance(tensor, torch.Tensor)
        or tensor.device.type != "cpu"
        or tensor.storage_offset() != 0
        or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"  # type: ignore[no-untyped-call]
    ):
        return 0
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
        return 0
    fd, size = storage._share_fd_cpu_()[:2]  # shared already: its own descriptor, no copy
    address = storage.data_ptr()
    if size != nbytes:
        return 0
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    placeholder = libc.mmap(
        address,
        length,
        _PROT_NONE,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
        -1,
        0,
    )
    if placeholder != address:
        # MAP_FIXED either replaces the range or fails leaving it as it was: nothing changed.
        return 0
    libc.dup2(_devnull(), fd)  # the shared file's last reference: its pages are freed here
    return nbytes
