"""The ring: a streamed call's copies through a few device buffers it owns, at the cost of a
hand-written double buffer.

A call through the managed values (:mod:`.pipeline`) makes every block a device replica of
its own: charged, copied, leased, released and reaped by the manager, one by one, on the event
loop. That costs the loop a few hundred microseconds of Python per block, which the thread
running the forward then waits for (they share the interpreter): at blocks of a few MiB the
loop's work, not the link, sets the pace. The ring takes that work off the per-block path:

* **Admission, once per call** (on the loop, in :meth:`RingCall.open`): the groups that stay on
  the device for the whole call (the tensors outside the blocks, and the blocks kept resident
  between calls) are materialized as managed values and leased, as before; then one named
  reservation, ``stream ring <module>``, admits ``k`` buffers of the largest streamed block
  (``k`` = ``prefetch + 1``, fewer when the budget has less room, at least one), and ``k``
  device buffers of that size are allocated. The budget sees exactly those bytes (the snapshot shows
  the reservation by name); nothing else is charged while the call runs.
* **Per block, in the consumer's own thread, no loop involved**: before block ``p`` runs, the
  copies of the next blocks (up to ``p + k - 1``) are enqueued on the host-to-device copy
  stream, each into the slot its block ``k`` positions earlier used, after that block's reader
  event (a device-side wait: the host never waits); the compute stream waits for block
  ``p``'s copy; the block runs on views of its slot. After it, one event records its readers.
  That is what a hand-written double buffer does, with ``k`` slots instead of two.
* **The end** (loop): leases exit with an event after the call's last kernel; the ring's
  buffer is freed, and its reservation ended, only once that event and the last copy's event
  completed (:meth:`StreamedModule.drain <.module.StreamedModule.drain>` waits for it).

Order: blocks run in call order; a block asked out of order (a model that skips or repeats a
block) moves the ring there and copies from it on (copies already issued for blocks skipped
are wasted link time, never wrong data: every slot is reused only after its last reader and
its last copy, both ordered on the device). A cyclic call (``generate``) wraps around; one
whose passes, after the first, start further on (an encoder-decoder's ``generate``: the encoder
once, the decoder per token) wraps to where they start from then on (see ``RingCall._seek``).

Used for a module whose weights are in pinned host memory (no staging, no checkpoint loads),
on a backend with :meth:`~aresidency.backends.base.Backend.copy_into`; everything else goes
through the managed values. On the simulation (compute on the host), a consumer thread waits
for its block's copy on the host before running it.

Why this module is long: one call's ring is one state machine, from admission (the groups held
for the call and the ring's reservation, waiting for room and saying so with ``want_room``, or
refusing a wait the calling task itself keeps from ending) through the copies issued ahead and
the slots' reuse to the retirement of the ring; each step reads the slots' state the others
write.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import torch

from ...backends.events import HostEvent
from ...core.errors import ResidencyBudgetError
from ...core.sizes import format_nbytes
from ...core.values import MaterializationState
from ...runtime.leases import Lease
from ...runtime.pending import PendingOperation
from .packing import TensorGroup
from .pipeline import CallAborted

if TYPE_CHECKING:
    from .module import StreamedModule

__all__ = ["RingCall", "RingSlot"]

_RESIDENT = MaterializationState.RESIDENT
_DONE = HostEvent(done=True, label="host compute")

#: How often a consumer thread waiting on the host for a block's copy looks whether the
#: manager closed: a simulated stream drops the copies queued when its backend closes, and
#: their events never complete.
_CLOSE_CHECK_S = 0.05


def _unkeep_if_failed(keep: set[int], index: int, pending: PendingOperation) -> None:
    """A copy of a group the module meant to keep ended after its call: if it failed (or was
    cancelled), nothing arrived, so the group is not kept (``keep`` is the module's set of
    that call; a later call planned its own)."""
    if pending.exception() is not None:
        keep.discard(index)


class IdleRing:
    """A finished call's ring until the device passed its last use: then its buffer is freed
    and its reservation ended, unless the next call adopted it first (a call that follows
    before the device caught up takes it over as it is: its copies wait, on the device, for
    the previous call's readers of each slot; nothing is freed, reserved or waited for).

    State: ``name`` (the reservation), ``buffers`` (one device tensor per slot), ``slots``,
    ``stride``, ``charge`` (bytes per slot in the reservation), ``readers`` (slot -> event
    after its last reader),
    ``done`` (set once retired or adopted), ``adopted``."""

    def __init__(
        self,
        name: str,
        buffers: list[torch.Tensor],
        slots: int,
        stride: int,
        charge: int,
        readers: list[Any],
    ) -> None:
        self.name = name
        self.buffers: list[torch.Tensor] | None = buffers
        self.slots = slots
        self.stride = stride
        self.charge = charge
        self.readers = readers
        self.done = anyio.Event()
        self.adopted = False

    @property
    def reserved_bytes(self) -> int:
        return self.slots * self.charge


class RingSlot:
    """What a consumer gets for one block: its tensors (views of a ring slot or of a leased
    replica) and the event its stream must wait for first (``None``: nothing to wait for)."""

    __slots__ = ("ready_event", "tensors")

    def __init__(self, tensors: list[torch.Tensor], ready_event: Any = None) -> None:
        self.tensors: list[torch.Tensor] | None = tensors
        self.ready_event = ready_event


def _layout(group: TensorGroup) -> tuple[Any, ...]:
    """What the views of a group depend on besides the buffer: equal layouts share views."""
    return tuple((e.dtype, e.shape, e.stride, e.offset) for e in group.entries)


class RingCall:
    """One call's copies through a ring (see the module docstring).

    State: ``slots`` (``k``), ``stride`` (bytes per slot), ``buffers`` (one per slot),
    ``sequence`` (the streamed group indexes in call order; a cyclic call's passes, once
    learned, when they start further on: see :meth:`_seek`), ``issued`` and ``used`` (positions
    in the sequence, counting on past its end when cyclic: the next copy to enqueue, the next
    block expected), ``readers`` (slot -> event after its last reader, or ``None``),
    ``copied`` (slot -> the event of the copy into it), ``_content`` (slot -> the group its
    last copy brought, -1 if none of this call's: a group already in the slot it would go to
    is not copied again), ``leases`` (group index -> the lease
    of a group held for the whole call), ``held`` (group index -> its views),
    ``active`` (false once aborted or finished). The consumer thread alone moves ``issued``
    and ``used`` once the call started; the loop reads them only after that thread ended.
    Invariant: a slot is copied into only after the device passed its last reader's event and
    its previous copy (the same copy stream); at most ``k`` blocks' data are in flight or in use.
    """

    def __init__(
        self,
        streamed: StreamedModule,
        stream: Any,
        *,
        host_wait: bool,
        keep: set[int],
        cyclic: bool,
    ) -> None:
        self.streamed = streamed
        self.manager = streamed.manager
        self.backend = streamed.manager.backend
        self.device = streamed.device
        # Set while open() waits for room (want_room's release).
        self._wanting: Callable[[], None] | None = None
        self.stream = stream
        self.host_wait = host_wait
        self.keep = keep
        self.cyclic = cyclic
        # The streamed groups in call order, a group each time its block runs (a block listed
        # twice comes twice: see _content for the copy that saves).
        self.sequence = [index for index in streamed.order if index not in keep]
        # The whole sequence, when a cyclic call's passes run only its end (see _seek).
        self._whole = self.sequence
        self.slots = 0
        self.stride = 0
        self.charge = 0
        self.buffers: list[torch.Tensor] | None = None
        self.reservation: str | None = None
        self.issued = 0
        self.used = 0
        self.readers: list[Any] = []
        self.copied: list[Any] = []  # slot -> its last copy's event (CUDA: reused objects)
        self._reader_events: list[Any] = []
        self._layouts: dict[int, tuple[Any, ...]] = {}  # group index -> its _layout
        self._views: dict[tuple[int, tuple[Any, ...]], list[torch.Tensor]] = {}
        self.taken: set[int] = set()  # group indexes the consumer holds (its thread only)
        self._current = 0  # the slot of the block the consumer holds
        self._last_copy: Any = None  # the event of the copy enqueued last
        self._places: dict[int, list[int]] = {}  # group index -> its places in sequence
        self._index_sequence()
        self._content: list[int] = []  # slot -> the group whose copy went there last (-1)
        self.leases: dict[int, Lease] = {}
        self.held: dict[int, RingSlot] = {}
        self._started: dict[int, PendingOperation] = {}  # materializations open() began
        self.failures: list[BaseException] = []
        self.active = True
        self._lock = threading.Lock()  # the consumer's issuing against the loop's abort

    @property
    def reserved_bytes(self) -> int:
        """The bytes of the ring's reservation while the call holds it (0 before and after)."""
        return self.slots * self.charge if self.reservation is not None else 0

    # ------------------------------------------------------------------ admission (loop)

    async def open(self) -> None:
        """Admit what the call needs (see the module docstring): the groups held for the whole
        call, then the ring. Waits for room (``TimeoutError`` past the module's timeout);
        while it does, tenants that could take that room first hold back
        (:meth:`ResidencyManager.want_room`), until the call has it all or gave up."""
        try:
            await self._open()
        finally:
            release, self._wanting = self._wanting, None
            if release is not None:
                release()

    async def _open(self) -> None:
        streamed = self.streamed
        deadline = streamed.deadline()
        needed: list[TensorGroup] = []
        if streamed.resident_group is not None:
            needed.append(streamed.resident_group)
        needed += [g for g in streamed.groups if g.index in self.keep]
        pendings: list[tuple[TensorGroup, PendingOperation]] = []
        for group in needed:
            required = group is streamed.resident_group
            pending = await self._materialize(group, deadline, required)
            if pending is None:
                if self._resident(group):
                    # Leased at once: nothing may release it while the others arrive.
                    self._lease(group)
                else:
                    self._stream_instead(group)  # no room to keep it: it streams
                continue
            pendings.append((group, pending))
            self._started[group.index] = pending
            streamed.copies += 1
            streamed.copied_bytes += group.nbytes
        for group, pending in pendings:
            await pending.wait_settled()
            error = pending.exception()
            if error is not None:
                raise error
            self._lease(group)
        await self._reserve(deadline)
        self.issue_ahead(0)

    def _state_here(self, group: TensorGroup) -> MaterializationState | None:
        assert group.handle is not None
        value = self.manager.state.find_value(group.handle)
        record = None if value is None else value.materializations.get(self.device)
        return None if record is None else record.state

    def _resident(self, group: TensorGroup) -> bool:
        return self._state_here(group) is _RESIDENT

    async def _materialize(
        self, group: TensorGroup, deadline: float | None, required: bool
    ) -> PendingOperation | None:
        """Start bringing ``group`` to the device unless it is resident there: its pending
        operation, or ``None`` when resident (or, when not ``required``, when there is no
        room). A replica arriving or leaving (an earlier call's prefetch or release) is
        waited for first."""
        while True:
            releasing = self.streamed.releasing.get(group.index)
            if releasing is not None:
                await releasing.wait_settled()  # an earlier call's release goes first
                continue
            state = self._state_here(group)
            if state is _RESIDENT:
                return None
            need = None  # the replica settling: nothing to make room for
            if state is None:
                assert group.handle is not None
                try:
                    return self.manager.materialize_nowait(group.handle, self.device)
                except ResidencyBudgetError:
                    if not required:
                        return None
                need = group.charge_bytes
            await self._wait_for_room(deadline, group, need)

    async def _wait_for_room(
        self, deadline: float | None, group: TensorGroup | None, need: int | None
    ) -> None:
        """Wait for a change that may make room for ``need`` bytes (``None``: that settles a
        replica arriving or leaving). While it waits for room, tenants that could take it
        first (a loader) hold back (:meth:`ResidencyManager.want_room`); it raises
        ``ResidencyBudgetError`` at once when only what the calling task keeps itself (a
        loader's batches copied ahead of it) stands in the way."""
        streamed = self.streamed
        if streamed.ask_others_for_room():  # their kept blocks leave: try again first
            await anyio.lowlevel.checkpoint()
            return
        what = group if group is not None else streamed.groups[0]
        if need is not None:
            own = self.manager.waiting_on_itself(
                need,
                self.device,
                exempt=streamed.handles,
                what=f"{streamed.name}: {what.name} waits for room",
            )
            if own is not None:
                raise own
            if self.manager.reclaim_for(self.device, need):  # a pool's idle cache left
                await anyio.lowlevel.checkpoint()
                return
            if self._wanting is None:  # held until open() ends
                self._wanting = self.manager.want_room(self.device)
        # A wait for room the calling task may hold some of (a pool request it is in):
        # registered, and refused at once if it closes a cycle of tasks waiting for each
        # other's room (hold and wait).
        waiting: contextlib.AbstractContextManager[None] = (
            contextlib.nullcontext()
            if need is None
            else self.manager.room_wait(
                need,
                self.device,
                what=f"{streamed.name}: {what.name} ({format_nbytes(need)})",
                exempt=streamed.unprotected_handles,
            )
        )
        with waiting:
            if deadline is None:
                await self.manager.wait_for_change()
                return
            remaining = deadline - anyio.current_time()
            if remaining <= 0 or not await self.manager.wait_for_change(remaining):
                raise TimeoutError(streamed.timeout_message(what, need))

    def _stream_instead(self, group: TensorGroup) -> None:
        """A block planned to stay that found no room: it streams through the ring."""
        self.keep.discard(group.index)
        self.sequence = [index for index in self.streamed.order if index not in self.keep]
        self._whole = self.sequence
        self._index_sequence()

    def _index_sequence(self) -> None:
        self._places = {}
        for p, index in enumerate(self.sequence):
            self._places.setdefault(index, []).append(p)

    def _lease(self, group: TensorGroup) -> None:
        assert group.handle is not None
        lease = self.manager.acquire(
            group.handle, self.device, stream=self.stream, order_stream=False
        )
        lease.enter_nowait()
        self.leases[group.index] = lease
        ready = lease.ready_event
        if ready is not None and self.stream is not None:
            self.backend.stream_wait(self.stream, ready)  # before any of the call's kernels
        self.held[group.index] = RingSlot(group.views(lease.tensor))

    async def _reserve(self, deadline: float | None) -> None:
        """The ring's reservation and buffer: ``prefetch + 1`` slots, or as many as fit now
        (at least one; waits for room for one)."""
        streamed = self.streamed
        if not self.sequence:
            return
        want = self._size_ring()
        if self._adopt(want):
            return
        name = self._free_name(f"stream ring {streamed.name} #{streamed.calls}")
        while True:
            for slots in range(want, 0, -1):
                try:
                    # The call's own (it gives the room back itself, and judges its waits
                    # with its own values exempt): not counted as the calling task's.
                    self.manager.reserve_nowait(
                        name, self.device, slots * self.charge, task_owned=False
                    )
                except ResidencyBudgetError:
                    continue
                self.reservation = name
                self.slots = slots
                break
            if self.reservation is not None:
                break
            if streamed.ask_others_for_room():  # their kept blocks leave: try again first
                await anyio.lowlevel.checkpoint()
                continue
            if self._give_up_kept():
                # The room the plan left for the ring was taken meanwhile (by another call in
                # flight, which may be waiting for room itself): a block planned to stay
                # streams instead, so that the call never waits on the room its own kept
                # blocks hold.
                want = self._size_ring()
                continue
            await self._wait_for_room(deadline, streamed.group(self.sequence[0]), self.charge)
        try:
            # One tensor per slot (as one block per value would be): the caching allocator
            # reuses such blocks exactly from one call to the next.
            self.buffers = [
                self.backend.allocate((self.stride,), torch.uint8, self.device)
                for _ in range(self.slots)
            ]
        except BaseException:
            self.manager.unreserve_nowait(name, self.device)
            self.reservation = None
            raise
        self.readers = [None] * self.slots
        self.copied = [None] * self.slots
        self._reader_events = [None] * self.slots
        self._content = [-1] * self.slots

    def _free_name(self, name: str) -> str:
        """``name``, or ``name (2)``, ``name (3)``... the first that no reservation at the
        device has now: another streamed module of the manager may have the same name (two
        model pools naming their models alike, a name given twice) and its call the same
        number, and a reservation name is the manager's key for it at a location."""
        taken = self.manager.state.ledger(self.device).reservations
        free, n = name, 2
        while free in taken:
            free, n = f"{name} ({n})", n + 1
        return free

    def _size_ring(self) -> int:
        """Set the ring's slot size for the streamed groups; return the slots it wants."""
        groups = [self.streamed.group(index) for index in self.sequence]
        self.charge = max(g.charge_bytes for g in groups)
        self.stride = max(g.nbytes for g in groups)
        return min(self.streamed.prefetch + 1, len(set(self.sequence)))

    def _give_up_kept(self) -> bool:
        """Stream one block leased to stay instead (the last in call order): its lease ends
        (nothing read it yet) and its replica is released. Whether there was one."""
        streamed = self.streamed
        for group in reversed(streamed.groups):
            index = group.index
            lease = self.leases.get(index)
            if lease is None or index not in self.keep:
                continue
            del self.leases[index]
            self.held.pop(index, None)
            error = lease.exit_nowait(reader_events=[])
            del lease
            if error is not None:
                self.failures.append(error)
            self._stream_instead(group)  # (keep is the module's kept set: no longer kept)
            streamed.release_replica(index)
            return True
        return False

    def _adopt(self, want: int) -> bool:
        """Take over the previous call's ring if the device has not retired it yet and it
        suits (slots at most ``want``, slots large enough, the same charge per slot)."""
        for idle in list(self.streamed.rings.values()):
            if idle.done.is_set() or idle.buffers is None:
                continue
            if idle.slots > want or idle.stride < self.stride or idle.charge != self.charge:
                continue
            idle.adopted = True
            del self.streamed.rings[idle.name]
            idle.done.set()
            self.reservation = idle.name
            self.slots = idle.slots
            self.stride = idle.stride
            self.buffers, idle.buffers = idle.buffers, None
            self.readers = idle.readers
            self.copied = [None] * self.slots
            self._reader_events = [None] * self.slots
            self._content = [-1] * self.slots  # (the previous call's copies: not ours)
            return True
        return False

    # ------------------------------------------------------------------ the per-block path

    def _group_at(self, position: int) -> int:
        return self.sequence[position % len(self.sequence)]

    def issue_ahead(self, position: int) -> None:
        """Enqueue the copies of the blocks from ``position`` up to ``position + k - 1`` not
        enqueued yet (the consumer's thread, or the loop before the consumer starts)."""
        count = len(self.sequence)
        if not count or self.buffers is None:
            return
        stop = position + self.slots
        if not self.cyclic:
            stop = min(stop, count)
        backend = self.backend
        buffers = self.buffers
        while self.issued < stop:
            p = self.issued
            slot = p % self.slots
            index = self._group_at(p)
            if self._content[slot] == index and self.copied[slot] is not None:
                # The slot holds this group already (a block run again after as many
                # others as the ring has slots, a block listed twice in a row with one
                # slot): nothing to copy, its copy's event stands.
                self.issued = p + 1
                continue
            group = self.streamed.group(index)
            src = group.host_flat
            assert src is not None
            waits = [] if self.readers[slot] is None else [self.readers[slot]]
            with self._lock:
                if not self.active:
                    raise CallAborted(f"{self.streamed.name}: the call ended")
                event = backend.copy_into(
                    src,
                    buffers[slot][: group.nbytes],
                    self.device,
                    wait_events=waits,
                    event=self.copied[slot],
                )
            self.copied[slot] = event
            self._content[slot] = index
            self._last_copy = event
            self.streamed.copies += 1
            self.streamed.copied_bytes += group.nbytes
            self.issued = p + 1

    def _seek(self, index: int) -> int:
        """The position of the block asked for: the expected one in the common case; else the
        next time ``index`` comes (cyclic) or its place in the call order, and the ring
        restarts copying there.

        A cyclic call whose pass, once wrapped around, starts further on than the call
        order's first block runs only the blocks from there on in each pass: an
        encoder-decoder's ``generate`` runs the encoder once and the decoder for every token.
        The sequence becomes those blocks, so that the copies issued ahead at the end of a
        pass are the next pass's first blocks, not the encoder's. A block left out that is
        asked after all brings the whole sequence back."""
        p = self.used
        count = len(self.sequence)
        if count and self._group_at(p) == index and (self.cyclic or p < count):
            return p
        places = self._places.get(index)
        if places is None:
            self.sequence = self._whole
            self._index_sequence()
            count = len(self.sequence)
            places = self._places[index]
        if self.cyclic:
            ahead = min((where - p) % count for where in places)
            if ahead and p >= count and p % count == 0:
                self.sequence = self.sequence[ahead:]
                self._index_sequence()
                count = len(self.sequence)
                p = -(-p // count) * count  # a position of the new first block
            else:
                p = p + ahead
        else:
            p = next((where for where in places if where >= p), places[-1])
        # Copies issued from here on were for other blocks: issue again from p.
        self.issued = p
        return p

    def take_blocking(self, index: int) -> RingSlot:
        """The consumer (thread or loop) takes group ``index``: a held group's views, or the
        ring slot its copy goes to, after enqueuing the copies ahead. Never waits, except on
        the host for its copy where compute runs on the host."""
        if not self.active:
            raise CallAborted(f"{self.streamed.name}: the call ended")
        held = self.held.get(index)
        if held is not None:
            self.taken.add(index)
            self._current = -1
            return held
        p = self._seek(index)
        self.issue_ahead(p)
        slot = p % self.slots  # where issue_ahead put position p
        event = self.copied[slot]
        self.used = p + 1
        group = self.streamed.group(index)
        layout = self._layouts.get(index)
        if layout is None:
            layout = self._layouts[index] = _layout(group)
        key = (slot, layout)
        views = self._views.get(key)
        if views is None:
            assert self.buffers is not None
            views = self._views[key] = group.views(self.buffers[slot][: group.nbytes])
        self.taken.add(index)
        self._current = slot
        if self.host_wait:
            while not event.wait_blocking(_CLOSE_CHECK_S):
                if not self.manager.running:  # (its close may have dropped the copy)
                    raise CallAborted(f"{self.streamed.name}: the manager closed")
            return RingSlot(views)
        return RingSlot(views, event)

    async def take(self, index: int) -> RingSlot:
        """:meth:`take_blocking` for a consumer on the loop (never blocks there: the loop
        consumer enqueues its blocks on a stream)."""
        return self.take_blocking(index)

    def give_back_threadsafe(self, index: int, event: Any) -> bool:
        """The consumer is done with group ``index``; ``event`` completes after its readers
        (the next copy into its slot waits for it on the device). Returns whether it held
        ``index``."""
        if index not in self.taken:
            return False
        self.taken.discard(index)
        if index not in self.held and event is not None:
            self.readers[self._current] = event
        return True

    def give_back(self, index: int, event: Any) -> None:
        self.give_back_threadsafe(index, event)

    def reader_event(self, stream: Any, index: int | None = None) -> Any:
        """An event after the consumer thread's work so far, for the slot it holds (recorded
        into that slot's own event object: no new event per block); ``None`` for a group held
        for the whole call (its lease exits after the call's last kernel); done at once where
        compute runs on the host. ``index`` (the block's group) changes nothing here."""
        if self.host_wait:
            return _DONE
        slot = self._current
        if slot < 0:
            return None
        event = self.backend.device_event(stream, self._reader_events[slot])
        self._reader_events[slot] = event
        return event

    # ------------------------------------------------------------------ the end (loop)

    def start(self) -> None:
        """Nothing to start: :meth:`open` issued the first copies."""

    def pump(self) -> None:
        """Nothing to do on a state change (a release of the module's completing): the ring
        never waits for one once open."""

    def abort(self) -> None:
        """Stop: the consumer's next block raises :class:`CallAborted`."""
        with self._lock:
            self.active = False

    def finish(self) -> None:
        """End the call (loop, synchronous, after the consumer ended): exit the leases after
        the call's last kernel, release the groups not kept, and retire the ring once the
        device passed that kernel and the last copy."""
        self.abort()
        streamed = self.streamed
        backend = self.backend
        closed = not self.manager.running
        # Once the manager closed its backend's streams may be gone: no event, the leases'
        # ends change nothing, and the ring's buffer and reservation went with the manager.
        last = None if closed else backend.record_event(self.stream)
        leases, self.leases = self.leases, {}
        leased = set(leases)
        self.held.clear()
        for index, lease in leases.items():
            error = lease.exit_nowait(reader_events=[] if last is None else [last])
            if error is not None:
                self.failures.append(error)
            if index not in self.keep:
                streamed.release_replica(index)
        del leases
        for index, pending in self._started.items():
            # Begun by open() but never leased (the call ended while it waited): its
            # replica goes once it arrived, unless the module keeps it; drain waits for it.
            if not pending.done():
                streamed.settle_later(pending)
            if index not in self.keep and index not in leased:
                streamed.release_replica(index, pending)
            elif pending.done():
                if pending.exception() is not None:
                    self.keep.discard(index)  # it never arrived: nothing is kept
            else:
                pending.add_done_callback(functools.partial(_unkeep_if_failed, self.keep, index))
        for index in list(self.keep):
            # Planned to stay, but the call ended before it was brought (and no earlier
            # call's copy of it is arriving): not kept after all.
            if (
                index not in leased
                and index not in self._started
                and self._state_here(streamed.group(index)) is None
            ):
                self.keep.discard(index)
        self._started.clear()
        self._views.clear()
        if closed:
            self.buffers = None
            self.copied = []
            self.readers = []
            self.reservation = None
        if self.reservation is None or last is None:
            return
        waits = [last]
        if self._last_copy is not None:
            # Copies run in order on the copy stream: the last one enqueued covers them all.
            waits.append(self._last_copy)
            self._last_copy = None
        buffers, self.buffers = self.buffers, None
        assert buffers is not None
        idle = IdleRing(
            self.reservation, buffers, self.slots, self.stride, self.charge, self.readers
        )
        del buffers
        self.copied = []
        self.readers = []
        self._retire_later(idle, waits)

    def _retire_later(self, idle: IdleRing, events: list[Any]) -> None:
        """Free ``idle``'s buffer and end its reservation once the device passed ``events``,
        unless a later call adopted it first."""
        streamed = self.streamed
        streamed.rings[idle.name] = idle
        remaining = [len(events)]

        def passed(error: BaseException | None) -> None:
            del error  # the backend closed: the manager frees everything itself
            remaining[0] -= 1
            if remaining[0] or idle.adopted:
                return
            idle.buffers = None  # the last references: freed before the bytes leave the budget
            idle.readers = []
            streamed.rings.pop(idle.name, None)
            streamed.end_reservation(idle.name)
            idle.done.set()

        for event in events:
            self.backend.notify(event, passed)

    def __repr__(self) -> str:
        kind = "cyclic " if self.cyclic else ""
        return (
            f"<RingCall {kind}{self.streamed.name} slots={self.slots} issued={self.issued} "
            f"used={self.used}>"
        )
