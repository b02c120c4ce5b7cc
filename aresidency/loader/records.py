"""The loader's records of the batches in flight: :class:`Part` (one value) and
:class:`BatchRecord` (one batch), and the states a batch goes through (see
:mod:`~aresidency.loader.pipeline`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.values import ValueHandle
from ..runtime.leases import Hold, Lease
from ..runtime.pending import PendingOperation
from .batch import DeviceBatch
from .staging import SlotSource, TensorSpec
from .structure import Structure

if TYPE_CHECKING:
    import torch

__all__ = ["COPYING", "DONE", "OUT", "QUEUED", "RELEASING", "BatchRecord", "Part"]

QUEUED, COPYING, OUT, RELEASING, DONE = "queued", "copying", "out", "releasing", "done"


class Part:
    """One value of a batch: a host tensor to register (``host``), or a staged batch's buffer
    (``source``). ``charge`` is what it costs at the device; ``key`` the host storage it was
    registered from (while the manager may still hold it there).

    The device copy is protected from the moment its materialization begins until the batch is
    released, so that a scope waiting for room counts it as transient (it ends on its own) and
    no controller evicts it: by ``hold`` until the copy is issued, then by ``lease``, entered
    without ordering any stream (the consumer's stream is ordered at the hand-out). The lease
    also tells whether the copy failed (``failed`` once that was reported)."""

    __slots__ = (
        "charge",
        "discarded",
        "failed",
        "handle",
        "hold",
        "host",
        "issued_at",
        "key",
        "landed",
        "lease",
        "location",
        "nbytes",
        "pending",
        "source",
        "version",
        "watching",
    )

    def __init__(
        self,
        charge: int,
        nbytes: int,
        *,
        host: torch.Tensor | None = None,
        location: Location | None = None,
        source: SlotSource | None = None,
        version: int | None = None,
    ) -> None:
        self.charge = charge
        self.nbytes = nbytes
        self.host = host
        self.version = version  # the host tensor's version counter as the source yielded it
        self.location = location
        self.source = source
        self.key: tuple[str, int] | None = None
        if host is not None and host.untyped_storage().nbytes():
            self.key = (str(host.device), host.untyped_storage().data_ptr())
        self.handle: ValueHandle | None = None
        self.pending: PendingOperation | None = None
        self.lease: Lease | None = None
        # The lease's copy completed (or had, when the lease was entered): only then can the
        # lease report a failure, so only then does the pump look at it.
        self.landed = False
        self.hold: Hold | None = None
        self.issued_at = 0.0
        self.watching = False
        self.failed = False
        self.discarded = False


class BatchRecord:
    """One batch in the pipeline (see the module docstring for ``state``).

    ``leaf_part`` (host batches: the part behind each tensor of ``structure``) or ``specs``
    (staged batches: where each tensor lies in the one part); ``slot``: the staging buffer it
    occupies until its copy completed; ``blocked_since``: when it started waiting for room;
    ``handed``: what the consumer got.
    """

    __slots__ = (
        "blocked_since",
        "copies_settled",
        "error",
        "handed",
        "index",
        "leaf_part",
        "nbytes",
        "parts",
        "slot",
        "specs",
        "state",
        "streams",
        "structure",
    )

    def __init__(
        self,
        index: int,
        parts: list[Part],
        structure: Structure,
        nbytes: int,
        *,
        leaf_part: list[int] | None = None,
        specs: list[TensorSpec] | None = None,
        slot: int | None = None,
    ) -> None:
        self.index = index
        self.parts = parts
        self.structure = structure
        self.nbytes = nbytes
        self.leaf_part = leaf_part
        self.specs = specs
        self.slot = slot
        self.state = QUEUED
        self.error: BaseException | None = None
        self.blocked_since: float | None = None
        self.handed: DeviceBatch | None = None
        self.streams: list[Any] = []  # the consumer's streams, while out
        # Every part leased and its copy committed (or failed, or discarded): nothing about
        # its protection can change any more, so the pump stops looking at it.
        self.copies_settled = False

    def __repr__(self) -> str:
        return f"<batch {self.index} {self.state} {format_nbytes(self.nbytes)}>"
