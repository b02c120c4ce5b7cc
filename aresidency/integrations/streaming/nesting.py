"""Streamed calls made from inside another streamed call's forward.

A forward runs in a thread (the module's worker thread, a model pool's thread, or, for a plain
``nn.Sequential`` on the simulated backend, the simulated compute stream's thread), while the
call that runs it waits on the event loop for that thread. A call made from there with
:meth:`~aresidency.integrations.streaming.module.StreamedModule.call_threadsafe` is a call
*nested* in that one: the outer call cannot go on, nor give back anything it holds, until the
nested call returned. This module is what the nested call knows of the calls it is nested in:

* :class:`Forward`: one call in flight whose forward runs in some thread, marked on that thread
  while it runs there (:func:`running`, :func:`current`), with the call it is nested in itself
  (``parent``, through :data:`NESTED_IN` in the nested call's task);
* what the outer calls hold counts as the nested call's own (:func:`keeper`): a wait for room
  that only they keep out would never end, and is refused at once, as a wait on what the
  waiting task holds itself is (:meth:`~aresidency.ResidencyManager.waiting_on_itself`);
* cancelling the outer call cancels the calls nested in it (:meth:`Forward.cancel`): the outer
  call waits for its thread, which waits for them.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from ...core.locations import Location
from ...core.values import ValueHandle
from ...runtime.admission import Keeper, Kept

if TYPE_CHECKING:
    from ...runtime.manager import ResidencyManager
    from .module import StreamedModule

__all__ = [
    "NESTED_IN",
    "RUNNING",
    "Forward",
    "awaited_in",
    "current",
    "keeper",
    "run_sync",
    "running",
]

T = TypeVar("T")

_here = threading.local()

#: In the task that runs a nested call: the call it was made from inside of.
NESTED_IN: contextvars.ContextVar[Forward | None] = contextvars.ContextVar(
    "aresidency_nested_in", default=None
)

#: In the context a forward runs in (set by :func:`running`): that call. A task the forward's
#: thread starts on a loop (``asyncio.run_coroutine_threadsafe``, ``anyio.from_thread.run``,
#: ``trio.from_thread.run``: each runs it in a copy of the thread's context) inherits it, so
#: that a streamed call awaited there knows the call it is nested in (:func:`awaited_in`).
RUNNING: contextvars.ContextVar[Forward | None] = contextvars.ContextVar(
    "aresidency_running_forward", default=None
)


class Forward:
    """A streamed call in flight whose forward runs in a thread: ``streamed`` (its module),
    ``task`` (the task awaiting the call, which holds what the call leased), ``bridge`` (its
    manager's loop), ``turn`` (its admission turn, ``None`` for a call that takes none),
    ``stream`` (set when its blocks run on this stream's own thread: a call that queues work
    there waits behind them), ``parent`` (the call this one is nested in, if any), ``nested``
    (cancel scopes of the calls nested in it now), ``cancelled`` (the call was cancelled or
    failed: nothing nested in it starts). Made and changed on the loop; :func:`current`
    reads it from the thread that runs the forward."""

    __slots__ = (
        "bridge",
        "cancelled",
        "done",
        "nested",
        "parent",
        "stream",
        "streamed",
        "task",
        "turn",
    )

    def __init__(
        self,
        streamed: StreamedModule,
        task: object | None,
        *,
        turn: Any = None,
        parent: Forward | None = None,
    ) -> None:
        self.streamed = streamed
        self.task = task
        self.bridge = streamed.manager.bridge
        self.turn = turn
        self.stream: Any = None
        self.parent = parent
        self.nested: set[anyio.CancelScope] = set()
        self.cancelled = False
        self.done = False  # the call returned: a task its forward started is not nested

    def chain(self) -> Iterator[Forward]:
        """This call, then the calls it is nested in, innermost first."""
        forward: Forward | None = self
        while forward is not None:
            yield forward
            forward = forward.parent

    def holds_turn(self, manager: ResidencyManager, device: Location) -> bool:
        """Whether the call holds ``manager``'s admission turn at ``device`` now."""
        turn = self.turn
        streamed = self.streamed
        return (
            streamed.manager is manager
            and streamed.device == device
            and turn is not None
            and bool(turn.held)
        )

    def cancel(self) -> None:
        """The call was cancelled (or ended): cancel the calls nested in it, and refuse any
        that starts from now on (loop thread)."""
        self.cancelled = True
        for scope in list(self.nested):
            scope.cancel()


@contextlib.contextmanager
def running(forward: Forward | None) -> Iterator[None]:
    """Mark the calling thread as running ``forward``'s module until the block ends (a call
    made from inside it finds it with :func:`current`)."""
    if forward is None:
        yield
        return
    previous = getattr(_here, "forward", None)
    _here.forward = forward
    token = RUNNING.set(forward)
    try:
        yield
    finally:
        RUNNING.reset(token)
        _here.forward = previous


def current() -> Forward | None:
    """The streamed call whose forward the calling thread runs now, if any."""
    forward: Forward | None = getattr(_here, "forward", None)
    return forward


def awaited_in(bridge: object) -> Forward | None:
    """The streamed call in flight (of a manager on ``bridge``'s loop) whose forward started
    the task awaiting a call now, through a loop's thread-safe entry (see :data:`RUNNING`),
    unless that call is already known to be nested there (:data:`NESTED_IN`) or returned."""
    forward = RUNNING.get()
    if forward is None or forward.done or forward.bridge != bridge:
        return None
    if NESTED_IN.get() is forward:
        return None
    return forward


def keeper(outer: Forward, task: object, inner: StreamedModule) -> Keeper:
    """A task keeper (:meth:`~aresidency.ResidencyManager.add_task_keeper`) for ``task``, which
    runs ``inner``'s call made from inside ``outer``'s forward: what the tasks of ``outer``
    and of the calls it is nested in hold at ``inner``'s manager (their leases and holds,
    what keepers keep for them) and the rings those calls reserved end only once ``task``
    went on."""
    manager = inner.manager

    def kept(asked: object) -> Kept | None:
        if asked is not task:
            return None
        calls = [f for f in outer.chain() if f.streamed.manager is manager]
        copies: dict[tuple[ValueHandle, Location], None] = {}
        reservations: dict[tuple[str, Location], None] = {}
        for forward in calls:
            held, reserved, _ = manager.task_holdings(forward.task)
            copies.update(dict.fromkeys(held))
            reservations.update(dict.fromkeys(reserved))
            ring = forward.streamed._ring_reservation()
            if ring is not None:
                reservations[ring, forward.streamed.device] = None
        if not copies and not reservations:
            return None
        names = " and ".join(dict.fromkeys(f"{f.streamed.name}'s" for f in calls))
        held_here = []
        here = sum(1 for _, location in copies if location == inner.device)
        if here:
            held_here.append(f"{here} cop{'y' if here == 1 else 'ies'} at {inner.device}")
        if reservations:
            held_here.append("reservation " + ", ".join(repr(name) for name, _ in reservations))
        return Kept(
            what=(
                f"{names} call in flight, which gives back what it holds "
                f"({'; '.join(held_here) or 'elsewhere'}) only once {inner.name}'s call, made "
                "from inside its forward, returned"
            ),
            materializations=tuple(copies),
            reservations=tuple(reservations),
            hint=(
                f"Call {inner.name} before or after {outer.streamed.name}'s call rather than "
                "from inside its forward, give the budget room for both, or stream the two as "
                "one module."
            ),
        )

    return kept


async def run_sync(fn: Callable[[], T], forward: Forward) -> T:
    """``anyio.to_thread.run_sync(fn)``, which waits for the thread even when the caller is
    cancelled, for a thread that runs ``forward``'s module: a cancellation meanwhile cancels
    the calls nested in it at once, so that the thread can end."""
    finished = False

    async def watch() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            if not finished:
                forward.cancel()

    result: list[T] = []
    failed: list[Exception] = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch)
        try:
            result.append(await anyio.to_thread.run_sync(fn))
        except Exception as error:  # (raised as it is, not in the task group's group)
            failed.append(error)
        finally:
            finished = True
            tasks.cancel_scope.cancel()
    if failed:
        # Cancelled meanwhile: the cancellation, not what it made the thread raise.
        await anyio.lowlevel.checkpoint_if_cancelled()
        raise failed[0]
    return result[0]
