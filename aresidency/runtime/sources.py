"""Sources: where a reconstructible value's data comes from when it has no materialization.

A source is any object with ``shape``, ``dtype``, ``source_location`` and a synchronous
``load() -> torch.Tensor`` that returns the value's data as a host tensor. The runtime calls
``load`` in a worker thread, so a slow load never blocks the event loop.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from ..core.errors import LOAD_NOTE_PREFIX
from ..core.locations import Location, LocationLike
from .checkpoints import Checkpoint
from .tensors import tensor_problem

__all__ = [
    "CallableSource",
    "SafetensorsSource",
    "Source",
    "load_failure_notes",
    "note_load_failure",
]

#: How the notes :func:`note_load_failure` adds begin (to find them again).
_NOTE_PREFIX = LOAD_NOTE_PREFIX


@runtime_checkable
class Source(Protocol):
    shape: tuple[int, ...]
    dtype: torch.dtype
    source_location: Location

    def load(self) -> torch.Tensor: ...


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()


def _check_shape(shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, or a ``TypeError``/``ValueError`` naming it: a sequence of
    non-negative integers (a ``torch.Size``, a tuple or list of ints or integer scalars). A
    float, bool or str dimension is refused rather than truncated (``(2.5,)`` was ``(2,)``,
    ``"34"`` was ``(3, 4)``)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(
            f"shape must be a sequence of ints (a tuple, a list or a torch.Size), got {shape!r}"
        )
    dims = []
    for dim in shape:
        if isinstance(dim, bool):
            raise TypeError(f"shape {shape!r} has a bool dimension {dim!r}; give ints")
        try:
            dims.append(operator.index(dim))
        except TypeError:
            raise TypeError(
                f"shape {shape!r} has a dimension {dim!r} ({type(dim).__name__}) that is not an int"
            ) from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must have no negative dimension, got {tuple(dims)}")
    return tuple(dims)


def check_loaded(
    tensor: object, shape: Sequence[int], dtype: torch.dtype, *, what: str
) -> torch.Tensor:
    """``tensor`` on the CPU if it is a tensor of ``shape`` and ``dtype``; else a ``TypeError``
    (not a tensor) or a ``ValueError`` (another shape or dtype) naming ``what``, what was
    expected and what came back."""
    expected = f"a tensor of shape {tuple(shape)} and dtype {dtype}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"loading {what}: load() returned {type(tensor).__name__} {_short_repr(tensor)}, "
            f"expected {expected}"
        )
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(
            f"loading {what}: load() returned a tensor of shape {tuple(tensor.shape)} and "
            f"dtype {tensor.dtype}, expected {expected}"
        )
    problem = tensor_problem(tensor)  # sparse, meta, a wrapper subclass...: no whole copy
    if problem is not None:
        kind, returned, instead = problem
        raise kind(
            f"loading {what}: load() returned {returned}, expected {expected} that can be "
            f"copied whole; {instead}"
        )
    return tensor.cpu() if tensor.device.type != "cpu" else tensor


def note_load_failure(error: BaseException, what: str, location: Location, source: object) -> None:
    """Add a note to ``error``, which a source's ``load()`` raised while the runtime rebuilt
    ``what`` (a value) at ``location``: the exception keeps its own type (code catches the
    ``OSError`` of a file gone), and its traceback then says which value was loading, where
    to and from which source. Each note once: the same exception raised again (a load that
    keeps one) moves its note to the end, so the last note is always this rebuild's."""
    note = (
        f"{_NOTE_PREFIX}{what} at {location}: load() of its source "
        f"{_short_repr(source, 120)} raised this {type(error).__name__}"
    )
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list) and note in notes:
        notes.remove(note)
    error.add_note(note)


def load_failure_notes(error: BaseException) -> list[str]:
    """The notes :func:`note_load_failure` added to ``error`` (none for any other error), the
    latest rebuild's last."""
    notes = getattr(error, "__notes__", None) or ()
    return [n for n in notes if isinstance(n, str) and n.startswith(_NOTE_PREFIX)]


