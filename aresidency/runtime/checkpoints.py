"""One safetensors reader, through the ``safetensors`` library, for sources and for streaming.

:meth:`Checkpoint.open` takes a single ``.safetensors`` file, a directory holding
``model.safetensors`` or a sharded checkpoint (an ``*.safetensors.index.json`` and the shards it
names: the Hugging Face layout), or the path of an index JSON itself. The checkpoint knows, for
every tensor name, its shard file, torch dtype, shape and byte size (:meth:`Checkpoint.info`),
and copies a tensor into a preallocated host tensor (:meth:`Checkpoint.read_into`), converting
floating-point dtypes on the way when the destination's differs (a bf16 checkpoint into a float32
module, or the reverse). Quantized dtypes (float8, float4) are never converted: their values mean
something only with the scales saved beside them (see :func:`convertible`).

What the host waits on: :meth:`Checkpoint.open` reads the index and every shard's header (file
I/O in the calling thread); :meth:`~Checkpoint.info` the first time it is asked about a tensor
and :meth:`~Checkpoint.read_into` / :meth:`~Checkpoint.read` block the calling thread, the reads
for the whole copy (which pages the data in from disk when it is not in the page cache). Call
them in a worker thread, never on an event loop. Several threads may read at once, the same
tensor included: a per-shard lock is held only while the library builds a tensor's view (a few
microseconds, once per tensor), never during a copy.

How a read works: ``safe_open(file, framework="pt")`` maps the whole file privately
(copy-on-write) and ``get_tensor`` returns a tensor *over that mapping*: no data is read and
nothing is allocated (the binding's source slices a storage made by
``torch.UntypedStorage.from_file(file, shared=False)``; with 0.8.0, ``/proc/self/maps`` shows one
``rw-p`` mapping of the file per handle, and the view outlives the handle). Each shard is opened
once, when the checkpoint is opened, and the handle is reused; the view of a tensor is made on
first use and kept, so a read is one ``out.copy_(view)``: the only copy, page cache to ``out``,
converting the dtype in the same pass (no temporary). The library gives torch dtypes (the view's
dtype, e.g. ``torch.float4_e2m1fn_x2`` for ``F4`` with its packed shape), so there is no dtype
table here; a dtype torch cannot represent (``F6_E2M3``) is an error naming the file and the
tensor. Views are never handed out: writing into one would write into the shared mapping and
every later read of that tensor would see it, so :meth:`read` returns memory of its own (one
copy).

Measured (safetensors 0.8.0, torch 2.13 CPU, a 2-core VM with 23 GiB; one 256 MiB float32
tensor; ``time.perf_counter`` around each step, ``RssAnon``/``RssFile`` of ``/proc/self/status``
and the mapping in ``/proc/self/maps``): ``safe_open`` 0.2 ms; ``get_tensor`` 0.6 ms with no
change in ``RssAnon`` (12 us per tensor on a 2,000-tensor file); ``out.copy_(view)`` into a
preallocated tensor, file in the page cache: 16-20 ms (13-16 GiB/s, as fast as a copy between two
anonymous buffers, 15.8 GiB/s), ``RssAnon`` unchanged (only ``out``), ``RssFile`` +256 MiB (the
page-cache pages now mapped: shared with the cache and reclaimable, so memory is not doubled). The
hand-written ``readinto`` this replaces read the same bytes in 28 ms (8.8 GiB/s). With the file
evicted first (``posix_fadvise(POSIX_FADV_DONTNEED)``): 106 ms (2.3 GiB/s) against 90 ms for
``readinto`` (2.7 GiB/s); the first, truly cold pass 327 ms against 358 ms.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

__all__ = ["Checkpoint", "TensorInfo", "convertible", "quantized", "why_not_converted"]

StrPath = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a checkpoint: its name, the file holding it, torch dtype, shape, bytes."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a scaled low-precision encoding (the float8 dtypes, ``float8_e8m0fnu``
    and ``float4_e2m1fn_x2``: floating point in one byte or less per element). A checkpoint's
    tensor of such a dtype means its values only together with the scale tensors saved beside
    it (``*.weight_scale_inv``, ``*_scale``), which only a model built with that quantization
    applies."""
    return dtype.is_floating_point and dtype.itemsize == 1


@functools.cache
def convertible(source: torch.dtype, destination: torch.dtype) -> bool:
    """Whether a tensor of dtype ``source`` is read into one of dtype ``destination``: the same
    dtype, or two floating-point dtypes torch converts between (integers and booleans are never
    converted: a silent truncation or widening would hide a checkpoint that does not match),
    neither of them :func:`quantized` (a conversion ignores the scales: the weights would be
    wrong)."""
    if source == destination:
        return True
    if not (source.is_floating_point and destination.is_floating_point):
        return False
    if quantized(source) or quantized(destination):
        return False
    try:
        torch.ones(1, dtype=source).to(destination)
    except (RuntimeError, TypeError):
        return False
    return True


