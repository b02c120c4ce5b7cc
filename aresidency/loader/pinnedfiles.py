"""A staged source's files page-locked where they lie, so batches go to the device by DMA
straight out of the page cache (``DeviceLoader(..., pin_source=True)``).

The staged path copies every batch twice: from the page cache into a pinned staging buffer
(host threads, bounded by the host's memory bandwidth, which the link's DMA shares), then to the
device. When the dataset fits in host memory and is read many times (epochs), the first copy can
go: :class:`PinnedFiles` maps each file read-only and shared (``mmap(PROT_READ, MAP_SHARED)``,
the page cache's own pages, no copy), page-locks the mapping with ``cudaHostRegister`` and the
read-only flag (``cudaHostRegisterReadOnly``: the device only reads it), and the ring's thread
copies each batch out of the mapping with one driver call per tensor and shard. The host does no
copy at all; batches move at the link's speed.

The price, paid once when the loader first needs the files: page-locking faults in and locks
every page of every file (the files are read from disk if not cached; on an H200 host locking
runs at a few GB/s), and the whole dataset stays locked in host memory until the loader closes.
So it is for datasets that fit, next to everything else, in host memory.

Accounting: the locked bytes (every file rounded up to whole pages) are charged to
``pinned-host`` as one named reservation (``"<loader name>.pinned-files"``), taken before
anything is locked (``ResidencyBudgetError`` at once, with a note, when it does not fit) and
ended at close, after the locks were released. Without CUDA (the simulated backend) nothing is
locked: the files are only mapped, and the reservation still charges what would be locked, so
that the accounting reads the same as on a GPU.

What the host waits on: :meth:`PinnedFiles.open` maps and locks in a worker thread;
:meth:`PinnedFiles.aclose` releases the locks in a worker thread once the devices finished
the work queued so far (unlocking waits for the device to be idle; see
:mod:`~aresidency.backends.pinned`). Nothing here runs on the event loop longer than a
reservation.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
from collections.abc import Sequence
from typing import Any, Final

import anyio
import torch

from ..backends.pinned import flush_unpins, register_available, unpin_later
from ..core.errors import ResidencyBudgetError
from ..core.sizes import format_nbytes
from ..runtime.manager import ResidencyManager
from ..runtime.shield import finish_shielded
from .shardfiles import ShardFile

__all__ = ["PinnedFiles"]

#: ``cudaHostRegisterReadOnly``: the device only reads the range (required for memory the
#: process mapped read-only).
REGISTER_READ_ONLY: Final = 8
PAGE: Final = mmap.PAGESIZE
#: Whether the C library's ``mmap`` can be called (through ``ctypes``).
POSIX = os.name == "posix"


def _libc() -> Any:
    if not POSIX:
        raise OSError(
            "pin_source maps the files with the C library's mmap, which needs a POSIX system; "
            "leave pin_source off here (batches then go through the staging buffers)"
        )
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
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class _Mapped:
    """One file mapped read-only and shared: ``address``, ``nbytes`` (the file's size),
    ``tensor`` (``uint8`` over the mapping), ``locked`` (page-locked with CUDA)."""

    __slots__ = ("address", "file", "locked", "nbytes", "tensor")

    def __init__(self, file: ShardFile, address: int, nbytes: int) -> None:
        self.file = file
        self.address = address
        self.nbytes = nbytes
        # ctypes' view of the mapping is a writable buffer to Python (torch.frombuffer would
        # warn about a read-only one); nothing ever writes it: the pages are PROT_READ.
        self.tensor = torch.frombuffer(
            (ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8
        )
        self.locked = False

    @property
    def locked_nbytes(self) -> int:
        return -(-self.nbytes // PAGE) * PAGE


class PinnedFiles:
    """The files of a staged source, mapped and page-locked for the life of a loader (see the
    module docstring).

    State: ``files`` (the :class:`~aresidency.loader.shardfiles.ShardFile` objects, in order),
    ``nbytes`` (what is charged: every file in whole pages), ``status`` (``new`` -> ``open``
    -> ``closed``), ``locked`` (page-locked with CUDA, else only mapped), ``lock_s`` (seconds
    :meth:`open` took to map and lock), ``_mapped`` (path -> :class:`_Mapped`).
    Invariant: a locked range is unlocked before it is unmapped.
    """

    def __init__(self, files: Sequence[ShardFile], name: str) -> None:
        if not files:
            raise ValueError("pin_source needs a source with at least one file")
        self.files = list(files)
        self.name = name
        self.nbytes = sum(-(-max(1, os.stat(f.path).st_size) // PAGE) * PAGE for f in self.files)
        self.status = "new"
        self.locked = False
        self.lock_s = 0.0
        self._mapped: dict[Any, _Mapped] = {}
        self._stack = contextlib.AsyncExitStack()

    def view(self, file: ShardFile, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of ``file`` from ``offset``: a ``uint8`` view of its locked mapping (any
        thread, while open). ``ValueError`` naming the file for a range past its end (it was
        cut short since it was opened)."""
        mapped = self._mapped.get(file.path)
        if mapped is None:
            raise RuntimeError(f"{file.path} is not mapped by {self!r}")
        if offset < 0 or offset + nbytes > mapped.nbytes:
            raise ValueError(
                f"{file.path} holds {mapped.nbytes} B, but a batch needs its bytes "
                f"{offset}..{offset + nbytes}: was it cut short after the source opened it?"
            )
        return mapped.tensor[offset : offset + nbytes]

    async def open(self, manager: ResidencyManager) -> None:
        """Take the ``pinned-host`` reservation (``ResidencyBudgetError`` at once if it does not
        fit), then map and lock every file in a worker thread (``OSError`` naming the file
        when one cannot be mapped or locked; nothing stays locked then). Loop thread."""
        if self.status != "new":
            raise RuntimeError(f"{self!r} was opened already")
        what = f"{self.name}.pinned-files"
        try:
            await self._stack.enter_async_context(
                manager.reservation(what, "pinned-host", self.nbytes)
            )
        except ResidencyBudgetError as error:
            error.add_note(
                f"pin_source page-locks the source's {len(self.files)} files "
                f"({format_nbytes(self.nbytes)}) in host memory: raise the pinned-host budget, "
                "or leave pin_source off (batches then go through the staging buffers)"
            )
            raise
        self.status = "open"
        try:
            # To the end whatever cancels the task (a native asyncio cancellation too, which an
            # anyio shield lets through): the thread maps and locks on regardless, and the
            # clean-up below must see every file it mapped.
            await finish_shielded(anyio.to_thread.run_sync, self._map_all)
        except BaseException:
            await self.aclose()
            raise

    def _map_all(self) -> None:
        start = time.perf_counter()
        libc = _libc()
        lock = torch.cuda.is_available() and register_available()
        for file in self.files:
            fd = file.open()  # checks it is still the file the source opened
            try:
                nbytes = os.fstat(fd).st_size
                if nbytes == 0:
                    continue  # nothing to read from it (a source refuses empty shards anyway)
                address = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if address in (None, ctypes.c_void_p(-1).value):
                    code = ctypes.get_errno()
                    raise OSError(code, f"could not map {file.path}: {os.strerror(code)}")
            finally:
                os.close(fd)
            mapped = _Mapped(file, address, nbytes)
            self._mapped[file.path] = mapped
            if lock:
                self._lock(mapped)
        self.locked = lock
        self.lock_s = time.perf_counter() - start

    @staticmethod
    def _lock(mapped: _Mapped) -> None:
        cudart: Any = torch.cuda.cudart  # untyped in torch
        rt = cudart()
        err = rt.cudaHostRegister(mapped.address, mapped.nbytes, REGISTER_READ_ONLY)
        if int(err) != 0:
            message = rt.cudaGetErrorString(err)
            with contextlib.suppress(Exception):
                rt.cudaGetLastError()  # clear it: torch's next check would report it
            raise OSError(
                f"cudaHostRegister could not page-lock {mapped.file.path} "
                f"({format_nbytes(mapped.nbytes)}, read-only): {message}; leave pin_source off "
                "to read it through the staging buffers"
            )
        mapped.locked = True

    async def aclose(self) -> None:
        """Unlock (once the devices finished the work queued so far: no copy reads a file any
        more) and unmap every file, then end the reservation. The caller makes sure no new
        copy out of the files is issued."""
        if self.status == "closed":
            return
        self.status = "closed"
        self.locked = False
        mapped, self._mapped = list(self._mapped.values()), {}

        def release() -> None:
            locked = [m for m in mapped if m.locked]
            for m in locked:
                unpin_later(m.address, m)
            if locked:
                flush_unpins()
            libc = _libc()
            for m in mapped:
                m.locked = False
                m.tensor = torch.empty(0, dtype=torch.uint8)  # no view outlives the mapping
                libc.munmap(m.address, m.nbytes)

        try:
            await finish_shielded(anyio.to_thread.run_sync, release)
        finally:
            with contextlib.suppress(Exception):  # a closed manager took its ledger with it
                await self._stack.aclose()

    def __repr__(self) -> str:
        kind = "page-locked" if self.locked else "mapped (no CUDA: not page-locked)"
        return (
            f"<PinnedFiles {self.name} {len(self.files)} files {format_nbytes(self.nbytes)} "
            f"{kind} {self.status}>"
        )
