"""``Runtime``: the parts of a running manager that its operations share.

One per running manager, made on its event loop by ``ResidencyManager.__aenter__``. The
manager's public operations, scopes, leases, the driver, the admission queue and the reaper all
work on it; none of them imports the manager (so the modules form no cycle).

The rule that keeps payloads in step with the model: every synchronous state change made on
the runtime is followed by :meth:`Runtime.settle`, which takes the transitions committed since
the last call, lets the payload table say which tensors no materialization references any
more, frees those (outside the state change), and notifies the change signal once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from ..backends.base import Backend
from ..backends.bridge import LoopBridge
from ..core.locations import Location
from ..core.state import ResidencyState
from ..core.values import ValueHandle
from .admission import AdmissionQueue
from .payloads import FREEING_KINDS, PayloadTable
from .reaper import Reaper
from .signal import ChangeSignal, ManagerClosedError
from .sources import Source

__all__ = ["Runtime"]

PINNED = Location("pinned-host")
PAGEABLE = Location("pageable-host")


def _loop_backend() -> Any:
    """anyio's backend class for the library running this loop, or ``None``.

    ``anyio.lowlevel.checkpoint()`` and ``anyio.CancelScope()`` look the running library up
    (sniffio, then a table) on every call: seven Python calls, as many as the checkpoint's
    own work, on every direct operation, scope and lease. The library of a running loop never
    changes, so the runtime looks it up once (a private name of anyio's: where it is missing,
    the runtime uses the public functions, which do the same work)."""
    try:
        from anyio._core._eventloop import get_async_backend

        backend = get_async_backend()
        for name in (
            "checkpoint",
            "checkpoint_if_cancelled",
            "cancel_shielded_checkpoint",
            "create_event",
        ):
            getattr(backend, name)
        backend.create_cancel_scope  # noqa: B018 - it must exist
    except Exception:  # pragma: no cover - another anyio's layout
        return None
    return backend


class Runtime:
    """Shared parts of one running manager (loop thread only, see the module docstring).

        State: ``state`` (the model), ``payloads``, ``backend``, ``bridge`` (the loop), ``signal``,
        ``reaper``, ``admission``, ``sources`` (handle -> source of a reconstructible value),
        ``closing`` (set when the manager starts closing: new work is refused), ``frozen`` (set
    once it closed: the state is final),
        ``_journal`` (transitions committed since the last :meth:`settle`), ``_tasks`` (the task
        group for background work, owned by the manager), ``_busy`` (runs and loads in flight:
        closing waits for them).
    """

    def __init__(
        self,
        state: ResidencyState,
        backend: Backend,
        bridge: LoopBridge,
        tasks: anyio.abc.TaskGroup,
    ) -> None:
        self.state = state
        self.backend = backend
        self.bridge = bridge
        self.payloads = PayloadTable()
        self.signal = ChangeSignal()
        self.reaper = Reaper(self)
        self.admission = AdmissionQueue(self)
        self.sources: dict[ValueHandle, Source] = {}
        self.scopes: set[Any] = set()  # entered scopes (their values: see scoped_values)
        # Active reservation blocks (manager.reservation), (name, location) -> the task in it.
        self.blocks: dict[tuple[str, Location], object] = {}
        # Active reservations made with reserve_nowait, (name, location) -> the task that made
        # it (one made outside any task is nobody's and is not here).
        self.nowaits: dict[tuple[str, Location], object] = {}
        self.closing = False
        # Set once the manager closed (after its last transfer): nothing changes the state any
        # more; what ends later (a lease, hold, scope, reservation block) raises instead.
        self.frozen = False
        self._journal: list[tuple[str, Any, Location | None]] = []
        state.journal = self._journal
        self._tasks = tasks
        # Loads from sources run here (reading a file, pinning): never on the loop.
        self.loads = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="aresidency-load"
        )
        self._busy = 0
        self._idle: anyio.Event | None = None
        # anyio's checkpoints and shielded cancel scope for this loop, looked up once (see
        # _loop_backend): what anyio.lowlevel's functions and anyio.CancelScope do.
        low = _loop_backend()
        self.checkpoint: Callable[[], Coroutine[Any, Any, None]] = (
            anyio.lowlevel.checkpoint if low is None else low.checkpoint
        )
        self.checkpoint_if_cancelled: Callable[[], Coroutine[Any, Any, None]] = (
            anyio.lowlevel.checkpoint_if_cancelled if low is None else low.checkpoint_if_cancelled
        )
        self.cancel_shielded_checkpoint: Callable[[], Coroutine[Any, Any, None]] = (
            anyio.lowlevel.cancel_shielded_checkpoint
            if low is None
            else low.cancel_shielded_checkpoint
        )
        self.shielded_scope: Callable[[], anyio.CancelScope] = functools.partial(
            anyio.CancelScope if low is None else low.create_cancel_scope, shield=True
        )
        self.new_event: Callable[[], anyio.Event] = anyio.Event if low is None else low.create_event
        # Whether the backend keeps spare host memory at all (it overrides the Backend
        # defaults, which keep none and bound nothing): sync_spare has nothing to do otherwise.
        kind = type(backend)
        self._keeps_spare = any(
            getattr(kind, name) is not getattr(Backend, name)
            for name in (
                "pinned_overhead_bytes",
                "limit_pinned_overhead",
                "pageable_overhead_bytes",
                "limit_pageable_overhead",
            )
        )

    def scoped_values(self) -> Iterator[ValueHandle]:
        """The values of the entered scopes (their exit may move them): admission's transient
        test reads them lazily, on its slow path only."""
        for scope in self.scopes:
            yield from scope.plan.handles()

    # -- the effects of state changes

    def settle(self) -> None:
        """Apply the transitions committed since the last call: free the tensors nothing
        references any more, then wake whoever waits for a change. Call after every
        synchronous state change (cheap when nothing changed)."""
        journal = self._journal
        if not journal:
            return
        committed = journal[:]
        del journal[:]
        # The payloads to free: only a transition that ends a materialization frees one.
        # The host budgets' headroom, and what the backend keeps spare there, change only
        # with a transition at a host location (or at none: a discard may free host memory).
        frees = host = False
        for kind, _, location in committed:
            if kind in FREEING_KINDS:
                frees = True
            if location is None or location.kind != "cuda":
                host = True
        if frees:
            self._free(committed)
        if host:
            self.sync_spare()
        self.signal.notify()

    def _free(self, committed: list[tuple[str, Any, Location | None]]) -> None:
        # A function of its own: no local of settle() may hold a freed tensor while the
        # notify that follows wakes code that allocates again (the memory would be counted
        # twice on a device: freed in the ledger, still allocated in torch).
        for tensor, location in self.payloads.effects(committed):
            self.backend.free(tensor, location)

    def sync_spare(self) -> None:
        """Bound the backend's spare host memory by the host budgets and show it in the
        ledgers: its pinned arena may hold what its live blocks and the copies admitted into
        pinned memory need, plus the pinned-host budget's headroom; the freed pageable
        destinations it keeps, the pageable-host budget's headroom. No more."""
        if not self._keeps_spare:
            return  # (the defaults: no spare memory, nothing to bound, spare_bytes stay 0)
        backend = self.backend
        ledger = self.state.find_ledger(PINNED)
        if ledger is not None:
            if ledger.budget_bytes is None:
                backend.limit_pinned_overhead(None)
            else:
                headroom = ledger.budget_bytes - ledger.charged_bytes
                backend.limit_pinned_overhead(ledger.incoming_bytes + max(headroom, 0))
            spare = backend.pinned_overhead_bytes()
            if spare != ledger.spare_bytes:
                self.state.set_spare_bytes(PINNED, spare)
        ledger = self.state.find_ledger(PAGEABLE)
        if ledger is not None:
            if ledger.budget_bytes is None:
                backend.limit_pageable_overhead(None)
            else:
                backend.limit_pageable_overhead(max(ledger.budget_bytes - ledger.charged_bytes, 0))
            spare = backend.pageable_overhead_bytes()
            if spare != ledger.spare_bytes:
                self.state.set_spare_bytes(PAGEABLE, spare)

    # -- checks

    def check_not_frozen(self, what: str) -> None:
        """Raise ``ManagerClosedError`` once the manager closed (``what`` ended too late)."""
        if self.frozen:
            raise ManagerClosedError(
                f"the manager closed before {what} ended; the state is final (what was active "
                "at close stays in its last snapshot), so nothing was changed"
            )

    def check_thread(self) -> None:
        """Raise ``RuntimeError`` unless called on the loop's thread while running."""
        if self.closing:
            raise ManagerClosedError("the manager is closing: it carries out nothing more")
        if threading.get_ident() != self.bridge.thread or not self.bridge.running_here():
            self.check_loop_thread()  # raises, saying why

    def check_loop_thread(self) -> None:
        """Raise ``RuntimeError`` unless called on the loop's thread (closing or not: for the
        end of a lease or hold, which must still be possible while the manager closes)."""
        if threading.get_ident() != self.bridge.thread:
            raise RuntimeError(
                "ResidencyManager state is owned by its event loop's thread; call it from that "
                "thread: from another one, manager.bridge.call_soon(fn, *args) (never waits) or "
                "manager.bridge.run_async(async_fn, *args) (blocks that thread)"
            )
        if not self.frozen and not self.bridge.running_here():
            # The right thread, but not the loop that entered the manager: its completions go
            # to that loop, so a wait here would never end.
            gone = "which has finished" if self.bridge.finished() else "which is not running"
            raise RuntimeError(
                "this ResidencyManager belongs to the event loop that entered it, "
                f"{gone}, not to the one running now (another event loop of the same "
                "thread, or none; each asyncio.run() starts a new loop): enter the manager "
                "with 'async with' inside the loop that uses it, or call it from that loop"
            )

    # -- background work

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the manager's task group. It must not raise: background work
        reports its errors through the objects that started it."""
        self._tasks.start_soon(fn, *args)

    def begin_work(self) -> None:
        """Count one run or load in flight (closing waits until none is)."""
        self._busy += 1

    def end_work(self) -> None:
        self._busy -= 1
        if self._idle is not None:  # (check_idle's first test: most ends wake nobody)
            self.check_idle()

    def check_idle(self) -> None:
        """Wake :meth:`wait_idle` if nothing is in flight any more (the reaper calls this
        after each delivery)."""
        if self._idle is not None and not self._busy and not self.reaper.watched:
            idle, self._idle = self._idle, None
            idle.set()

    async def wait_idle(self) -> None:
        """Park until no run or load is in flight and no device completion is awaited."""
        while self._busy or self.reaper.watched:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()
