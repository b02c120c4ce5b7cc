"""Packing a module's tensors into flat byte buffers: one buffer per block, pure layout.

Each *block* (see :func:`find_blocks`) becomes one :class:`TensorGroup`: its parameters and
buffers laid out in one flat ``uint8`` buffer, each starting on an ``ALIGN``-byte boundary (the
CUDA caching allocator's granularity) with its own dense strides, so kernels see the alignment and
layout a tensor of its own would have and give bit-identical results. Tensors outside every block
form the *resident* group. Nothing here touches a device or the manager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import torch
from torch import nn

from ...core.values import ValueHandle
from ...runtime.leases import Hold

__all__ = [
    "ALIGN",
    "PackedTensor",
    "TensorGroup",
    "collect_groups",
    "find_blocks",
]

#: Every tensor of a packed block starts on this boundary (the CUDA caching allocator rounds
#: blocks to 512 bytes), so kernels see the alignment a tensor of its own would have.
ALIGN: Final = 512


def _version_of(tensor: torch.Tensor) -> int:
    """``tensor._version``, or -1 for an inference tensor (it keeps no version counter)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(stride))


def broadcast_dims(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The dimensions of size above one with stride 0: an ``expand()``ed tensor's, whose
    elements along them are one element of memory repeated."""
    return tuple(d for d, (size, st) in enumerate(zip(shape, stride)) if st == 0 and size > 1)


def compact(tensor: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``tensor`` narrowed to its first element along ``dims`` (its broadcast dimensions):
    the memory an expanded tensor really has, as a tensor that can be copied to or from."""
    for d in dims:
        tensor = tensor.narrow(d, 0, 1)
    return tensor


def _dense_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s strides if they lay it out densely without overlap (contiguous, channels-last,
    transposed...), else contiguous strides. Keeping them keeps the kernels the same.

    An expanded tensor (stride 0 along a dimension of size above one: ``expand()``, a
    broadcast buffer) keeps its stride 0 there, so that it is packed at the size of its memory,
    not of its shape, and its views on the device are expanded as the module's tensor is; its
    other dimensions are laid out as any tensor's."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    if tensor.numel() == 0:
        return _contiguous_stride(shape)
    broadcast = broadcast_dims(shape, stride)
    expected = 1
    for st, size in sorted(
        (st, size)
        for d, (size, st) in enumerate(zip(shape, stride))
        if size != 1 and d not in broadcast
    ):
        if st != expected:
            if not broadcast:
                return _contiguous_stride(shape)
            dense = _contiguous_stride([1 if d in broadcast else n for d, n in enumerate(shape)])
            return tuple(0 if d in broadcast else st for d, st in enumerate(dense))
        expected *= size
    return stride


# ---------------------------------------------------------------- block discovery


def _tensor_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks streaming runs one by one: the children of an ``nn.Sequential``, else the
    ``nn.ModuleList`` inside ``module`` holding the most parameter and buffer bytes (ties: the
    first in ``named_modules`` order). ``ValueError`` if there is none: pass ``blocks=``."""
    if isinstance(module, nn.Sequential):
        return list(module)
    best: nn.ModuleList | None = None
    best_bytes = -1
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0:
            nbytes = _tensor_bytes(sub)
            if nbytes > best_bytes:
                best, best_bytes = sub, nbytes
    if best is None:
        raise ValueError(
            f"{type(module).__name__} is not an nn.Sequential and holds no nn.ModuleList of "
            "blocks; pass blocks=[...] (the submodules to stream one at a time, in call order)"
        )
    return list(best)


# ---------------------------------------------------------------- packing


@dataclass(frozen=True, slots=True)
class PackedTensor:
    """One tensor of a group: where it sits in the flat buffer and every slot that names it."""

    tensor: torch.Tensor  # the module's own Parameter or buffer object
    names: tuple[str, ...]  # qualified names in the root module (state_dict keys)
    slots: tuple[tuple[dict[str, Any], str], ...]  # (module._parameters or _buffers, attribute)
    dtype: torch.dtype
    element_size: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # bytes from the start of the flat buffer, a multiple of ALIGN
    span_bytes: int  # bytes the strided layout covers
    # in its module's state_dict: a parameter, or a buffer not in its owner's
    # _non_persistent_buffers_set (True if any slot naming the tensor is)
    persistent: bool = True
    # dimensions laid out with stride 0 (an expanded tensor's: see _dense_stride); a copy to
    # or from its view goes through compact() of both sides
    broadcast: tuple[int, ...] = ()


class TensorGroup:
    """The tensors of one block (or the resident rest) packed into one managed value.

    State: ``entries`` (the layout), ``nbytes`` (the flat buffer's size, a multiple of ALIGN),
    ``handle`` (the value), ``hold`` (keeps the host copy from being moved away while the
    module's parameters point into it), ``from_source`` (rebuilt from a checkpoint).
    """

    def __init__(self, index: int, name: str, entries: list[PackedTensor], nbytes: int) -> None:
        self.index = index
        self.name = name
        self.entries = entries
        self.nbytes = nbytes
        self.charge_bytes = nbytes
        self.handle: ValueHandle | None = None
        self.hold: Hold | None = None
        self.from_source = False
        self.host_flat: torch.Tensor | None = None
        # (data_ptr, version) of each entry's tensor when last copied into the host flat
        # buffer (host mode): a changed version means written in place since
        self.seen: list[tuple[int, int]] | None = None
        self._dtypes = sorted({e.dtype for e in entries}, key=str)
        # (slot dict, attribute, entry index) flattened once: swapping is the per-call hot path.
        self._slots = [(d, attr, i) for i, e in enumerate(entries) for d, attr in e.slots]
        self._originals = [e.tensor for e in entries]
        # The tensors swap_in put in the slots, and (entry index -> a host copy of the value,
        # or None) the tensors the forward put in their place (a dynamic RoPE's
        # ``register_buffer("inv_freq", ...)``), taken by ``restore(capture=True)``: the
        # streamed module writes them back into its own tensors before the next call.
        self._swapped: Sequence[torch.Tensor] | None = None
        self.replaced: dict[int, torch.Tensor | None] = {}

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each entry's tensor as a strided view of ``flat`` (one op per tensor; no copy)."""
        typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        for dtype in self._dtypes:
            view = flat.view(dtype)
            typed[dtype] = (view, int(view.storage_offset()))
        out = []
        for e in self.entries:
            view, base = typed[e.dtype]
            out.append(view.as_strided(e.shape, e.stride, base + e.offset // e.element_size))
        return out

    def swap_in(self, tensors: Sequence[torch.Tensor]) -> None:
        for slots, attr, i in self._slots:
            slots[attr] = tensors[i]
        self._swapped = tensors

    def note(self) -> None:
        """Remember each tensor's memory and version, for :meth:`changes` (a tensor made under
        ``torch.inference_mode()`` has no version counter: -1, its writes are not seen)."""
        self.seen = [(t.data_ptr(), _version_of(t)) for t in self._originals]

    def changes(self) -> tuple[PackedTensor | None, bool]:
        """Since :meth:`note`: the first entry whose tensor was replaced (its module holds
        another tensor in its place, or it has other memory now), and whether any was
        written in place (its version moved). Runs at every call: one pass, no allocation.
        While a call has its device tensors swapped in (a model pool's calls run beside each
        other), the module holds those in the tensors' places: only the versions are read."""
        originals = self._originals
        if self.swapped_storage() is None:
            for slots, attr, i in self._slots:
                if slots.get(attr) is not originals[i]:
                    return self.entries[i], False
        assert self.seen is not None
        stale = False
        for i, (ptr, version) in enumerate(self.seen):
            tensor = originals[i]
            if tensor.data_ptr() != ptr:
                return self.entries[i], False
            if version >= 0 and tensor._version != version:
                stale = True
        return None, stale

    def swapped_storage(self) -> int | None:
        """The memory of the tensors swapped in now (a device replica or ring buffer), or
        ``None`` (nothing swapped in, or no tensors)."""
        swapped = self._swapped
        if not self._slots or not swapped:
            return None
        # (what swap_in put there, not what the slot holds now: the forward may have put
        # another tensor in its place)
        tensor = swapped[self._slots[0][2]]
        try:
            return int(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None

    def capture_replaced(self) -> None:
        """Copy to the host, into :attr:`replaced`, the value of each slot the forward gave
        another tensor (or ``None``) since :meth:`swap_in`. Call where the calling thread
        orders work after the forward's (its compute stream current: the copy waits for the
        value), before the reader event that lets the swapped-in tensors go."""
        swapped = self._swapped
        if swapped is None:
            return
        originals = self._originals
        for slots, attr, i in self._slots:
            current = slots.get(attr)
            if current is not swapped[i] and current is not originals[i]:
                self.replaced[i] = (
                    None if current is None else current.detach().to("cpu", copy=True)
                )

    def restore(self, capture: bool = False) -> None:
        """Put the module's own tensors back in their slots (first, with ``capture``,
        :meth:`capture_replaced`)."""
        if capture:
            self.capture_replaced()
        originals = self._originals
        for slots, attr, i in self._slots:
            slots[attr] = originals[i]
        self._swapped = None

    def pack_from(
        self, flat: torch.Tensor, skip: Callable[[PackedTensor], bool] | None = None
    ) -> None:
        """Copy the module's tensors into ``flat`` (host side, at start-up or in a load)."""
        for entry, view in zip(self.entries, self.views(flat)):
            if skip is None or not skip(entry):
                copy_into(entry, view, entry.tensor.detach())

    def __repr__(self) -> str:
        return f"<TensorGroup {self.name!r} {len(self.entries)} tensors {self.nbytes} B>"


def copy_into(entry: PackedTensor, view: torch.Tensor, value: torch.Tensor) -> None:
    """``view.copy_(value)`` for ``entry``'s view: only its memory, for an expanded one (a
    copy into its broadcast dimensions would write one element many times, which torch
    refuses; ``value`` must be equal along them, as the module's own expanded tensor is)."""
    if entry.broadcast:
        view = compact(view, entry.broadcast)
        value = compact(value, entry.broadcast)
    view.copy_(value)


def pack_layout(
    modules: Sequence[nn.Module],
    qualified: dict[int, list[str]],
    keep_strides: bool,
    aliases: dict[int, list[str]] | None = None,
) -> list[PackedTensor]:
    """Lay out the tensors held directly by ``modules`` (each module's own tables only; a tensor
    held twice, a tied weight, is laid out once and every slot naming it is kept). Strides are
    the tensor's own when ``keep_strides`` and dense, else contiguous (a checkpoint's: its
    tensors are stored dense, so an expanded tensor of the module is laid out at its full
    size there, and its view is dense); an expanded tensor keeps its stride 0 (its memory,
    not its shape, is packed: see :func:`_dense_stride`). ``aliases``: every state_dict name
    of each tensor in the root module (by ``id``), added after the names ``modules`` give it:
    a weight tied across blocks is named by all of them in each group that holds it (a
    checkpoint that stores it once, as ``safetensors.torch.save_model`` does, has one of
    them)."""
    found: dict[int, tuple[torch.Tensor, list[str], list[tuple[dict[str, Any], str]]]] = {}
    persistent: set[int] = set()
    seen_slots: set[tuple[int, str]] = set()
    for sub in modules:
        for table in (sub._parameters, sub._buffers):
            for attr, tensor in table.items():
                if tensor is None or (id(sub), attr) in seen_slots:
                    continue
                seen_slots.add((id(sub), attr))
                record = found.setdefault(id(tensor), (tensor, [], []))
                for base in qualified.get(id(sub), []):
                    record[1].append(f"{base}.{attr}" if base else attr)
                record[2].append((cast(dict[str, Any], table), attr))
                if table is sub._parameters or attr not in sub._non_persistent_buffers_set:
                    persistent.add(id(tensor))
    entries: list[PackedTensor] = []
    offset = 0
    for tensor, names, slots in found.values():
        if aliases is not None:
            names.extend(n for n in aliases.get(id(tensor), ()) if n not in names)
        stride = _dense_stride(tensor) if keep_strides else _contiguous_stride(tensor.shape)
        span = 0
        if tensor.numel():
            span = 1 + sum((size - 1) * st for size, st in zip(tensor.shape, stride))
        span_bytes = span * tensor.element_size()
        entries.append(
            PackedTensor(
                tensor=tensor,
                names=tuple(names),
                slots=tuple(slots),
                dtype=tensor.dtype,
                element_size=tensor.element_size(),
                shape=tuple(tensor.shape),
                stride=stride,
                offset=offset,
                span_bytes=span_bytes,
                persistent=id(tensor) in persistent,
                broadcast=broadcast_dims(tensor.shape, stride),
            )
        )
        offset = _align(offset + span_bytes)
    return entries


def make_group(index: int, name: str, entries: list[PackedTensor]) -> TensorGroup | None:
    if not entries:
        return None
    return TensorGroup(index, name, entries, _align(entries[-1].offset + entries[-1].span_bytes))


def collect_groups(
    root: nn.Module, blocks: Sequence[nn.Module], prefix: str, keep_strides: bool
) -> tuple[list[TensorGroup | None], TensorGroup | None]:
    """One group per entry of ``blocks`` (``None`` for a block without tensors) and the
    resident group: the tensors of ``root``'s modules outside every block. A block listed
    more than once (one the forward runs several times) has one group, its weights packed
    once: every entry of it is that group, numbered after its first entry."""
    qualified: dict[int, list[str]] = {}
    for name, sub in root.named_modules(remove_duplicate=False):
        qualified.setdefault(id(sub), []).append(name)
    aliases: dict[int, list[str]] = {}
    for name, tensor in (
        *root.named_parameters(remove_duplicate=False),
        *root.named_buffers(remove_duplicate=False),
    ):
        aliases.setdefault(id(tensor), []).append(name)
    groups: list[TensorGroup | None] = []
    inside: set[int] = set()
    made: dict[int, TensorGroup | None] = {}  # id(block) -> its group
    for index, block in enumerate(blocks):
        if id(block) in made:
            groups.append(made[id(block)])
            continue
        modules = list(block.modules())
        inside.update(id(sub) for sub in modules)
        group = make_group(
            index,
            f"{prefix}.block{index}",
            pack_layout(modules, qualified, keep_strides, aliases),
        )
        made[id(block)] = group
        groups.append(group)
    outside = [sub for sub in root.modules() if id(sub) not in inside]
    resident = make_group(
        len(blocks), f"{prefix}.resident", pack_layout(outside, qualified, keep_strides, aliases)
    )
    return groups, resident
