"""Leases (active uses) and holds (protection without use).

A :class:`Lease` is made by ``manager.acquire(handle, location, stream=..., mode=...)``; a
:class:`Hold` by ``manager.hold(handle, location)``. Both work on the manager's
:class:`~aresidency.runtime.context.Runtime` and never place a value.

Each active lease and hold is listed with the task that entered it (:class:`LeaseOwners`, one
table per runtime), so that a ``ResidencyInUseError`` can name who protects the
materialization (:func:`add_owners`) and a dump can list them.

Why this module is long: leases and holds are the two kinds of protection and share one
owners table and one notion of the owning task (``TaskRef``); the lease's entry and exit
(waiting for the copy, ordering streams, recording reader events, a write lease invalidating
the other replicas) are one state machine that the streaming pipeline also drives without
awaiting (``enter_nowait``, ``exit_nowait``).
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import anyio.lowlevel
import torch

from ..core.errors import ResidencyInUseError, ResidencyUnavailableError
from ..core.locations import Location
from ..core.values import Materialization, ValueHandle
from .payloads import Payload
from .signal import ManagerClosedError, refuse_copy

if TYPE_CHECKING:
    from .context import Runtime

__all__ = [
    "Hold",
    "Lease",
    "LeaseOwners",
    "LeaseWouldWait",
    "TaskRef",
    "add_owners",
    "current_task",
    "current_task_ref",
    "lease_owners",
]

#: The owner recorded when a lease or hold is entered outside any task (a loop callback).
NO_TASK = "(no task: a loop callback)"


def current_owner() -> str:
    """The name of the task running now, or :data:`NO_TASK` in a loop callback (a copy's
    completion enters leases from one). About a microsecond: cheap enough for every lease.

    On asyncio it asks asyncio itself: within a callback there is no current task, and
    ``anyio.get_current_task()`` then raises ``RuntimeError`` in recent anyio releases but
    ``TypeError`` in earlier 4.x ones (it builds the task's info from ``None``), which once
    escaped into the copy's completion and left a streamed call waiting forever."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop running here: trio, or no loop at all
        try:
            return anyio.get_current_task().name or NO_TASK
        except RuntimeError:
            return NO_TASK
    return NO_TASK if task is None else task.get_name() or NO_TASK


def current_task() -> object | None:
    """The task running now (asyncio's or trio's), or ``None`` in a loop callback: what
    :meth:`LeaseOwners.task_protects` counts by."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no asyncio loop running here: trio, or no loop at all
        pass
    try:
        import trio

        return trio.lowlevel.current_task()
    except (ImportError, RuntimeError):
        return None


@dataclass(frozen=True, slots=True)
class TaskRef:
    """A task as a hold records it: its ``name`` (for reports) and the ``task`` itself (what
    admission counts by), taken in that task by :func:`current_task_ref`, so that a tenant
    may take a hold on its behalf from a loop callback (a copy's completion)."""

    name: str
    task: object | None


def current_task_ref() -> TaskRef:
    """The task running now, as a hold records it (see :class:`TaskRef`)."""
    return TaskRef(current_owner(), current_task())


class LeaseOwners:
    """Who holds the active leases and holds of one runtime (loop thread only).

    State: ``_entries``: ``(handle, location)`` -> ``[(kind, task name), ...]``, one entry per
    active lease (``kind`` ``"read lease"`` or ``"write lease"``) or hold (``"hold"``), in
    entry order. Invariant: a materialization's list has ``use_count + hold_count`` entries
    (what leases and holds made through the runtime added); empty lists are dropped. One list
    append and one removal per lease: cheap on the lease hot path. ``_tasks``: task object ->
    ``[(handle, location, lease), ...]``, what each task protects (``lease``: a lease, else a
    hold; admission's self-wait check reads it).
    """

    __slots__ = ("_entries", "_tasks")

    def __init__(self) -> None:
        self._entries: dict[tuple[ValueHandle, Location], list[tuple[str, str]]] = {}
        # task -> the materializations it holds leases and holds on, one entry each, and
        # whether that is a lease (the task object is kept only while it protects something)
        self._tasks: dict[object, list[tuple[ValueHandle, Location, bool]]] = {}

    def add_task(
        self, task: object | None, handle: ValueHandle, location: Location, *, lease: bool
    ) -> None:
        if task is not None:
            self._tasks.setdefault(task, []).append((handle, location, lease))

    def remove_task(
        self, task: object | None, handle: ValueHandle, location: Location, *, lease: bool
    ) -> None:
        keys = self._tasks.get(task) if task is not None else None
        if keys is None:
            return
        try:
            keys.remove((handle, location, lease))
        except ValueError:
            return
        if not keys:
            del self._tasks[task]

    def task_protects(self, task: object | None) -> bool:
        """Whether ``task`` holds an active lease or hold of this runtime."""
        return task is not None and task in self._tasks

    def protected_by(self, task: object | None) -> tuple[tuple[ValueHandle, Location], ...]:
        """The materializations ``task`` holds leases or holds on (one per lease or hold)."""
        return () if task is None else tuple((h, loc) for h, loc, _ in self._tasks.get(task, ()))

    def leased_by(self, task: object | None) -> tuple[tuple[ValueHandle, Location], ...]:
        """The materializations ``task`` holds leases on (one per lease; its holds left out)."""
        if task is None:
            return ()
        return tuple((h, loc) for h, loc, lease in self._tasks.get(task, ()) if lease)

    def add(self, handle: ValueHandle, location: Location, kind: str, owner: str) -> None:
        self._entries.setdefault((handle, location), []).append((kind, owner))

    def remove(self, handle: ValueHandle, location: Location, kind: str, owner: str) -> None:
        key = (handle, location)
        entries = self._entries.get(key)
        if entries is None:
            return
        try:
            entries.remove((kind, owner))
        except ValueError:
            return
        if not entries:
            del self._entries[key]

    def of(self, handle: ValueHandle, location: Location) -> tuple[str, ...]:
        """The names of the tasks holding leases and holds on the materialization."""
        return tuple(owner for _, owner in self._entries.get((handle, location), ()))

    def entries(self) -> list[tuple[ValueHandle, Location, str, str]]:
        """Every active lease and hold as ``(handle, location, kind, task name)``."""
        return [
            (handle, location, kind, owner)
            for (handle, location), entries in self._entries.items()
            for kind, owner in entries
        ]

    def __repr__(self) -> str:
        count = sum(len(entries) for entries in self._entries.values())
        return f"<LeaseOwners [{count} leases and holds on {len(self._entries)} materializations]>"


# One table per runtime, kept beside it (not on it) and gone with it.
_TABLES: weakref.WeakKeyDictionary[Any, LeaseOwners] = weakref.WeakKeyDictionary()


def lease_owners(runtime: Runtime) -> LeaseOwners:
    """The owners table of ``runtime`` (made on first use)."""
    table = _TABLES.get(runtime)
    if table is None:
        table = _TABLES[runtime] = LeaseOwners()
    return table


def add_owners(runtime: Runtime, error: BaseException) -> None:
    """If ``error`` is a ``ResidencyInUseError`` that names no owners yet, name the tasks
    holding leases and holds on its materialization (in place; cheap: one lookup)."""
    if isinstance(error, ResidencyInUseError) and not error.owners:
        table = _TABLES.get(runtime)
        if table is not None and isinstance(error.handle, ValueHandle):
            owners = table.of(error.handle, error.location)
            if owners:
                error.with_owners(owners)


class LeaseWouldWait(Exception):
    """:meth:`Lease.enter_nowait` could not enter without waiting (the data is still being
    loaded, a staged copy is still being issued, or a host reader must wait for its copy)."""


class Lease:
    """An active use of one materialization: ``async with manager.acquire(h, loc) as lease``.

    Entering never places a value (a missing materialization is ``ResidencyUnavailableError``).
    For a ``cuda`` location the lease's stream (``stream=``, default the device's current
    stream) is made to wait *on the device* for the transfer that brought the value there, so
    the host never waits: kernels the body enqueues on that stream see the data. For a host
    location the host awaits (without blocking the loop) any transfer still writing it. A write
    lease also orders its stream after the consumers recorded by earlier leases.

    Exiting records an event on every reader stream (the lease's own and each one given to
    :meth:`register_stream`); the materialization keeps ``pending_event_count`` until the
    reaper sees them complete, so it cannot be removed while a kernel may still read it. The
    use ends whatever happens while recording. If the lease was entered on an incoming copy,
    exiting then waits for that copy (without blocking the loop) and raises
    ``ResidencyUnavailableError`` if it failed: what the body read was not the value. Entered
    before any data exists there (a load from the source still running, a copy its phase has
    not issued yet), it waits for the data, and raises ``ResidencyUnavailableError`` instead
    once that will not come (the load or copy failed, or was given up and the materialization
    dropped: a later copy there is a new one, which this lease never counts down).

    For pipelines whose consumer runs on another thread (weight streaming), a lease can also
    be entered without ordering any stream (``order_stream=False``: the consumer makes its own
    stream wait for :attr:`ready_event` right before its kernels, as a stream wait enqueued
    from another thread could land between earlier kernels) and exited with reader events the
    consumer recorded itself (``exit_nowait(reader_events=...)``).

    Exited after the manager closed (a task outliving the manager's block), the use ends
    without touching the closed backend or the final state and ``ManagerClosedError`` is
    raised (returned by :meth:`exit_nowait`).

    State: ``handle``, ``location``, ``mode``, ``stream``, ``tensor`` (while entered),
    ``ready_event`` (what a stream must wait for before reading, ``None`` once the data is
    there), ``status`` (``new`` -> ``entered`` -> ``exited``).
    """

    def __init__(
        self,
        runtime: Runtime,
        handle: ValueHandle,
        location: Location,
        *,
        stream: Any = None,
        mode: str = "read",
        order_stream: bool = True,
        on_behalf_of: TaskRef | None = None,
    ) -> None:
        if mode not in ("read", "write"):
            raise ValueError(f"lease mode must be 'read' or 'write', got {mode!r}")
        if on_behalf_of is not None and not isinstance(on_behalf_of, TaskRef):
            raise TypeError(
                f"on_behalf_of must be a TaskRef (current_task_ref()), got {on_behalf_of!r}"
            )
        self._rt = runtime
        self._on_behalf_of = on_behalf_of
        self.order_stream = order_stream
        self.ready_event: Any = None
        self.handle = handle
        self.location = location
        self.mode = mode
        if stream is None and location.is_cuda:
            stream = runtime.backend.current_stream(location)
        else:
            runtime.backend.check_stream(stream, location)
        self.stream = stream
        self._streams: list[Any] = [] if stream is None else [stream]
        self._tensor: torch.Tensor | None = None
        self._payload: Payload | None = None
        self._mat: Materialization | None = None  # what the use counts on (set at entry)
        self.owner: str | None = None  # the task that entered it (set at entry)
        self._task: object | None = None  # that task itself, while the lease is active
        self.status = "new"

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("the lease's tensor is available only inside 'async with'")
        return self._tensor

    def register_stream(self, stream: Any) -> None:
        """Also record a reader event on ``stream`` when the lease exits (a stream other than the
        lease's own that reads the tensor). Registering a stream twice records it once. A
        stream of another device, or not a stream, is refused here rather than at exit. Loop
        thread: from another thread it raises ``RuntimeError`` and registers nothing."""
        self._rt.check_loop_thread()
        if self.status == "exited":
            raise RuntimeError("register_stream after the lease exited protects nothing")
        if stream is None:
            raise ValueError("register_stream needs a stream")
        self._rt.backend.check_stream(stream, self.location)
        if all(stream is not s for s in self._streams):
            self._streams.append(stream)

    # ------------------------------------------------------------------ entry

    def _begin(self) -> Payload | None:
        if self.status != "new":
            raise RuntimeError("a lease is single use; call manager.acquire again")
        rt = self._rt
        rt.check_thread()
        ref = self._on_behalf_of
        # before the state changes: nothing after it may fail
        owner = current_owner() if ref is None else ref.name
        try:
            self._mat = rt.state.lease(self.handle, self.location, self.mode)
        except ResidencyInUseError as error:
            add_owners(rt, error)
            raise
        self.owner = owner
        table = lease_owners(rt)
        table.add(self.handle, self.location, self._kind, owner)
        self._task = current_task() if ref is None else ref.task
        table.add_task(self._task, self.handle, self.location, lease=True)
        self.status = "entering"
        rt.settle()  # a write lease may have invalidated other replicas
        return rt.payloads.get(self.handle, self.location)

    @property
    def _kind(self) -> str:
        return f"{self.mode} lease"

    def _ready(self, payload: Payload) -> bool:
        """Whether the lease can be entered now without waiting."""
        transfer = payload.transfer
        if transfer is None:
            return True
        if self.location.is_cuda:
            return transfer.issued()
        return transfer.query()

    def _complete_entry(self, payload: Payload) -> None:
        if payload.aborting:
            raise ResidencyUnavailableError(
                self.handle,
                self.location,
                "the transfer bringing it there is being cancelled; materialize it again",
            )
        if payload.failure is not None:
            raise self._fill_failed(payload.failure) from payload.failure
        backend = self._rt.backend
        transfer = payload.transfer
        self.ready_event = None if transfer is None else transfer.event
        if not self.order_stream:
            pass  # the consumer waits for ready_event itself
        elif self.location.is_cuda:
            if transfer is not None:
                assert transfer.event is not None
                backend.stream_wait(self.stream, transfer.event)
            if self.mode == "write":  # after the earlier readers' (and writers') kernels
                for event in payload.readers:
                    backend.stream_wait(self.stream, event)
        self._payload = payload
        self._tensor = payload.tensor
        self.status = "entered"

    def enter_nowait(self) -> Lease:
        """Enter now, synchronously, when no wait is needed (the copy is issued, or for a host
        location complete); else raise :class:`LeaseWouldWait`, changing nothing. The weight
        streaming pipeline enters its leases this way."""
        payload = self._rt.payloads.get(self.handle, self.location)
        if payload is None or not self._ready(payload):
            self._rt.state.materialization(self.handle, self.location)  # a clear error first
            raise LeaseWouldWait(f"{self.handle} at {self.location} is not ready yet")
        payload = self._begin()
        try:
            if payload is None:  # pragma: no cover - checked just above, on the same loop step
                raise LeaseWouldWait(f"{self.handle} at {self.location} is not ready yet")
            self._complete_entry(payload)
        except BaseException:
            self._abandon()
            raise
        return self

    async def __aenter__(self) -> Lease:
        # A checkpoint, entering and leaving (as trio's async context managers are): a caller
        # already cancelled enters nothing; __aexit__ lets the loop run once the use ended.
        await self._rt.checkpoint_if_cancelled()
        if self.mode == "write":
            await self._wait_for_other_replicas_readers()
        payload = self._begin()
        rt = self._rt
        try:
            while payload is None:  # a load from the source (or a copy) is not issued yet
                self._check_filling()
                await rt.signal.wait()
                payload = rt.payloads.get(self.handle, self.location)
            self._check_filling()  # (the data of a later copy there is not this lease's)
            transfer = payload.transfer
            if transfer is not None and not self._ready(payload):
                if self.location.is_cuda:
                    await transfer.wait_issued()
                else:
                    await rt.backend.wait(transfer)
                    if payload.failure is None and transfer.query():
                        payload.failure = transfer.outcome()
            self._complete_entry(payload)
        except BaseException:
            self._abandon()
            raise
        return self

    async def _wait_for_other_replicas_readers(self) -> None:
        """A write lease invalidates the other replicas: while reader events still pending
        (they always complete) are all that keeps one, wait, as ``release`` does. A lease or
        hold on one is left to :meth:`_begin`, which refuses it (``ResidencyInUseError``)."""
        rt = self._rt
        while (value := rt.state.find_value(self.handle)) is not None:
            others = [m for loc, m in value.materializations.items() if loc != self.location]
            if any(m.use_count or m.hold_count for m in others):
                return
            if not any(m.pending_event_count for m in others):
                return
            await rt.signal.wait()

    def _check_filling(self) -> None:
        """Raise ``ResidencyUnavailableError`` if the materialization this lease counts on,
        entered before its data existed, will never get it: the copy or load filling it
        failed (it is aborted once this lease ends), or was given up and the materialization
        dropped (a copy that came there later made a new one, which is not this lease's)."""
        mat = self._mat
        assert mat is not None
        if not self._rt.state.is_current(self.handle, self.location, mat):
            raise ResidencyUnavailableError(
                self.handle,
                self.location,
                "the copy that was bringing it there was given up (cancelled, or it failed) "
                "before its data existed; materialize it again",
            )
        if mat.fill_failure is not None:
            raise self._fill_failed(mat.fill_failure) from mat.fill_failure

    def _fill_failed(self, failure: BaseException) -> ResidencyUnavailableError:
        """The error for a lease whose data's transfer or load failed with ``failure``."""
        return ResidencyUnavailableError(
            self.handle, self.location, f"the transfer bringing it there failed: {failure}"
        )

    def _abandon(self) -> None:
        """End a use whose entry failed (nothing was handed out, so no reader to record)."""
        self.status = "exited"
        if self._rt.frozen:
            return  # the manager closed meanwhile: its state is final
        self._rt.state.unlease(self.handle, self.location, self.mode, self._mat)
        self._forget_owner()
        self._rt.settle()

    def _forget_owner(self) -> None:
        if self.owner is not None:
            table = lease_owners(self._rt)
            table.remove(self.handle, self.location, self._kind, self.owner)
            table.remove_task(self._task, self.handle, self.location, lease=True)
            self._task = None

    # ------------------------------------------------------------------ exit

    def exit_nowait(self, reader_events: Any = None) -> BaseException | None:
        """End the use now, synchronously: record the reader events (on the lease's streams,
        or use ``reader_events`` recorded by the consumer itself) and end the lease, whatever
        fails while recording (that error is returned, the use ends anyway). Returns ``None``
        when nothing went wrong. Does not wait for an incoming copy: see :meth:`failure`."""
        if self.status != "entered":
            raise RuntimeError(f"the lease is {self.status}, not entered")
        self._rt.check_loop_thread()  # before anything changes: the state is the loop's
        self.status = "exited"
        self._tensor = None
        rt = self._rt
        if rt.frozen:  # the manager closed during the use: its state (and backend) are final
            self._payload = None
            return ManagerClosedError(
                f"the manager closed while the {self._kind} on {self.handle} at "
                f"{self.location} was active; the state is final, so its end changed nothing"
            )
        payload = self._payload
        if payload is not None and payload.transfer is None and payload.failure is None:
            # Nothing left to report (the data was there): an exited lease must not keep the
            # payload's tensor alive once the materialization is released.
            self._payload = None
        del payload
        error: BaseException | None = None
        events: list[Any] = []
        try:
            if reader_events is not None:
                events = [e for e in reader_events if not e.query()]
            else:
                events = [rt.backend.record_event(stream) for stream in self._streams]
        except BaseException as exc:  # a closing backend: the use still ends
            error = exc
        mat, self._mat = self._mat, None
        try:
            if events and mat is not None and rt.state.is_current(self.handle, self.location, mat):
                rt.reaper.track_readers(self.handle, self.location, events)
        finally:
            rt.state.unlease(self.handle, self.location, self.mode, mat)
            self._forget_owner()
            rt.settle()
        return error

    def release(self, reader_events: Any = None) -> None:
        """End the use now, synchronously, as leaving its block does: :meth:`exit_nowait`,
        raising what it would return (recording a reader event failed, or the manager closed
        during the use; the use ends anyway). For a lease entered with :meth:`enter_nowait`,
        or to end an ``async with`` lease before its block ends (leaving the block then does
        nothing more). ``RuntimeError`` for a lease not entered or already ended. Like
        :meth:`exit_nowait`, it does not wait for an incoming copy: check :meth:`failure`."""
        error = self.exit_nowait(reader_events)
        if error is not None:
            raise error

    def failure(self) -> BaseException | None:
        """The error of the transfer that was bringing the data when the lease was entered,
        if it failed (known once it completed)."""
        payload = self._payload
        return None if payload is None else payload.failure

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.status != "entered":
            return
        error = self.exit_nowait()
        if self._rt.frozen:
            if exc is None and error is not None:
                raise error
            return
        payload = self._payload  # kept only when entered on a copy that was still incoming
        transfer = None if payload is None else payload.transfer
        if transfer is not None and not transfer.query():
            # Entered on an incoming copy: the body's reads are valid only if it succeeds.
            await self._rt.backend.wait(transfer)
        else:
            await self._rt.cancel_shielded_checkpoint()
        if payload is not None and payload.failure is None and transfer is not None:
            payload.failure = transfer.outcome()
        if payload is not None and payload.failure is not None:
            failed = ResidencyUnavailableError(
                self.handle,
                self.location,
                "the transfer that was bringing it when the lease was entered failed, so what "
                f"the lease read was not the value: {payload.failure}",
            )
            if exc is not None:  # the body's own exception stays primary; it says so too
                exc.add_note(str(failed))
                return
            raise failed from payload.failure
        if error is not None and exc is None:
            raise error

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy(
            self,
            "it is one use of a value in its manager, and a copy would enter or end that use twice",
            "call manager.acquire(...) again for another lease",
        )

    def __repr__(self) -> str:
        owner = f" by {self.owner!r}" if self.owner is not None else ""
        return f"<Lease {self.handle.name!r} @ {self.location} {self.mode} {self.status}{owner}>"


class Hold:
    """Protects a materialization from removal without using it. ``release()`` ends it; also a
    context manager (``with`` or ``async with``). Releasing twice is an error, and so is
    entering one already released (it would protect nothing).

    Released after the manager closed, it changes nothing and raises ``ManagerClosedError``.

    State: ``handle``, ``location``, ``active``, ``owner`` (the task that made it)."""

    def __init__(
        self,
        runtime: Runtime,
        handle: ValueHandle,
        location: Location,
        on_behalf_of: TaskRef | None = None,
    ) -> None:
        self._rt = runtime
        self.handle = handle
        self.location = location
        # Before the state changes: nothing after it may fail.
        ref = current_task_ref() if on_behalf_of is None else on_behalf_of
        self._mat: Materialization | None = runtime.state.hold(handle, location)
        self.owner = ref.name
        table = lease_owners(runtime)
        table.add(handle, location, "hold", ref.name)
        self._task = ref.task
        table.add_task(self._task, handle, location, lease=False)
        self.active = True
        runtime.settle()

    def release(self) -> None:
        self._rt.check_loop_thread()  # before anything changes: the state is the loop's
        if not self.active:
            raise RuntimeError(f"{self!r} was already released")
        if self._rt.frozen:
            self.active = False
            self._rt.check_not_frozen(f"the hold on {self.handle} at {self.location}")
        mat, self._mat = self._mat, None
        self._rt.state.unhold(self.handle, self.location, mat)
        table = lease_owners(self._rt)
        table.remove(self.handle, self.location, "hold", self.owner)
        table.remove_task(self._task, self.handle, self.location, lease=False)
        self._task = None
        self.active = False
        self._rt.settle()

    def _check_enterable(self) -> None:
        if not self.active:
            raise RuntimeError(
                f"{self!r} was already released: a hold protects from its making to its "
                "release, once; make another with manager.hold(...)"
            )

    def __enter__(self) -> Hold:
        self._check_enterable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self.release()

    async def __aenter__(self) -> Hold:
        self._check_enterable()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.active:
            self.release()

    if not TYPE_CHECKING:  # to a type checker a Hold stays not awaitable, as it is

        def __await__(self) -> Any:
            # ``await manager.hold(h, loc)``, as every other call of the manager is awaited:
            # the hold was taken by the call, and Python's own TypeError would lose it still
            # active (the copy protected for good). Give it back, then say how to hold.
            was = self.active
            if was:
                self.release()
            raise TypeError(
                f"a hold is not awaitable: manager.hold() takes the hold when it is called "
                f"(no wait); {'it was released now, so ' if was else ''}nothing stays held. "
                "Write 'hold = manager.hold(handle, location)' ... 'hold.release()', or "
                "'with manager.hold(handle, location):'"
            )

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy(
            self,
            "it is one hold on a value in its manager, and a copy would release it twice "
            "(the second release taking another hold's place)",
            "call manager.hold(...) again for another hold",
        )

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"<Hold {self.handle.name!r} @ {self.location} {state} by {self.owner!r}>"