def _short_repr(obj: object, limit: int = 60) -> str:
    """``repr(obj)`` cut to ``limit`` characters (and never raising: it names a bad value)."""
    try:
        text = repr(obj)
    except Exception:
        return f"<{type(obj).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CallableSource:
    """A source that calls ``load()`` to produce the tensor (shape and dtype declared up front).

    ``source_location`` is where the loaded data is charged temporarily while it is copied to
    its destination (``pageable-host`` by default, or ``pinned-host``). The loaded tensor must
    match ``shape`` and ``dtype``; a mismatch is an error naming the value being loaded, what
    was expected and what came back (see :func:`check_loaded`).
    """

    def __init__(
        self,
        load: Callable[[], torch.Tensor],
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        source_location: LocationLike = "pageable-host",
    ) -> None:
        if not callable(load):
            raise TypeError(f"load must be callable, got {load!r}")
        if inspect.iscoroutinefunction(load) or inspect.iscoroutinefunction(
            getattr(load, "__call__", None)  # noqa: B004 - an object whose __call__ is async
        ):
            raise TypeError(
                f"load must be a plain function returning the tensor; {load!r} is a coroutine "
                "function, and load runs in a worker thread, where it would return a "
                "coroutine that nobody awaits: pass a synchronous load (read the file, "
                "build the tensor, return it)"
            )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self._load = load
        self.shape = _check_shape(shape)
        self.dtype = dtype
        self.source_location = Location.parse(source_location)
        if self.source_location.is_cuda:
            raise ValueError(f"source_location must be a host location, got {self.source_location}")

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def load(
        self, *, what: str | None = None, rebuilding_at: Location | None = None
    ) -> torch.Tensor:
        """Call the load function and check what it returned against the declared shape and
        dtype (a ``TypeError`` for something not a tensor, a ``ValueError`` for another shape
        or dtype). ``what`` names what is being loaded in that error (the runtime passes the
        value, its name and handle); the source itself is named when it is not given. With
        ``rebuilding_at`` (the runtime's: where the value is being rebuilt), an exception the
        load function raises keeps its type and gets a note naming ``what`` and that location
        (:func:`note_load_failure`)."""
        try:
            loaded = self._load()
        except Exception as error:
            if rebuilding_at is not None:
                note_load_failure(error, what or repr(self), rebuilding_at, self)
            raise
        return check_loaded(loaded, self.shape, self.dtype, what=what or repr(self))

    def __repr__(self) -> str:
        return f"<CallableSource {self.shape} {self.dtype} at {self.source_location}>"


class SafetensorsSource:
    """One tensor of a safetensors checkpoint; loads into ``pageable-host``.

    ``path`` is anything :meth:`Checkpoint.open <aresidency.runtime.checkpoints.Checkpoint.open>`
    takes (a ``.safetensors`` file, a directory holding one or a sharded checkpoint, an index
    JSON) or an open :class:`~aresidency.runtime.checkpoints.Checkpoint` (to share one among many
    sources). Construction reads the headers, not the data, and blocks for that; a missing
    tensor is a ``KeyError`` naming the checkpoint and the tensor. ``load`` (in a worker thread)
    copies the tensor out of the file's mapping into new memory: one copy, served by the page
    cache on repeats.
    """

    def __init__(self, path: str | Path | Checkpoint, tensor_name: str) -> None:
        self._checkpoint = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
        self.path = self._checkpoint.path
        self.tensor_name = tensor_name
        self.source_location = Location("pageable-host")
        info = self._checkpoint.info(tensor_name)  # KeyError naming both if it has none
        self.shape: tuple[int, ...] = info.shape
        self.dtype: torch.dtype = info.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def load(self) -> torch.Tensor:
        """The tensor in new host memory; blocks the calling thread for the copy."""
        return self._checkpoint.read(self.tensor_name)

    def __repr__(self) -> str:
        return f"<SafetensorsSource {self.path}:{self.tensor_name} {self.shape} {self.dtype}>"
