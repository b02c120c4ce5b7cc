"""The shard files' formats and reads, for :class:`~aresidency.loader.ShardSource`.

``.npy`` headers (numpy's NEP 1) and safetensors headers are parsed here without numpy;
:func:`pread_into` reads a run of samples with ``preadv`` straight into a destination
buffer, opening the file for each read and checking it is the file the source opened.

What the host waits on: opening reads headers (file I/O in the calling thread); the reads block
their thread (a loader's fill thread, never the event loop).
"""

from __future__ import annotations

import ast
import ctypes
import errno
import json
import mmap
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..backends.memory import as_bytes

# The .npy format (numpy's NEP 1): magic, version, header length, then a Python literal dict.
NPY_MAGIC = b"\x93NUMPY"
NPY_DTYPES: dict[str, torch.dtype] = {
    "f8": torch.float64,
    "f4": torch.float32,
    "f2": torch.float16,
    "i8": torch.int64,
    "i4": torch.int32,
    "i2": torch.int16,
    "i1": torch.int8,
    "u1": torch.uint8,
    "u2": torch.uint16,
    "u4": torch.uint32,
    "u8": torch.uint64,
    "b1": torch.bool,
    "c8": torch.complex64,
    "c16": torch.complex128,
}


class ShardFile:
    """A shard file read with ``pread``: opened for each read, not held open (a dataset of
    thousands of shards would otherwise hold thousands of descriptors), and checked to be the
    file the source opened (the same device and inode), so that a file replaced since reads
    as an error, not as other data."""

    __slots__ = ("identity", "path")

    def __init__(self, path: Path) -> None:
        self.path = path
        info = os.stat(path)
        self.identity = (info.st_dev, info.st_ino)

    def open(self) -> int:
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != self.identity:
            os.close(fd)
            raise OSError(
                f"{self.path} was replaced since the ShardSource opened it: open a new "
                "source to read the new file"
            )
        return fd


#: The most one read(2) call returns on Linux (0x7ffff000 bytes).
READ_MAX = 0x7FFFF000


def pread_into(file: ShardFile, offset: int, buffer: torch.Tensor, start: int, nbytes: int) -> None:
    """Fill ``nbytes`` of the contiguous ``buffer`` from byte ``start`` on with as many bytes of
    ``file`` at ``offset``; blocks the calling thread (a reading thread of the loader, never the
    event loop).

    The kernel copies from the page cache straight into the buffer (``preadv``, the GIL
    released): unlike a copy out of the file's mapping it takes no page fault per 4 KiB of
    the file, and it runs in the calling thread only, where torch's copy would start its own
    thread pool in every reading thread at once (CPUs oversubscribed, the event loop late).
    No tensor view is made: the caller's thread (the loader's ring thread, which the event
    loop shares the interpreter with) only computes addresses."""
    address = buffer.data_ptr() + start
    done = 0
    fd = file.open()
    try:
        while done < nbytes:
            count = min(nbytes - done, READ_MAX)
            window = (ctypes.c_char * count).from_address(address + done)
            got = os.preadv(fd, [window], offset + done)
            if got <= 0:
                raise OSError(
                    f"{file.path} ended early: {nbytes - done} B missing at offset {offset + done}"
                )
            done += got
    finally:
        os.close(fd)


def copy_bytes(destination: torch.Tensor, source: torch.Tensor) -> None:
    as_bytes(destination).copy_(as_bytes(source))


def gather(source: torch.Tensor, index: torch.Tensor, destination: torch.Tensor) -> None:
    torch.index_select(source, 0, index, out=destination)


#: How many pieces one process_vm_readv call takes on Linux (IOV_MAX).
_IOV_MAX = 1024
#: Rows smaller than this are gathered by torch after the check: the kernel's cost per row
#: (about half a microsecond) made 256-byte rows 2.7x slower than torch's gather
#: (benchmarks/bench_shard_gather.py), while from 4 KiB up the two are on par or the kernel
#: is faster.
KERNEL_ROW_MIN = 1024


