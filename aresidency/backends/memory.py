"""Byte views and poison: helpers every backend shares.

* :func:`as_bytes`: a flat ``uint8`` view of a contiguous tensor (no copy), the unit that copies
  and staging move.
* :func:`poison_` / :func:`is_poisoned`: the pattern written into memory that holds no value
  (NaN for floating and complex dtypes, the byte 0xA5 otherwise). The simulation poisons every
  allocation and every release; both backends poison the destination of a transfer that fault
  injection fails, so a read that should not have happened shows up in tests.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["POISON_BYTE", "as_bytes", "is_poisoned", "poison_"]

POISON_BYTE: Final = 0xA5


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's elements (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


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
