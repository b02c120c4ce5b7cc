"""``ShardSource``: batches read from memory-mapped ``.npy`` or safetensors shards.

A dataset stored as shards, each holding a run of samples along the first dimension:

* ``.npy`` files: ``ShardSource(["x-000.npy", "x-001.npy"], batch_size=64)`` yields tensor
  batches; ``ShardSource({"x": [...], "y": [...]}, batch_size=64)`` dict batches, one list of
  files per key (the i-th files of every key hold the same samples);
* ``.safetensors`` files: ``ShardSource(["part-0.safetensors", ...], batch_size=64,
  keys=["x", "y"])`` yields dicts of the named tensors (default: every tensor of the first
  shard, sorted by name); every tensor of a shard has the same number of samples.

A directory stands for the shards it holds (``*.safetensors``, else ``*.npy``, sorted by name).
Every shard is memory-mapped once (safetensors through its library, ``.npy`` by reading the
format's header, so numpy is not needed). Reading a batch is one copy per tensor and shard from
the page cache into the destination: ``preadv`` on the file for a run of samples (POSIX; the
kernel copies, with no page fault per 4 KiB of the mapping and no torch thread pool), a gather
from the mapping for shuffled samples; :meth:`ShardSource.read_pieces` cuts a batch into pieces
that several threads read at once. Batches may span shards. Samples come
in file order, or with ``shuffle=True`` in a new random order each epoch (``seed + epoch``): a
batch then holds a random set of samples, ordered inside the batch by their place in the files
so that each shard is read in one forward gather straight into the destination.

It is a *staged source* (:class:`~aresidency.loader.staging.StagedSource`): a
:class:`~aresidency.loader.DeviceLoader` has ``workers`` threads read batches straight into its
pinned staging buffers, so the only host copy is page cache to pinned memory. Iterated on its
own (``for batch in source``) it yields batches in new host memory, one tensor per key.

What the host waits on: construction reads the headers (file I/O in the calling thread; quick);
:meth:`ShardSource.read_into` and iteration block the calling thread for the copies, which read
the data from disk when it is not in the page cache. Several threads may read at once.
"""

from __future__ import annotations

import functools
import mmap
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ..core.values import check_flag
from .shardfiles import (
    ShardFile,
    copy_bytes,
    gather,
    gather_rows,
    open_npy,
    open_safetensors,
    pread_into,
    safetensors_offsets,
)
from .staging import TensorSpec

__all__ = ["ShardSource"]

StrPath = str | os.PathLike[str]


#: Whether contiguous runs are read with ``os.preadv`` (POSIX); elsewhere they are copied
#: from the file's mapping.
PREAD = hasattr(os, "preadv")


