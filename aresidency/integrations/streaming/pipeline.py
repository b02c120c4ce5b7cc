"""The per-call prefetch pipeline of a streamed module.

One :class:`CallPipeline` per call (a forward, or a whole ``generate``). It runs on the event
loop, without a task of its own: it advances when one of its own operations completes (a copy,
a release), when the consumer hands blocks back or asks for one, and, only while it is blocked
on something else (room in the budget another tenant holds, a copy still being issued), on the
manager's change signal. For each group of weights it keeps a :class:`Slot` that goes

``idle`` -> ``starting`` (materialization begun: charged, copy enqueued; or already resident)
-> ``ready`` (leased; its views made) -> ``returning`` -> back to ``idle`` once the consumer
handed it back (lease exited with the consumer's reader event; the device replica released in
the background, or kept resident).

The *consumer* runs the blocks: the event loop itself for an ``nn.Sequential``, or the worker
thread that runs the module's own forward (through forward hooks). Either way the common case
crosses no thread and awaits nothing: the consumer finds the slot ready (its copy already
issued, its lease already entered), makes its own stream wait for the copy on the device right
before the block's kernels, runs the block, records one event and hands the slot back. A thread
hands it back by appending to a queue, without waking the loop when one of the pipeline's own
operations is in flight (its completion wakes the loop, which then takes every block handed
back so far: their lease exits, their releases and the next prefetches in one batch). Only
when a slot is not ready does the consumer wait (a task parks on the slot; a thread blocks on
it, never the loop), and only then does a thread wake the loop itself.

Order: groups start in call order from the block expected next (the resident group first),
never out of order (a later block never takes an earlier one's room). The window covers the
next ``prefetch + 1`` blocks that need a copy; blocks already on the device (kept resident)
are leased as the window passes them but do not count, so copies run ahead over them. Before
the consumer has enqueued its first block the window is that one block, so that its kernels
are enqueued right behind its copy and not behind the Python work of issuing the prefetches.
A *cyclic* call (``generate``: one forward after the other over the same blocks) wraps around:
while the last blocks of a forward run, the first blocks of the next are being copied. Groups
in ``keep`` stay on the device after use ("budgets that remember": see
:meth:`~aresidency.integrations.streaming.module.StreamedModule.residency`).

When the budget has no room for the block the consumer waits for, the call gives up what it
holds and does not need now (a kept block it has run, or a block prefetched out of the
consumer's order) rather than wait on room that only it could free.

A block listed twice in ``blocks=`` is one group (one slot) that comes twice in the call
order: the window counts runs, and a group handed back that runs again within the window keeps
its replica for that run (released first if an earlier block finds no room).

No loop callback of the pipeline raises: one that fails stops the call with its error, and once
the manager closed every consumer raises ``ManagerClosedError``. While the pipeline waits for a
change that no callback of its own announces, the call's task waits on the manager's change
signal (:meth:`CallPipeline.park`), the one way to learn that the manager closed.

Why this module is long: the slot states, the window that advances them, the hand-back from
the consumer's thread and the giving up under a full budget are one state machine on the
loop; each part reads the state the others write, so they stay side by side.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

import anyio
import torch

from ...core.errors import ResidencyBudgetError
from ...core.locations import Location
from ...core.sizes import format_nbytes
from ...core.values import MaterializationState
from ...runtime.leases import Lease, LeaseWouldWait, current_task, current_task_ref
from ...runtime.pending import PendingOperation
from ...runtime.signal import ManagerClosedError
from .packing import TensorGroup
from .readroom import make_read_room

if TYPE_CHECKING:
    from .module import StreamedModule

__all__ = ["CallAborted", "CallPipeline", "Slot"]

_RESIDENT = MaterializationState.RESIDENT

_P = ParamSpec("_P")


def _loop_callback(
    method: Callable[Concatenate[CallPipeline, _P], None],
) -> Callable[Concatenate[CallPipeline, _P], None]:
    """A pipeline method the event loop calls back (a listener, a done callback, a callback a
    consumer thread scheduled): it never raises. An error there would escape into the event
    loop (asyncio logs it, trio dies of it) and leave every slot as it was, so that a consumer
    waiting for one would wait for ever: the call stops with it instead (the consumer raises
    it; :class:`ManagerClosedError` once the manager closed)."""

    def guarded(self: CallPipeline, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception as error:
            self.stop(error)

    guarded.__name__ = method.__name__
    guarded.__qualname__ = method.__qualname__
    guarded.__doc__ = method.__doc__
    return guarded


def _asking() -> None:
    """The placeholder of :meth:`CallPipeline._want_room` while ``want_room`` runs."""


class CallAborted(Exception):
    """The call ended (cancelled or failed elsewhere) while a consumer waited for a block."""


class Slot:
    """One group of weights in one call. The loop writes it; a consumer thread reads it only
    after ``flag`` is set (``ready`` or ``failed``), which orders the reads after the writes.
    A consumer thread clears ``flag`` when it hands the slot back, so that it never takes the
    same lease twice."""

    __slots__ = (
        "failure",
        "flag",
        "group",
        "lease",
        "pending",
        "ready_event",
        "refused",
        "state",
        "tensors",
        "waiter",
    )

    def __init__(self, group: TensorGroup) -> None:
        self.group = group
        self.state = "idle"  # idle -> starting -> ready (or failed) -> returning -> idle
        self.pending: PendingOperation | None = None  # None: it was resident already
        self.lease: Lease | None = None
        self.tensors: list[torch.Tensor] | None = None
        self.ready_event: Any = None  # what the consumer's stream waits for (None: data there)
        self.failure: BaseException | None = None
        self.flag = threading.Event()  # set while ready or failed (thread consumers)
        self.waiter: anyio.Event | None = None  # a loop consumer parked on this slot
        # The manager's last refusal of its copy (for a timeout's message: the room may have
        # been short where a checkpoint's group is read, not at the device).
        self.refused: ResidencyBudgetError | None = None

    def signal(self) -> None:
        self.flag.set()
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.set()

    def __repr__(self) -> str:
        return f"<Slot {self.group.name} {self.state}>"


def admitted(slot: Slot) -> bool:
    """Whether ``slot``'s group was admitted at the device (its copy charged and begun, or it
    was there already): what is left of a wait for it is not a wait for room. Read by a
    consumer thread too, without a lock: a state the loop wrote a moment ago is as good."""
    return slot.state in ("starting", "ready", "failed")


class CallPipeline:
    """The pipeline state of one call (see the module docstring).

    ``host_wait``: a slot is ready only once its copy completed (a consumer that computes on
    the host, the simulation's worker thread); otherwise once its copy is issued. ``cyclic``:
    the blocks run over and over (``generate``); the window wraps around.
    State (loop thread unless said): ``slots`` (group index -> slot), ``pos`` (the position of
    the block expected next: an index into the call order, counting on past its end when
    cyclic), ``window_open``, ``active``, ``failures`` (copy errors seen after their block
    ran), ``returned`` (groups handed back in this call), ``copies_in_flight`` (this call's
    materializations not complete yet; read by the consumer thread), ``taken`` (groups the
    consumer thread holds: that thread only), ``_returns`` (blocks handed back by the thread,
    not taken by the loop yet), ``_waiting`` (the ticket of the consumer thread's wait in
    progress, 0 if none: a request from the thread counts only while its wait lasts),
    ``error`` (why the call stopped early: the manager closed, or a fault in a loop callback
    of ours; every consumer raises it), ``_parked`` (the cancel scope of the call's task
    waiting in :meth:`park`: cancelled to wake it), ``_again`` (groups handed back whose
    replica stays for their next run, within the window: a block listed twice).
    ``pos`` counts runs, not groups: a block listed twice in ``blocks=`` is one group (one
    slot) that comes twice in the call order.
    Invariants: a slot is ready only while its lease is entered; a slot returns to idle only
    after its lease exited; groups start in order from ``pos``; while the consumer thread left
    blocks in ``_returns`` without waking the loop, an operation of ours is in flight (its
    completion takes them) or the thread will wake the loop when it next waits. Once every
    slot of a non-cyclic call is ready, the thread hands kept blocks back without an event or
    a wake-up at all: their leases exit at the call's end.
    """

    def __init__(
        self,
        streamed: StreamedModule,
        stream: Any,
        *,
        host_wait: bool,
        keep: set[int],
        cyclic: bool = False,
    ) -> None:
        self.streamed = streamed
        self.manager = streamed.manager
        self.bridge = streamed.manager.bridge  # consumer threads call back through it
        # The task awaiting the call (made there): what it keeps itself (a loader's batches
        # copied ahead) ends only when the call returns.
        self.task = current_task()
        self.task_ref = current_task_ref()
        # Set while the block the call needs next waits for room (want_room's release): the
        # tenants that could take that room first (a loader) hold back meanwhile.
        self._wanting: Callable[[], None] | None = None
        self._head_blocked = False
        # The wait for room of the block it needs next, registered with the manager (see
        # _waits_on_itself), and that block's index (-1: none).
        self._room_wait: contextlib.AbstractContextManager[None] | None = None
        self._room_wait_for = -1
        self.stream = stream
        self.host_wait = host_wait
        self.keep = keep
        self.cyclic = cyclic
        self.order = streamed.order
        self.slots: dict[int, Slot] = {g.index: Slot(g) for g in streamed.all_groups}
        self.pos = 0
        self.window_open = False
        self.active = True
        self.failures: list[BaseException] = []
        self.returned: set[int] = set()
        self.copies_in_flight = 0
        self.taken: set[int] = set()
        self._returns: deque[tuple[int, Any]] = deque()
        self._wake_lock = threading.Lock()
        self._wake_scheduled = False
        self._pumping = False
        self._pump_again = False
        self._window_asked = False  # the consumer thread asked the loop to open the window
        # Every slot was made ready in this (non-cyclic) call: set once by the loop, read by
        # the consumer thread, which then hands kept blocks back without waking the loop.
        self.all_ready = False
        self._made_ready = 0
        self._wait_ticket = 0  # consumer thread: numbers its waits for a slot not ready
        self._waiting = 0  # the ticket of the wait in progress (0: none; the loop reads it)
        self._waiting_for = -1  # the group index that wait is for (set before _waiting)
        # Groups handed back whose replica stays for their next run, within the window (a
        # block listed twice): idle, not released; leased again by _start.
        self._again: set[int] = set()
        self._unlisten: Callable[[], None] | None = None
        self.error: BaseException | None = None
        self._parked: anyio.CancelScope | None = None
        self._watching = False  # the parked task waits on the manager's change signal

    # ------------------------------------------------------------------ driving

    def start(self) -> None:
        """Start the first groups now."""
        self.pump()

    @_loop_callback
    def pump(self) -> None:
        """Take the blocks the consumer thread handed back, then start what the budget
        admits, in order, and make started slots ready. Synchronous and not re-entrant:
        starting a copy changes the state, which may notify, which may pump; that nested pump
        is folded into a further round of this one. Listens to the manager's change signal
        only while blocked on something no callback of ours announces. Never raises (see
        :func:`_loop_callback`); once the manager closed, it stops the call."""
        if not self.manager.running:
            self.stop(None)
            return
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        blocked = False
        try:
            while self.active:
                self._pump_again = False
                self._head_blocked = False
                if self._returns:
                    self._take_returns()
                blocked = self._advance()
                if not self._pump_again:
                    break
        finally:
            self._pumping = False
        self._want_room(self._head_blocked and self.active)
        if blocked and self.active:
            if self._unlisten is None:
                self._unlisten = self.manager.add_change_listener(self.pump)
                self.unpark()  # the call's task watches the manager from now on (see park)
        elif self._unlisten is not None:
            self._stop_listening()
            self.unpark()

    def _stop_listening(self) -> None:
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            unlisten()

    def stop(self, error: BaseException | None) -> None:
        """The call cannot go on: the manager closed (``error`` ``None``, or whatever a
        manager call raised because of it), or a loop callback of ours failed with ``error``.
        Every consumer waiting (or coming) raises :attr:`error`: a :class:`ManagerClosedError`
        naming the call once the manager closed (chained from ``error``), else ``error``.
        :meth:`finish` cleans up as for any call. Loop; never raises."""
        if self.error is None:
            if not self.manager.running:
                closed = ManagerClosedError(
                    f"{self.streamed.name}: the manager closed during the call, which cannot "
                    "go on (a block it needs cannot be brought to the device any more)"
                )
                closed.__cause__ = error
                self.error = closed
            else:
                self.error = error if error is not None else CallAborted("the call stopped")
        if not self.active:
            return
        self.abort()
        self._stop_listening()
        with contextlib.suppress(Exception):  # (a closed manager: nothing left to give back)
            self._want_room(False)
        self.unpark()

    def ended(self) -> BaseException:
        """What a consumer raises once the call stopped: the error that stopped it, else
        :class:`CallAborted` (cancelled, or finished)."""
        if self.error is not None:
            return self.error
        return CallAborted(f"{self.streamed.name}: the call ended")

    async def park(self, event: anyio.Event, deadline: float | None = None) -> None:
        """The call's task, on the loop, waits until ``event`` is set, ``deadline``
        (``anyio.current_time`` clock) passes, the call stops or the pipeline's state calls
        for a look (the caller checks its own condition again and parks again).

        While the pipeline listens to the manager's change signal (it waits for room another
        tenant holds, or a copy being issued: a change no callback of ours announces), the
        task waits on that signal instead. That is the one way to learn that the manager
        closed (``ManagerClosedError``): nothing else would call the pipeline back then, and
        the consumer would wait for ever. The call stops with it. Otherwise the pipeline's
        own callbacks (a copy, a release, a hand-back) move it, and find the manager closed
        if it did."""
        with anyio.CancelScope(deadline=math.inf if deadline is None else deadline) as scope:
            self._parked = scope
            self._watching = self._unlisten is not None and self.active
            try:
                if self._watching:
                    await self.manager.wait_for_change()
                else:
                    await event.wait()
            except ManagerClosedError as error:
                self.stop(error)
            finally:
                if self._parked is scope:
                    self._parked = None

    def unpark(self) -> None:
        """Wake the call's task waiting in :meth:`park` (loop)."""
        scope, self._parked = self._parked, None
        if scope is not None:
            scope.cancel()

    def _signal(self, slot: Slot) -> None:
        """``slot`` is ready or failed: wake its consumer (a task parked on the change signal
        instead of the slot's event too)."""
        slot.signal()
        if self._watching:
            self.unpark()

    def _advance(self) -> bool:
        """One round of :meth:`pump`; returns whether it is blocked waiting for a state
        change (room in the budget, a copy still being issued)."""
        streamed = self.streamed
        releasing = streamed.releasing
        resident = streamed.resident_group
        listen = False
        if resident is not None and resident.index not in self.returned:
            outcome = self._visit(self.slots[resident.index], releasing)
            if outcome == "stop" or outcome == "blocked":
                return outcome == "blocked"
            listen = outcome == "listen"
        order = self.order
        count = len(order)
        ahead = streamed.prefetch + 1 if self.window_open else 1
        stop = self.pos + count if self.cyclic else count
        copies = 0
        position = self.pos
        seen: set[int] = set()  # (a block run twice is one group: visited once a round)
        while position < stop and copies < ahead:
            index = order[position % count]
            position += 1
            if index in seen:
                continue
            seen.add(index)
            slot = self.slots[index]
            if index not in self.keep:
                copies += 1  # kept blocks are leased as the window passes but do not count
            outcome = self._visit(slot, releasing)
            if outcome == "stop" or outcome == "blocked":
                return listen or outcome == "blocked"
            listen = listen or outcome == "listen"
        return listen

    def _visit(self, slot: Slot, releasing: dict[int, PendingOperation]) -> str:
        """Start ``slot`` or make it ready. ``"next"``: go on to the next block; ``"listen"``:
        go on, but only a state change says when this one is ready (its copy is still being
        issued or loaded); ``"stop"``: stop here, a callback of ours pumps again;
        ``"blocked"``: stop here until a state change (no room in the budget)."""
        if slot.state == "idle":
            if slot.group.index in releasing:
                return "stop"  # its last release must finish first (_released pumps)
            if slot.group.index in self.streamed.cancelling:
                return "stop"  # an earlier call's copy of it is being cancelled (_cancelled pumps)
            started = self._start(slot)
            if started is False and (
                self._give_up_held(slot)
                or self.streamed.ask_others_for_room()
                or self._give_up_kept()
                or self._give_up_prefetched(slot)
            ):
                # The other streamed modules idle at this device gave up what they keep
                # between calls, or this call a block it holds and does not need now: a
                # release with no readers left has committed already (else its commit pumps).
                started = self._start(slot)
            if started is None:
                return "stop"  # failed: the consumer raises it
            if not started:
                if self._waits_on_itself(slot):
                    return "stop"  # failed: the consumer raises it
                return "blocked"  # no room: keep block order, wait for a change
        if slot.state == "starting" and not self._make_ready(slot):
            pending = slot.pending
            if self.host_wait and pending is not None and not pending.done():
                return "next"  # _materialized pumps when the copy completed
            return "listen"
        return "next"

    def _waits_on_itself(self, slot: Slot) -> bool:
        """``slot`` found no room: fail it (``ResidencyBudgetError``) if the call needs it
        next (the resident group, or the window's first block) and only what the call's task
        keeps itself stands in the way, which ends only when the call returns. Whether it
        failed."""
        group = slot.group
        if group is not self.streamed.resident_group:
            order = self.order
            if not order or order[self.pos % len(order)] != group.index:
                return False  # a prefetch: it waits for the blocks before it to leave
        error = self.manager.waiting_on_itself(
            group.charge_bytes,
            self.streamed.device,
            exempt=self.streamed.handles,
            what=f"{self.streamed.name}: {group.name} waits for room",
            task=self.task,
        )
        if error is None and self._room_wait_for != group.index:
            # A wait for room the call's task may hold some of (a pool request it is in):
            # registered while it lasts, refused at once if it closes a cycle of tasks
            # waiting for each other's room (hold and wait).
            self._end_room_wait()
            wait = self.manager.room_wait(
                group.charge_bytes,
                self.streamed.device,
                what=f"{self.streamed.name}: {group.name} ({format_nbytes(group.charge_bytes)})",
                task=self.task,
                exempt=self.streamed.unprotected_handles,
            )
            try:
                wait.__enter__()
            except ResidencyBudgetError as refused:
                error = refused
            else:
                self._room_wait, self._room_wait_for = wait, group.index
        if error is None:
            self._head_blocked = True
            # Idle cached data (a pool's models) may give the room back: asked after this
            # pump (its releases notify, which pumps again).
            need = group.charge_bytes
            device = self.streamed.device
            self.manager.bridge.call_soon_quietly(self._reclaim, device, need)
            return False
        self._fail(slot, error)
        return True

    def _end_room_wait(self) -> None:
        wait, self._room_wait, self._room_wait_for = self._room_wait, None, -1
        if wait is not None:
            wait.__exit__(None, None, None)

    @_loop_callback
    def _reclaim(self, device: Location, need: int) -> None:
        if self.manager.running and self._head_blocked:
            self.manager.reclaim_for(device, need)

    def _want_room(self, wanted: bool) -> None:
        """Say (or stop saying) that the call waits for room for the block it needs next.
        ``want_room`` notifies, which may pump again from inside it: that nested pump sees
        the placeholder, and if it stopped wanting meanwhile the token goes back at once."""
        if not wanted:
            self._end_room_wait()  # (the head block has room now, or the call ended)
        if wanted == (self._wanting is not None):
            return
        if not wanted:
            release, self._wanting = self._wanting, None
            if release is not None:
                release()
            return
        if not self.manager.running:
            return
        self._wanting = _asking
        release = self.manager.want_room(self.streamed.device)
        if self._wanting is _asking:
            self._wanting = release
        else:
            release()  # a nested pump stopped wanting meanwhile

    def _give_up_kept(self) -> bool:
        """No room for the next block: release one this call planned to keep that it has run
        already and holds no more (the room the plan left for the window was taken meanwhile,
        by another call in flight that may be waiting for room itself: this call must not
        wait on the room its own kept blocks hold). Whether one was."""
        streamed = self.streamed
        for index in sorted(self.returned, key=lambda i: streamed.position.get(i, -1)):
            slot = self.slots[index]
            if index not in self.keep or slot.state != "idle" or slot.lease is not None:
                continue
            if index in streamed.releasing or slot.group is streamed.resident_group:
                continue
            self.keep.discard(index)  # (the module's kept set: no longer kept)
            streamed.release_replica(index)
            return True
        return False

    def _give_up_prefetched(self, wanted: Slot) -> bool:
        """No room for ``wanted``, the block the consumer thread waits for: hand back one block
        started ahead of it that the consumer has not taken (a model that runs its blocks out
        of call order moved the window away from them; they hold the room ``wanted`` needs,
        and nothing else would free it). Only while the thread waits for ``wanted``: it takes
        no other block until ``wanted`` is ready, so none of these can be taken meanwhile.
        The block farthest in call order from ``pos`` goes first. Whether one was."""
        if not self._waiting or self._waiting_for != wanted.group.index:
            return False
        streamed = self.streamed
        count = len(self.order)
        candidates = [
            s
            for s in self.slots.values()
            if s is not wanted
            and s.state in ("starting", "ready")
            and s.group is not streamed.resident_group
            and s.group.index not in self.taken
            and s.group.index in streamed.position
        ]
        if not candidates:
            return False
        slot = max(candidates, key=lambda s: self._distance(s.group.index) % count)
        index = slot.group.index
        pending, slot.pending = slot.pending, None
        self.keep.discard(index)  # (the module's kept set: no longer kept)
        if slot.state == "ready":
            lease, slot.lease = slot.lease, None
            slot.tensors = None
            slot.ready_event = None
            slot.flag.clear()
            self._made_ready -= 1
            assert lease is not None
            error = lease.exit_nowait(reader_events=[])  # nothing read it
            del lease
            if error is not None:
                self.failures.append(error)
        slot.state = "idle"
        if pending is None or pending.done():
            streamed.release_replica(index, pending)
        else:
            streamed.cancel_copy(index, pending)
            pending.add_done_callback(self._release_if_arrived(index))
        return True

    def _distance(self, index: int) -> int:
        """How far ahead of ``pos`` group ``index`` runs next (see :meth:`_next_run`)."""
        at = self._next_run(index)
        return 0 if at is None else at - self.pos

    def _fits(self, group: TensorGroup) -> bool:
        """Whether the device budget has room for ``group`` now (a cheap look at the ledger
        before asking the manager, which would raise): a refusal costs nothing this way.
        A group that could never fit is let through, for the manager's error."""
        ledger = self.manager.state.find_ledger(self.streamed.device)
        if ledger is None or ledger.budget_bytes is None:
            return True
        charge = group.charge_bytes
        return charge > ledger.budget_bytes or ledger.charged_bytes + charge <= ledger.budget_bytes

    def _start(self, slot: Slot) -> bool | None:
        """Begin bringing ``slot``'s group to the device: ``True`` begun (or there already),
        ``False`` no room now, ``None`` failed (the slot carries the error)."""
        group = slot.group
        handle = group.handle
        assert handle is not None
        device = self.streamed.device
        value = self.manager.state.find_value(handle)
        here = None if value is None else value.materializations.get(device)
        if group.index in self._again:
            self._again.discard(group.index)
            if here is not None:
                # Held over from its run just before (see _give_back_one): leased again as
                # it is, after the copy that brought it (slot.pending, if any).
                slot.state = "starting"
                return True
        if here is not None and here.state is _RESIDENT:
            # Kept from an earlier call (or put there by someone else): lease it as it is.
            slot.pending = None
            slot.state = "starting"
            return True
        if here is None and not self._fits(group):
            slot.refused = None  # (short at the device)
            return False
        try:
            try:
                pending = self.manager.materialize_nowait(handle, device)
            except ResidencyBudgetError as error:
                # A checkpoint's group is read into pageable-host on its way: room there held
                # by values nobody needs now is evicted (as a decision would), then it is
                # tried once more; anything else that fills it ends on its own (a wait).
                if error.location == device or not make_read_room(self.manager, error):
                    raise
                pending = self.manager.materialize_nowait(handle, device)
        except ResidencyBudgetError as error:
            if error.budget_bytes is not None and error.requested_bytes > error.budget_bytes:
                self._fail(slot, error)  # it could never fit
                return None
            slot.refused = error
            return False
        except Exception as error:  # a ResidencyError, or the device's out-of-memory error
            # Raised here, in a loop callback's pump, it would escape into the event loop and
            # leave the slot idle: the call raises it when it reaches the block instead.
            self._fail(slot, error)
            return None
        slot.pending = pending
        slot.state = "starting"
        slot.refused = None
        self.streamed.copies += 1
        self.streamed.copied_bytes += group.nbytes
        counted = not pending.done()
        if counted:
            self.copies_in_flight += 1
        pending.add_done_callback(functools.partial(self._materialized, slot, counted))
        if not self.host_wait and counted and not self.manager.copy_issued(handle, device):
            # A staged copy takes a while to issue: look again once it is.
            self.manager.when_copy_issued(handle, device, self.pump)
        return True

    def _make_ready(self, slot: Slot) -> bool:
        """Enter ``slot``'s lease if that needs no wait: ``True`` once ready (or failed)."""
        pending = slot.pending
        if self.host_wait and pending is not None and not pending.done():
            return False
        group = slot.group
        assert group.handle is not None
        device = self.streamed.device
        if not self.manager.copy_issued(group.handle, device):
            return False  # pumped again once it is (or once the load put its data there)
        try:
            lease = self.manager.acquire(
                group.handle,
                device,
                stream=self.stream,
                order_stream=False,
                on_behalf_of=self.task_ref,  # (entered in a pump: a loop callback, often)
            )
            lease.enter_nowait()
        except LeaseWouldWait:
            return False
        except Exception as error:  # a ResidencyError, or a fault of ours: the consumer raises it
            self._fail(slot, error)
            return True
        slot.lease = lease
        slot.tensors = group.views(lease.tensor)
        slot.ready_event = lease.ready_event
        slot.state = "ready"
        self._made_ready += 1
        if not self.cyclic and self._made_ready == len(self.slots):
            self.all_ready = True
        self._signal(slot)
        return True

    @_loop_callback
    def _materialized(self, slot: Slot, counted: bool, pending: PendingOperation) -> None:
        # Counted down before the returns are taken (in pump): a consumer thread that saw it
        # above zero and did not wake the loop has its returns taken here.
        if counted:
            self.copies_in_flight -= 1
        error = pending.exception()
        if error is not None:
            if slot.state == "starting" and slot.pending is pending:
                self._fail(slot, error)
            elif slot.pending is pending:
                # Its block may have run already (CUDA): the call (or drain) reports it.
                self.failures.append(error)
        if self.active and (slot.state == "starting" or self._returns or not self.manager.running):
            self.pump()

    def _fail(self, slot: Slot, error: BaseException) -> None:
        slot.failure = error
        slot.state = "failed"
        self._signal(slot)

    @_loop_callback
    def open_window(self) -> None:
        """Prefetch from now on (the first block is on its way), and start what fits."""
        if not self.window_open:
            self.window_open = True
            self.pump()

    @_loop_callback
    def _request(self, index: int) -> None:
        """The consumer asks for group ``index`` next (loop): the window moves there."""
        if self._returns:
            self._take_returns()
        at = self._next_run(index)
        if at is not None:
            self.pos = at
        self.pump()

    def _next_run(self, index: int) -> int | None:
        """The position of group ``index``'s next run from ``pos`` on (a block listed twice
        has several): counting on past the end of the call order in a cyclic call; in
        another, its last position when it runs no more after ``pos`` (a block the forward
        runs once more than listed). ``None`` for a group outside the call order."""
        places = self.streamed.positions.get(index)
        if not places:
            return None
        pos = self.pos
        if self.cyclic:
            count = len(self.order)
            return pos + min((place - pos) % count for place in places)
        for place in places:
            if place >= pos:
                return place
        return places[-1]

    def _runs_soon(self, index: int) -> bool:
        """Whether group ``index`` runs again within the window from ``pos`` on (the next
        ``prefetch + 1`` runs: what the budget leaves room for beside the call's tensors
        outside the blocks)."""
        places = self.streamed.positions.get(index)
        if not places or (len(places) == 1 and not self.cyclic):
            return False  # runs once per forward: not again in this one
        at = self._next_run(index)
        if at is None or at < self.pos:
            return False
        return at - self.pos <= self.streamed.prefetch

    def _give_up_held(self, wanted: Slot) -> bool:
        """No room for ``wanted``: release the replica of a group held over for a run that
        comes after ``wanted``'s (the farthest first), so that a later block never keeps an
        earlier one's room. Whether one was."""
        count = len(self.order)

        def ahead(index: int) -> int:  # (a group that runs no more after pos: farthest)
            distance = self._distance(index)
            return distance if distance >= 0 else count

        mine = ahead(wanted.group.index)
        later = [i for i in self._again if i != wanted.group.index and ahead(i) > mine]
        if not later:
            return False
        index = max(later, key=ahead)
        self._again.discard(index)
        self.streamed.release_replica(index, self.slots[index].pending)
        return True

    # ------------------------------------------------------------------ consumers

    async def take(self, index: int) -> Slot:
        """The loop consumer's access to group ``index``: returns once it is ready (at once in
        the common case), raising its failure, the error that stopped the call (such as
        ``ManagerClosedError``) or ``TimeoutError`` (it waited that long for room: the wait
        for its copy once admitted is not counted)."""
        slot = self.slots[index]
        if slot.state != "ready":
            self._request(index)
        deadline = self.streamed.deadline()
        while slot.state not in ("ready", "failed"):
            if not self.active:
                raise self.ended()
            self.open_window()  # about to wait: let the prefetches use the time
            if slot.state in ("ready", "failed") or not self.active:
                continue
            waiter = slot.waiter = slot.waiter or anyio.Event()
            await self.park(waiter, deadline)
            if (
                deadline is not None
                and slot.state not in ("ready", "failed")
                and anyio.current_time() >= deadline
            ):
                if not admitted(slot):
                    raise TimeoutError(
                        self.streamed.timeout_message(
                            slot.group, slot.group.charge_bytes, slot.refused
                        )
                    )
                deadline = None  # admitted: what is left is its copy, which is not timed
        if slot.state == "failed":
            assert slot.failure is not None
            raise slot.failure
        return slot

    def give_back(self, index: int, event: Any) -> None:
        """The loop consumer is done with group ``index``; ``event`` completes after its last
        reader. Exits the lease, releases (or keeps) the replica, starts what is next."""
        self._give_back_one(index, event)
        if not self.window_open:
            self.window_open = True
        self.pump()

    def take_blocking(self, index: int) -> Slot:
        """A consumer thread's access to group ``index``: returns the ready slot at once in the
        common case (no thread crossing); otherwise asks the loop for it and blocks this thread
        (never the loop) until it is ready. Raises its failure, :class:`CallAborted` or
        ``TimeoutError``."""
        if not self.active:
            raise self.ended()
        slot = self.slots[index]
        if not slot.flag.is_set():
            # The request may reach the loop after a pump made the slot ready and the block
            # ran: the ticket tells the loop it is stale then (moving the window back to a
            # block already run would copy it again).
            self._wait_ticket += 1
            ticket = self._wait_ticket
            self._waiting_for = index
            self._waiting = ticket
            self.bridge.call_soon(self._request_from_thread, index, ticket)
            try:
                timeout = self.streamed.timeout
                if not slot.flag.wait(timeout) and timeout is not None:
                    # Only the wait for room is timed: once the loop admitted the block (its
                    # copy charged and begun), its copy may take what it takes.
                    if not admitted(slot):
                        raise TimeoutError(
                            self.streamed.timeout_message(
                                slot.group, slot.group.charge_bytes, slot.refused
                            )
                        )
                    slot.flag.wait()
            finally:
                self._waiting = 0
        elif not self._window_asked:
            # The first block is on its way to the compute stream: prefetch from now on
            # (nothing left to prefetch once every slot is ready).
            self._window_asked = True
            if not self.all_ready:
                self.bridge.call_soon(self.open_window)
        if not self.active:
            raise self.ended()
        if slot.state == "failed":
            assert slot.failure is not None
            raise slot.failure
        self.taken.add(index)
        return slot

    def reader_event(self, stream: Any, index: int | None = None) -> Any:
        """An event after the consumer thread's work so far, reaped with the lease it exits
        (compute on the host: done now); ``None`` for block ``index`` once every slot is
        ready and the block is kept: nothing waits for it before the call's end, which exits
        its lease with one event after the call's last kernel (see :meth:`finish`)."""
        if index is not None and self.all_ready and index in self.keep:
            return None
        return self.manager.backend.record_event(None if self.streamed.host_compute else stream)

    @_loop_callback
    def _request_from_thread(self, index: int, ticket: int) -> None:
        if self.active and self._waiting == ticket:  # the thread still waits for it
            self.window_open = True  # the consumer waits: let the prefetches use the time
            self._request(index)

    def give_back_threadsafe(self, index: int, event: Any) -> bool:
        """:meth:`give_back` from the consumer thread: queued for the loop, which is woken only
        if no operation of ours is in flight (whose completion would take it anyway). Returns
        whether the thread held ``index`` (a block whose take failed holds nothing)."""
        if index not in self.taken:
            return False
        self.taken.discard(index)
        if event is None:
            # Every slot ready and the block kept (reader_event): nothing for the loop to do
            # now; the call's end exits the lease (finish). A forward on a kept model then
            # records one event and wakes the loop once, not once per block. The slot stays
            # ready: a block run again in this call takes the same lease.
            return True
        self.slots[index].flag.clear()  # never take this lease again
        self._returns.append((index, event))
        if self.copies_in_flight or self.streamed.releasing:
            return True
        with self._wake_lock:
            if self._wake_scheduled:
                return True
            self._wake_scheduled = True
        self.bridge.call_soon(self._woken)
        return True

    @_loop_callback
    def _woken(self) -> None:
        with self._wake_lock:
            self._wake_scheduled = False
        self.pump()

    def _take_returns(self) -> None:
        """Take every block the consumer thread handed back (loop): their lease exits and
        releases in one batch; the caller pumps once after."""
        returns = self._returns
        while returns:
            index, event = returns.popleft()
            self._give_back_one(index, event)

    def _give_back_one(self, index: int, event: Any) -> None:
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
        del lease  # a release may free the replica right away: hold nothing of it
        if error is not None:
            self.failures.append(error)
        at = self._next_run(index)  # the run just done: the next one at or after pos
        if at is not None and (self.cyclic or at + 1 > self.pos):
            self.pos = at + 1
        if index not in self.keep:
            if self._runs_soon(index):
                # A block listed twice, run again within the window: its replica stays for
                # that run (no release and copy in between); _start leases it again, and
                # an earlier block that finds no room takes it first (_give_up_held).
                self._again.add(index)
            else:
                self.streamed.release_replica(index, slot.pending)
        slot.state = "idle"

    # ------------------------------------------------------------------ the end

    def abort(self) -> None:
        """Stop: waiting consumers (tasks and threads) raise :class:`CallAborted` (or the
        error that stopped the call: :meth:`ended`)."""
        self.active = False
        for slot in self.slots.values():
            slot.signal()

    def finish(self) -> None:
        """End the call (loop, synchronous): take what the consumer handed back, hand back
        what it still holds (with an event on the compute stream, after anything it may have
        enqueued), release every replica not kept, cancel copies nobody needs any more."""
        self._take_returns()
        self.abort()
        self._stop_listening()
        self._want_room(False)
        backend = self.manager.backend
        streamed = self.streamed
        # One event after everything the consumer enqueued, for every lease: none once the
        # manager closed (its backend's streams may be gone; the leases' ends change nothing).
        end: list[Any] | None = None if self.manager.running else []
        for index, slot in self.slots.items():
            kept = index in self.keep
            if slot.lease is not None:
                lease, slot.lease = slot.lease, None
                slot.tensors = None
                if end is None:  # compute on the host: the consumer is done by now
                    end = [backend.record_event(None if streamed.host_compute else self.stream)]
                error = lease.exit_nowait(reader_events=end)
                del lease
                if error is not None:
                    self.failures.append(error)
                if not kept:
                    streamed.release_replica(index, slot.pending)
            elif slot.state == "starting":
                pending = slot.pending
                if pending is None:
                    if not kept:
                        streamed.release_replica(index)  # resident at the start, unused
                elif pending.done():
                    if pending.exception() is not None:
                        self.keep.discard(index)  # nothing arrived: nothing is kept
                    elif not kept:
                        streamed.release_replica(index)
                else:
                    streamed.cancel_copy(index, pending)
                    pending.add_done_callback(self._release_if_arrived(index))
            elif slot.state == "failed" and not kept:
                # Its lease could not be entered (its copy may have landed, or it was there
                # already): its replica goes like any other (nothing, if none came).
                streamed.release_replica(index, slot.pending)
            elif index in self._again and not kept:
                streamed.release_replica(index, slot.pending)  # held over for a run not come
            self._again.discard(index)
            slot.state = "idle"
            slot.flag.clear()

    def _release_if_arrived(self, index: int) -> Callable[[PendingOperation], None]:
        def release(pending: PendingOperation) -> None:
            if pending.exception() is not None:
                self.keep.discard(index)  # nothing arrived: nothing is kept
            elif index not in self.keep:
                self.streamed.release_replica(index)

        return release

    def __repr__(self) -> str:
        states: dict[str, int] = {}
        for slot in self.slots.values():
            states[slot.state] = states.get(slot.state, 0) + 1
        kind = "cyclic " if self.cyclic else ""
        return f"<CallPipeline {kind}{self.streamed.name} pos={self.pos} {states}>"