def why_not_converted(source: torch.dtype, destination: torch.dtype) -> str:
    """Why a tensor of dtype ``source`` is not read into one of ``destination`` (see
    :func:`convertible`), and what to do: a clause for an error message."""
    if quantized(source):
        return (
            f"{source} is a quantized encoding whose values mean something only with the scale "
            "tensors saved beside it (such as '*.weight_scale_inv' or '*_scale'), so converting "
            f"it to {destination} would give wrong weights: a quantized checkpoint needs its "
            "model built with its quantization (in transformers, from the checkpoint's config "
            "with its quantization_config), so that the tensor has the checkpoint's dtype"
        )
    if quantized(destination):
        return (
            f"{destination} is a quantized encoding, which needs scales computed for it, so "
            f"converting a {source} tensor to it would give wrong weights: a model built with "
            "a quantization needs a checkpoint quantized the same way"
        )
    return "only floating-point dtypes are converted"


@dataclass(slots=True)
class _Shard:
    file: Path
    handle: Any  # safetensors.safe_open; None once closed
    lock: threading.Lock
    fd: int  # our own descriptor of the mapped file (its inode, whatever the path becomes)
    stat: os.stat_result  # that file as it was opened (and mapped)

    def check_unchanged(self) -> None:
        """``RuntimeError`` if the mapped file was written in place since it was opened: its
        mapping then shows the new bytes (a torn mix of both checkpoints), and past a
        truncation a read kills the process (``SIGBUS``). A path renamed over by another file,
        or removed, is fine: the mapping keeps the opened file's data."""
        with self.lock:  # (close() may give the descriptor back meanwhile)
            if self.fd < 0:
                return  # closed: the read fails on the closed handle
            now = os.fstat(self.fd)
        then = self.stat
        if now.st_size != then.st_size or now.st_mtime_ns != then.st_mtime_ns:
            raise RuntimeError(
                f"{self.file} was written in place since the checkpoint was opened (size "
                f"{then.st_size} B, now {now.st_size} B): its mapping no longer holds the "
                "checkpoint that was opened, and reading past a truncation would kill the "
                "process (SIGBUS). Replace a checkpoint by writing a new file and renaming it "
                "over the old one (the open one keeps reading the old), or open it again"
            )


def _resolve(path: Path) -> tuple[Path | None, list[Path]]:
    """(the index JSON or ``None``, the safetensors files named) for what ``path`` points at."""
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist: give a .safetensors file, a directory holding "
            "model.safetensors or a sharded checkpoint, or a *.safetensors.index.json"
        )
    if path.is_dir():
        single = path / "model.safetensors"
        if single.is_file():
            return None, [single]
        indexes = sorted(path.glob("*.safetensors.index.json"))
        preferred = path / "model.safetensors.index.json"
        if preferred in indexes:
            return preferred, []
        if len(indexes) == 1:
            return indexes[0], []
        if not indexes:
            pickles = sorted(
                p.name for p in path.iterdir() if p.is_file() and p.suffix in _PICKLE_SUFFIXES
            )
            if pickles:
                raise FileNotFoundError(
                    f"checkpoint directory {path} holds no safetensors checkpoint, only PyTorch "
                    f"pickle files ({', '.join(pickles[:4])}"
                    f"{', ...' if len(pickles) > 4 else ''}), which are not read here: " + _CONVERT
                )
            raise FileNotFoundError(
                f"checkpoint directory {path} holds neither model.safetensors nor a "
                "*.safetensors.index.json (a sharded checkpoint): give the path of the "
                ".safetensors file to read"
            )
        raise ValueError(
            f"checkpoint directory {path} holds several indexes "
            f"({', '.join(p.name for p in indexes)}): give the path of the one to read"
        )
    if path.name.endswith(".json"):
        return path, []
    return None, [path]


