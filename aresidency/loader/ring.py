"""One pass of a ``DeviceLoader`` through a ring of device buffers: the per-batch work off the
event loop.

The managed-value pass (:mod:`~aresidency.loader.pipeline`) makes every tensor of every batch a
value of the manager: registered, charged, materialized, leased, released and discarded on the
loop, one by one. That is a few hundred microseconds of Python per batch on the loop, which the
step (sharing the interpreter) waits for: at batches of a megabyte, the loop's work, not the
link, sets the pace. The ring keeps the byte budget and the ordering and drops that work:

* **Slots.** The pass owns device buffers ("slots"), each charged to the device budget as a
  named reservation (``"<loader> ring e<pass> #<n>"``, visible in the snapshot) for as long as
  it exists. A slot is made (or grown) on the loop when the ring's thread needs one: at most
  ``prefetch`` batches are copied ahead of the consumer (one when ``prefetch=0`` and the
  consumer waits), so a consumer that releases each batch at the next step uses ``prefetch + 1``
  slots; a batch larger than every free slot grows one (the old buffer is freed, and its
  reservation ended, once the device passed its last reader and copy). When the budget has no
  room for a slot the ring waits (and the consumer with it, cause ``budget``, ``timeout``
  applies) until a slot of its own frees up or room appears; meanwhile what of the ring could
  never hold the batch and stands in its way leaves it (the free slots too small for it, and
  the old buffer of the slot it grows: :meth:`RingEpoch._shed_for`), so that a batch the
  budget holds alone always gets in. A batch larger than the whole budget fails at its place
  with the arithmetic.
* **Per batch, in the ring's thread, no loop involved**: the batch's tensors are copied into a
  free slot, packed (512-byte aligned), on the backend's host-to-device copy stream after the
  slot's last readers (a device-side wait; the host never waits): page-locked tensors by one
  driver call each (the thread keeps them alive until their copy completed). A batch with
  pageable tensors of ``pack_min_bytes`` or more is packed into the slot's *pinned twin* (a
  page-locked host buffer as large as the slot, reserved at ``pinned-host`` with the slot,
  locked by this thread on first use) once the twin's last copy out completed (this thread
  waits for it), then copied with one DMA; smaller pageable batches, and every one when
  ``pinned-host`` has no room for twins, go through the driver's own staging (the call
  returns once the bytes were taken, after the copy stream's earlier work). One event
  after the batch's copies; the batch joins the ready queue with its tensors as views of the
  slot. Where compute runs on the host (the simulation), the thread waits for that event
  first.
* **Hand-out and release, on the loop**: the consumer takes the next ready batch (its stream
  waits for the copy event on the device) and releases it at the next step, or at the end of
  its ``async with`` block: an event is recorded on each of its reader streams (the next copy
  into the slot waits for them on the device) and the slot is free again. No value, lease or
  ledger entry per batch.
* **The end**: :meth:`RingEpoch.shutdown` stops the source and the thread; :meth:`drain` waits
  for the thread, then frees every slot and ends its reservation once the device passed the
  last readers (events recorded then on every stream that read a slot) and the last copies.
  An end nobody awaits (the source's end, a dropped iterator, the manager's close:
  :meth:`RingEpoch.end_soon`) does the same from a thread that joins the ring's thread. At
  the source's end a batch an ``async with`` block keeps (a worker's) is not released: its
  slot stays until the block ends (:meth:`_release` retires it then) or the loader closes
  (:meth:`RingEpoch.release_kept`).
  Where compute runs on the host (the simulation), a released slot is poisoned first, in
  stream order, so that a read after the release is seen.

A staged source (:class:`~aresidency.loader.ShardSource`) is read the same way, without the
source's own thread: the ring's thread has the loader's ``workers`` fill threads read the next
batches into the pinned staging buffers (a fill first waits, in its thread, for the last copy
out of its buffer), takes them in order and copies each out with one driver call. With
``pin_source`` (the source's files page-locked, :mod:`~aresidency.loader.pinnedfiles`) and a
source that :attr:`~aresidency.loader.ShardSource.reads_direct`, there are no fills: the
ring's thread copies each batch into its slot straight out of the files.

An async source is read by a task of the loader into the same queue the ring's thread takes
from. Used on a backend with :meth:`~aresidency.backends.base.Backend.copy_into`; ``ring=False``
goes through the managed values.

Why this module is long: the ring's thread (reading, packing, copying) and the loop (slots,
budget, hand-out, release, the end) are two halves of one state machine under one lock; each
half reads the state the other writes, so they stay side by side.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import mmap
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import torch

from ..backends import PinnedAllocator
from ..backends.bridge import LoopBridge
from ..backends.memory import POISON_BYTE, host_copy
from ..core.errors import ResidencyBudgetError
from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.values import value_charge
from ..runtime.admission import Kept
from ..runtime.leases import current_task
from ..runtime.shield import finish_shielded
from ..runtime.signal import ManagerClosedError
from .batch import DeviceBatch
from .budget import held_by_waiter, kept_by_waiter, reclaim_for
from .feeder import Arrivals, End, HostBatch, ThreadFeeder, changed_since_yielded, feed_async
from .kept import KeptAfterRelease
from .lifetime import HostWaits, closed_under_pass, watch_close
from .reclaim import release_shared
from .staging import StagedFill, TensorSpec, staged_layout
from .structure import flatten

PINNED = Location("pinned-host")
PAGE = mmap.PAGESIZE

if TYPE_CHECKING:
    from .loader import DeviceLoader

__all__ = ["RingEpoch"]

ALIGN = 512  # bytes between packed tensors: any dtype's alignment, and the allocator's
FREE, FILLING, READY, OUT = "free", "filling", "ready", "out"


class _Stopped(Exception):
    """The pass ended while the ring's thread waited."""


class Slot:
    """One device buffer of the ring. ``state``: ``free`` -> ``filling`` (the thread copies a
    batch in) -> ``ready`` (queued for the consumer) -> ``out`` (the consumer has it) ->
    ``free``. ``readers``: events after its last readers (the next copy waits for them);
    ``copied``: the event after the last copy into it; ``pins``: page-locked source tensors
    its last copy may still read; ``streams``: the consumer's streams while out."""

    __slots__ = (
        "buffer",
        "charge",
        "copied",
        "host",
        "host_nbytes",
        "host_reservation",
        "number",
        "pins",
        "readers",
        "reservation",
        "state",
        "streams",
    )

    def __init__(self, number: int, buffer: torch.Tensor, charge: int, reservation: str) -> None:
        self.number = number
        self.buffer = buffer
        self.charge = charge
        self.reservation = reservation
        self.state = FILLING
        self.readers: list[Any] = []
        self.copied: Any = None
        self.pins: list[torch.Tensor] = []
        self.streams: list[Any] = []
        # The slot's pinned twin, for pageable batches: reserved at pinned-host by the loop
        # (host_nbytes, under host_reservation), allocated by the ring's thread on first use.
        self.host: torch.Tensor | None = None
        self.host_nbytes = 0
        self.host_reservation: str | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def __repr__(self) -> str:
        return f"<ring slot #{self.number} {format_nbytes(self.nbytes)} {self.state}>"


def _regions(buffer: torch.Tensor, views: list[torch.Tensor]) -> list[tuple[int, int, Any]]:
    """Where each of ``views`` lies in its slot's byte ``buffer``: (offset, bytes, dtype)."""
    base = buffer.data_ptr()
    return [
        (view.data_ptr() - base, view.numel() * view.element_size(), view.dtype)
        for view in views
        if view.numel()
    ]


