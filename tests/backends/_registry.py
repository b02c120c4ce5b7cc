"""A stand-in for cudaHostRegister, for the allocator and arena tests on the CPU."""

from __future__ import annotations

import torch


class FakeRegistry:
    """Stands in for cudaHostRegister: refuses an overlapping range, as the driver does."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        for start, size in self.ranges.items():
            if ptr < start + size and start < ptr + nbytes:
                raise torch.OutOfMemoryError("part or all of the range is already mapped")
        self.ranges[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.ranges[ptr]