def _default_workers() -> int:
    return min(8, max(2, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True, slots=True)
class _Column:
    """One key of the dataset: its dtype and the shape of one sample."""

    key: str | None
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def row_nbytes(self) -> int:
        count = 1
        for dim in self.row_shape:
            count *= dim
        return count * self.dtype.itemsize


class _Shard:
    """One run of samples: per key, a tensor over the file's mapping (``[rows, *row_shape]``).

    State: ``rows``, ``columns`` (key -> mapped tensor), ``_maps`` (the ``mmap`` objects and
    library handles to close).
    """

    def __init__(self, rows: int, columns: dict[str | None, torch.Tensor], keep: list[Any]):
        self.rows = rows
        self.columns = columns
        # key -> (the file, file offset of its first sample): where contiguous runs are read
        # with pread (see pread_into); a key missing here is copied from the mapping.
        self.files: dict[str | None, tuple[ShardFile, int]] = {}
        self._keep = keep

    def close(self) -> None:
        self.columns = {}
        self.files = {}
        keep, self._keep = self._keep, []
        for thing in keep:
            if isinstance(thing, mmap.mmap):
                try:
                    thing.close()
                except BufferError:
                    pass  # a tensor over it is still alive: unmapped when that one dies


def _describe(columns: list[_Column]) -> str:
    """What a shard holds, for an error: ``float32 samples of shape (4,)``, or per key."""
    described = [
        f"{'' if c.key is None else repr(c.key) + ': '}{str(c.dtype).removeprefix('torch.')} "
        f"samples of shape {c.row_shape}"
        for c in columns
    ]
    return "; ".join(described) if described else "nothing"


def _where(shard: _Shard) -> str:
    """The files of a shard, for an error."""
    paths = sorted({str(file.path) for file, _ in shard.files.values()})
    return ", ".join(paths) if paths else "its files"


#: The smallest piece :meth:`ShardSource.read_pieces` cuts a batch into. Every piece costs the
#: reading thread a few turns of the interpreter lock, which the event loop's thread then waits
#: for: on the H200 host, 1 MiB pieces made a loader's steps slower at 16 and 64 MiB batches
#: (the loop thread launches the step's kernels late), whole batches did not.
MIN_PIECE = 32 << 20


def _check_int(value: object, wanted: str, minimum: int) -> None:
    """``value`` is an int (not a bool) of at least ``minimum``: ``TypeError`` when it is no
    int, ``ValueError`` when it is too small."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{wanted}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{wanted}, got {value!r}")


def _expand(paths: StrPath | Sequence[StrPath]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        path = Path(paths)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.npy"))
            if not found:
                raise FileNotFoundError(f"{path} holds no *.safetensors or *.npy shard")
            return found
        return [path]
    return [Path(p) for p in paths]


@dataclass(frozen=True, slots=True)
class _Run:
    """Samples of one batch from one shard: rows ``start:stop``, or the rows ``index``."""

    shard: int
    start: int
    stop: int
    index: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start if self.index is None else int(self.index.numel())


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Which samples make one batch: its number, row count and runs (one per shard read)."""

    number: int
    rows: int
    runs: tuple[_Run, ...]


class ShardSource:
    """A dataset of memory-mapped shards, read in batches (see the module docstring).

    ``batch_size`` samples per batch (the last one smaller unless ``drop_last``); ``keys`` the
    safetensors tensors to read (default all); ``shuffle``/``seed`` a new random order each
    epoch; ``workers`` threads a loader uses to read batches at once (default: half the CPUs,
    2 to 8); ``align``: each tensor of a batch starts on a multiple of this many bytes in the
    buffer it is read into (256: the alignment CUDA kernels like).

    State: ``shards`` (each mapped once, at construction), ``columns`` (per key: dtype and
    sample shape, the same in every shard), ``num_samples``, ``epoch`` (iterations planned so
    far, for the shuffle's seed), ``closed``.
    """

    def __init__(
        self,
        paths: StrPath | Sequence[StrPath] | Mapping[str, Sequence[StrPath]],
        batch_size: int,
        *,
        keys: Sequence[str] | None = None,
        drop_last: bool = False,
        shuffle: bool = False,
        seed: int = 0,
        workers: int | None = None,
        align: int = 256,
    ) -> None:
        _check_int(batch_size, "batch_size must be an int >= 1", 1)
        if workers is None:
            workers = _default_workers()
        _check_int(workers, "workers must be an int >= 1", 1)
        _check_int(align, "align must be a power of two >= 16", 16)
        if align & align - 1:
            raise ValueError(f"align must be a power of two >= 16, got {align!r}")
        if keys is not None:
            if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
                raise TypeError(
                    f"keys must be a list of tensor names, got {keys!r}"
                    + (f" (for one tensor: keys=[{keys!r}])" if isinstance(keys, str) else "")
                )
            if not keys:
                raise ValueError("keys= names no tensor: name at least one, or leave it out")
        check_flag(drop_last, "drop_last")
        check_flag(shuffle, "shuffle")
        if isinstance(seed, bool) or not hasattr(seed, "__index__"):
            raise TypeError(f"seed must be an int, got {seed!r}")
        seed = operator.index(seed)  # a numpy integer too
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        self.workers = workers
        self.align = align
        self.epoch = 0
        self.closed = False
        self.shards: list[_Shard] = []
        self.keys: list[str | None] = []
        self.tensor_batches = False
        self.columns: list[_Column] = []
        try:
            self._open(paths, keys)
        except BaseException:
            self.close()
            raise
        self.num_samples = sum(s.rows for s in self.shards)
        self._starts = torch.tensor([0] + [s.rows for s in self.shards]).cumsum(0)
        self.max_batch_nbytes = self.batch_nbytes(min(batch_size, self.num_samples))

    # -- opening

    def _open(
        self,
        paths: StrPath | Sequence[StrPath] | Mapping[str, Sequence[StrPath]],
        keys: Sequence[str] | None,
    ) -> None:
        if isinstance(paths, Mapping):
            if keys is not None:
                raise ValueError("keys= is for safetensors shards; a mapping names its keys")
            files = {str(k): _expand(v) for k, v in paths.items()}
            if not files:
                raise ValueError("the mapping of keys to .npy files is empty")
            counts = {k: len(v) for k, v in files.items()}
            empty = [k for k, n in counts.items() if n == 0]
            if empty:
                raise ValueError(f"no .npy shard given for key {empty[0]!r}")
            if len(set(counts.values())) != 1:
                raise ValueError(f"every key needs as many .npy shards; got {counts}")
            self.keys = list(files)
            for i in range(next(iter(counts.values()))):
                self._add_npy_shard({k: files[k][i] for k in files})
        else:
            found = _expand(paths)
            if not found:
                raise ValueError("no shard paths given")
            suffixes = {p.suffix for p in found}
            if suffixes == {".npy"}:
                if keys is not None:
                    raise ValueError(
                        "keys= is for safetensors shards; for several .npy arrays per batch "
                        "give a mapping {key: [files]}"
                    )
                self.tensor_batches = True
                self.keys = [None]
                for path in found:
                    self._add_npy_shard({None: path})
            elif suffixes == {".safetensors"}:
                for path in found:
                    self._add_safetensors_shard(path, keys)
                    keys = [k for k in self.keys if k is not None]
            else:
                raise ValueError(
                    f"shards must all be .npy or all .safetensors files, got {sorted(suffixes)}"
                )
        self.columns = self._columns_of(self.shards[0])
        for number, shard in enumerate(self.shards):
            columns = self._columns_of(shard)
            if columns != self.columns:
                raise ValueError(
                    f"shard {number} ({_where(shard)}) holds {_describe(columns)}, but the first "
                    f"shard ({_where(self.shards[0])}) holds {_describe(self.columns)}: every "
                    "shard needs the same keys, dtypes and sample shapes"
                )

    def _add_npy_shard(self, files: dict[str | None, Path]) -> None:
        columns: dict[str | None, torch.Tensor] = {}
        keep: list[Any] = []
        shard = _Shard(0, columns, keep)
        self.shards.append(shard)  # closed with the others if a later file fails
        for key, path in files.items():
            tensor, mapped, offset = open_npy(path)
            keep.append(mapped)
            columns[key] = tensor
            shard.files[key] = (ShardFile(path), offset)
        self._check_rows(shard, files)

    def _add_safetensors_shard(self, path: Path, keys: Sequence[str] | None) -> None:
        tensors, handle = open_safetensors(path, keys)
        if not tensors:
            raise ValueError(f"{path} holds no tensor")
        shard = _Shard(0, dict(tensors), [handle])
        self.shards.append(shard)
        offsets = safetensors_offsets(path)
        if offsets:
            file = ShardFile(path)
            for name in tensors:
                if name in offsets and tensors[name].is_contiguous():
                    shard.files[name] = (file, offsets[name])
        if not self.shards[:-1]:
            self.keys = list(tensors)
        for name, tensor in tensors.items():
            if tensor.dim() == 0 or tensor.shape[0] == 0:
                raise ValueError(
                    f"{path}:{name} has shape {tuple(tensor.shape)}: a shard's tensors hold "
                    "samples along their first dimension"
                )
        self._check_rows(shard, {k: path for k in tensors})

    @staticmethod
    def _check_rows(shard: _Shard, files: Mapping[Any, Path]) -> None:
        rows = {key: int(t.shape[0]) for key, t in shard.columns.items()}
        if len(set(rows.values())) != 1:
            where = ", ".join(f"{files[k]}:{k}={n}" for k, n in rows.items())
            raise ValueError(f"the tensors of one shard hold different sample counts: {where}")
        shard.rows = next(iter(rows.values()))

    @staticmethod
    def _columns_of(shard: _Shard) -> list[_Column]:
        return [_Column(k, t.dtype, tuple(t.shape[1:])) for k, t in shard.columns.items()]

    # -- layout

    def _align_up(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def batch_nbytes(self, rows: int) -> int:
        """Bytes a batch of ``rows`` samples takes in a buffer (each tensor aligned)."""
        return sum(self._align_up(rows * c.row_nbytes) for c in self.columns)

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    # -- epochs

    def plan_epoch(self) -> list[BatchPlan]:
        """The batches of the next epoch, in order (a new permutation with ``shuffle``)."""
        self._check_open()
        count = len(self)
        size = self.batch_size
        if not self.shuffle:
            plans = [
                self._plan_range(b, b * size, min((b + 1) * size, self.num_samples))
                for b in range(count)
            ]
            self.epoch += 1
            return plans
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        order = torch.randperm(self.num_samples, generator=generator)
        return [self._plan_indices(b, order[b * size : (b + 1) * size]) for b in range(count)]

    def _plan_range(self, number: int, start: int, stop: int) -> BatchPlan:
        runs: list[_Run] = []
        for index, shard_start in enumerate(self._starts[:-1].tolist()):
            shard_stop = shard_start + self.shards[index].rows
            lo, hi = max(start, shard_start), min(stop, shard_stop)
            if lo < hi:
                runs.append(_Run(index, lo - shard_start, hi - shard_start))
        return BatchPlan(number, stop - start, tuple(runs))

    def _plan_indices(self, number: int, samples: torch.Tensor) -> BatchPlan:
        ordered = samples.sort().values
        shard_of = torch.searchsorted(self._starts, ordered, right=True) - 1
        runs: list[_Run] = []
        unique: Any = torch.unique  # untyped in torch
        for index in unique(shard_of).tolist():
            local = ordered[shard_of == index] - self._starts[index]
            runs.append(_Run(index, 0, 0, local))
        return BatchPlan(number, int(samples.numel()), tuple(runs))

    # -- reading

    def read_into(self, plan: BatchPlan, out: torch.Tensor) -> Any:
        """Copy the batch ``plan`` into the flat ``uint8`` buffer ``out`` and return its layout
        (a :class:`TensorSpec`, or a dict of them by key). Blocks the calling thread."""
        layout, pieces = self.read_pieces(plan, out, 1)
        for piece in pieces:
            piece()
        return layout

    def read_pieces(
        self, plan: BatchPlan, out: torch.Tensor, parts: int
    ) -> tuple[Any, list[Callable[[], None]]]:
        """The batch ``plan``'s layout in the flat ``uint8`` buffer ``out`` (as
        :meth:`read_into` returns it) and the reads that fill it, as about ``parts`` pieces
        of similar size (none under 32 MiB unless the batch is) that may run in different
        threads at once, in any order: a loader reads one batch several threads wide, so that
        it is ready sooner. Quick; the pieces block their thread."""
        self._check_open()
        nbytes = self.batch_nbytes(plan.rows)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < nbytes:
            raise ValueError(
                f"read_into needs a flat uint8 buffer of at least {nbytes} B, got "
                f"{out.dtype} {tuple(out.shape)}"
            )
        piece_nbytes = max(MIN_PIECE, -(-nbytes // max(1, parts)))
        specs: dict[str | None, TensorSpec] = {}
        pieces: list[Callable[[], None]] = []
        offset = 0
        for column in self.columns:
            spec = TensorSpec(offset, column.dtype, (plan.rows, *column.row_shape))
            pieces += self._column_pieces(plan, column, out, spec, piece_nbytes)
            specs[column.key] = spec
            offset += self._align_up(spec.nbytes)
        if self.tensor_batches:
            return specs[None], pieces
        return specs, pieces

    def _column_pieces(
        self,
        plan: BatchPlan,
        column: _Column,
        out: torch.Tensor,
        spec: TensorSpec,
        piece_nbytes: int,
    ) -> list[Callable[[], None]]:
        """The reads of one key of batch ``plan`` into its place ``spec`` in the flat buffer
        ``out``. Runs read with ``preadv`` need only addresses (no tensor view is made here,
        in the ring's thread); copies from the mapping and gathers view their destination."""
        row_nbytes = column.row_nbytes
        rows_per_piece = max(1, piece_nbytes // max(1, row_nbytes))
        pieces: list[Callable[[], None]] = []
        position = 0
        destination: torch.Tensor | None = None
        for run in plan.runs:
            shard = self.shards[run.shard]
            stored = shard.files.get(column.key)  # (file, offset) where stored contiguously
            extent = stored if PREAD else None
            for first in range(0, run.rows, rows_per_piece):
                rows = min(rows_per_piece, run.rows - first)
                if run.index is None and extent is not None:
                    file, offset = extent
                    pieces.append(
                        functools.partial(
                            pread_into,
                            file,
                            offset + (run.start + first) * row_nbytes,
                            out,
                            spec.offset + (position + first) * row_nbytes,
                            rows * row_nbytes,
                        )
                    )
                    continue
                if destination is None:
                    destination = spec.view(out)
                place = destination[position + first : position + first + rows]
                source = shard.columns[column.key]
                if run.index is None:
                    # Both contiguous: one memcpy from the page cache.
                    start = run.start + first
                    pieces.append(
                        functools.partial(copy_bytes, place, source[start : start + rows])
                    )
                elif stored is not None:
                    # Out of the mapping, checked: a file cut short is an error, not SIGBUS.
                    file, offset = stored
                    index = run.index[first : first + rows]
                    pieces.append(
                        functools.partial(gather_rows, file, offset, source, index, place)
                    )
                else:
                    index = run.index[first : first + rows]
                    pieces.append(functools.partial(gather, source, index, place))
            position += run.rows
        return pieces

    # -- reading straight out of the files (a loader with ``pin_source=True``)

    def files(self) -> list[ShardFile]:
        """Every file the shards are read from, once each, in shard order (a
        :class:`~aresidency.loader.DeviceLoader` with ``pin_source=True`` page-locks them)."""
        self._check_open()
        seen: dict[Path, ShardFile] = {}
        for shard in self.shards:
            for file, _ in shard.files.values():
                seen.setdefault(file.path, file)
        return list(seen.values())

    @property
    def reads_direct(self) -> bool:
        """Whether every batch lies in the files as runs of bytes (no ``shuffle``, and every
        tensor of every shard stored contiguously at a known offset), so that a loader can
        copy it to the device straight out of the page-locked files (:meth:`direct_reads`)."""
        return not self.shuffle and all(
            column.key in shard.files for shard in self.shards for column in self.columns
        )

    def direct_reads(self, plan: BatchPlan) -> tuple[Any, list[tuple[ShardFile, int, int, int]]]:
        """The batch ``plan``'s layout (as :meth:`read_into` returns it) and where its bytes lie
        in the files: ``(file, file offset, offset in the batch, nbytes)`` per run, one run per
        tensor and shard. ``ValueError`` unless :attr:`reads_direct`. Quick; reads nothing."""
        self._check_open()
        if not self.reads_direct:
            raise ValueError(
                f"{self!r} cannot be read straight out of its files: "
                + (
                    "shuffled batches gather their samples"
                    if self.shuffle
                    else "a tensor of a shard is not stored contiguously at a known offset"
                )
            )
        specs: dict[str | None, TensorSpec] = {}
        reads: list[tuple[ShardFile, int, int, int]] = []
        offset = 0
        for column in self.columns:
            spec = TensorSpec(offset, column.dtype, (plan.rows, *column.row_shape))
            row_nbytes = column.row_nbytes
            position = 0
            for run in plan.runs:
                file, start = self.shards[run.shard].files[column.key]
                nbytes = run.rows * row_nbytes
                if nbytes:
                    reads.append((file, start + run.start * row_nbytes, offset + position, nbytes))
                position += nbytes
            specs[column.key] = spec
            offset += self._align_up(spec.nbytes)
        return (specs[None] if self.tensor_batches else specs), reads

    def __iter__(self) -> Iterator[Any]:
        """The batches of one epoch in new host memory (one tensor per key)."""
        for plan in self.plan_epoch():
            batch: dict[str | None, torch.Tensor] = {}
            for column in self.columns:
                spec = TensorSpec(0, column.dtype, (plan.rows, *column.row_shape))
                flat = torch.empty(spec.nbytes, dtype=torch.uint8)
                for piece in self._column_pieces(plan, column, flat, spec, spec.nbytes):
                    piece()
                batch[column.key] = spec.view(flat)
            yield batch[None] if self.tensor_batches else batch

    # -- end

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")

    def close(self) -> None:
        """Unmap the shards (a tensor still viewing one keeps its mapping alive)."""
        self.closed = True
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> ShardSource:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        keys = "tensor" if getattr(self, "tensor_batches", True) else f"keys={self.keys}"
        state = " closed" if self.closed else ""
        return (
            f"<ShardSource {len(self.shards)} shards, {getattr(self, 'num_samples', '?')} "
            f"samples, batch_size={self.batch_size} {keys} workers={self.workers}{state}>"
        )