def _poison_regions(buffer: torch.Tensor, regions: list[tuple[int, int, Any]]) -> None:
    """NaN into floating and complex tensors, the byte 0xA5 into the others (the simulated
    backend's poison). The regions, not the batch's own tensors, so that the poison waiting
    in stream order keeps none of them alive (:mod:`~aresidency.loader.kept`)."""
    for offset, nbytes, dtype in regions:
        region = buffer[offset : offset + nbytes]
        if dtype.is_floating_point or dtype.is_complex:
            region.view(dtype).fill_(float("nan"))
        else:
            region.fill_(POISON_BYTE)


@dataclass(slots=True)
class _Request:
    """The thread asks the loop for a slot of ``nbytes``: a new one, or ``grow`` (a free slot
    too small, replaced). ``blocked_since``: when it began waiting for room; the loop fills in
    ``slot`` or ``error``."""

    nbytes: int
    index: int
    grow: Slot | None = None
    pageable: bool = False  # the batch has pageable tensors: its slot gets a pinned twin
    blocked_since: float | None = None
    slot: Slot | None = None
    error: BaseException | None = None
    cancelled: bool = False

    @property
    def answered(self) -> bool:
        return self.slot is not None or self.error is not None


@dataclass(slots=True)
class _Ready:
    """A batch in a slot, its copies issued (``event`` after them), or the ``error`` that
    stopped it at its place (``slot`` may then be ``None``)."""

    index: int
    slot: Slot | None
    data: Any = None
    nbytes: int = 0
    event: Any = None
    error: BaseException | None = None
    views: list[torch.Tensor] = field(default_factory=list)  # its tensors in the slot


@dataclass(slots=True)
class _Out:
    """A batch the consumer holds (``views``: its tensors in the slot, poisoned at the
    release where compute runs on the host)."""

    slot: Slot
    handed: DeviceBatch | None = None
    streams: list[Any] = field(default_factory=list)
    views: list[torch.Tensor] = field(default_factory=list)


