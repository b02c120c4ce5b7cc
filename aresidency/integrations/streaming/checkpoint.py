"""Loading a packed group's flat buffer from a safetensors checkpoint (in a worker thread)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, cast

import torch

from .packing import TensorGroup

__all__ = ["CheckpointBlock", "checkpoint_plan", "read_safetensors_header"]

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


def read_safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header) of a safetensors file; reads only the header."""
    with open(path, "rb") as file:
        raw = file.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 << 20:
            raise ValueError(f"{path}: implausible safetensors header length {length}")
        header = json.loads(file.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + length, header


class CheckpointBlock:
    """Loads one group's flat buffer: tensors found in the checkpoint are read straight from the
    file into their place (one copy, the GIL released by the read); the others (non-persistent
    buffers) are copied from the module's own tensors. Runs in a worker thread."""

    def __init__(
        self,
        group: TensorGroup,
        path: Path,
        ranges: list[tuple[int, int, int]],
        from_module: list[int],
    ) -> None:
        self.group = group
        self.path = path
        self.ranges = ranges  # (offset in flat, offset in file, nbytes)
        self.from_module = set(from_module)

    def __call__(self) -> torch.Tensor:
        flat = torch.empty(self.group.nbytes, dtype=torch.uint8)
        if self.ranges:
            target = memoryview(cast(Any, flat.numpy()))
            with open(self.path, "rb", buffering=0) as file:
                for dst, src, nbytes in self.ranges:
                    file.seek(src)
                    done = 0
                    while done < nbytes:
                        got = file.readinto(target[dst + done : dst + nbytes])
                        if not got:
                            raise OSError(f"{self.path}: unexpected end of file at {src + done}")
                        done += got
        if self.from_module:
            entries = self.group.entries
            for index, view in enumerate(self.group.views(flat)):
                if index in self.from_module:
                    view.copy_(entries[index].tensor.detach())
        return flat


def checkpoint_plan(
    group: TensorGroup, path: Path, data_start: int, header: dict[str, Any]
) -> CheckpointBlock:
    ranges: list[tuple[int, int, int]] = []
    from_module: list[int] = []
    for index, entry in enumerate(group.entries):
        found = next((name for name in entry.names if name in header), None)
        if found is None:
            if entry.tensor.is_meta:
                raise KeyError(
                    f"{path} has no tensor named {' or '.join(map(repr, entry.names))} and the "
                    "module's own tensor is on the meta device"
                )
            from_module.append(index)
            continue
        info = header[found]
        dtype = _ST_DTYPES.get(str(info.get("dtype")))
        shape = tuple(int(d) for d in info.get("shape", ()))
        if dtype != entry.dtype or shape != entry.shape:
            raise ValueError(
                f"{path}:{found} is {info.get('dtype')} {list(shape)}, but the module's tensor "
                f"is {entry.dtype} {list(entry.shape)}"
            )
        begin, end = (int(x) for x in info["data_offsets"])
        if end - begin != entry.span_bytes:
            raise ValueError(f"{path}:{found} holds {end - begin} B, expected {entry.span_bytes}")
        if (
            ranges
            and ranges[-1][0] + ranges[-1][2] == entry.offset
            and (ranges[-1][1] + ranges[-1][2] == data_start + begin)
        ):
            dst, src, nbytes = ranges.pop()
            ranges.append((dst, src, nbytes + end - begin))
        else:
            ranges.append((entry.offset, data_start + begin, end - begin))
    return CheckpointBlock(group, path, ranges, from_module)
