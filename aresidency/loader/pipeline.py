"""One iteration (epoch) of a ``DeviceLoader``: the state machine that moves batches from the
source to the consumer.

Like the weight-streaming pipeline it has no task of its own: :meth:`Epoch.pump` advances it
whenever something happened (the manager's change listener, a batch arriving from the feeder, a
staging buffer filled, a copy issued or completed, the consumer asking), synchronously, on the
loop. A batch goes

``queued`` (its host tensors arrived) -> ``copying`` (registered, materialization begun: the
device budget is charged and the copy enqueued) -> ``out`` (handed to the consumer under
leases) -> ``releasing`` (leases exited, reader events recorded) -> ``done`` (every value
discarded once its reader events completed: the budget is free again).

Admission is in source order, never out of order (a later batch never takes room an earlier one
waits for), at most ``prefetch`` batches ahead of the consumer (one when ``prefetch=0`` and the
consumer waits), and only when the whole batch fits the device budget now: a batch never holds
part of the budget while it waits for the rest, and a batch that could never fit (larger than
the whole budget) fails at its place with the arithmetic. Room is checked on the live ledger
(``manager.state``), and ``materialize_nowait`` is the final word (it also refuses while a scope
waits for room at the device first: the loader then waits its turn like anyone else).

A batch is ready for the consumer once every copy is issued (CUDA: the consumer's stream is made
to wait for it on the device when the leases are entered, right before the step's kernels) or,
where compute runs on the host (the simulation), once every copy completed.

Why this module is long: the epoch's lifecycle of a batch (arrival, admission, protection,
readiness, hand-out, release, discard) and of the epoch itself (start, failure, shutdown, drain)
are steps of one state machine that read the state the others write; what stands alone lives
elsewhere: the records (:mod:`~aresidency.loader.records`), the budget arithmetic
(:mod:`~aresidency.loader.budget`), a staged source's fills (:mod:`~aresidency.loader.fills`),
the source's reading (:mod:`~aresidency.loader.feeder`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import torch

from ..backends.bridge import LoopBridge
from ..core.errors import ResidencyBudgetError, ResidencyError, ResidencyUnavailableError
from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.values import MaterializationState, ValueHandle, value_charge
from ..runtime.admission import Kept
from ..runtime.leases import LeaseWouldWait, TaskRef, current_task, current_task_ref
from ..runtime.pending import PendingOperation
from ..runtime.shield import finish_shielded
from ..runtime.signal import ManagerClosedError
from .batch import DeviceBatch
from .budget import (
    held_by_waiter,
    kept_by_waiter,
    never_fits,
    reclaim_for,
    room,
    timeout_error,
)
from .feeder import (
    Arrivals,
    End,
    HostBatch,
    ThreadFeeder,
    bridge_wake,
    changed_since_yielded,
    feed_async,
    version_of,
)
from .fills import StagedFills, return_slot
from .lifetime import closed_under_pass, watch_close
from .records import COPYING, DONE, OUT, QUEUED, RELEASING, BatchRecord, Part
from .staging import StagingSlots

if TYPE_CHECKING:
    from .loader import DeviceLoader

__all__ = ["Epoch"]


class Epoch:
    """One iteration over the source (see the module docstring). Loop thread only.

    State: ``status`` (``new`` -> ``running`` -> ``closing`` -> ``closed``), ``_queue`` (batches
    not handed out yet, in order: queued, then copying), ``_out`` (handed out, not released),
    ``_releasing``, ``_end`` (the source's end or error, once it arrived), ``_failure`` (an
    error of the pipeline itself), ``_deferred`` (copy failures known only after their batch was
    handed out), ``_host_storages`` (host storages registered and maybe still held by the
    manager, so that a tensor the source hands out again waits for the first copy),
    ``_consumer_waiting``, ``_pumping``/``_again`` (re-entrant pumps fold into the running one).
    ``_fills``: a staged source's fills (:class:`~aresidency.loader.fills.StagedFills`).
    Invariants: ``_queue`` holds batches in source order; a batch's values are all discarded
    before it leaves ``_releasing``; a staging buffer returns to the free list only after the copy
    reading it completed (or when it was never copied).
    """

    def __init__(self, loader: DeviceLoader, number: int) -> None:
        # The loader, until the pass finished: an ended pass refers to it no more, so that
        # the loader (and its source: a DataLoader's worker processes) goes as soon as the
        # application drops it, with no reference cycle for the collector to find.
        self._loader: DeviceLoader | None = loader
        self.name = loader.name
        self.number = number
        self.ended_by: int | None = None  # the newer pass that ended this one
        self.ended_by_close = False  # the loader's close ended it while it ran
        self.dropped = False  # its iterator was dropped while it ran: it ends on its own
        self.manager = loader.manager
        self.device = loader.device
        self.counters = loader.counters
        self.host_compute = self.manager.backend.host_compute
        self.status = "new"
        self._queue: deque[BatchRecord] = deque()
        self._out: list[BatchRecord] = []
        self._releasing: list[BatchRecord] = []
        self._end: End | None = None
        self._failure: BaseException | None = None
        self._deferred: list[BaseException] = []
        self._host_storages: dict[tuple[str, int], Part] = {}
        self._consumer_waiting = False
        self._pumping = False
        self._again = False
        self._progress: anyio.Event | None = None
        self._unlisten: Callable[[], None] | None = None
        self._arrivals: Arrivals | None = None
        self._feeder: ThreadFeeder | None = None
        self._feed_scope: anyio.CancelScope | None = None
        self._fills: StagedFills | None = None
        self._staging: StagingSlots | None = None  # a staged source's buffers (the loader's)
        self._unwatch: Callable[[], None] | None = None
        self._fed: anyio.Event | None = None  # set when the task reading an async source ended
        self._feeding = False
        self._ending = False  # end_soon: stop listening once nothing is left
        self.bridge: LoopBridge | None = None
        # The task that asked for the last batch: the batches copied ahead and handed out move
        # only when it goes on (admission counts them as its own: :meth:`_kept_for`).
        self._consumer: object | None = None
        # The same task as the holds and leases record it: the pump that takes them runs in
        # whichever task made a change (another loader's consumer, say), whose own they are not.
        self._consumer_ref: TaskRef | None = None
        self._unkeep: Callable[[], None] | None = None
        self.closed_by_manager = False  # the manager closed while the pass ran
        self.closed_reported = False  # ... and the consumer was told so

    @property
    def loader(self) -> DeviceLoader:
        """The loader of this pass (until the pass finished)."""
        loader = self._loader
        if loader is None:
            raise RuntimeError(f"pass {self.number} of {self.name} has finished")
        return loader

    def __repr__(self) -> str:
        return (
            f"<Epoch {self.number} of {self.name} {self.status} [{len(self._queue)} "
            f"queued, {len(self._out)} out, {len(self._releasing)} releasing]>"
        )

    # ------------------------------------------------------------------ start

    def start(self, plans: Sequence[Any] | None = None) -> None:
        """Start reading the source (a staged source: fill the buffers with ``plans``). Loop."""
        loader = self.loader
        self.status = "running"
        self._consumer_ref = current_task_ref()  # (the task beginning the pass consumes it)
        self._staging = loader.staging  # opened before the pass; its buffers return there
        self.bridge = self.manager.bridge
        self._unlisten = self.manager.add_change_listener(self.pump)
        self._unkeep = self.manager.add_task_keeper(self._kept_for)
        self._unwatch = watch_close(self.manager.backend, loader.name, self.manager_closed)
        wake = bridge_wake(self.bridge, self.pump)
        if plans is not None:
            self._fills = StagedFills(loader, self.number, plans, self.pump)
        elif loader.is_async_source:
            tasks = loader.task_group
            if tasks is None:
                raise RuntimeError(
                    f"{loader.name}: an async source is read by a task of the loader; enter it "
                    "first: 'async with DeviceLoader(...) as loader: async for batch in loader'"
                )
            self._arrivals = Arrivals(loader.read_ahead, wake)
            self._feed_scope = anyio.CancelScope()
            self._fed = anyio.Event()
            tasks.start_soon(self._feed_async, self._feed_scope, self._arrivals)
        else:
            self._arrivals = Arrivals(loader.read_ahead, wake)
            self._feeder = ThreadFeeder(
                loader.source,
                self._arrivals,
                self.counters.source_clock,
                loader.name,
                managed=self._registered_elsewhere,
            )
            self._feeder.start()
        self.pump()

    async def _feed_async(self, scope: anyio.CancelScope, arrivals: Arrivals) -> None:
        fed = self._fed
        assert fed is not None
        self._feeding = True  # join_feeder waits for ``fed`` only once this task ran
        try:
            with scope:
                if not arrivals.stopped:  # a pass ended before its task started reads nothing
                    await feed_async(
                        self.loader.source,
                        arrivals,
                        self.counters.source_clock,
                        managed=self._registered_elsewhere,
                    )
        finally:
            fed.set()

    def _registered_elsewhere(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is a host value the loader did not register (the
        application's own: the batch gets a copy). A storage the loader registered for an
        earlier batch is not: that batch waits for its copy instead (see :meth:`_try_admit`);
        nor is a device value's (a copy in the feeder's thread would not be ordered after
        the stream writing it: it stays refused, with the manager's message). Any thread
        (dictionary reads)."""
        owner = self.manager.storage_owner(tensor)
        if owner is None or not owner[1].is_host:
            return False
        part = self._host_storages.get((str(tensor.device), tensor.untyped_storage().data_ptr()))
        return part is None or part.handle != owner[0]

    # ------------------------------------------------------------------ the pump

    def pump(self) -> None:
        """Advance everything that can advance now (never waits; never raises: an unexpected
        error fails the epoch and reaches the consumer)."""
        if self._pumping:
            self._again = True
            return
        if self.status in ("new", "closed"):
            return
        self._pumping = True
        try:
            while True:
                self._again = False
                try:
                    self._advance()
                except BaseException as error:
                    if self._failure is None:
                        self._failure = error
                if not self._again:
                    break
        finally:
            self._pumping = False
        if self._ending and self.status == "closing" and self.settled:
            self._finish()  # ended by end_soon: nobody drains, nothing is left to watch
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    def _advance(self) -> None:
        if self.status == "running" and self._failure is None:
            while True:
                took = self._take_arrivals()
                admitted = self._admit()
                if not (took or admitted):
                    break
            for batch in (*self._queue, *self._out):
                if batch.state in (COPYING, OUT) and not batch.copies_settled:
                    settled = True
                    for part in batch.parts:
                        if part.lease is not None and not part.landed:
                            settled = False  # in flight: nothing to look at until it lands
                            continue
                        self._protect(batch, part)
                        settled = settled and self._protection_settled(part)
                    batch.copies_settled = settled
        self._reap()

    # ------------------------------------------------------------------ arrivals

    def _take_arrivals(self) -> bool:
        """Move arrived batches into the queue, keeping at most one batch on the loop side that
        waits for admission (the feeder's FIFO holds the rest). True if one moved."""
        moved = False
        if self._fills is not None and self._end is None and self.status == "running":
            self._fills.dispatch()
        while self._end is None and not any(b.state == QUEUED for b in self._queue):
            item = self._next_item()
            if item is None:
                break
            if isinstance(item, End):
                self._end = item
                break
            self._queue.append(item)
            moved = True
        return moved

    def _next_item(self) -> BatchRecord | End | None:
        if self._fills is not None:
            return self._fills.take()
        arrivals = self._arrivals
        if arrivals is None:
            return None
        taken = arrivals.take()
        if taken is None or isinstance(taken, End):
            return taken
        return self._batch_of(taken)

    def _batch_of(self, host: HostBatch) -> BatchRecord:
        counters = self.counters
        counters.source_batches += 1
        counters.source_bytes += host.nbytes
        counters.host_copies += host.host_copies
        granularity = self.manager.state.granularity
        backend = self.manager.backend
        parts = []
        for tensor, version in zip(host.parts, host.versions, strict=True):
            storage = max(tensor.untyped_storage().nbytes(), tensor.numel() * tensor.element_size())
            parts.append(
                Part(
                    value_charge(storage, None, granularity),
                    tensor.numel() * tensor.element_size(),
                    host=tensor,
                    location=backend.location_of(tensor),
                    version=version,
                )
            )
        return BatchRecord(host.index, parts, host.structure, host.nbytes, leaf_part=host.leaf_part)

    # ------------------------------------------------------------------ admission

    def _window(self) -> int:
        return max(self.loader.prefetch, 1 if self._consumer_waiting else 0)

    def _admit(self) -> bool:
        """Admit queued batches in order while the window and the budget allow. True if one
        was admitted."""
        ahead = sum(1 for b in self._queue if b.state == COPYING)
        limit = self._window()
        admitted = False
        for batch in self._queue:
            if batch.state != QUEUED:
                continue
            if batch.error is not None or ahead >= limit or not self._try_admit(batch):
                break
            ahead += 1
            admitted = True
        return admitted

    def _blocked(self, batch: BatchRecord) -> bool:
        """Note when the batch began waiting for room; False (it was not admitted). While the
        consumer waits for it, cached data that went idle since it last asked (a pool's
        model no request waits for any more) is asked for again: the consumer is not woken
        by a change that admits nothing."""
        if batch.blocked_since is None:
            batch.blocked_since = time.perf_counter()
        elif self._consumer_waiting and self._queue and self._queue[0] is batch:
            need = sum(p.charge for p in batch.parts if p.pending is None)
            if reclaim_for(self.manager, self.device, need):
                self.manager.bridge.call_soon_quietly(self.pump)  # (once the releases left)
        return False

    def _copy_host(self, part: Part) -> None:
        """Give ``part`` a copy of its host tensor, in memory of its own (a clone on the loop:
        only for a storage that became another value after the source's thread looked)."""
        assert part.host is not None
        host = part.host.clone(memory_format=torch.contiguous_format)
        part.host = host
        part.version = version_of(host)
        part.location = self.manager.backend.location_of(host)
        storage = host.untyped_storage()
        part.key = (str(host.device), storage.data_ptr()) if storage.nbytes() else None
        self.counters.host_copies += 1

    def _try_admit(self, batch: BatchRecord) -> bool:
        """Register the batch's values and begin their materializations at the device, if the
        whole batch fits now. False (changing nothing that holds room) if it must wait."""
        manager = self.manager
        waiting = [p for p in batch.parts if p.pending is None]
        too_big = never_fits(self.manager, self.device, batch, self.name)
        if too_big is not None:
            batch.error = too_big
            return False
        if not room(self.manager, self.device, sum(p.charge for p in waiting)):
            return self._blocked(batch)
        if manager.waiting_for_room(self.device):
            # A scope, or a streamed call (``want_room``), waits for room here: it comes
            # first (a scope would refuse the materialization below anyway).
            return self._blocked(batch)
        for part in waiting:
            if (
                part.handle is None
                and part.host is not None
                and self._registered_elsewhere(part.host)
            ):
                # Registered by another tenant since the source's thread looked (another
                # loader's batch of the same tensors, its copy in flight): the batch gets a
                # copy of its own, as that thread gives it one of a value it sees.
                changed = self._changed(batch)
                if changed is not None:
                    batch.error = changed
                    return False
                self._copy_host(part)
        host_needs: dict[Location, int] = {}
        for part in waiting:
            if part.handle is None and part.location is not None:
                host_needs[part.location] = host_needs.get(part.location, 0) + part.charge
            if part.key is not None and self._host_storages.get(part.key, part) is not part:
                # The source handed this storage out again while the manager still holds it
                # for an earlier batch: wait until that copy completed.
                return self._blocked(batch)
        if not all(room(self.manager, loc, need) for loc, need in host_needs.items()):
            return self._blocked(batch)
        for part in waiting:
            if part.handle is not None:
                continue
            label = self._label(batch, part)
            try:
                if part.source is not None:
                    part.handle = manager.register_source(part.source, name=label)
                else:
                    assert part.host is not None
                    part.handle = manager.register(part.host, name=label)
            except ResidencyBudgetError:
                return self._blocked(batch)
            except Exception as error:
                batch.error = self._in_batch(error, batch, part, "could not be registered")
                return False
            if part.key is not None:
                self._host_storages[part.key] = part
        for part in waiting:
            assert part.handle is not None
            try:
                pending = manager.materialize_nowait(part.handle, self.device)
            except ResidencyBudgetError:
                return self._blocked(batch)  # a scope waits for room here first (FIFO)
            except Exception as error:
                batch.error = self._in_batch(error, batch, part, f"could not go to {self.device}")
                return False
            part.pending = pending
            part.issued_at = time.perf_counter()
            if not pending.done():
                part.hold = manager.hold(part.handle, self.device, on_behalf_of=self._consumer_ref)
            pending.add_done_callback(functools.partial(self._copied, batch, part))
        batch.state = COPYING
        batch.blocked_since = None
        for part in waiting:
            self._protect(batch, part)
        return True

    # ------------------------------------------------------------------ protection

    @staticmethod
    def _protection_settled(part: Part) -> bool:
        """Whether nothing more can happen to the part's protection: its copy failed (and was
        reported), it was discarded, or it is leased and its copy committed (a committed copy
        cannot fail later, and a failed one under a lease completes only after the loader
        saw the failure and dropped the lease)."""
        if part.failed or part.discarded:
            return True
        pending = part.pending
        return (
            part.lease is not None
            and pending is not None
            and pending.done()
            and pending.exception() is None
        )

    def _protect(self, batch: BatchRecord, part: Part) -> None:
        """Trade the part's hold for a lease once its copy is issued (or arm a callback for
        that); report a copy failure the lease has seen."""
        manager = self.manager
        if part.handle is None or part.pending is None or part.discarded:
            return
        lease = part.lease
        if lease is not None:
            if not part.landed:
                return  # its copy has not completed: no failure to see yet
            failure = lease.failure()
            if failure is not None and not part.failed:
                part.failed = True
                self._copy_failed(batch, part, failure)
            return
        if batch.state != COPYING:
            return  # released, or being released: never protect it again
        if part.pending.done() and part.pending.exception() is not None:
            return  # failed: nothing to protect
        if not manager.copy_issued(part.handle, self.device):
            if part.watching:
                return
            try:
                manager.tensor(part.handle, self.device)
            except ResidencyUnavailableError:
                return  # a load still reading its source: the manager notifies when done
            part.watching = True
            manager.when_copy_issued(
                part.handle, self.device, functools.partial(self._issued, part)
            )
            return
        lease = manager.acquire(
            part.handle, self.device, order_stream=False, on_behalf_of=self._consumer_ref
        )
        try:
            lease.enter_nowait()
        except LeaseWouldWait:
            return
        except ResidencyUnavailableError as error:  # the copy failed already
            self._unhold(part)
            if not part.failed:
                part.failed = True
                self._copy_failed(batch, part, error.__cause__ or error)
            return
        part.lease = lease
        self._unhold(part)
        event = lease.ready_event
        if event is not None and not event.query():
            # Its completion commits the copy (a change the pump hears about), but a failed one
            # waits for the lease to end: the pump must look at the lease when the copy ends.
            manager.backend.notify(event, functools.partial(self._landed, part))
        else:
            part.landed = True

    def _landed(self, part: Part, error: BaseException | None) -> None:
        # One more turn of the loop: the manager's own completion callback, queued at the
        # same moment, has then recorded the copy's outcome on the lease. A manager that is
        # closing pumps nothing more (its close released the batches).
        part.landed = True
        if self.manager.running:
            self.manager.bridge.call_soon_quietly(self.pump)

    def _copy_failed(self, batch: BatchRecord, part: Part, error: BaseException) -> None:
        """A copy failed while the loader protected it: fail the batch if the consumer has not
        got it yet, else report it at the next step; let the manager abort the copy (it waits
        until nothing protects it)."""
        if batch.state in (QUEUED, COPYING):
            if batch.error is None:
                batch.error = error
            self._drop_protection(part)
            return
        assert part.handle is not None
        late = ResidencyUnavailableError(
            part.handle,
            self.device,
            f"the copy of batch {batch.index} failed after the batch was handed out, so what "
            f"that step read was not the batch: {error}",
        )
        late.__cause__ = error
        self._deferred.append(late)

    def _drop_protection(self, part: Part) -> None:
        """End the part's hold or lease (never handed out: no reader to record)."""
        self._unhold(part)
        lease, part.lease = part.lease, None
        if lease is not None and lease.status == "entered":
            lease.exit_nowait(reader_events=[])

    def _in_batch(self, error: Exception, batch: BatchRecord, part: Part, what: str) -> Exception:
        """``error`` (its type and message kept) with a note saying which batch and tensor it
        is about: the manager's own message speaks of values, which the consumer never made."""
        where = ""
        if batch.leaf_part is not None and len(batch.structure) > 1:
            where = f" at {batch.structure.part_path(batch.leaf_part, batch.parts.index(part))}"
        error.add_note(
            f"{self.name}, pass {self.number}: the tensor{where} of batch {batch.index} "
            f"{what} as a managed value (ring=False makes each tensor one)"
        )
        return error

    def _label(self, batch: BatchRecord, part: Part) -> str:
        """The value's name: loader, epoch, batch, and the path of its first tensor."""
        name = f"{self.name}/e{self.number}/b{batch.index}"
        if batch.leaf_part is None or len(batch.structure) == 1:
            return name
        return f"{name}{batch.structure.part_path(batch.leaf_part, batch.parts.index(part))}"

    def _copied(self, batch: BatchRecord, part: Part, pending: PendingOperation) -> None:
        """A materialization finished: committed, failed (once nothing protected it any more)
        or cancelled."""
        now = time.perf_counter()
        error = pending.exception()
        if error is None:
            self.counters.copy_clock.add(part.issued_at, now)
            self.counters.copy_bytes += part.nbytes
            if part.key is not None and self._host_storages.get(part.key) is part:
                del self._host_storages[part.key]  # moved: the manager holds it no more
        elif not part.failed and self.status == "running" and batch.state in (QUEUED, COPYING):
            part.failed = True
            if batch.error is None:
                batch.error = error
        if batch.slot is not None and all(
            p.pending is None or p.pending.done() for p in batch.parts
        ):
            return_slot(self._staging, batch)
        self.pump()

    # ------------------------------------------------------------------ readiness

    def _ready(self, batch: BatchRecord) -> bool:
        """Whether the consumer may have the batch: every copy issued and leased (the
        consumer's stream is ordered after them at the hand-out), or, where compute runs on
        the host (the simulation), every copy complete."""
        if batch.state != COPYING or batch.error is not None:
            return False
        for part in batch.parts:
            if part.lease is None:
                self._protect(batch, part)
                if part.lease is None:
                    return False
            if self.host_compute and not (part.pending is not None and part.pending.done()):
                return False
        return True

    def _changed(self, batch: BatchRecord) -> RuntimeError | None:
        """The error if the source changed one of the batch's host tensors after yielding it
        (:func:`~aresidency.loader.feeder.changed_since_yielded`)."""
        if batch.leaf_part is None:
            return None  # a staged batch: read from its files, not from the source's tensors
        return changed_since_yielded(
            batch.index,
            batch.structure,
            batch.leaf_part,
            [part.host for part in batch.parts],
            [part.version for part in batch.parts],
        )

    def _issued(self, part: Part) -> None:
        # Called once: when the copy is issued (or soon, if it already was).
        part.watching = False
        self.pump()

    def _cause(self, head: BatchRecord | None) -> str:
        if head is None or (head.state == QUEUED and head.blocked_since is None):
            return "source"
        return "budget" if head.state == QUEUED else "copy"

    # ------------------------------------------------------------------ the consumer

    async def next(self) -> DeviceBatch:
        """The next batch, once it is ready (see the module docstring). Any error but the
        end closes the epoch (releasing everything, shielded from cancellation) before it
        propagates, as an async generator's would; so does the end, without waiting."""
        try:
            return await self._next()
        except StopAsyncIteration:
            # A batch another task keeps in an open ``async with`` stays until that block
            # ends (or the loader closes); the rest is discarded as the device passes it.
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
        # A checkpoint per batch, even when the next one is ready: a consumer whose steps only
        # enqueue kernels would otherwise never let the loop run the other tasks (a cancelled
        # consumer stops here, and next() releases everything).
        await anyio.lowlevel.checkpoint()
        if self.status != "running":
            raise StopAsyncIteration
        self._consumer = current_task()
        self._consumer_ref = current_task_ref()
        counters = self.counters
        self.release_unkept()
        if self._deferred:
            raise self._deferred.pop(0)
        began = time.perf_counter()
        if counters.first_request is None:
            counters.first_request = began
        self._consumer_waiting = True
        try:
            while True:
                self.pump()
                if self._failure is not None:
                    if isinstance(self._failure, ManagerClosedError):
                        raise self.closed_error(self._failure)  # the loader's own account
                    raise self._failure
                if self.status != "running":
                    if self.closed_by_manager:
                        raise self.closed_error()
                    raise StopAsyncIteration  # closed by another task meanwhile
                head = self._queue[0] if self._queue else None
                if head is not None and head.error is not None:
                    raise head.error
                if head is not None and self._ready(head):
                    changed = self._changed(head)
                    if changed is not None:
                        head.error = changed
                        raise changed
                    handed = self._hand_out(head)
                    # The window moved: admit the next batch now, while the step runs (no
                    # manager change may come to pump it when every copy completed already).
                    self._consumer_waiting = False
                    self.pump()
                    return handed
                if head is None and self._end is not None:
                    if self._end.error is not None:
                        raise self._end.error
                    raise StopAsyncIteration
                cause = self._cause(head)
                waiting: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                if cause == "budget" and head is not None:
                    need = sum(p.charge for p in head.parts if p.pending is None)
                    # An idle cache (a pool's models) goes first: only then can the wait be
                    # on what this task holds itself.
                    if reclaim_for(self.manager, self.device, need):
                        self.pump()  # (the cache given back: admit it now if it fits)
                        continue
                    stuck = self._kept_by_me(head)
                    if stuck is not None:
                        head.error = stuck
                        raise stuck
                    # Refused at once if it closes a cycle of tasks waiting for each other's
                    # room (this task holds a pool request, say, that another one waits for).
                    try:
                        waiting = self.manager.room_wait(
                            need,
                            self.device,
                            what=f"batch {head.index} of {self.name} "
                            f"({format_nbytes(need)} at {self.device})",
                            exempt=self._own_handles(),
                            kind="materialization",
                        )
                        waiting.__enter__()
                    except ResidencyBudgetError as error:
                        head.error = error
                        raise
                deadline = None
                timeout = self.loader.timeout
                if (
                    cause == "budget"
                    and timeout is not None
                    and head is not None
                    and not self._fits_once_released(head)
                ):
                    assert head.blocked_since is not None
                    deadline = anyio.current_time() + (
                        head.blocked_since + timeout - time.perf_counter()
                    )
                start = time.perf_counter()
                try:
                    timed_out = await self._wait(deadline)
                finally:
                    waiting.__exit__(None, None, None)
                counters.add_wait(cause, time.perf_counter() - start)
                if (
                    timed_out
                    and head is not None
                    and head.state == QUEUED
                    and not self._fits_once_released(head)
                ):
                    raise timeout_error(
                        self.manager, self.device, head, self.name, self.loader.timeout
                    )
        finally:
            self._consumer_waiting = False
            counters.wait_s += time.perf_counter() - began

    @property
    def leaving_bytes(self) -> int:
        """Bytes the released batches of this pass still hold at the device: their values
        are discarded as the device passes their readers (the consumer's last steps)."""
        return sum(
            part.charge
            for released in self._releasing
            for part in released.parts
            if part.handle is not None and not part.discarded
        )

    def _fits_once_released(self, batch: BatchRecord) -> bool:
        """Whether ``batch`` fits the device budget once the loader's released batches left
        it (this pass's or an earlier one's: see :meth:`DeviceLoader.leaving_bytes`).
        Waiting for that is waiting for the device, not for room others hold, so
        ``timeout`` does not count it (the ring reuses such a batch's slot and never waits
        for it on the host)."""
        loader = self._loader
        ledger = self.manager.state.find_ledger(self.device)
        if loader is None or ledger is None or ledger.budget_bytes is None:
            return True  # (no loader: the pass finished, the manager's close say)
        leaving = loader.leaving_bytes()
        need = sum(p.charge for p in batch.parts if p.pending is None)
        return ledger.charged_bytes - leaving + need <= ledger.budget_bytes

    def _kept_for(self, task: object) -> Kept | None:
        """For admission: the device copies of the batches copied ahead and handed out, when
        ``task`` is the consumer: they leave only when it asks for the next batch (or ends
        the pass), so a wait of its own for their room would never end. A batch another
        task keeps in its ``async with`` is that task's to release: not counted. Loop."""
        if task is not self._consumer or self.status != "running":
            return None
        batches = [b for b in self._queue if b.state == COPYING] + [
            b for b in self._out if b.handed is None or b.handed.kept_by in (None, task)
        ]
        kept = tuple(
            (part.handle, self.device)
            for batch in batches
            for part in batch.parts
            if part.handle is not None
        )
        if not kept:
            return None
        charge = sum(part.charge for batch in batches for part in batch.parts)
        out = sum(1 for b in batches if b.state != COPYING)
        return Kept(
            what=(
                f"{len(batches)} batch(es) of {self.name} ({format_nbytes(charge)} at "
                f"{self.device}: {len(batches) - out} copied ahead, {out} handed out), which "
                "leave only when this task asks for the next batch"
            ),
            materializations=kept,
            hint=(
                f"Lower {self.name}'s prefetch, or raise the budget of {self.device} "
                "to hold the loader's window and what a step needs together."
            ),
        )

    def _kept_by_me(self, head: BatchRecord) -> ResidencyBudgetError | None:
        """The error when the batches the waiting consumer task keeps itself, or what else
        it holds, leave ``head`` too little room ever to fit (see
        :func:`~.budget.kept_by_waiter` and :func:`~.budget.held_by_waiter`)."""
        task = current_task()
        if task is None:
            return None
        kept = self.kept_by(task)
        for ended in self.loader._handed_over:  # kept past the end of an earlier pass
            kept += ended.kept_by(task)
        need = sum(part.charge for part in head.parts)
        stuck = kept_by_waiter(self.manager, self.device, need, head.index, kept, self.name)
        if stuck is not None:
            return stuck
        mine = self._own_handles()
        return held_by_waiter(self.manager, self.device, need, head.index, self.name, exempt=mine)

    def kept_by(self, task: object) -> list[tuple[int, int]]:
        """``(index, bytes)`` of the batches handed out that ``task``'s open ``async with``
        blocks keep. Loop."""
        return [
            (batch.index, sum(part.charge for part in batch.parts))
            for batch in self._out
            if batch.handed is not None and batch.handed.kept_by is task
        ]

    def _own_handles(self) -> list[ValueHandle]:
        """The values of the batches in the window and handed out (the loader's own)."""
        return [p.handle for b in (*self._queue, *self._out) for p in b.parts if p.handle]

    async def _wait(self, deadline: float | None) -> bool:
        """Park until the pump made progress; True if ``deadline`` passed first."""
        if self._progress is None:
            self._progress = anyio.Event()
        progress = self._progress
        if deadline is None:
            await progress.wait()
            return False
        with anyio.move_on_at(deadline) as scope:
            await progress.wait()
        return scope.cancelled_caught

    def _hand_out(self, batch: BatchRecord) -> DeviceBatch:
        """Order the consumer's stream after the batch's copies, on the device (the host does
        not wait), and rebuild its structure around the device tensors."""
        backend = self.manager.backend
        stream = self.loader.stream
        if stream is None:
            stream = backend.current_stream(self.device)
        tensors = []
        for part in batch.parts:
            lease = part.lease
            assert lease is not None
            event = lease.ready_event
            if event is not None and not event.query():
                backend.stream_wait(stream, event)
            tensors.append(lease.tensor)
        batch.streams = [stream]
        if batch.specs is not None:
            leaves = [spec.view(tensors[0]) for spec in batch.specs]
        else:
            assert batch.leaf_part is not None
            leaves = [tensors[i] for i in batch.leaf_part]
        data = batch.structure.rebuild(leaves)
        self._queue.popleft()
        batch.state = OUT
        self._out.append(batch)
        handed = DeviceBatch(
            batch.index,
            data,
            batch.nbytes,
            self.device,
            functools.partial(self._release, batch),
            functools.partial(self._register_stream, batch),
            on_loop=self.manager.bridge.on_loop,
        )
        batch.handed = handed
        counters = self.counters
        counters.batches += 1
        counters.bytes += batch.nbytes
        counters.last_hand_out = time.perf_counter()
        return handed

    @staticmethod
    def _unhold(part: Part) -> None:
        hold, part.hold = part.hold, None
        if hold is not None and hold.active:
            hold.release()

    def release_unkept(self) -> None:
        """Release every batch handed out that no ``async with`` block keeps (the next step)."""
        for batch in list(self._out):
            if batch.handed is not None and not batch.handed.kept:
                batch.handed.release()

    def release_kept(self) -> None:
        """Release the batches still handed out after the pass ended (those ``async with``
        blocks kept when the source ran out): the loader's close, or the manager's. Loop."""
        for batch in list(self._out):
            if batch.handed is not None:
                batch.handed.release()

    def _register_stream(self, batch: BatchRecord, stream: Any) -> None:
        self.manager.backend.check_stream(stream, self.device)
        if stream is None:
            raise ValueError("register_stream needs a stream")
        if all(stream is not s for s in batch.streams):
            batch.streams.append(stream)

    def _release(self, batch: BatchRecord) -> None:
        """End the batch's leases with an event recorded on each reader stream (after the
        kernels enqueued there so far); its values are discarded once those completed (the
        pump watches). The host does not wait."""
        if batch.state != OUT:
            return
        # The batch changes state before any lease exits: each exit is a state change, whose
        # listeners (this pump) must see it released already.
        batch.state = RELEASING
        self._out.remove(batch)
        self._releasing.append(batch)
        leases = [part.lease for part in batch.parts]
        for part in batch.parts:
            part.lease = None
        events: list[Any] = []
        try:
            if self.manager.running:  # else the device stopped: nothing reads any more
                events = [self.manager.backend.record_event(stream) for stream in batch.streams]
        finally:
            for lease in leases:
                if lease is not None and lease.status == "entered":
                    lease.exit_nowait(reader_events=events)
        self.pump()

    # ------------------------------------------------------------------ discards

    def _settled(self, part: Part) -> bool:
        if part.pending is not None and not part.pending.done():
            return False
        assert part.handle is not None
        value = self.manager.state.find_value(part.handle)
        if value is None:
            return True
        return all(
            m.state is MaterializationState.RESIDENT and not m.protected
            for m in value.materializations.values()
        )

    def _reap(self) -> None:
        """Discard the values of released batches whose readers completed."""
        for batch in list(self._releasing):
            for part in batch.parts:
                if part.discarded:
                    continue
                if part.handle is None:
                    part.discarded = True
                    continue
                if not self._settled(part):
                    continue
                if self.manager.state.find_value(part.handle) is not None:
                    try:
                        self.manager.discard_nowait(part.handle)
                    except ResidencyError:
                        continue  # someone else holds it now: try again at the next change
                part.discarded = True
                if part.key is not None and self._host_storages.get(part.key) is part:
                    del self._host_storages[part.key]
            if all(p.discarded for p in batch.parts):
                if batch.slot is not None:
                    return_slot(self._staging, batch)
                self._releasing.remove(batch)
                batch.state = DONE

    # ------------------------------------------------------------------ the end

    def shutdown(self, *, keep_kept: bool = False) -> None:
        """Stop reading the source and release everything (synchronous; loop thread): batches
        handed out are released (their leases exit; with ``keep_kept``, the source having run
        out, not those an ``async with`` block keeps: each goes when its block ends, or at
        :meth:`release_kept`), copies not handed out yet are cancelled, and every value is
        discarded as soon as nothing reads it. :meth:`drain` waits for that."""
        if self.status != "running":
            return
        self.status = "closing"
        if self._arrivals is not None:
            self._arrivals.stop()
        if self._feeder is not None:
            self._feeder.stop()
        if self._feed_scope is not None:
            self._feed_scope.cancel()
        for batch in list(self._out):
            if batch.handed is not None and not (keep_kept and batch.handed.kept):
                batch.handed.release()
        for batch in self._queue:
            for part in batch.parts:
                self._drop_protection(part)
                if part.pending is not None and not part.pending.done():
                    part.pending.cancel()
            batch.state = RELEASING
            self._releasing.append(batch)
        self._queue.clear()
        if self._fills is not None:
            self._fills.stop()
        self._progress_now()
        self.pump()

    def end_soon(self, *, keep_kept: bool = False) -> None:
        """End the pass without waiting (a dropped iterator, the source's end):
        :meth:`shutdown` now (``keep_kept``: see there); every value is discarded as the
        device passes it, and the pass stops listening to the manager once nothing is left.
        Loop."""
        self._ending = True
        self.shutdown(keep_kept=keep_kept)
        self.pump()

    def manager_closed(self) -> None:
        """The manager closed (its backend with it) while the pass existed: stop the source,
        release what can be, stop listening; a consumer that waits, or asks for the next
        batch, gets ``ManagerClosedError``. Loop."""
        self._unwatch = None
        if self.status == "running":
            self.closed_by_manager = True
        try:
            self.shutdown()
            self.release_kept()  # kept past the pass's end: the device stopped
        finally:
            if self.status == "closing":
                self._finish()
            self._progress_now()

    def _progress_now(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    @property
    def settled(self) -> bool:
        """Nothing left: no batch queued, out or releasing, and no fill in flight."""
        return not self._out and self._nothing_but_kept

    @property
    def _nothing_but_kept(self) -> bool:
        """Nothing left but batches still handed out (after the pass's end: those ``async
        with`` blocks kept when the source ran out)."""
        fills = 0 if self._fills is None else self._fills.in_flight
        return not (self._queue or self._releasing or fills)

    @property
    def retiring(self) -> bool:
        """Whether the ended pass still has batches to discard or kept ones out (the
        loader's close releases those)."""
        return self.status != "closed"

    async def drain(self, *, releases_only: bool = False, handover: bool = False) -> None:
        """Park until every released batch has left the budget (``releases_only``), or, after
        :meth:`shutdown`, until nothing is left at all (but batches ``async with`` blocks
        kept past the pass's end: they go when their blocks end, or at
        :meth:`release_kept`); then stop listening (once nothing is left). Returns at once
        once the manager closed (it waited for every copy and reader already). ``handover``
        (the loader starts its next pass) changes nothing here: the pass's values are
        discarded as the device passes them either way."""
        while True:
            if not self.manager.running:
                break
            if releases_only:
                if not self._releasing:
                    return
            elif self._nothing_but_kept:
                break
            try:
                if self._fills is not None and self._fills.in_flight:
                    await self._wait(None)  # a buffer being filled: its thread calls back
                else:
                    await self.manager.wait_for_change()
            except ManagerClosedError:
                break
            self.pump()
        if self.status == "closing":
            if self.settled or not self.manager.running:
                self._finish()
            else:
                self._ending = True  # the last kept batch's release finishes it (pump)

    async def settle(self) -> None:
        """Park until the ended pass has nothing left but batches kept past its end (as
        :meth:`drain`)."""
        await self.drain()

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
        # No cycle loader -> pass -> loader (or pass -> fills -> pass) once the pass is over.
        self._loader = None
        self._fills = None

    async def join_feeder(self) -> None:
        """Wait for the feeder thread to stop (after its current ``next``), or the task
        reading an async source to end: the next pass must not iterate the source while this
        one still does. Abandonable."""
        if self._feeder is not None:
            await self._feeder.join()
        if self._fed is not None and self._feeding:
            await self._fed.wait()

    def take_deferred(self) -> list[BaseException]:
        """Copy failures no step reported (each only once)."""
        deferred, self._deferred = self._deferred, []
        return deferred
