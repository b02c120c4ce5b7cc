"""Byte views and poison: helpers every backend shares.

* :func:`as_bytes`: a flat ``uint8`` view of a contiguous tensor (no copy), the unit that copies
  and staging move.
* :func:`poison_` / :func:`is_poisoned`: the pattern written into memory that holds no value
  (NaN for floating and complex dtypes, the byte 0xA5 otherwise). The simulation poisons every
  allocation and every release; both backends poison the destination of a transfer that fault
  injection fails, so a read that should not have happened shows up in tests.
* :func:`host_copy` / :func:`host_fill`: large copies and fills of host memory (packing
  pinned twins, faulting in new pinned slabs) in at most :data:`HOST_THREADS` threads of the
  process's own, through libc's ``memmove``/``memset`` without the interpreter lock. torch's
  ``copy_``/``fill_`` would run on its intra-op pool, one thread per core, which competes with
  the event loop and a ``DataLoader``'s workers for every core (measured on an H200 host: the
  loop's lag p99 went from 0.4 ms to 3-10 ms while twins were packed that way).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Final

import torch

__all__ = [
    "HOST_THREADS",
    "POISON_BYTE",
    "as_bytes",
    "host_copy",
    "host_fill",
    "is_poisoned",
    "poison_",
    "tensor_over",
]

POISON_BYTE: Final = 0xA5


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's elements (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def tensor_over(
    exporter: object, nbytes: int, dtype: torch.dtype, shape: Sequence[int] | torch.Size
) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` over the first ``nbytes`` of the buffer ``exporter``
    (``nbytes`` = its elements' bytes; no copy; the tensor's storage keeps ``exporter``). Made
    with one view at most: it runs on the loop, once per destination."""
    if nbytes:
        typed = torch.frombuffer(exporter, dtype=dtype, count=nbytes // dtype.itemsize)
    else:
        typed = torch.frombuffer(exporter, dtype=torch.uint8)[:0].view(dtype)
    shape = tuple(shape)
    return typed if typed.shape == shape else typed.view(shape)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Overwrite the whole storage under ``tensor`` (not just its view) with poison: NaN for
    floating and complex dtypes, the byte 0xA5 otherwise. Enqueued on the current stream of the
    tensor's device (synchronous for host memory)."""
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


#: Threads of :func:`host_copy` and :func:`host_fill` (a quarter of the CPUs, 1 to 4).
HOST_THREADS = max(1, min(4, (os.cpu_count() or 2) // 4))
#: Work this large or more is split across the threads; less runs in the calling thread.
HOST_SPLIT_BYTES = 4 << 20
_host_pool: concurrent.futures.ThreadPoolExecutor | None = None
_host_pool_lock = threading.Lock()


def _split(total: int) -> int:
    """The bytes each thread takes (page-aligned), or 0 to stay in the calling thread."""
    if HOST_THREADS == 1 or total < HOST_SPLIT_BYTES:
        return 0
    step = -(-total // HOST_THREADS)
    return -(-step // mmap.PAGESIZE) * mmap.PAGESIZE


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _host_pool
    with _host_pool_lock:
        if _host_pool is None:
            _host_pool = concurrent.futures.ThreadPoolExecutor(
                HOST_THREADS, thread_name_prefix="aresidency-host-copy"
            )
        return _host_pool


def _run_all(calls: list[tuple[Callable[..., object], int, int, int]]) -> None:
    pool = _pool()
    futures = [pool.submit(fn, a, b, n) for fn, a, b, n in calls]
    for future in futures:
        future.result()


def host_copy(spans: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(destination address, source address, nbytes)`` span of host memory and
    return when all are done (blocks the calling thread, never holds the interpreter lock
    while copying). Large work is split, page-aligned, across :data:`HOST_THREADS` threads."""
    step = _split(sum(n for _, _, n in spans))
    if not step:
        for dst, src, n in spans:
            ctypes.memmove(dst, src, n)
        return
    _run_all(
        [
            (ctypes.memmove, dst + off, src + off, min(step, n - off))
            for dst, src, n in spans
            for off in range(0, n, step)
        ]
    )


def host_fill(address: int, nbytes: int, byte: int = 0) -> None:
    """Set ``nbytes`` of host memory at ``address`` to ``byte`` (faulting new pages in), as
    :func:`host_copy` does its copies."""
    step = _split(nbytes)
    if not step:
        ctypes.memset(address, byte, nbytes)
        return
    _run_all(
        [
            (ctypes.memset, address + off, byte, min(step, nbytes - off))
            for off in range(0, nbytes, step)
        ]
    )