def _read_index(index: Path) -> dict[str, Path]:
    """The index's ``weight_map``: tensor name -> shard file (relative to the index)."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"checkpoint index {index} cannot be read as JSON ({error})") from error
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f'checkpoint index {index} has no "weight_map" of tensor names to shard files: is '
            "it a Hugging Face *.safetensors.index.json?"
        )
    if not weight_map:
        raise ValueError(f"checkpoint index {index} lists no tensor (its weight_map is empty)")
    shards: dict[str, Path] = {}
    files: dict[str, Path] = {}
    for name, shard in weight_map.items():
        file = files.get(shard)
        if file is None:
            file = files[shard] = Path(os.path.normpath(index.parent / shard))  # one per file
            if not file.is_file():
                raise FileNotFoundError(
                    f"checkpoint index {index} puts tensor {name!r} in shard {shard}, but "
                    f"{file} does not exist: download the missing shard or fix the index"
                )
        shards[name] = file
    return shards


#: Suffixes of PyTorch's own checkpoint files (``torch.save``: a zip archive or a pickle).
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

#: How to turn a PyTorch pickle checkpoint into safetensors, for the errors that find one.
_CONVERT = (
    "convert it to safetensors once (memory-mapped, read without running pickled code). A "
    "Hugging Face model: model = AutoModelForCausalLM.from_pretrained(its directory) (or the "
    "model's own class), then "
    "model.save_pretrained(new directory), which writes model.safetensors (or shards and "
    "their index). A plain state dict: safetensors.torch.save_file({k: v.contiguous() for "
    "k, v in torch.load(file, weights_only=True).items()}, 'model.safetensors') "
    "(safetensors.torch.save_model(module, ...) for a module with tied weights)"
)


def _torch_pickle(file: Path) -> bool:
    """Whether ``file`` looks like a ``torch.save`` file: a zip archive (the format since
    torch 1.6) or a pickle (the legacy one), by its first bytes; or a PyTorch suffix."""
    try:
        with open(file, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith((b"PK\x03\x04", b"\x80")) or file.suffix in _PICKLE_SUFFIXES


def _safe_open(file: Path) -> Any:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as error:  # pragma: no cover - safetensors is in the test extra
        raise ImportError(
            f"reading {file} needs the safetensors package: pip install 'aresidency[safetensors]'"
        ) from error
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as error:
        if _torch_pickle(file):
            raise ValueError(
                f"{file} is a PyTorch checkpoint (torch.save: pickle or zip), not a "
                f"safetensors file, and is not read here: {_CONVERT}"
            ) from error
        raise ValueError(
            f"{file} is not a readable safetensors file ({error}): a damaged or partial file, "
            "or a dtype this safetensors version does not know (then upgrade safetensors)"
        ) from error


def _close_descriptors(shards: list[_Shard]) -> None:
    for shard in shards:
        with shard.lock:
            fd, shard.fd = shard.fd, -1
            if fd >= 0:
                os.close(fd)


class Checkpoint:
    """A safetensors checkpoint (one file or shards), its tensors read into host tensors.

    Made by :meth:`open`. State: ``path`` (as given), ``index`` (the index JSON, or ``None``),
    ``files`` (the safetensors files, each opened once and kept open until :meth:`close`; also a
    context manager). Invariant: every tensor name is in exactly one file.
    """

    def __init__(self, path: StrPath) -> None:
        """Open ``path`` (see :meth:`open`); blocks for reading the index and the headers."""
        self.path = Path(path)
        self.index, files = _resolve(self.path)
        listed: dict[str, Path] = {}
        if self.index is not None:
            listed = _read_index(self.index)
            files = list(dict.fromkeys(listed.values()))
        self.files: tuple[Path, ...] = tuple(files)
        self._shards: list[_Shard] = []
        self._shard_of: dict[str, _Shard] = {}
        self._infos: dict[str, TensorInfo] = {}
        self._views: dict[str, torch.Tensor] = {}
        try:
            for file in self.files:
                fd = os.open(file, os.O_RDONLY)
                try:
                    handle = _safe_open(file)
                except BaseException:
                    os.close(fd)
                    raise
                shard = _Shard(file, handle, threading.Lock(), fd, os.fstat(fd))
                self._shards.append(shard)
                for name in shard.handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    other = self._shard_of.setdefault(name, shard)
                    if other is not shard:
                        raise ValueError(
                            f"tensor {name!r} is in two shards of checkpoint {self.path}: "
                            f"{other.file} and {file}; a checkpoint must hold each tensor once "
                            "(remove the stale shard or fix the index)"
                        )
            for name, file in listed.items():
                holder = self._shard_of.get(name)
                if holder is None or holder.file != file:
                    where = "no shard" if holder is None else f"shard {holder.file}"
                    raise ValueError(
                        f"checkpoint index {self.index} puts tensor {name!r} in {file}, but "
                        f"{where} holds it: the index does not match its shards"
                    )
        except BaseException:
            self.close()
            raise
        # A checkpoint dropped without close() gives its descriptors back when collected.
        weakref.finalize(self, _close_descriptors, self._shards)

    @classmethod
    def open(cls, path: StrPath) -> Checkpoint:
        """Open a ``.safetensors`` file, a directory holding ``model.safetensors`` or a sharded
        checkpoint (``model.safetensors.index.json``, else its only ``*.safetensors.index.json``),
        or an index JSON. Blocks for reading the index and every shard's header (no tensor
        data). ``FileNotFoundError`` for a missing path or shard; ``ValueError`` for an
        unreadable file, an index that does not match its shards, or a tensor in two shards."""
        return cls(path)

    # -- names

    def names(self) -> list[str]:
        """Every tensor name, shard by shard."""
        return list(self._shard_of)

    def __contains__(self, name: object) -> bool:
        return name in self._shard_of

    def __len__(self) -> int:
        return len(self._shard_of)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def info(self, name: str) -> TensorInfo:
        """``name``'s file, torch dtype, shape and byte size. ``KeyError`` naming the checkpoint
        and the tensor if it has none; ``ValueError`` if torch cannot represent its dtype. The
        first call for a tensor asks the library for its view (microseconds, no data read)."""
        info = self._infos.get(name)
        if info is None:
            self._view(name)
            info = self._infos[name]
        return info

    # -- reads

    def _view(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is not None:
            return view
        shard = self._shard_of.get(name)
        if shard is None:
            raise KeyError(f"checkpoint {self.path} has no tensor named {name!r}")
        with shard.lock:  # one thread at a time in the library's handle
            view = self._views.get(name)
            if view is not None:
                return view
            if shard.handle is None:
                raise RuntimeError(f"checkpoint {self.path} is closed: open it again to read")
            try:
                view = shard.handle.get_tensor(name)
            except Exception as error:
                code = "?"
                try:
                    code = str(shard.handle.get_slice(name).get_dtype())
                except Exception:
                    pass
                raise ValueError(
                    f"{shard.file}: tensor {name!r} (safetensors dtype {code}) cannot be read as "
                    f"a torch tensor ({error}); convert it to a dtype torch supports"
                ) from error
            assert isinstance(view, torch.Tensor)
            self._infos[name] = TensorInfo(
                name=name,
                file=shard.file,
                dtype=view.dtype,
                shape=tuple(view.shape),
                nbytes=view.numel() * view.element_size(),
            )
            self._views[name] = view
        return view

    def check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorInfo:
        """``name``'s info if it can be read into a tensor of ``shape`` and ``dtype``, else
        ``ValueError`` naming the file, the tensor and both shapes or dtypes (``KeyError`` if
        it is missing)."""
        info = self.info(name)
        if tuple(shape) != info.shape:
            raise ValueError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, but the destination "
                f"has shape {list(shape)}: the checkpoint does not match the model"
            )
        if not convertible(info.dtype, dtype):
            raise ValueError(
                f"{info.file}: tensor {name!r} is {info.dtype} and cannot be read into "
                f"{dtype} ({why_not_converted(info.dtype, dtype)}): the checkpoint does not "
                "match the model"
            )
        return info

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor ``name`` into ``out``, a CPU tensor of the same shape (any strides; a
        floating-point dtype other than the checkpoint's is converted in the same pass).

        Blocks the calling thread for the copy: one pass from the file's mapping, paging the
        data in from disk when it is not cached. Errors: ``KeyError`` (no such tensor),
        ``ValueError`` (shape, dtype or device of ``out``), ``RuntimeError`` (closed)."""
        if out.device.type != "cpu":
            raise ValueError(
                f"reading {name!r} from checkpoint {self.path}: out must be a CPU tensor, got "
                f"one on {out.device}"
            )
        self.check(name, tuple(out.shape), out.dtype)
        view = self._view(name)
        self._shard_of[name].check_unchanged()
        with torch.no_grad():
            out.copy_(view)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` in new CPU memory (contiguous), in ``dtype`` (default: the
        checkpoint's). Blocks like :meth:`read_into` (one copy)."""
        info = self.info(name)
        out = torch.empty(info.shape, dtype=info.dtype if dtype is None else dtype)
        self.read_into(name, out)
        return out

    # -- end

    def close(self) -> None:
        """Close every shard. Reads afterwards fail; a read in progress completes (its view
        keeps the mapping alive)."""
        for shard in self._shards:
            with shard.lock:
                handle, shard.handle = shard.handle, None
                if handle is not None:
                    handle.__exit__(None, None, None)
        self._views.clear()
        _close_descriptors(self._shards)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Checkpoint {self.path} {len(self)} tensors in {len(self.files)} files>"
