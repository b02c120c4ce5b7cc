"""The tensors behind materializations, and what a batch of transitions does to them.

The model (``core``) knows that a value has a materialization at a location; this table knows
the tensor behind it, the transfer still filling it and the reader events still using it. It
never frees anything by itself: :meth:`PayloadTable.effects` takes the transitions the model
committed and *returns* the tensors that no materialization references any more; the runtime
hands them to the backend after the state change, as httpcore's pool returns the connections
to close instead of closing them inside the state change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.base import DeviceEvent, Transfer
from ..core.locations import Location
from ..core.values import ValueHandle

__all__ = ["FREEING_KINDS", "Payload", "PayloadTable"]

# Transitions that end the materialization at ``transition.location``.
_ENDS_ONE = frozenset({"release", "invalidate", "move_commit", "copy_abort"})
#: Transitions that may end payloads (what :meth:`PayloadTable.effects` acts on; it does
#: nothing for a batch without one).
FREEING_KINDS = _ENDS_ONE | {"discard"}


@dataclass(slots=True, eq=False)
class Payload:
    """The tensor behind one materialization.

    ``transfer``: the transfer filling ``tensor`` (``None`` once committed, or for data that
    was there from the start); ``readers``: consumer events recorded by leases and not reaped
    yet; ``failure``: the error of the transfer that was filling it (set before its abort, so
    that leases entered on the incoming copy report it); ``aborting``: its transfer is being
    cancelled, so no new lease may start on it. ``key``: its storage's key in the table
    (set when it is put there: the tensor never changes, and popping it needs the key).
    """

    tensor: torch.Tensor
    transfer: Transfer | None = None
    readers: list[DeviceEvent] = field(default_factory=list)
    failure: BaseException | None = None
    aborting: bool = False
    key: tuple[bool, int] | None = None


class PayloadTable:
    """Payloads by value and location, and the storage they own.

    Invariant (kept by the runtime): a payload exists for exactly the materializations of the
    model whose data exists (a load still reading its source has none yet); a tensor leaves the
    table only through :meth:`effects`, after the model removed its materialization.
    ``_storages`` maps the data pointer of every managed storage to its key, so a tensor that
    already belongs to the manager cannot be registered again as another value.
    """

    __slots__ = ("_by_value", "_storages")

    def __init__(self) -> None:
        self._by_value: dict[ValueHandle, dict[Location, Payload]] = {}
        self._storages: dict[tuple[bool, int], tuple[ValueHandle, Location]] = {}

    def get(self, handle: ValueHandle, location: Location) -> Payload | None:
        per = self._by_value.get(handle)
        return None if per is None else per.get(location)

    def put(self, handle: ValueHandle, location: Location, payload: Payload) -> None:
        self._by_value.setdefault(handle, {})[location] = payload
        key = payload.key = _storage_key(payload.tensor)
        if key is not None:
            self._storages[key] = (handle, location)

    def owner_of(self, tensor: torch.Tensor) -> tuple[ValueHandle, Location] | None:
        """The materialization whose storage ``tensor`` shares, if any."""
        key = _storage_key(tensor)
        return None if key is None else self._storages.get(key)

    def _pop(self, handle: ValueHandle, location: Location) -> Payload | None:
        per = self._by_value.get(handle)
        if per is None:
            return None
        payload = per.pop(location, None)
        if not per:
            del self._by_value[handle]
        if payload is not None:
            key = payload.key
            if key is not None and self._storages.get(key) == (handle, location):
                del self._storages[key]
        return payload

    def effects(
        self, transitions: Iterable[tuple[str, Any, Location | None]]
    ) -> list[tuple[torch.Tensor, Location]]:
        """Remove the payloads whose materialization these transitions (``(kind, handle,
        location)``, the state's journal) ended; return their tensors and locations, for the
        backend to free."""
        freed: list[tuple[torch.Tensor, Location]] = []
        for kind, handle, location in transitions:
            if kind in _ENDS_ONE:
                assert location is not None
                # self._pop(handle, location), inline (one per freed payload)
                per = self._by_value.get(handle)
                if per is None:
                    continue
                payload = per.pop(location, None)
                if not per:
                    del self._by_value[handle]
                if payload is None:
                    continue
                key = payload.key
                if key is not None and self._storages.get(key) == (handle, location):
                    del self._storages[key]
                freed.append((payload.tensor, location))
            elif kind == "discard":
                for location in list(self._by_value.get(handle, {})):
                    payload = self._pop(handle, location)
                    if payload is not None:
                        freed.append((payload.tensor, location))
        return freed

    def items(self) -> Iterator[tuple[ValueHandle, Location, Payload]]:
        for handle, per in self._by_value.items():
            for location, payload in per.items():
                yield handle, location, payload

    def __len__(self) -> int:
        return sum(len(per) for per in self._by_value.values())


def _storage_key(tensor: torch.Tensor) -> tuple[bool, int] | None:
    """The key of the storage ``tensor`` views: a data pointer is unique among the live
    storages of one kind of memory (host, or CUDA's one virtual address space for every
    device), so the pointer and whether it is device memory name it (``str(tensor.device)``
    would cost more than the rest of the lookup)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (tensor.is_cuda, storage.data_ptr())
