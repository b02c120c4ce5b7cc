"""Reading a staged source (such as :class:`~aresidency.loader.ShardSource`) for one epoch: the
plans are filled into the loader's free staging buffers by its worker threads, several at once,
and the filled batches are handed to the pipeline in plan order (a fill that finishes early
waits in ``filled`` for its turn).

What the host waits on: nothing here waits; fills run in the staging threads and report back
through the manager's bridge (``call_soon_quietly``), which then pumps the pipeline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.values import value_charge
from .feeder import End
from .records import BatchRecord, Part
from .staging import SlotSource, StagedFill, StagingSlots, staged_layout

if TYPE_CHECKING:
    import torch

    from .loader import DeviceLoader

__all__ = ["StagedFills", "return_slot"]


class StagedFills:
    """The fills of one epoch of a staged source. Loop thread, except :meth:`_filled_in_thread`.

    State: ``plans`` (one per batch, in order), ``next_plan`` (the next plan to fill),
    ``next_arrival`` (the next batch the pipeline takes), ``filled`` (filled batches, or the
    error that ended one, by index, waiting for their turn), ``in_flight`` (fills running),
    ``active`` (whether fills are still wanted). Invariant: a buffer is in the free list, in a
    fill, in ``filled``, or behind a batch record's ``slot``, never two of these.
    """

    def __init__(
        self,
        loader: DeviceLoader,
        epoch_number: int,
        plans: Sequence[Any],
        pump: Callable[[], None],
    ) -> None:
        self.loader = loader
        self.epoch_number = epoch_number
        self.plans = plans
        self.pump = pump
        self.next_plan = 0
        self.next_arrival = 0
        self.filled: dict[int, BatchRecord | End] = {}
        self.in_flight = 0
        self.active = True
        # The fill threads report through the loop's bridge, kept: the manager's refuses
        # once it closes, and a fill in flight must still say that it ended.
        self._bridge = loader.manager.bridge

    def __repr__(self) -> str:
        return (
            f"<StagedFills {self.next_arrival}/{len(self.plans)} taken, {self.in_flight} "
            f"filling, {len(self.filled)} filled>"
        )

    def dispatch(self) -> None:
        """Start filling the next plans into the free buffers (never waits)."""
        slots = self.loader.staging
        assert slots is not None
        source = self.loader.source
        while self.active and slots.free and self.next_plan < len(self.plans):
            slot = slots.free.pop()
            index = self.next_plan
            self.next_plan += 1
            self.in_flight += 1
            fill = StagedFill(
                slots.executor,
                source,
                self.plans[index],
                slots.buffers[slot],
                None,
                _never,
                slots.workers,
            )
            fill.when_done(functools.partial(self._filled_in_thread, index, slot))

    def take(self) -> BatchRecord | End | None:
        """The next batch in plan order once it is filled, the :class:`End` after the last
        one (or in place of a batch whose read failed), or ``None`` for now."""
        if self.next_arrival >= len(self.plans):
            return End(self.next_arrival)
        item = self.filled.pop(self.next_arrival, None)
        if isinstance(item, BatchRecord):
            self.next_arrival += 1
        return item

    def stop(self) -> None:
        """Fill no more and give back the buffers of filled batches not taken (loop thread)."""
        self.active = False
        for item in self.filled.values():
            if isinstance(item, BatchRecord):
                return_slot(self.loader.staging, item)
        self.filled.clear()

    def _filled_in_thread(
        self,
        index: int,
        slot: int,
        layout: Any,
        error: BaseException | None,
        start: float,
        end: float,
    ) -> None:
        self._bridge.call_soon_quietly(self._filled_on_loop, index, slot, layout, error, start, end)

    def _filled_on_loop(
        self,
        index: int,
        slot: int,
        layout: Any,
        error: BaseException | None,
        start: float,
        end: float,
    ) -> None:
        self.in_flight -= 1
        slots = self.loader.staging
        if not self.active or slots is None or slots.status != "open":
            if slots is not None and slots.status == "open":
                slots.free.append(slot)
            self.pump()
            return
        if error is not None:
            slots.free.append(slot)
            self.filled[index] = End(index, error)
            self.pump()
            return
        try:
            batch = self._record(index, slot, layout, slots.buffers[slot])
        except BaseException as failure:
            slots.free.append(slot)
            self.filled[index] = End(index, failure)
            self.pump()
            return
        counters = self.loader.counters
        counters.source_clock.add(start, end)
        counters.source_batches += 1
        counters.source_bytes += batch.nbytes
        self.filled[index] = batch
        self.pump()

    def _record(self, index: int, slot: int, layout: Any, buffer: torch.Tensor) -> BatchRecord:
        specs, structure, nbytes = staged_layout(index, layout, buffer)
        label = f"{self.loader.name}/e{self.epoch_number}/b{index}"
        source = SlotSource(buffer[:nbytes], label)
        charge = value_charge(nbytes, None, self.loader.manager.state.granularity)
        part = Part(charge, nbytes, source=source)
        return BatchRecord(index, [part], structure, nbytes, specs=specs, slot=slot)


def _never(_after: Any) -> None:
    raise AssertionError("a free staging buffer has no copy to wait for")


def return_slot(slots: StagingSlots | None, batch: BatchRecord) -> None:
    """Give the batch's staging buffer back to ``slots`` (the loader's staging buffers; its
    copy completed, or it was never copied) and retire its source, so that nothing loads from
    the buffer again."""
    slot, batch.slot = batch.slot, None
    for part in batch.parts:
        if part.source is not None:
            part.source.retire()
    if slot is not None and slots is not None and slots.status == "open":
        slots.free.append(slot)