def _load_self_read() -> Any:
    """libc's ``process_vm_readv``, or None where there is none (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return function


_self_read: Any = _load_self_read()


def gather_rows(
    file: ShardFile,
    offset: int,
    source: torch.Tensor,
    index: torch.Tensor,
    destination: torch.Tensor,
) -> None:
    """Copy the rows ``index`` (``int64``) of ``source``, contiguous rows over a private
    mapping of ``file`` whose row 0 lies at file offset ``offset``, into the contiguous
    ``destination``; blocks the calling thread.

    A mapping whose file was cut short kills the process with ``SIGBUS`` when a page past
    the new end is touched. So the file is opened first (it must still be the file the source
    opened) and must hold every row asked for, else ``OSError`` naming it; then the rows are
    copied by the kernel (``process_vm_readv`` on this process: one call for up to 1024
    rows, the interpreter lock released), which reports a page it cannot read as a short
    copy instead of a signal: a file cut short during the copy is an ``OSError`` too. Rows
    under ``KERNEL_ROW_MIN`` bytes, and every row where the system refuses that call (not
    Linux, or a sandbox that forbids it), are gathered by torch after the check: then only a
    file cut short in the microseconds of the gather itself still stops the process."""
    rows = int(index.numel())
    row_nbytes = destination.nbytes // max(rows, 1)
    if rows == 0 or row_nbytes == 0:
        return
    needed = offset + (int(index.max()) + 1) * row_nbytes
    _check_holds(file, needed)
    global _self_read
    if _self_read is not None and row_nbytes >= KERNEL_ROW_MIN:
        # Each row is one iovec (address, length): two int64 per row, as the kernel reads it.
        remote = torch.empty((rows, 2), dtype=torch.int64)
        torch.mul(index, row_nbytes, out=remote[:, 0]).add_(source.data_ptr())
        remote[:, 1] = row_nbytes
        local = (ctypes.c_uint64 * 2)()
        pid = os.getpid()
        for first in range(0, rows, _IOV_MAX):
            count = min(_IOV_MAX, rows - first)
            local[0] = destination.data_ptr() + first * row_nbytes
            local[1] = count * row_nbytes
            address = remote.data_ptr() + first * 16
            got = _self_read(pid, ctypes.addressof(local), 1, address, count, 0)
            if got == count * row_nbytes:
                continue
            error = ctypes.get_errno()
            if got < 0 and error in (errno.ENOSYS, errno.EPERM) and first == 0:
                _self_read = None  # refused here: gather with torch from now on
                break
            _check_holds(file, needed)  # cut short meanwhile: says so, with the bytes
            raise OSError(
                error or errno.EIO,
                f"{file.path}: rows of a shuffled batch could not be read from its mapping "
                f"({os.strerror(error) if got < 0 else f'{max(got, 0)} B read'})",
            )
        else:
            return
    gather(source, index, destination)


def _check_holds(file: ShardFile, needed: int) -> None:
    """``OSError`` naming ``file`` unless it is still the source's file and has ``needed``
    bytes."""
    fd = file.open()
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size < needed:
        raise OSError(f"{file.path} ended early: {needed - size} B missing at offset {size}")


def open_npy(path: Path) -> tuple[torch.Tensor, mmap.mmap, int]:
    """The array of an ``.npy`` file as a tensor over a private mapping of the file, and the
    file offset of its data."""
    with open(path, "rb") as file:
        if file.read(6) != NPY_MAGIC:
            raise ValueError(f"{path} is not a .npy file (no NUMPY magic)")
        major = file.read(2)[0]
        size_format = "<H" if major == 1 else "<I"
        (header_len,) = struct.unpack(size_format, file.read(struct.calcsize(size_format)))
        header = file.read(header_len).decode("latin1" if major < 3 else "utf8")
        offset = file.tell()
        try:
            info = ast.literal_eval(header)
            descr, fortran, shape = info["descr"], info["fortran_order"], tuple(info["shape"])
        except (ValueError, SyntaxError, KeyError, TypeError):
            raise ValueError(f"{path}: unreadable .npy header {header!r}") from None
        if (
            not isinstance(descr, str)
            or descr[:1] == ">"
            or (descr[:1] == "=" and sys.byteorder != "little")
        ):
            raise ValueError(
                f"{path}: dtype {descr!r} is not little-endian plain data; save it with "
                "numpy.save from a little-endian array of numbers or booleans"
            )
        dtype = NPY_DTYPES.get(descr.lstrip("<|="))
        if dtype is None:
            raise ValueError(
                f"{path}: dtype {descr!r} has no torch equivalent here (supported: "
                f"{', '.join(sorted(NPY_DTYPES))})"
            )
        if fortran and len(shape) > 1:
            raise ValueError(f"{path} is stored in Fortran order; save a C-contiguous array")
        if not shape or shape[0] == 0:
            raise ValueError(f"{path} holds no samples (shape {shape})")
        # ACCESS_COPY: a private mapping, so the tensor over it is writable (torch warns about
        # read-only buffers) while reads still come from the page cache; nothing writes it.
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    nbytes = count * itemsize
    if offset + nbytes > len(mapped):
        mapped.close()
        raise ValueError(f"{path} is truncated: its header promises {nbytes} B of data")
    if not nbytes:  # samples of no bytes (a (rows, 0) array): torch maps no empty buffer
        return torch.empty(shape, dtype=dtype), mapped, offset
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape), mapped, offset


def open_safetensors(
    path: Path, keys: Sequence[str] | None
) -> tuple[dict[str | None, torch.Tensor], Any]:
    """The named tensors of a safetensors file as views over the library's mapping of it."""
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - the extra is installed for the tests
        raise ImportError(
            "reading .safetensors shards needs the safetensors package: pip install "
            "'aresidency[safetensors]'"
        ) from None
    handle: Any = safe_open(str(path), framework="pt")  # untyped library
    held = sorted(handle.keys())
    names = held if keys is None else list(keys)
    tensors: dict[str | None, torch.Tensor] = {}
    for name in names:
        if name not in held:
            raise KeyError(f"{path} has no tensor {name!r}; it holds {held}")
        # A view over the library's private mapping of the file: no data is read here.
        tensors[name] = handle.get_tensor(name)
    return tensors, handle


def safetensors_offsets(path: Path) -> dict[str, int]:
    """The file offset of each tensor's data in a safetensors file (its format: an 8-byte
    little-endian header length, a JSON header whose ``data_offsets`` count from the end of
    the header). Empty when the header cannot be read: its tensors are then copied from the
    library's mapping."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        return {
            name: 8 + length + int(info["data_offsets"][0])
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return {}
