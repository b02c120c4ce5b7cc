"""The per-call prefetch pipeline of a streamed module.

One :class:`CallPipeline` per call. It runs on the event loop, without a task of its own: it
advances whenever something changes (the manager's change signal, a copy being issued, a block
handed back) and keeps, for each group of weights, a :class:`Slot` that goes

``idle`` -> ``starting`` (materialization begun: charged, copy enqueued) -> ``ready`` (leased;
its views made) -> ``returning`` -> back to ``idle`` once the consumer handed it back (lease
exited with the consumer's reader event; the device replica released in the background, or
kept resident).

The *consumer* runs the blocks: the event loop itself for an ``nn.Sequential``, or the worker
thread that runs the module's own forward (through forward hooks). Either way the common case
crosses no thread and awaits nothing: the consumer finds the slot ready (its copy already
issued, its lease already entered), makes its own stream wait for the copy on the device right
before the block's kernels, runs the block, records one event and hands the slot back; a
thread hands it back through a lock-protected queue that wakes the loop once per batch. Only
when a slot is not ready yet does the consumer wait (a task parks on the slot; a thread blocks
on it, never the loop).

Order: groups start in call order (the resident group first), at most ``prefetch`` ahead of
the block in use, never out of order (a later block never takes an earlier one's room), and
only the first block until the consumer has enqueued its kernels (or has to wait), so that they
are enqueued right behind its copy and not behind the Python work of issuing the prefetches.
Groups in ``keep`` stay resident on the device after use ("budgets that remember": see
:meth:`~aresidency.integrations.streaming.module.StreamedModule.residency`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ...core.errors import ResidencyBudgetError, ResidencyError
from ...runtime.leases import Lease, LeaseWouldWait
from ...runtime.pending import PendingOperation
from .packing import TensorGroup

if TYPE_CHECKING:
    from .module import StreamedModule

__all__ = ["CallAborted", "CallPipeline", "Slot"]


class CallAborted(Exception):
    """The call ended (cancelled or failed elsewhere) while a consumer waited for a block."""


class Slot:
    """One group of weights in one call. The loop writes it; a consumer thread reads it only
    after ``flag`` is set (``ready`` or ``failed``), which orders the reads after the writes."""

    __slots__ = (
        "failure",
        "flag",
        "group",
        "lease",
        "pending",
        "ready_event",
        "state",
        "tensors",
        "waiter",
    )

    def __init__(self, group: TensorGroup) -> None:
        self.group = group
        self.state = "idle"  # idle -> starting -> ready (or failed) -> idle
        self.pending: PendingOperation | None = None
        self.lease: Lease | None = None
        self.tensors: list[torch.Tensor] | None = None
        self.ready_event: Any = None  # what the consumer's stream waits for (None: data there)
        self.failure: BaseException | None = None
        self.flag = threading.Event()  # set while ready or failed (thread consumers)
        self.waiter: anyio.Event | None = None  # a loop consumer parked on this slot

    def _signal(self) -> None:
        self.flag.set()
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.set()

    def __repr__(self) -> str:
        return f"<Slot {self.group.name} {self.state}>"


class CallPipeline:
    """The pipeline state of one call (see the module docstring).

    ``host_wait``: a slot is ready only once its copy completed (a consumer that computes on
    the host, the simulation's worker thread); otherwise once its copy is issued.
    State (loop thread): ``slots`` (group index -> slot), ``pos`` (order position of the block
    expected next), ``requested`` (a group asked for out of order), ``window_open``,
    ``active``, ``failures`` (copy errors seen after their block ran), ``_returns`` (blocks
    handed back by a thread, under ``_lock``).
    Invariants: a slot is ready only while its lease is entered; a slot returns to idle only
    after its lease exited; groups start in order from ``pos``.
    """

    def __init__(
        self,
        streamed: StreamedModule,
        stream: Any,
        *,
        host_wait: bool,
        keep: set[int],
    ) -> None:
        self.streamed = streamed
        self.manager = streamed.manager
        self.bridge = streamed.manager.bridge  # consumer threads call back through it
        self.stream = stream
        self.host_wait = host_wait
        self.keep = keep
        self.slots: dict[int, Slot] = {g.index: Slot(g) for g in streamed.all_groups}
        self.pos = 0
        self.requested: int | None = None
        self.window_open = False
        self.active = True
        self.failures: list[BaseException] = []
        self.returned: set[int] = set()  # groups the consumer handed back in this call
        self._returns: deque[tuple[int, Any]] = deque()
        self._lock = threading.Lock()
        self._drain_scheduled = False
        self._pumping = False
        self._pump_again = False
        self._window_asked = False  # a consumer thread asked the loop to open the window
        self._unlisten: Callable[[], None] | None = None

    # ------------------------------------------------------------------ driving

    def start(self) -> None:
        """Start the first groups now and follow the manager's state from here on."""
        self._unlisten = self.manager.add_change_listener(self.pump)
        self.pump()

    def _candidates(self) -> Iterator[int]:
        streamed = self.streamed
        resident = streamed.resident_group
        if resident is not None and resident.index not in self.returned:
            yield resident.index
        if self.requested is not None:
            yield self.requested
        ahead = streamed.prefetch + 1 if self.window_open else 1
        yield from streamed.order[self.pos : self.pos + ahead]

    def pump(self) -> None:
        """Start what the budget admits, in order; make started slots ready. Synchronous and
        not re-entrant: starting a copy changes the state, which notifies, which pumps; that
        nested pump is folded into a further round of this one."""
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            while self.active:
                self._pump_again = False
                self._pump_once()
                if not self._pump_again:
                    return
        finally:
            self._pumping = False

    def _pump_once(self) -> None:
        releasing = self.streamed.releasing
        for index in self._candidates():
            slot = self.slots[index]
            if slot.state == "idle" and (index in releasing or not self._start(slot)):
                break  # keep block order: a later block never takes an earlier one's room
            if slot.state == "starting":
                self._make_ready(slot)

    def _start(self, slot: Slot) -> bool:
        group = slot.group
        assert group.handle is not None
        device = self.streamed.device
        try:
            pending = self.manager.materialize_nowait(group.handle, device)
        except ResidencyBudgetError as error:
            if error.budget_bytes is not None and error.requested_bytes > error.budget_bytes:
                self._fail(slot, error)  # it could never fit
            return False
        except ResidencyError as error:
            self._fail(slot, error)
            return False
        slot.pending = pending
        slot.state = "starting"
        pending.add_done_callback(lambda done: self._materialized(slot, done))
        if not self.host_wait and not pending.done():
            # A staged copy takes a while to issue: look again once it is.
            self.manager.when_copy_issued(group.handle, device, self.pump)
        return True

    def _make_ready(self, slot: Slot) -> None:
        pending = slot.pending
        if self.host_wait and (pending is None or not pending.done()):
            return
        group = slot.group
        assert group.handle is not None
        if not self.manager.copy_issued(group.handle, self.streamed.device):
            return  # pumped again once it is (or once the load put its data there)
        try:
            lease = self.manager.acquire(
                group.handle, self.streamed.device, stream=self.stream, order_stream=False
            )
            lease.enter_nowait()
        except LeaseWouldWait:
            return  # not issued (or not loaded) yet: pumped again when it is
        except ResidencyError as error:
            self._fail(slot, error)
            return
        slot.lease = lease
        slot.tensors = group.views(lease.tensor)
        slot.ready_event = lease.ready_event
        slot.state = "ready"
        slot._signal()

    def _materialized(self, slot: Slot, pending: PendingOperation) -> None:
        error = pending.exception()
        if error is None:
            if slot.state == "starting":
                self.pump()
            return
        if slot.state == "starting" and slot.pending is pending:
            self._fail(slot, error)
        elif slot.pending is pending:
            # Its block may have run already (CUDA): the call (or drain) reports it.
            self.failures.append(error)

    def _fail(self, slot: Slot, error: BaseException) -> None:
        slot.failure = error
        slot.state = "failed"
        slot._signal()

    def open_window(self) -> None:
        """Prefetch from now on (the first block is on its way), and start what fits."""
        if not self.window_open:
            self.window_open = True
            self.pump()

    def _request(self, index: int) -> None:
        """The consumer asks for ``index`` next (loop)."""
        position = self.streamed.position.get(index)
        if position is not None:
            self.pos = position
        if index != self._resident_index and position is None:
            self.requested = index
        self.pump()

    @property
    def _resident_index(self) -> int:
        group = self.streamed.resident_group
        return -1 if group is None else group.index

    # ------------------------------------------------------------------ consumers

    async def take(self, index: int) -> Slot:
        """The loop consumer's access to group ``index``: returns once it is ready (at once in
        the common case), raising its failure or ``TimeoutError``."""
        slot = self.slots[index]
        if slot.state != "ready":
            self._request(index)
        deadline = self.streamed.deadline()
        while slot.state not in ("ready", "failed"):
            if not self.active:
                raise CallAborted(f"{self.streamed.name}: the call ended")
            self.open_window()  # about to wait: let the prefetches use the time
            if slot.state in ("ready", "failed"):
                break
            waiter = slot.waiter = slot.waiter or anyio.Event()
            if deadline is None:
                await waiter.wait()
            else:
                with anyio.move_on_at(deadline):
                    await waiter.wait()
                if slot.state not in ("ready", "failed") and anyio.current_time() >= deadline:
                    raise TimeoutError(self.streamed.timeout_message(slot.group))
        if slot.state == "failed":
            assert slot.failure is not None
            raise slot.failure
        self.requested = None
        return slot

    def take_blocking(self, index: int) -> Slot:
        """A consumer thread's access to group ``index``: returns the ready slot at once in the
        common case (no thread crossing); otherwise asks the loop for it and blocks this thread
        (never the loop) until it is ready. Raises its failure, :class:`CallAborted` or
        ``TimeoutError``."""
        slot = self.slots[index]
        if not slot.flag.is_set():
            self.bridge.call_soon(self._request_from_thread, index)
            timeout = self.streamed.timeout
            if not slot.flag.wait(timeout):
                raise TimeoutError(self.streamed.timeout_message(slot.group))
        elif not self._window_asked:
            # The first block is on its way to the compute stream: prefetch from now on.
            self._window_asked = True
            self.bridge.call_soon(self.open_window)
        if not self.active:
            raise CallAborted(f"{self.streamed.name}: the call ended")
        if slot.state == "failed":
            assert slot.failure is not None
            raise slot.failure
        return slot

    def _request_from_thread(self, index: int) -> None:
        if self.active:
            self._request(index)
            self.open_window()

    def give_back(self, index: int, event: Any) -> None:
        """The consumer is done with group ``index``; ``event`` completes after its last
        reader (loop)."""
        slot = self.slots[index]
        lease = slot.lease
        if lease is None:
            return
        slot.lease = None
        slot.tensors = None
        slot.ready_event = None
        slot.flag.clear()
        # "returning" until the release is registered and the position moved on, so that a
        # pump the lease's exit triggers does not start the group again.
        slot.state = "returning"
        self.returned.add(index)
        error = lease.exit_nowait(reader_events=[event])
        if error is not None:
            self.failures.append(error)
        if index not in self.keep:
            self.streamed.release_replica(index, slot.pending)
        position = self.streamed.position.get(index)
        if position is not None and position + 1 > self.pos:
            self.pos = position + 1
        slot.state = "idle"
        self.open_window()
        self.pump()

    def give_back_threadsafe(self, index: int, event: Any) -> None:
        """:meth:`give_back` from a consumer thread: queued, the loop woken once per batch."""
        with self._lock:
            self._returns.append((index, event))
            schedule = not self._drain_scheduled
            self._drain_scheduled = True
        if schedule:
            self.bridge.call_soon(self._drain_returns)

    def _drain_returns(self) -> None:
        with self._lock:
            returns = list(self._returns)
            self._returns.clear()
            self._drain_scheduled = False
        for index, event in returns:
            self.give_back(index, event)

    # ------------------------------------------------------------------ the end

    def abort(self) -> None:
        """Stop: waiting consumers (tasks and threads) raise :class:`CallAborted`."""
        self.active = False
        for slot in self.slots.values():
            slot._signal()

    def finish(self) -> None:
        """End the call (loop, synchronous): hand back what a consumer still holds (with an
        event on the compute stream, after anything it may have enqueued), release every
        replica not kept, cancel copies nobody needs any more."""
        self._drain_returns()
        self.abort()
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        backend = self.manager.backend
        for index, slot in self.slots.items():
            if slot.lease is not None:
                lease, slot.lease = slot.lease, None
                slot.tensors = None
                error = lease.exit_nowait(reader_events=[backend.record_event(self.stream)])
                if error is not None:
                    self.failures.append(error)
                if index not in self.keep:
                    self.streamed.release_replica(index, slot.pending)
            elif slot.state == "starting" and slot.pending is not None:
                pending = slot.pending
                if pending.done():
                    if pending.exception() is None and index not in self.keep:
                        self.streamed.release_replica(index)
                else:
                    pending.cancel()
                    self.streamed.settle_later(pending)
                    pending.add_done_callback(self._release_if_arrived(index))
            slot.state = "idle"
            slot.flag.clear()

    def _release_if_arrived(self, index: int) -> Callable[[PendingOperation], None]:
        def release(pending: PendingOperation) -> None:
            if pending.exception() is None and index not in self.keep:
                self.streamed.release_replica(index)

        return release

    def __repr__(self) -> str:
        states: dict[str, int] = {}
        for slot in self.slots.values():
            states[slot.state] = states.get(slot.state, 0) + 1
        return f"<CallPipeline {self.streamed.name} pos={self.pos} {states}>"
