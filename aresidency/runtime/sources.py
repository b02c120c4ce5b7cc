"""Sources: where a reconstructible value's data comes from when it has no materialization.

A source is any object with ``shape``, ``dtype``, ``source_location`` and a synchronous
``load() -> torch.Tensor`` that returns the value's data as a host tensor. The runtime calls
``load`` in a worker thread, so a slow load never blocks the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..core.locations import Location, LocationLike

__all__ = ["CallableSource", "SafetensorsSource", "Source"]


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


class CallableSource:
    """A source that calls ``load()`` to produce the tensor (shape and dtype declared up front).

    ``source_location`` is where the loaded data is charged temporarily while it is copied to
    its destination (``pageable-host`` by default, or ``pinned-host``). The loaded tensor must
    match ``shape`` and ``dtype``; a mismatch is an error naming both.
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
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self._load = load
        self.shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape must have no negative dimension, got {self.shape}")
        self.dtype = dtype
        self.source_location = Location.parse(source_location)
        if self.source_location.is_cuda:
            raise ValueError(f"source_location must be a host location, got {self.source_location}")

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def load(self) -> torch.Tensor:
        tensor = self._load()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"source load() returned {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"source load() returned shape {tuple(tensor.shape)} {tensor.dtype}, declared "
                f"{self.shape} {self.dtype}"
            )
        return tensor.cpu() if tensor.device.type != "cpu" else tensor

    def __repr__(self) -> str:
        return f"<CallableSource {self.shape} {self.dtype} at {self.source_location}>"


_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsSource:
    """One tensor of a safetensors file, memory-mapped; loads into ``pageable-host``.

    Shape and dtype are read from the file's header at construction (no data is read then);
    ``load`` maps the file and copies the one tensor out, so the page cache serves repeats.
    """

    def __init__(self, path: str | Path, tensor_name: str) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self.tensor_name = tensor_name
        self.source_location = Location("pageable-host")
        with safe_open(str(self.path), framework="pt") as handle:
            if tensor_name not in handle.keys():  # noqa: SIM118 (safe_open has no __contains__)
                raise KeyError(f"{self.path} has no tensor named {tensor_name!r}")
            piece: Any = handle.get_slice(tensor_name)
            self.shape = tuple(int(d) for d in piece.get_shape())
            dtype_name = str(piece.get_dtype())
        if dtype_name not in _ST_DTYPES:
            raise ValueError(f"unsupported safetensors dtype {dtype_name} for {tensor_name!r}")
        self.dtype = _ST_DTYPES[dtype_name]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def load(self) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(self.tensor_name)
        return tensor

    def __repr__(self) -> str:
        return f"<SafetensorsSource {self.path}:{self.tensor_name} {self.shape} {self.dtype}>"