class RingEpoch:
    """One pass over a source through a ring of device slots (see the module
    docstring). The same interface as :class:`~aresidency.loader.pipeline.Epoch`.

    State: ``status`` (``new`` -> ``running`` -> ``closing`` -> ``closed``); under ``_cond``
    (shared with the ring's thread): ``slots``, ``_ready`` (batches copied, in order, then the
    :class:`End`), ``_request`` (a slot asked of the loop), ``_consumer_waiting``,
    ``_stopped``; loop only: ``_out`` (batches handed out and not released), ``_streams``
    (every stream that read a slot), ``_progress`` (set when the consumer may go on),
    ``_pending_retires`` (slot sets waiting for the device before they are freed).
    Invariants: a slot is copied into only after the device passed its last readers
    (device-side waits); at most ``max(prefetch, 1 if the consumer waits)`` slots are
    filling or ready; a slot's reservation ends only after its buffer was dropped, once the
    device passed its last readers and copy.
    """

    def __init__(
        self, loader: DeviceLoader, number: int, *, after: RingEpoch | None = None
    ) -> None:
        # The loader, until the pass finished: an ended pass refers to it no more, so that
        # the loader (and its source: a DataLoader's worker processes) goes as soon as the
        # application drops it, with no reference cycle for the collector to find.
        self._loader: DeviceLoader | None = loader
        self.name = loader.name
        self._run_ahead = loader.run_ahead
        self.number = number
        self.ended_by: int | None = None  # the newer pass that ended this one
        self.ended_by_close = False  # the loader's close ended it while it ran
        self.dropped = False  # its iterator was dropped while it ran: it ends on its own
        self.manager = loader.manager
        self.backend = loader.manager.backend
        self.device: Location = loader.device
        self.counters = loader.counters
        self.host_wait = self.backend.host_compute
        self.status = "new"
        self.slots: list[Slot] = []
        self._cond = threading.Condition()
        self._ready: deque[_Ready | End] = deque()
        self._request: _Request | None = None
        self._consumer_waiting = False
        # Set (loop, under _cond) when admission asks what the consumer keeps while slots are
        # free: the thread fills no free slot until the loop cleared it (no scope waits for
        # room here, or the consumer waits for a batch), so the free slots admission counted
        # as transient are given back, not filled under a scope that then waits for ever.
        self._withheld = False
        self._stopped = False
        self._out: dict[int, _Out] = {}
        self._streams: list[Any] = []
        self._progress: anyio.Event | None = None
        # Shared by every loader of this name on the manager: a slot's reservation name is
        # unique even beside a dropped pass of another loader of that name, still ending.
        self._serial = loader.ring_serial
        self._numbers = itertools.count()  # the slots' numbers (a slot shed leaves a gap)
        self._retiring: list[tuple[Any, list[torch.Tensor]]] = []  # (copy event, pins)
        self._unlisten: Callable[[], None] | None = None
        self._servicing = False
        self._pending_retires = 0
        self.leaving_bytes = 0  # charged by the slots retired, until the device passed them
        # The request the consumer waits for without a deadline while only the loader's own
        # retired slots stand in its way (a wait for the device; :meth:`_waits_for_room`).
        self._device_wait: _Request | None = None
        self._thread: threading.Thread | None = None
        self._feeder: ThreadFeeder | None = None
        self._feed_scope: anyio.CancelScope | None = None
        self._arrivals: Arrivals | None = None
        # Pinned twins of the slots (pageable batches are packed there, then copied with one
        # DMA): page-locked by this allocator on a machine with CUDA, plain host memory in the
        # simulation without one. ``_twins`` is cleared once pinned-host had no room.
        self._pinned = PinnedAllocator(unpin_later=True) if torch.cuda.is_available() else None
        self._twins = True
        self.twin_refusal: str | None = None
        # The pass's own way to the loop (the manager's ``bridge`` refuses once it closes, and
        # the threads must still be able to say they stopped), its threads' host waits (the
        # manager's close abandons them), and the watch on that close.
        self._bridge: LoopBridge | None = None
        self._waits = HostWaits()
        self._unwatch: Callable[[], None] | None = None
        self._fed: anyio.Event | None = None  # set when the task reading an async source ended
        self._feeding = False
        self.closed_by_manager = False  # the manager closed while the pass ran
        self.closed_reported = False  # ... and the consumer was told so
        self._ending = False  # end_soon retires the slots once the thread ended
        self._slots_taken = False  # the end took the slots (but those of batches still out)
        self._direct = False  # batches copied straight out of the page-locked files
        # Per released batch (oldest first), the events after its readers' kernels: the
        # consumer is handed a batch only while at most ``run_ahead`` of them are incomplete.
        # Those of the pass before (``after``) count too: the device may still run its steps.
        self._behind: deque[list[Any]] = deque() if after is None else deque(after._behind)
        # Batches still referenced after their release (not those ``async with`` keeps).
        self._kept_after_release = KeptAfterRelease()
        # The task that asked for the last batch: the slots in use move only when it goes on
        # (admission counts them as its own: :meth:`_kept_for`).
        self._consumer: object | None = None
        self._unkeep: Callable[[], None] | None = None

    @property
    def loader(self) -> DeviceLoader:
        """The loader of this pass (until the pass finished)."""
        loader = self._loader
        if loader is None:
            raise RuntimeError(f"pass {self.number} of {self.name} has finished")
        return loader

    def __repr__(self) -> str:
        with self._cond:
            states = ",".join(s.state for s in self.slots)
            ready = len(self._ready)
        return (
            f"<RingEpoch {self.number} of {self.name} {self.status} slots=[{states}] "
            f"{ready} ready, {len(self._out)} out>"
        )

    # ------------------------------------------------------------------ start (loop)

    def start(self, plans: Sequence[Any] | None = None) -> None:
        """Start the source's thread (a staged source: none, its ``plans`` are filled by the
        staging threads) and the ring's thread. Loop."""
        loader = self.loader
        if plans is None and loader.is_async_source and loader.task_group is None:
            raise RuntimeError(
                f"{loader.name}: an async source is read by a task of the loader; enter it "
                "first: 'async with DeviceLoader(...) as loader: async for batch in loader'"
            )
        self.status = "running"
        self._bridge = self.manager.bridge
        self._unlisten = self.manager.add_change_listener(self._service)
        self._unkeep = self.manager.add_task_keeper(self._kept_for)
        self._unwatch = watch_close(self.backend, loader.name, self.manager_closed)
        self._direct = (
            plans is not None and loader.pinned_files is not None and loader.source.reads_direct
        )
        if self._direct:
            target: Callable[[], None] = functools.partial(self._run_direct, list(plans or ()))
        elif plans is not None:
            target = functools.partial(self._run_staged, list(plans))
        elif loader.is_async_source:
            tasks = loader.task_group
            assert tasks is not None
            self._arrivals = Arrivals(loader.read_ahead, self._notify_thread)
            self._feed_scope = anyio.CancelScope()
            self._fed = anyio.Event()
            tasks.start_soon(self._feed_async, self._feed_scope, self._arrivals)
            target = self._run
        else:
            self._arrivals = Arrivals(loader.read_ahead, self._notify_thread)
            self._feeder = ThreadFeeder(
                loader.source,
                self._arrivals,
                self.counters.source_clock,
                loader.name,
                own_memory=False,
            )
            self._feeder.start()
            target = self._run
        self._thread = threading.Thread(
            target=target, name=f"aresidency-loader-ring-{loader.name}", daemon=True
        )
        self._thread.start()

    async def _feed_async(self, scope: anyio.CancelScope, arrivals: Arrivals) -> None:
        fed = self._fed
        assert fed is not None
        self._feeding = True  # join_feeder waits for ``fed`` only once this task ran
        try:
            with scope:
                if not arrivals.stopped:  # a pass ended before its task started reads nothing
                    await feed_async(
                        self.loader.source, arrivals, self.counters.source_clock, own_memory=False
                    )
        finally:
            fed.set()

    @property
    def bridge(self) -> LoopBridge:
        """The loop this pass runs on (any thread; the threads call back through it)."""
        assert self._bridge is not None, "the pass has not started"
        return self._bridge

    def _wait_host(self, event: Any) -> None:
        """Block the calling thread (never the loop) until ``event`` completed; the pass
        stops (``_Stopped``) if the manager closed first."""
        if not self._waits.wait(event):
            raise _Stopped

    def _notify_thread(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the ring's thread

    def _run(self) -> None:
        arrivals = self._arrivals
        assert arrivals is not None
        index = 0
        try:
            while True:
                item = arrivals.take_blocking(self.bridge.call_soon_quietly)
                if item is None:
                    return  # stopped
                if isinstance(item, End):
                    self._push(item)
                    return
                index = item.index
                ready = self._copy(item)
                # Read (packed, or its copies issued): the source must not have written to
                # it since it yielded it. The batch then raises that at its place.
                ready.error = changed_since_yielded(
                    index, item.structure, item.leaf_part, item.parts, item.versions
                )
                self._push(ready)
                # The batch's views of its slot go with the batch, not with this thread: a
                # slot freed while the thread waits for the next one (given back to make
                # room) must not stay allocated because of them.
                del ready
                # The batch's bytes are on their way (taken by the driver, packed, or kept
                # in the slot's pins): its shared memory goes back without the interpreter lock
                parts, item.parts = item.parts, []
                self.counters.released_shared_bytes += release_shared(parts)
        except _Stopped:
            return
        except BaseException as error:  # a copy or slot failure: the batch raises it
            self._push(_Ready(index, None, error=error))

    def _run_staged(self, plans: list[Any]) -> None:
        """A staged source: fill the staging buffers ahead (``workers`` at once), in plan
        order take each filled batch, copy it into a slot with one call, give its buffer back
        to the fills."""
        staging = self.loader.staging
        assert staging is not None
        executor = staging.executor
        source = self.loader.source
        last_copy = staging.last_copy  # kept across passes: a copy may outlive its pass
        free = deque(range(staging.count))
        fills: deque[tuple[int, int, StagedFill]] = deque()
        next_plan = 0
        index = 0
        try:
            while True:
                while free and next_plan < len(plans) and not self._stopped:
                    buffer = free.popleft()
                    fill = StagedFill(
                        executor,
                        source,
                        plans[next_plan],
                        staging.buffers[buffer],
                        last_copy[buffer],
                        self._wait_host,
                        staging.workers,
                    )
                    fills.append((next_plan, buffer, fill))
                    next_plan += 1
                if self._stopped:
                    return
                if not fills:
                    self._push(End(len(plans)))
                    return
                index, buffer, fill = fills.popleft()
                try:
                    layout, start, end = fill.result()
                except BaseException as error:  # the source's own error, at its batch
                    self._push(End(index, error))
                    return
                self.counters.source_clock.add(start, end)
                ready = self._copy_staged(index, layout, staging.buffers[buffer])
                last_copy[buffer] = ready.event
                free.append(buffer)
                self._push(ready)
                del ready  # its views of the slot go with the batch (see _run)
        except _Stopped:
            return
        except BaseException as error:
            self._push(_Ready(index, None, error=error))
        finally:
            # Reads still in flight write into staging buffers the next pass fills again:
            # the pass (this thread, which drain joins) ends only after them.
            for _, _, fill in fills:
                fill.cancel()
            concurrent.futures.wait([f for _, _, fill in fills for f in fill.futures()])

    def _run_direct(self, plans: list[Any]) -> None:
        """A staged source whose files the loader page-locked (``pin_source``): copy each
        batch into a slot straight out of the files, one driver call per tensor and shard,
        in plan order; no host copy, no fill thread."""
        source = self.loader.source
        index = 0
        try:
            for index, plan in enumerate(plans):
                if self._stopped:
                    return
                try:
                    layout, reads = source.direct_reads(plan)
                except BaseException as error:  # the source refused the plan: at its batch
                    self._push(End(index, error))
                    return
                self._push(self._copy_direct(index, layout, reads))
            self._push(End(len(plans)))
        except _Stopped:
            return
        except BaseException as error:
            self._push(_Ready(index, None, error=error))

    def _copy_direct(self, index: int, layout: Any, reads: list[Any]) -> _Ready:
        files = self.loader.pinned_files
        assert files is not None
        specs, structure = flatten(layout, TensorSpec)
        nbytes = max((spec.offset + spec.nbytes for spec in specs), default=0)
        counters = self.counters
        counters.source_batches += 1
        counters.source_bytes += nbytes
        slot = self._acquire(max(ALIGN, -(-nbytes // ALIGN) * ALIGN), index)
        start = time.perf_counter()
        event = None
        try:
            waits = slot.readers
            for file, offset, place, count in reads:
                event = self.backend.copy_into(
                    files.view(file, offset, count),
                    slot.buffer[place : place + count],
                    self.device,
                    wait_events=waits,
                )
                waits = []
        except BaseException:
            with self._cond:
                if event is not None:
                    # The batch's copies issued before the failure still read the files and
                    # write the slot: the slot's end (and the files' unmapping) waits for them.
                    slot.readers = []
                    slot.copied = event
                slot.state = FREE
                self._cond.notify_all()
            raise
        if event is not None:  # else nothing was written: the readers still stand
            slot.readers = []
            slot.copied = event
        counters.copy_clock.add(start, time.perf_counter())
        counters.copy_bytes += nbytes
        counters.direct_bytes += nbytes
        views = [spec.view(slot.buffer) for spec in specs]
        data = structure.rebuild(views)
        if self.host_wait and event is not None:
            self._wait_host(event)
        return _Ready(index, slot, data, nbytes, event, views=views)

    def _copy_staged(self, index: int, layout: Any, buffer: torch.Tensor) -> _Ready:
        specs, structure, nbytes = staged_layout(index, layout, buffer)
        counters = self.counters
        counters.source_batches += 1
        counters.source_bytes += nbytes
        slot = self._acquire(-(-nbytes // ALIGN) * ALIGN, index)
        start = time.perf_counter()
        try:
            event = self.backend.copy_into(
                buffer[:nbytes], slot.buffer[:nbytes], self.device, wait_events=slot.readers
            )
        except BaseException:
            with self._cond:
                slot.state = FREE
                self._cond.notify_all()
            raise
        slot.readers = []
        slot.copied = event
        counters.copy_clock.add(start, time.perf_counter())
        counters.copy_bytes += nbytes
        views = [spec.view(slot.buffer) for spec in specs]
        data = structure.rebuild(views)
        if self.host_wait:
            self._wait_host(event)
        return _Ready(index, slot, data, nbytes, event, views=views)

    def _copy(self, host: HostBatch) -> _Ready:
        counters = self.counters
        counters.source_batches += 1
        counters.source_bytes += host.nbytes
        counters.host_copies += host.host_copies
        offsets = []
        total = 0
        for part in host.parts:
            offsets.append(total)
            total += -(-(part.numel() * part.element_size()) // ALIGN) * ALIGN
        pack = self.loader.pack_min_bytes
        on_host = all(part.device.type == "cpu" for part in host.parts)
        # Where the device computes on the host (the simulation), its memory is host memory
        # too: a CPU tensor may still be device memory, so each one is asked where it lives.
        if not on_host or self.host_wait:
            self._refuse_device_parts(host)
        pageable = (
            pack is not None
            and on_host
            and host.nbytes >= pack
            and any(not part.is_pinned() for part in host.parts if part.numel())
        )
        slot = self._acquire(max(total, ALIGN), host.index, pageable)
        start = time.perf_counter()
        try:
            event = None
            if pageable and slot.host_nbytes >= total:
                event = self._pack(host, offsets, total, slot)
            if event is None:
                event = self._issue(host, offsets, slot)
        except BaseException:
            with self._cond:
                slot.state = FREE
                self._cond.notify_all()
            raise
        counters.copy_clock.add(start, time.perf_counter())
        counters.copy_bytes += host.nbytes
        views = []
        for part, offset in zip(host.parts, offsets, strict=True):
            nbytes = part.numel() * part.element_size()
            views.append(slot.buffer[offset : offset + nbytes].view(part.dtype).view(part.shape))
        leaves = [views[i] for i in host.leaf_part]
        data = host.structure.rebuild(leaves)
        if self.host_wait and event is not None:  # None: nothing to copy (no bytes)
            self._wait_host(event)
        return _Ready(host.index, slot, data, host.nbytes, event, views=views)

    def _refuse_device_parts(self, host: HostBatch) -> None:
        """``ValueError`` naming the batch and the place of a tensor already in device memory:
        the ring fills its slots from host memory only (the backend's ``copy_into`` refuses a
        device source), so such a batch would fail in the copy with an error naming neither.
        Through managed values it is handed out where it is (copied from another device)."""
        for number, part in enumerate(host.parts):
            where = self.backend.location_of(part)
            if where.is_cuda:
                path = host.structure.part_path(host.leaf_part, number)
                raise ValueError(
                    f"batch {host.index} holds a tensor in {where} memory at {path}, which the "
                    "loader's ring cannot take: it fills its device buffers from host memory. "
                    "Hand out host tensors (move it to the CPU in the source), or pass "
                    "ring=False, which hands a device tensor out where it is"
                )

    def _issue(self, host: HostBatch, offsets: list[int], slot: Slot) -> Any:
        """Enqueue the batch's copies into ``slot`` after its last readers; the event after
        them."""
        backend = self.backend
        self._prune_pins()
        if slot.pins:
            self._retiring.append((slot.copied, slot.pins))
            slot.pins = []
        waits = slot.readers
        event = None
        pins: list[torch.Tensor] = []
        try:
            for part, offset in zip(host.parts, offsets, strict=True):
                nbytes = part.numel() * part.element_size()
                if nbytes == 0:
                    continue
                src = part if part.is_contiguous() else part.contiguous()
                flat = (
                    src.reshape(-1).view(torch.uint8)
                    if src.dim()
                    else src.view(1).view(torch.uint8)
                )
                event = backend.copy_into(
                    flat, slot.buffer[offset : offset + nbytes], self.device, wait_events=waits
                )
                waits = []
                if src.is_pinned():
                    pins.append(src)
        finally:
            # When a copy fails too: the ones issued before it still read their tensors and
            # write the slot, whose end waits for them.
            if event is not None:  # else nothing was written: the readers still stand
                slot.readers = []
                slot.copied = event
            slot.pins = pins
        return event

    def _pack(self, host: HostBatch, offsets: list[int], total: int, slot: Slot) -> Any:
        """Copy the batch's tensors into the slot's pinned twin (host memcpy in this thread,
        after the twin's last copy out completed), then the twin into the slot with one
        DMA after the slot's last readers; the event after it. The twin is page-locked on
        first use, here (it blocks this thread only); ``None`` (nothing done) when that
        fails: no twin for the rest of the pass, and ``twin_refusal`` says why."""
        backend = self.backend
        if slot.host is None:
            try:
                slot.host = self._allocate_twin(slot.host_nbytes)
            except Exception as error:  # page-locking refused (a memlock limit, no memory)
                self._twins = False
                self.twin_refusal = f"page-locking a pinned twin failed: {error!r}"
                return None  # this batch and the rest of the pass go through the driver
        elif slot.copied is not None:
            self._wait_host(slot.copied)  # the previous batch's DMA out of the twin
        self._prune_pins()
        if slot.pins:
            self._retiring.append((slot.copied, slot.pins))
            slot.pins = []
        twin = slot.host
        spans: list[tuple[int, int, int]] = []  # (destination, source, bytes)
        for part, offset in zip(host.parts, offsets, strict=True):
            nbytes = part.numel() * part.element_size()
            if not nbytes:
                continue
            if part.is_contiguous():
                spans.append((twin.data_ptr() + offset, part.data_ptr(), nbytes))
            else:
                twin[offset : offset + nbytes].view(part.dtype).view(part.shape).copy_(part)
        host_copy(spans)
        event = backend.copy_into(
            twin[:total], slot.buffer[:total], self.device, wait_events=slot.readers
        )
        slot.readers = []
        slot.copied = event
        self.counters.packed_bytes += host.nbytes
        return event

    def _allocate_twin(self, nbytes: int) -> torch.Tensor:
        """A twin of ``nbytes``: page-locked on a machine with CUDA (blocks this thread),
        plain host memory in the simulation without one."""
        if self._pinned is not None:
            return self._pinned.empty((nbytes,), torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _prune_pins(self) -> None:
        """Drop the page-locked sources whose copies completed (the thread's own list)."""
        if self._retiring:
            self._retiring = [(e, p) for e, p in self._retiring if not e.query()]

    def _acquire(self, nbytes: int, index: int, pageable: bool = False) -> Slot:
        """A free slot of at least ``nbytes`` (with a pinned twin as large for a ``pageable``
        batch, while pinned-host has room for twins), once the window allows one more batch
        ahead: a free one that fits, else one made or grown by the loop. Blocks the
        thread."""
        with self._cond:
            while True:
                if self._stopped:
                    raise _Stopped
                request = self._request
                if request is not None and request.answered:
                    self._request = None
                    if request.error is not None:
                        raise request.error
                    assert request.slot is not None
                    return request.slot
                ahead = sum(1 for s in self.slots if s.state in (FILLING, READY))
                ahead -= 1 if request is not None and request.grow is not None else 0
                window = max(self.loader.prefetch, 1 if self._consumer_waiting else 0)
                if ahead < window and not (self._withheld and not self._consumer_waiting):
                    free = [s for s in self.slots if s.state == FREE]
                    twin = pageable and self._twins
                    fits = [
                        s
                        for s in free
                        if s.nbytes >= nbytes and (not twin or s.host_nbytes >= nbytes)
                    ]
                    if fits:
                        if request is not None:
                            self._withdraw(request)
                        slot = min(fits, key=lambda s: s.nbytes)
                        slot.state = FILLING
                        return slot
                    if request is None or (request.grow is None and free):
                        if request is not None:
                            self._withdraw(request)
                        grow = free[0] if free else None
                        if grow is not None:
                            grow.state = FILLING
                        self._request = _Request(nbytes, index, grow, pageable)
                        self.bridge.call_soon_quietly(self._service)
                self._cond.wait()

    def _withdraw(self, request: _Request) -> None:
        # Under _cond: the loop has not answered (it answers under _cond too).
        request.cancelled = True
        if request.grow is not None:
            request.grow.state = FREE
        self._request = None

    def _push(self, item: _Ready | End) -> None:
        with self._cond:
            if isinstance(item, _Ready) and item.slot is not None:
                item.slot.state = READY
            if self._stopped:
                if isinstance(item, _Ready) and item.slot is not None:
                    item.slot.state = FREE
                return
            self._ready.append(item)
            waiting = self._consumer_waiting
        if waiting:
            self.bridge.call_soon_quietly(self._wake)

    # ------------------------------------------------------------------ slots (loop)

    def _service(self) -> None:
        """Give free slots back while a scope waits for room here, and answer the thread's
        request for a slot if the budget has room now (the manager's change listener and the
        thread call this; never waits)."""
        if self._servicing or self.status != "running":
            return
        self._give_back()
        with self._cond:
            request = self._request
            if request is None or request.answered or request.cancelled:
                return
        self._servicing = True
        try:
            self._answer(request)
        except BaseException as error:  # unexpected: the batch raises it
            with self._cond:
                if not (request.answered or request.cancelled):
                    request.error = error
                self._cond.notify_all()
        finally:
            self._servicing = False

    def _answer(self, request: _Request) -> None:
        manager = self.manager
        charge = value_charge(request.nbytes, None, manager.state.granularity)
        error: BaseException | None = self._never_fits(request, charge)
        if error is None:
            name = f"{self.name} ring e{self.number} #{next(self._serial)}"
            admitted = not manager.waiting_for_room(self.device)  # never overtake a scope
            if admitted:
                try:
                    # The ring's own (it gives the slot back itself), never the task's that
                    # happened to run this (a change listener runs in the notifying task).
                    manager.reserve_nowait(name, self.device, charge, task_owned=False)
                except ResidencyBudgetError:
                    admitted = False
            if not admitted:
                # What of the ring's own stands in the way and could never hold this batch
                # goes first: the free slots too small for it, and the old buffer of the slot
                # it grows (given back once the device passed them; the request is answered
                # when their reservations ended and the room is there).
                self._shed_for(request)
                if request.blocked_since is None:
                    request.blocked_since = time.perf_counter()
                    self._wake()  # the consumer now waits for room (its timeout applies)
                elif self._consumer_waiting and reclaim_for(manager, self.device, charge):
                    # Cached data went idle since the consumer asked (a pool request
                    # ended): given back now, and the request is answered once it left.
                    self.bridge.call_soon_quietly(self._service)
                elif self._device_wait is request:
                    # The consumer waits, with no deadline, for the loader's own retired
                    # slots to leave: once they left (or others took their room), the wait
                    # is for room, and its timeout applies from when the request blocked.
                    with self._cond:
                        judged = self._waits_for_room(request)
                    if judged:
                        self._device_wait = None
                        self._wake()
                return
            try:
                buffer = self.backend.allocate((charge,), torch.uint8, self.device)
            except BaseException as failure:
                manager.unreserve_nowait(name, self.device)
                error = failure
        twin_name, twin_nbytes = None, 0
        if error is None and request.pageable and self._twins:
            twin_name, twin_nbytes = self._reserve_twin(name, charge)
        old: Slot | None = None
        with self._cond:
            if request.cancelled or self._stopped:
                answered = False
            else:
                answered = True
                if error is not None:
                    request.error = error
                elif request.grow is not None:
                    slot = request.grow
                    old = Slot(slot.number, slot.buffer, slot.charge, slot.reservation)
                    old.readers, old.copied, old.pins = slot.readers, slot.copied, slot.pins
                    old.host, old.host_nbytes = slot.host, slot.host_nbytes
                    old.host_reservation = slot.host_reservation
                    slot.buffer, slot.charge, slot.reservation = buffer, charge, name
                    slot.readers, slot.copied, slot.pins = [], None, []
                    slot.host = None
                    slot.host_nbytes, slot.host_reservation = twin_nbytes, twin_name
                    request.slot = slot
                else:
                    slot = Slot(next(self._numbers), buffer, charge, name)
                    slot.host_nbytes, slot.host_reservation = twin_nbytes, twin_name
                    self.slots.append(slot)
                    request.slot = slot
                self._cond.notify_all()
        if not answered and error is None:
            del buffer
            manager.unreserve_nowait(name, self.device)
            if twin_name is not None:
                self._end_twin(twin_name, twin_nbytes)
        if old is not None:
            self._retire([old])
        self._wake()

    def _reserve_twin(self, name: str, charge: int) -> tuple[str | None, int]:
        """Reserve a pinned twin for a slot of ``charge`` bytes at ``pinned-host`` (whole pages:
        what page-locking locks); ``(None, 0)`` when it does not fit there, and from then on
        this pass copies its pageable batches through the driver's staging instead. Loop."""
        twin_name = f"{name} pinned"
        nbytes = max(PAGE, -(-charge // PAGE) * PAGE)
        try:
            self.manager.reserve_nowait(twin_name, PINNED, nbytes, task_owned=False)
        except ResidencyBudgetError as refused:
            self._twins = False
            self.twin_refusal = str(refused)
            return None, 0
        counters = self.counters
        counters.twin_bytes += nbytes
        counters.twin_peak = max(counters.twin_peak, counters.twin_bytes)
        return twin_name, nbytes

    def _end_twin(self, name: str, nbytes: int) -> None:
        self.counters.twin_bytes -= nbytes
        if self.manager.running:
            with contextlib.suppress(ValueError):  # the manager closed meanwhile
                self.manager.unreserve_nowait(name, PINNED)

    def _give_back(self) -> None:
        """While a scope waits for room at the device, the free slots leave the ring (freed,
        their reservations ended, once the device passed them): the ring shrinks to the slots
        in use and takes new ones only when no one waits (FIFO, as every tenant). While the
        ring's own request waits for room, the free slots too small for its batch leave it
        (:meth:`_shed_for`)."""
        with self._cond:
            request = self._request
        if request is not None and request.blocked_since is not None:
            self._shed_for(request)
        if not self.manager.waiting_for_room(self.device):
            if self._withheld:
                with self._cond:
                    self._withheld = False
                    self._cond.notify_all()
            return
        with self._cond:
            free = [s for s in self.slots if s.state == FREE]
            if not free:
                return
            self.slots = [s for s in self.slots if s.state != FREE]
        self._retire(free)

    def _shed_for(self, request: _Request) -> None:
        """The ring's own ``request`` waits for room: the slots of the ring that stand in its
        way and could never hold its batch leave the ring (freed, their reservations ended,
        once the device passed them: :meth:`_retire`): the free slots too small for it, and
        the one it grows (its old buffer; the request then asks for a new slot). Without
        this, a batch larger than every free slot, under a budget with room for it but not
        beside the ring's other slots, would wait for ever (or be refused as the consumer's
        own holding). Loop."""
        with self._cond:
            if request.cancelled or request.answered or self._request is not request:
                return
            twin = request.pageable and self._twins
            need = request.nbytes
            shed = [
                s
                for s in self.slots
                if s.state == FREE
                and not (s.nbytes >= need and (not twin or s.host_nbytes >= need))
            ]
            if request.grow is not None:
                shed.append(request.grow)
                request.grow = None  # a new slot, once the room is there
            if not shed:
                return
            self.slots = [s for s in self.slots if all(s is not x for x in shed)]
            self._cond.notify_all()
        self._retire(shed)

    def _kept_for(self, task: object) -> Kept | None:
        """For admission: the slots in use (batches copied ahead and handed out), and their
        pinned twins, when ``task`` is the consumer: they free only when it asks for the
        next batch (or ends the pass), so a wait of its own for their room would never end.
        A batch another task keeps in its ``async with`` is that task's to release: not
        counted. Loop."""
        if task is not self._consumer or self.status != "running":
            return None
        others = {
            id(out.slot)
            for out in self._out.values()
            if out.handed is not None and out.handed.kept_by not in (None, task)
        }
        with self._cond:
            # The slot a request grows holds no batch: its old buffer leaves the ring as soon
            # as the request waits for room (:meth:`_shed_for`), so it is no holding either.
            request = self._request
            growing = None if request is None or request.answered else request.grow
            used = [
                s
                for s in self.slots
                if s.state != FREE and id(s) not in others and s is not growing
            ]
            if not self._withheld and any(s.state == FREE for s in self.slots):
                self._withheld = True  # counted as transient: not filled meanwhile
                self.bridge.call_soon_quietly(self._service)  # cleared if nobody waits
        if not used:
            return None
        out = sum(1 for s in used if s.state == OUT)
        reservations = [(s.reservation, self.device) for s in used]
        reservations += [(s.host_reservation, PINNED) for s in used if s.host_reservation]
        charge = sum(s.charge for s in used)
        return Kept(
            what=(
                f"{len(used)} ring slot(s) of {self.name} ({format_nbytes(charge)} at "
                f"{self.device}: {len(used) - out} batch(es) copied ahead, {out} handed out), "
                "which free only when this task asks for the next batch"
            ),
            reservations=tuple(reservations),
            hint=(
                f"Lower {self.name}'s prefetch, or raise the budget of {self.device} "
                "to hold the loader's window and what a step needs together."
            ),
        )

    def _never_fits(self, request: _Request, charge: int) -> ResidencyBudgetError | None:
        ledger = self.manager.state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None or charge <= ledger.budget_bytes:
            return None
        return ResidencyBudgetError(
            self.device,
            ledger.budget_bytes,
            ledger.used_bytes,
            ledger.reserved_bytes,
            charge,
            kind="reservation",  # a slot is a named reservation; no value, no handle
            what=(
                f"batch {request.index} of {self.name}: its tensors need "
                f"{format_nbytes(charge)} at {self.device}, more than the whole budget of "
                f"{format_nbytes(ledger.budget_bytes)}, so it could never be copied there"
            ),
        )

    def _retire(self, slots: list[Slot]) -> None:
        """Free ``slots``' buffers and end their reservations once the device passed their
        last readers (an event recorded now on every stream that read a slot) and copies,
        waited for in a thread of its own (as :meth:`drain` does). Loop."""
        if not slots:
            return
        backend = self.backend
        waits = [backend.record_event(stream) for stream in self._streams]
        waits += [s.copied for s in slots if s.copied is not None]
        self._pending_retires += 1
        self._free_later(slots, waits)

    def _free_later(self, slots: list[Slot], waits: list[Any]) -> None:
        charge = sum(slot.charge for slot in slots)
        self.leaving_bytes += charge

        def passed() -> None:
            self._free(slots)
            self._pending_retires -= 1
            self.leaving_bytes -= charge

        def wait() -> None:
            self._waits.wait_all(waits)  # abandoned: the manager closed, nothing to wait for
            self.bridge.call_soon_quietly(passed)

        threading.Thread(target=wait, name="aresidency-loader-ring-retire", daemon=True).start()

    def _free(self, slots: list[Slot]) -> None:
        """Drop the buffers (the last references) and end their reservations. Loop."""
        for slot in slots:
            slot.buffer = torch.empty(0, dtype=torch.uint8)
            slot.pins = []
            slot.readers = []
            host, slot.host = slot.host, None
            if host is not None and self._pinned is not None:
                self._pinned.release(host)  # unlocked on the unpinner's thread
            del host
            if slot.host_reservation is not None:
                self._end_twin(slot.host_reservation, slot.host_nbytes)
                slot.host_reservation, slot.host_nbytes = None, 0
            if self.manager.running:
                with contextlib.suppress(ValueError):  # the manager closed meanwhile
                    self.manager.unreserve_nowait(slot.reservation, self.device)

    # ------------------------------------------------------------------ the consumer (loop)

    def _wake(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    async def next(self) -> DeviceBatch:
        """The next batch (see :meth:`Epoch.next <aresidency.loader.pipeline.Epoch.next>`)."""
        try:
            return await self._next()
        except StopAsyncIteration:
            # The slots retire as the device passes them; a batch another task keeps in an
            # open ``async with`` keeps its slot until that block ends (or the loader closes).
            self.end_soon(keep_kept=True)
            raise
        except BaseException:
            self.shutdown()
            await finish_shielded(self.drain)  # native cancellations too: raised after
            raise

    def closed_error(self, cause: BaseException | None = None) -> ManagerClosedError:
        """The error the consumer gets once the manager closed under the pass (reported: a
        later ``aclose`` does not raise it again)."""
        self.closed_reported = True
        return closed_under_pass(self.name, self.number, cause)

    async def _next(self) -> DeviceBatch:
        if self.closed_by_manager:
            raise self.closed_error()
        self.manager.check_thread()
        await anyio.lowlevel.checkpoint()
        if self.status != "running":
            if self.closed_by_manager:
                raise self.closed_error()
            raise StopAsyncIteration
        self._consumer = current_task()
        if self._withheld:  # its own step is over (admitted, refused or given up): read on
            with self._cond:
                self._withheld = False
                self._cond.notify_all()
        counters = self.counters
        counters.kept_after_release += self._kept_after_release.requested(self.name, self.number)
        self.release_unkept()
        await self._catch_up()
        began = time.perf_counter()
        if counters.first_request is None:
            counters.first_request = began
        try:
            while True:
                if self.status != "running":
                    if self.closed_by_manager:
                        raise self.closed_error()
                    raise StopAsyncIteration
                with self._cond:
                    item = self._ready.popleft() if self._ready else None
                    if item is None:
                        self._consumer_waiting = True
                        self._cond.notify_all()  # prefetch=0: the window opens now
                        request = self._request
                        blocked = None
                        if request is not None and not request.answered:
                            if self._waits_for_room(request):
                                blocked = request.blocked_since
                            elif request.blocked_since is not None:
                                self._device_wait = request
                        progress = self._progress = anyio.Event()
                    else:
                        self._consumer_waiting = False
                if item is not None:
                    error = item.error
                    if error is not None:
                        ended = isinstance(item, End)
                        # This frame is in the error's traceback: it keeps neither the item
                        # nor the error (a cycle that only the garbage collector frees).
                        item = None
                        try:
                            if not ended and not self.manager.running:  # stopped under the copy
                                raise self.closed_error(error)
                            raise error
                        finally:
                            error = None
                    if isinstance(item, End):
                        raise StopAsyncIteration
                    return self._hand_out(item)
                cause = "budget" if blocked is not None else "source"
                waiting: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                if blocked is not None and request is not None:
                    need = -(-request.nbytes // ALIGN) * ALIGN
                    # An idle cache (a pool's models) goes first: only then can the wait be
                    # on what this task holds itself.
                    if reclaim_for(self.manager, self.device, need):
                        continue  # the cache given back: the thread is told by the change
                    # Judged under the lock, on the request as it is now: the ring's thread
                    # may have withdrawn it since it was read (a slot of its own freed up and
                    # it took that one), and a stale request's arithmetic says nothing.
                    with self._cond:
                        current = self._request is request and not (
                            request.cancelled or request.answered
                        )
                        stuck = self._kept_by_me(request) if current else None
                    if not current:
                        continue
                    if stuck is not None:
                        raise stuck
                    # Refused at once if it closes a cycle of tasks waiting for each other's
                    # room (this task holds a pool request, say, that another one waits for).
                    waiting = self.manager.room_wait(
                        need,
                        self.device,
                        what=f"batch {request.index} of {self.name} "
                        f"({format_nbytes(need)} at {self.device})",
                    )
                if cause == "source" and (
                    self._direct or (self._arrivals is not None and len(self._arrivals))
                ):
                    cause = "copy"  # nothing to read: the next copy is being issued
                deadline = None
                timeout = self.loader.timeout
                if blocked is not None and timeout is not None:
                    deadline = anyio.current_time() + (blocked + timeout - time.perf_counter())
                start = time.perf_counter()
                with waiting:
                    if deadline is None:
                        await progress.wait()
                        timed_out = False
                    else:
                        with anyio.move_on_at(deadline) as scope:
                            await progress.wait()
                        timed_out = scope.cancelled_caught
                counters.add_wait(cause, time.perf_counter() - start)
                if timed_out:
                    # Judged again under the lock: the thread may have taken a slot of the
                    # ring's own meanwhile (the one this consumer's previous batch just left)
                    # and withdrawn the request; that was never a wait for room.
                    with self._cond:
                        still = self._request is request and self._waits_for_room(request)
                    if still:
                        assert request is not None
                        raise self._timeout_error(timeout, request)
        finally:
            with self._cond:
                self._consumer_waiting = False
            self._device_wait = None
            counters.wait_s += time.perf_counter() - began

    async def _catch_up(self) -> None:
        """Park the consumer while the device still has more than ``run_ahead`` released
        batches' kernels to run: a consumer that launches its steps faster than the device
        runs them would otherwise fill the launch queue and then block in a kernel launch, on
        the loop's thread (everything else on the loop late). Parked here, on an event, the
        loop stays free. The state is unchanged when cancelled. Loop."""
        behind = self._behind
        limit = self.loader.run_ahead
        while behind and all(event.query() for event in behind[0]):
            behind.popleft()
        if len(behind) <= limit:
            return
        start = time.perf_counter()
        try:
            while len(behind) > limit:
                for event in behind[0]:
                    if not event.query():
                        await self.backend.wait(event)
                behind.popleft()
        except Exception as error:
            if not self.manager.running:
                raise self.closed_error(error) from error
            raise
        finally:
            self.counters.device_wait_s += time.perf_counter() - start

    def _kept_by_me(self, request: _Request) -> ResidencyBudgetError | None:
        """The error when the slots of the batches the waiting consumer task keeps itself,
        or what else it holds, leave the blocked request too little room ever to fit (see
        :func:`~.budget.kept_by_waiter` and :func:`~.budget.held_by_waiter`)."""
        task = current_task()
        if task is None:
            return None
        kept = self.kept_by(task)
        for ended in self.loader._handed_over:  # kept past the end of an earlier pass
            kept += ended.kept_by(task)
        need = -(-request.nbytes // ALIGN) * ALIGN
        stuck = kept_by_waiter(
            self.manager, self.device, need, request.index, kept, self.name, "reservation"
        )
        if stuck is not None:
            return stuck
        return held_by_waiter(
            self.manager, self.device, need, request.index, self.name, kind="reservation"
        )

    def kept_by(self, task: object) -> list[tuple[int, int]]:
        """``(index, bytes)`` of the batches handed out that ``task``'s open ``async with``
        blocks keep. Loop."""
        return [
            (out.handed.index, out.slot.charge)
            for out in self._out.values()
            if out.handed is not None and out.handed.kept_by is task
        ]

    def _waits_for_room(self, request: _Request | None) -> bool:
        """Whether the thread's ``request`` for a slot still waits for room that others
        hold at the device (what ``timeout`` bounds): neither answered nor withdrawn, no free
        slot of the ring fits it (the thread takes such a slot, as :meth:`_acquire` does,
        once it runs), and it would not fit once the loader's own retired slots left (this
        pass's or an earlier one's: freed as the device passes the consumer's last steps,
        a wait for the device). Under ``_cond``."""
        loader = self._loader
        if request is None or request.answered or request.cancelled or loader is None:
            return False  # (no loader: the pass finished, the manager's close say)
        twin = request.pageable and self._twins
        if any(
            s.state == FREE
            and s.nbytes >= request.nbytes
            and (not twin or s.host_nbytes >= request.nbytes)
            for s in self.slots
        ):
            return False
        ledger = self.manager.state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return False
        leaving = loader.leaving_bytes()
        charge = value_charge(request.nbytes, None, self.manager.state.granularity)
        return ledger.charged_bytes - leaving + charge > ledger.budget_bytes

    def _timeout_error(self, timeout: float | None, request: _Request) -> TimeoutError:
        ledger = self.manager.state.ledger(self.device)
        budget = "no" if ledger.budget_bytes is None else format_nbytes(ledger.budget_bytes)
        need = -(-request.nbytes // ALIGN) * ALIGN
        return TimeoutError(
            f"batch {request.index} of {self.name} waited {timeout} s for room at "
            f"{self.device}: its slot needs {format_nbytes(need)}, and "
            f"{format_nbytes(ledger.used_bytes)} used + "
            f"{format_nbytes(ledger.reserved_bytes)} reserved of a {budget} budget left too "
            "little; release batches you keep, or give the loader more room"
        )

    def _hand_out(self, item: _Ready) -> DeviceBatch:
        slot = item.slot
        assert slot is not None
        backend = self.backend
        stream = self.loader.stream
        if stream is None:
            stream = backend.current_stream(self.device)
        event = item.event
        if event is not None and not self.host_wait and not event.query():
            backend.stream_wait(stream, event)
        with self._cond:
            slot.state = OUT
            self._cond.notify_all()  # one batch fewer ahead: the window opens
        out = _Out(slot, streams=[stream], views=item.views)
        self._out[id(slot)] = out
        self._add_stream(stream)
        handed = DeviceBatch(
            item.index,
            item.data,
            item.nbytes,
            self.device,
            functools.partial(self._release, out),
            functools.partial(self._register_stream, out),
            on_loop=self.bridge.on_loop,
        )
        out.handed = handed
        counters = self.counters
        counters.batches += 1
        counters.bytes += item.nbytes
        counters.last_hand_out = time.perf_counter()
        return handed

    def _add_stream(self, stream: Any) -> None:
        if stream is not None and all(stream is not s for s in self._streams):
            self._streams.append(stream)

    def _register_stream(self, out: _Out, stream: Any) -> None:
        self.backend.check_stream(stream, self.device)
        if stream is None:
            raise ValueError("register_stream needs a stream")
        if all(stream is not s for s in out.streams):
            out.streams.append(stream)
            self._add_stream(stream)

    def _release(self, out: _Out) -> None:
        """Events after the kernels enqueued on the batch's streams so far; the slot is free
        (its next copy waits for them on the device). The host does not wait."""
        if self._out.pop(id(out.slot), None) is None:
            return
        handed, views = out.handed, out.views
        # Nothing of the ring refers to the batch's tensors from here on: the consumer's
        # references are then the only ones left for the check of kept batches to see.
        out.handed, out.views = None, []
        if handed is not None:
            self._kept_after_release.released(handed.index, views)
        readers: list[Any] = []
        if self.manager.running:  # else the device stopped: nothing reads or copies any more
            if self.host_wait:
                self._poison(out.slot, out.streams, views)
            backend = self.backend
            readers = [backend.device_event(stream) for stream in out.streams]
            if readers:
                behind = self._behind
                behind.append(readers)
                if len(behind) > 2 * self._run_ahead + 8:  # nobody asked for a batch
                    behind.popleft()
        with self._cond:
            out.slot.readers = readers
            out.slot.state = FREE
            self._cond.notify_all()
            # Kept past the pass's end (an ``async with`` open when the source ran out): the
            # end took the other slots already, this one goes now.
            late = self._slots_taken and any(s is out.slot for s in self.slots)
            if late:
                self.slots = [s for s in self.slots if s is not out.slot]
        if late:
            if self.manager.running:
                self._retire([out.slot])
            else:
                self._free([out.slot])
            return
        self._give_back()

    def _poison(self, slot: Slot, streams: list[Any], views: list[torch.Tensor]) -> None:
        """Where compute runs on the host (the simulation): overwrite the batch's tensors in
        the slot with poison (NaN, or the byte 0xA5) after the kernels its reader streams
        have so far, before the slot's next copy (which waits for the reader events recorded
        after this), so that a read after the release shows up as poison, never as another
        batch's data. The host does not wait. Never on CUDA (it would cost a kernel)."""
        streams = [s for s in streams if s is not None]
        regions = _regions(slot.buffer, views)
        if not streams or not regions:
            return
        backend = self.backend
        first = streams[0]
        for other in streams[1:]:
            backend.stream_wait(first, backend.record_event(other))
        backend.run_in_stream_order(first, functools.partial(_poison_regions, slot.buffer, regions))

    def release_unkept(self) -> None:
        """Release every batch handed out that no ``async with`` block keeps."""
        for out in list(self._out.values()):
            if out.handed is not None and not out.handed.kept:
                out.handed.release()

    def release_kept(self) -> None:
        """Release the batches still handed out after the pass ended (those ``async with``
        blocks kept when the source ran out): the loader's close, or the manager's. Loop."""
        for out in list(self._out.values()):
            if out.handed is not None:
                out.handed.release()

    # ------------------------------------------------------------------ the end

    def shutdown(self, *, keep_kept: bool = False) -> None:
        """Stop the source and the ring's thread and release every batch handed out (loop;
        never waits); with ``keep_kept`` (the source ran out), not those an ``async with``
        block keeps: each is released, and its slot retired, when its block ends (or at
        :meth:`release_kept`). :meth:`drain` frees the slots."""
        if self.status != "running":
            return
        self.status = "closing"
        # The source and the thread first: nothing below may leave them running.
        if self._arrivals is not None:
            self._arrivals.stop()
        if self._feeder is not None:
            self._feeder.stop()
        if self._feed_scope is not None:
            self._feed_scope.cancel()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for out in list(self._out.values()):
            if out.handed is not None and not (keep_kept and out.handed.kept):
                out.handed.release()
        with self._cond:
            self._stopped = True
            for item in self._ready:
                if isinstance(item, _Ready) and item.slot is not None:
                    item.slot.state = FREE
            self._ready.clear()
            request, self._request = self._request, None
            if request is not None and not request.answered:
                request.cancelled = True
            self._cond.notify_all()
        self._wake()

    @property
    def settled(self) -> bool:
        return self.status == "closed"

    async def drain(self, *, releases_only: bool = False, handover: bool = False) -> None:
        """After :meth:`shutdown`: park until the ring's thread ended and every slot was freed
        (its reservation ended). With ``handover`` (the loader starts its next pass): only
        until the thread ended; the slots are freed later, once the device passed their last
        readers and copies (:meth:`settle` waits for that), so the next pass fills and copies
        while the device still runs this one's steps. While running (``releases_only``): until
        the device passed every batch released so far (the slots stay with the pass). Once
        the manager closed, nothing waits for the device (it stopped)."""
        if releases_only:
            await self._drain_releases()
            return
        if self.status == "closing":
            thread = self._thread
            if thread is not None and thread.is_alive():
                await anyio.to_thread.run_sync(thread.join)
            if self.manager.running:
                slots = self._take_slots()
                if handover:
                    self._retire(slots)
                    self._finish()
                    return
                # The last readers (an event now on every stream that read a slot) and
                # copies, waited for in a worker thread: the end of a pass does not depend on
                # the backend's completion notifications.
                backend = self.backend
                events = [backend.record_event(stream) for stream in self._streams]
                events += [s.copied for s in slots if s.copied is not None]
                await anyio.to_thread.run_sync(self._waits.wait_all, events)
                self._free(slots)
            else:
                self._drop_slots()
            self._finish()
        if not handover:
            await self.settle()

    def end_soon(self, *, keep_kept: bool = False) -> None:
        """End the pass without waiting (the source's end, a dropped iterator, the manager's
        close): :meth:`shutdown` now (``keep_kept``: see there); once the ring's thread ended
        (a thread of its own joins it), the slots retire: freed, their reservations ended,
        once the device passed their last readers and copies (events; nothing
        synchronizes). Loop."""
        self.shutdown(keep_kept=keep_kept)
        if self.status != "closing" or self._ending:
            return
        self._ending = True
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._hand_back()
            return
        bridge = self.bridge

        def join() -> None:
            thread.join()
            bridge.call_soon_quietly(self._hand_back)

        threading.Thread(
            target=join, name=f"aresidency-loader-ring-end-{self.name}", daemon=True
        ).start()

    def _hand_back(self) -> None:
        """The thread ended: retire every slot (unless :meth:`drain` did already). Loop."""
        if self.status != "closing":
            return
        if self.manager.running:
            self._retire(self._take_slots())
        else:
            self._drop_slots()
        self._finish()

    def _take_slots(self) -> list[Slot]:
        """The pass ended: its slots leave it, but those of batches still handed out (kept by
        an ``async with`` block open when the source ran out), which :meth:`_release` retires
        one by one. Loop."""
        with self._cond:
            slots = [s for s in self.slots if s.state != OUT]
            self.slots = [s for s in self.slots if s.state == OUT]
            self._slots_taken = True
        return slots

    def _drop_slots(self) -> None:
        """The manager closed: drop the buffers (its ledger closed with it; the device
        stopped). Loop."""
        self._free(self._take_slots())

    def manager_closed(self) -> None:
        """The manager closed (its backend with it) while the pass existed: stop the source
        and the threads, abandon their waits on the device, drop the slots; a consumer that
        waits, or asks for the next batch, gets ``ManagerClosedError``. Loop."""
        self._unwatch = None
        if self.status == "running":
            self.closed_by_manager = True
        self._waits.abandon()
        self.end_soon()
        self.release_kept()  # kept past the pass's end: the device stopped
        self._wake()

    @property
    def retiring(self) -> bool:
        """Whether slots this pass retired still wait for the device, or batches ``async
        with`` blocks kept past the pass's end are still out (the loader's close releases
        them)."""
        return self._pending_retires > 0 or bool(self._out)

    async def settle(self) -> None:
        """Park until every slot this pass retired was freed (or the manager closed)."""
        try:
            while self._pending_retires and self.manager.running:
                await self.manager.wait_for_change()
        except ManagerClosedError:
            pass

    async def _drain_releases(self) -> None:
        if not self._streams or not self.manager.running:
            return
        events = [self.backend.record_event(stream) for stream in self._streams]
        await anyio.to_thread.run_sync(self._waits.wait_all, events)

    def _finish(self) -> None:
        self.status = "closed"
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            unlisten()
        unkeep, self._unkeep = self._unkeep, None
        if unkeep is not None:
            unkeep()
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()
        self._retiring = []
        self._loader = None  # no cycle loader -> pass -> loader once the pass is over

    async def join_feeder(self) -> None:
        """Wait for the source's thread (after its current ``next``), or the task reading an
        async source, to stop: the next pass must not iterate the source while this one
        still does."""
        if self._feeder is not None:
            await self._feeder.join()
        if self._fed is not None and self._feeding:
            await self._fed.wait()

    def take_deferred(self) -> list[BaseException]:
        """Copy failures no step reported: none here (a ring copy fails as it is issued, at its
        batch)."""
        return []
