"""``ResidencyManager``: the lifecycle and the public operations.

The manager is a thin front: its state is the pure model (``core.ResidencyState``), and while
it runs (``async with ResidencyManager(...) as manager``) its operations work on a
:class:`~aresidency.runtime.context.Runtime` made on the loop that entered it:

* :mod:`~aresidency.runtime.driver` carries out every action (direct operations, scopes,
  ``execute``, ``materialize_nowait``) and is where cancellation is handled;
* :mod:`~aresidency.runtime.admission` queues scopes (and the direct operations that would
  overtake them) first come, first served;
* :mod:`~aresidency.runtime.reaper` turns completed device work into state;
* :mod:`~aresidency.runtime.scopes` and :mod:`~aresidency.runtime.leases` hold plans, uses and
  protections for the duration of a block;
* :mod:`~aresidency.runtime.signal` is the one way to wait for the state to change.

The loop may be asyncio, uvloop or trio (directly or through anyio). All state is owned by
that loop and mutated only on it; a call from another thread raises ``RuntimeError``. The
public surface other layers build on (the controller, weight streaming, serving, the loader)
is: :attr:`ResidencyManager.state` (read it, never mutate it),
:meth:`ResidencyManager.wait_for_change`, :attr:`ResidencyManager.bridge` (to call back into
the loop from another thread), :meth:`ResidencyManager.materialize_nowait` and
:meth:`ResidencyManager.copy_issued`.

Why this module is long: it is the one public front of the runtime; every operation is a short
method that checks its arguments and hands over to the runtime's modules, and their docstrings
(what the host waits for, on which stream) are the API reference. The diagnosis methods at the
end (``owners``, ``dump``, ``export_timeline``) delegate to :mod:`aresidency.diagnosis`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from ..backends.base import Backend
from ..backends.bridge import LoopBridge
from ..core.errors import ResidencyBudgetError, ResidencyUnavailableError, format_bytes
from ..core.explain import PlanExplanation, explain_plan
from ..core.locations import PINNED_HOST, Location, LocationLike
from ..core.plans import Action, ActionFailed, Materialize, Move, Release, ResidencyPlan
from ..core.sizes import ByteSize, format_nbytes, parse_nbytes
from ..core.snapshot import ResidencySnapshot, bring_up_to_date, take_snapshot
from ..core.state import ResidencyState
from ..core.timeouts import check_timeout
from ..core.trace import ExecutionReport, ResidencyTrace
from ..core.values import (
    DEFAULT_GRANULARITY,
    Materialization,
    ReplicaMode,
    ValueHandle,
    check_flag,
    check_value_name,
    value_charge,
)
from ..progress import progress_if_large
from .admission import AdmissionTurn, Keeper, RoomWait
from .context import Runtime
from .driver import PhaseRun
from .hosted import HostedTaskGroup
from .leases import Hold, Lease, TaskRef, add_owners, current_task, lease_owners
from .payloads import Payload
from .pending import PendingOperation
from .scopes import Scope, plan_of
from .shield import finish_shielded
from .signal import ManagerClosedError, check_callback, refuse_copy
from .sources import Source
from .tensors import tensor_problem

__all__ = ["STAGING_RESERVATION", "ResidencyManager"]

STAGING_RESERVATION = "aresidency.staging"

_log = logging.getLogger(__name__)


_BACKEND_NAMES = ("auto", "cuda", "sim")


def _make_backend(spec: Any) -> Backend:
    if isinstance(spec, Backend):
        return spec
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "sim"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("backend='cuda' but torch sees no CUDA device; use 'sim' or 'auto'")
        from ..backends.cuda import CudaBackend

        return CudaBackend()
    if spec == "sim":
        from ..backends.sim import SimBackend

        return SimBackend()
    raise ValueError(f"backend must be 'auto', 'cuda', 'sim' or a Backend, got {spec!r}")


def _on_loop_thread(rt: Runtime, remove: Callable[[], None]) -> Callable[[], None]:
    """``remove``, refused with a ``RuntimeError`` (nothing removed) unless called on the
    manager's loop thread: the lists it changes are the loop's."""

    def remove_on_loop_thread() -> None:
        rt.check_loop_thread()
        remove()

    return remove_on_loop_thread


def _check_tensor(tensor: Any, name: str | None) -> torch.Tensor:
    """``tensor`` if it is a tensor the manager can hold and copy (see :func:`tensor_problem`);
    the error names the value (``name``, when given)."""
    value = "a value" if name is None else f"value {name!r}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"cannot register {value}: register takes a torch.Tensor, got {type(tensor).__name__}"
        )
    problem = tensor_problem(tensor)
    if problem is not None:
        kind, what, instead = problem
        raise kind(f"cannot register {value}: it is {what}; {instead}")
    return tensor


class _SingleUse(AbstractAsyncContextManager[None]):
    """An ``async with`` block entered once: a second entry is a ``RuntimeError`` that says
    so (contextlib's generator block raised ``AttributeError: ... no attribute 'args'``)."""

    __slots__ = ("_block", "_entered", "_exited", "_label", "_shown")

    def __init__(
        self, block: AbstractAsyncContextManager[None], label: str, shown: str | None = None
    ) -> None:
        self._block = block
        self._label = label
        self._shown = label if shown is None else shown  # what the repr calls it
        self._entered = False
        self._exited = False

    async def __aenter__(self) -> None:
        if self._entered:
            raise RuntimeError(
                f"{self._label} is single use and was entered already; call it again for "
                "another block"
            )
        self._entered = True
        await self._block.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._exited = True
        return await self._block.__aexit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        status = "exited" if self._exited else "entered" if self._entered else "new"
        return f"<{self._shown} {status}>"


class ResidencyManager:
    """Owns residency state and carries out transitions on a device backend.

    ``budgets`` maps locations to strict byte budgets (``None`` or absent: no strict budget),
    written as ints, whole floats (``10.5e9``) or strings (``"10GiB"``, ``"64GB"``; see
    :func:`~aresidency.core.sizes.parse_nbytes`); accelerate's ``max_memory`` form converts with
    :func:`~aresidency.core.sizes.budgets_from_max_memory`.
    ``backend`` is ``"auto"`` (CUDA when available, else the simulation), ``"cuda"``, ``"sim"``
    (a simulation of CUDA devices in host memory) or a ``Backend`` instance.
    ``trace_capacity=0`` disables the trace. Use as ``async with ResidencyManager(...) as m``
    under asyncio, uvloop or trio.
    """

    def __init__(
        self,
        budgets: Mapping[Any, ByteSize | None] | None = None,
        backend: Any = "auto",
        trace_capacity: int = 4096,
        *,
        granularity: int = DEFAULT_GRANULARITY,
        reserve_staging: bool = True,
    ) -> None:
        check_flag(reserve_staging, "reserve_staging")  # "no" would be true
        if budgets is not None and not isinstance(budgets, Mapping):
            raise TypeError(
                f"budgets must be a mapping from location to bytes (such as "
                f"{{'cuda:0': 8 << 30}}), got {budgets!r}"
            )
        self._state = ResidencyState(
            budgets=dict(budgets or {}), trace_capacity=trace_capacity, granularity=granularity
        )
        if not isinstance(backend, Backend) and not (
            isinstance(backend, str) and backend in _BACKEND_NAMES
        ):
            # Refused here, where it was written, not at the 'async with' that starts it.
            raise ValueError(f"backend must be 'auto', 'cuda', 'sim' or a Backend, got {backend!r}")
        self._backend_spec = backend
        self._backend: Backend | None = None
        self._reserve_staging = reserve_staging
        self._rt: Runtime | None = None
        self._hosted: HostedTaskGroup | None = None
        self._status = "new"  # new -> running -> closing -> closed
        # Tenants waiting for room outside the admission queue, per location (want_room).
        self._wanting: dict[Location, int] = {}

    # ---------------------------------------------------------------- lifecycle

    @property
    def id(self) -> str:
        return self._state.manager_id

    @property
    def state_version(self) -> int:
        return self._state.state_version

    @property
    def state(self) -> ResidencyState:
        """The live model, to *read* (the controller's search, a pipeline's budget check). Never
        mutate it: every change goes through the manager's operations. Loop thread only."""
        return self._state

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("the manager is not running: use 'async with ResidencyManager()'")
        return self._backend

    @property
    def bridge(self) -> LoopBridge:
        """The manager's event loop, reachable from other threads (``bridge.call_soon``,
        ``bridge.run_async``). Any thread, while the manager runs."""
        rt = self._rt
        if rt is None or self._status != "running":
            raise ManagerClosedError(f"the manager is {self._status}: it has no loop to call")
        return rt.bridge

    @property
    def running(self) -> bool:
        return self._status == "running"

    @property
    def waiting(self) -> int:
        """How many scopes (and direct operations behind them) wait for admission now."""
        return 0 if self._rt is None else len(self._rt.admission)

    def waiting_for_room(self, location: LocationLike) -> bool:
        """Whether a scope waits for room at ``location`` now: a tenant that holds memory it
        could give back (a loader's free buffers) should, and one that can wait should not take
        more first (``materialize_nowait`` refuses to overtake it). Loop thread."""
        rt = self._rt
        if rt is None or self._status != "running":
            return False
        rt.check_loop_thread()
        loc = Location.parse(location)
        return loc in rt.admission.short_of() or self._wanting.get(loc, 0) > 0

    def want_room(self, location: LocationLike) -> Callable[[], None]:
        """For a tenant that waits for room at ``location`` outside the admission queue (a
        streamed call waiting for a block's room): until the returned function is called,
        :meth:`waiting_for_room` says so, so that tenants that could take that room first
        hold back and give back what they can (a loader's free buffers), as they do for a
        waiting scope. Notifies the change listeners at once. Loop thread, and so is the
        returned function."""
        rt = self._running()
        loc = Location.parse(location)
        self._wanting[loc] = self._wanting.get(loc, 0) + 1
        done = False

        def release() -> None:
            nonlocal done
            rt.check_loop_thread()  # it notifies the listeners: never from another thread
            if done:
                return
            done = True
            left = self._wanting.get(loc, 0) - 1
            if left > 0:
                self._wanting[loc] = left
            else:
                self._wanting.pop(loc, None)
                if self._status == "running":
                    rt.signal.notify()  # those that held back may go on

        rt.signal.notify()
        return release

    async def __aenter__(self) -> ResidencyManager:
        if self._status != "new":
            raise RuntimeError("a ResidencyManager can be entered once")
        bridge = LoopBridge.current()
        backend = _make_backend(self._backend_spec)
        for location in self._state.locations():
            try:
                backend.check_location(location)
            except ValueError as error:
                # Said where it was written: the budgets, not an operation at that location.
                raise ValueError(
                    f"budgets name {location}, which this manager cannot use: {error}"
                ) from None
        staging = backend.staging_nbytes() if self._reserve_staging else 0
        pinned = self._state.find_ledger(PINNED_HOST)
        if staging and pinned is not None:
            # Refused before anything starts (the backend, the task group): a manager whose
            # start failed has nothing left running that no one would stop.
            pinned.check_admit(
                staging,
                f"the backend's pinned staging buffers, reserved as {STAGING_RESERVATION!r} "
                "for the manager's lifetime (ResidencyManager(reserve_staging=False) leaves "
                "them uncharged)",
                kind="reservation",
            )
        # Every location of the machine appears in snapshots from the start.
        for host in ("pageable-host", "pinned-host"):
            self._state.ledger(host)
        for index in range(backend.device_count()):
            self._state.ledger(Location("cuda", index))
        # The background task group first (its start is the one await here: cancelled, it
        # leaves nothing started), in a task of its own on asyncio so that any task may close
        # the manager (see .hosted).
        hosted = HostedTaskGroup()
        tasks = await hosted.open()
        try:
            backend.start(bridge)
        except BaseException:
            await hosted.close()  # nothing runs in it yet
            raise
        self._hosted = hosted
        self._backend = backend
        rt = self._rt = Runtime(self._state, backend, bridge, tasks)
        if staging:
            self._state.reserve(STAGING_RESERVATION, PINNED_HOST, staging, owner="backend")
            rt.settle()
        tasks.start_soon(rt.reaper.run_safety_net)
        self._status = "running"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Wake every task waiting for admission or a state change with
        ``ManagerClosedError``, wait (shielded, from native asyncio cancellations too) for the
        transfers and consumer events in flight, then stop the background tasks and the
        backend. From then on the state is final: leases, holds, scopes and reservation blocks
        still active keep their records (a dump shows them) and raise ``ManagerClosedError``
        when they end."""
        rt, hosted, backend = self._rt, self._hosted, self._backend
        if rt is None or hosted is None or backend is None or self._status != "running":
            return None
        # Refused before anything changes: from another thread or loop the close would wait
        # for ever for completions that go to the manager's own loop.
        rt.check_loop_thread()
        hosted.check_closer()  # on trio only the entering task can: refused before a change
        self._status = "closing"
        rt.closing = True
        message = "the manager closed while this was waiting"
        rt.admission.close(message)
        rt.signal.close(message)

        async def drain() -> None:
            await rt.wait_idle()
            # In the step that found nothing in flight: a task the last completion woke (a
            # scope's body about to run its exit) must not begin work the close would not
            # wait for, before the closing task itself runs again.
            rt.frozen = True

        try:
            # Finished even if the task is cancelled meanwhile, natively on asyncio too (the
            # cancellation is raised once it is done): see .shield.
            await finish_shielded(drain)
        finally:
            # From here on the state is final: a lease, hold, scope or reservation block that
            # ends after this changes nothing and raises ManagerClosedError.
            rt.frozen = True
            # The body's own exception is not handed to the task group: it would come back
            # wrapped in an exception group. Background tasks never raise, so the group ends
            # cleanly and the body's exception (if any) propagates as it is.
            try:
                await hosted.close()
            finally:
                try:
                    await finish_shielded(backend.aclose)
                finally:
                    rt.loads.shutdown(wait=False)  # idle: every load finished before wait_idle
                    self._status = "closed"
        return None

    def _running(self) -> Runtime:
        """The runtime, after checking the caller is on the loop's thread and it runs."""
        rt = self._rt
        if (
            rt is not None
            and self._status == "running"
            and not rt.closing
            and threading.get_ident() == rt.bridge.thread
            and rt.bridge.running_here()
        ):
            return rt  # (what the checks below and rt.check_thread() accept)
        if rt is None or self._status != "running":
            if self._status in ("closing", "closed"):
                raise ManagerClosedError(
                    f"the manager is {self._status}: it carries out nothing more"
                )
            raise RuntimeError("the manager is not running: use 'async with ResidencyManager()'")
        rt.check_thread()
        return rt

    def check_thread(self) -> None:
        """Raise unless called on the manager's loop thread while it runs."""
        self._running()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy(
            self,
            "it owns the residency state of its values, and its id is in each of their "
            "handles (a copy would take the other's handles for its own; a copy of a running "
            "one would share its runtime, and closing either would close both)",
            "make a new ResidencyManager(...) wherever another one is needed (in another "
            "process too), and pass handles and snapshots around instead",
        )

    def __repr__(self) -> str:
        backend = self._backend.name if self._backend is not None else self._backend_spec
        waiting = len(self._rt.admission) if self._rt is not None else 0
        values = sum(1 for _ in self._state.values())
        # Sizes as torch.cuda.memory_summary prints them, for the locations that hold or limit.
        charged = []
        for location in self._state.locations():
            ledger = self._state.ledger(location)
            if ledger.charged_bytes or ledger.budget_bytes is not None:
                limit = (
                    "unlimited"
                    if ledger.budget_bytes is None
                    else format_nbytes(ledger.budget_bytes)
                )
                charged.append(f" {location} {format_nbytes(ledger.charged_bytes)}/{limit}")
        return (
            f"<ResidencyManager {self.id} v{self.state_version} backend={backend} "
            f"{self._status} [{values} values, {waiting} waiting]{''.join(charged)}>"
        )

    # ---------------------------------------------------------- waiting

    async def wait_for_change(self, timeout: float | None = None) -> bool:
        """Park until the state changes (any committed transition, reaping included); ``False``
        if ``timeout`` seconds passed first. Raises ``ManagerClosedError`` when the manager
        closes. The one way to wait for the state; the host does not block."""
        rt = self._running()
        seconds = check_timeout(timeout)
        deadline = None if seconds is None else anyio.current_time() + seconds
        return await rt.signal.wait(deadline)

    def add_change_listener(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` on the loop after every batch of committed transitions, until
        the returned function is called. For state machines that advance without a task of
        their own (a prefetch pipeline); the callback must not raise and must not await. Loop
        thread, and so is the returned function (it works after the manager closed too)."""
        rt = self._running()
        check_callback(callback, "manager.add_change_listener")
        return _on_loop_thread(rt, rt.signal.add_listener(callback))

    def add_reclaimer(self, reclaimer: Callable[[Location, int], int]) -> Callable[[], None]:
        """Offer what a tenant caches and could give back (a model pool's idle models on the
        device), until the returned function is called: ``reclaimer(location, nbytes)``
        begins releasing up to about ``nbytes`` at ``location`` of what nothing protects and
        another copy keeps (``release_nowait``) and returns the bytes it began releasing.
        Called by :meth:`reclaim`, and by a scope's admission before it refuses a plan that
        only resident values nobody protects keep out. Loop thread, and so is the returned
        function (it works after the manager closed too); ``reclaimer`` must not raise or
        await."""
        rt = self._running()
        check_callback(reclaimer, "manager.add_reclaimer")
        return _on_loop_thread(rt, rt.admission.add_reclaimer(reclaimer))

    def reclaimable_changed(self) -> None:
        """Tell the tenants waiting for room that a reclaimer (:meth:`add_reclaimer`) may
        give back more than when they last asked, with no transition to say so (a model
        pool's idle model that a request no longer waits for): they look again, soon, on the
        loop. Loop thread (a ``RuntimeError`` from another); never waits; does nothing once
        the manager closes."""
        rt = self._rt
        if rt is None:
            return
        rt.check_loop_thread()  # before reading the state: another thread must not touch it
        if self._status == "running" and rt.admission.has_room_waits:
            rt.signal.notify()

    def reclaim(self, location: LocationLike, nbytes: int) -> int:
        """For a tenant that waits for ``nbytes`` more room at ``location`` that only cached
        data takes (a loader's next batch beside a pool's idle models): ask the reclaimers
        (:meth:`add_reclaimer`), in the order they came, to give back that much. Returns the
        bytes whose release began (they free as the releases commit: wait for the change).
        Loop thread; never waits."""
        rt = self._running()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise TypeError(f"reclaim: nbytes must be an int >= 0, got {nbytes!r}")
        if nbytes < 0:
            raise ValueError(f"reclaim: nbytes must be an int >= 0, got {nbytes}")
        return rt.admission.reclaim(Location.parse(location), nbytes)

    def reclaim_for(self, location: LocationLike, need: int) -> int:
        """:meth:`reclaim` what ``need`` more bytes at ``location`` lack beside the charge
        now (nothing when they fit, or there is no budget). Returns the bytes whose release
        began. Loop thread; never waits."""
        rt = self._running()
        ledger = rt.state.find_ledger(Location.parse(location))
        if ledger is None or ledger.budget_bytes is None:
            return 0
        short = ledger.charged_bytes + need - ledger.budget_bytes
        return self.reclaim(location, short) if short > 0 else 0

    def add_task_keeper(self, keeper: Keeper) -> Callable[[], None]:
        """Tell admission what a tenant keeps on a task's behalf, until the returned function
        is called: ``keeper(task)`` returns a :class:`~aresidency.runtime.admission.Kept`
        (materializations and reservations that end only when ``task`` goes on, such as a
        loader's batches copied ahead of its consumer) or ``None``. A scope of that task that
        could fit only once they ended is refused at once instead of waiting for ever, and
        the task does not queue behind scopes that may wait for that room (as with its own
        leases). Loop thread; the keeper must not raise or await."""
        return self._running().admission.add_keeper(keeper)

    def waiting_on_itself(
        self,
        need: int,
        location: LocationLike,
        *,
        what: str,
        task: object | None = None,
        exempt: Iterable[ValueHandle] = (),
        kind: str = "reservation",
    ) -> ResidencyBudgetError | None:
        """For a tenant about to wait for ``need`` bytes of room at ``location`` on behalf of
        ``task`` (default: the calling task), such as a streamed block: the error to raise
        instead when that room could appear only once what the task holds itself ended (its
        scopes, leases and holds, and what keepers keep on its behalf), so that the wait
        would never end; ``None`` when waiting may end. ``exempt``: the tenant's own values,
        which it gives back itself (counted as transient, leased or not). ``what`` names the
        need in the error, ``kind`` what it is (``"reservation"``, or ``"materialization"``
        for values to be copied there; the ledger as it is). Loop thread; never waits."""
        rt = self._running()
        return rt.admission.budget_waiting_on_itself(
            need,
            Location.parse(location),
            what,
            current_task() if task is None else task,
            frozenset(exempt),
            kind,
        )

    def task_holdings(
        self, task: object | None = None
    ) -> tuple[tuple[tuple[ValueHandle, Location], ...], tuple[tuple[str, Location], ...], str]:
        """What ``task`` (default: the calling task) holds itself, which ends only when it goes
        on: the materializations its leases and holds (and keepers on its behalf) keep, as
        ``(handle, location)``; the reservations of its scopes, reservation blocks, keepers and
        its ``reserve_nowait`` calls, as ``(name, location)``; and a sentence naming them and
        what to do. Empty when it holds nothing. For a tenant about to wait (the controller's
        scope): what waiting cannot end. Loop thread; never waits."""
        rt = self._running()
        own = rt.admission._held_by(current_task() if task is None else task)
        if own is None:
            return (), (), ""
        return tuple(own.kept), tuple(own.reservations), own.describe(None)

    def task_leases(self, task: object | None = None) -> tuple[tuple[ValueHandle, Location], ...]:
        """The leases among what :meth:`task_holdings` lists first for ``task`` (default: the
        calling task), one ``(handle, location)`` per lease; the rest are its holds, or what
        keepers keep on its behalf. For a tenant that stands them in when it judges a wait
        (the controller's scope): an error then says the task holds a lease, not a hold.
        Loop thread; never waits."""
        rt = self._running()
        own = rt.admission._held_by(current_task() if task is None else task)
        return () if own is None else own.uses

    @contextmanager
    def room_wait(
        self,
        need: int,
        location: LocationLike,
        *,
        what: str,
        task: object | None = None,
        exempt: Iterable[ValueHandle] | Callable[[], Iterable[ValueHandle]] = (),
        kind: str = "reservation",
    ) -> Iterator[None]:
        """``with manager.room_wait(need, location, what=...)``: around a tenant's wait for
        ``need`` bytes of room at ``location`` on behalf of ``task`` (default: the calling
        task), such as a loader's consumer waiting for a batch or a pool request parked.

        On entry, ``ResidencyBudgetError`` at once when this wait and those other tasks
        registered there now would wait for one another for ever: each task holds room (its
        scopes, leases, holds, reservation blocks, what keepers keep for it) that ends only
        when it goes on, and no need among them would fit while the others' holdings stay
        (hold and wait). Inside, the wait is registered, so that a later wait of another task
        closing such a cycle is refused in turn. ``exempt``: the tenant's own values, which it
        gives back itself (as for :meth:`waiting_on_itself`), or a function naming them
        whenever a check runs (they change while it waits); ``what`` names the need in the
        error, ``kind`` what it is (as for :meth:`waiting_on_itself`). Loop thread; never
        waits."""
        rt = self._running()
        wait = RoomWait.for_bytes(
            need,
            Location.parse(location),
            what,
            current_task() if task is None else task,
            exempt if callable(exempt) else frozenset(exempt),
        )
        error = rt.admission.room_wait_error(wait, kind)
        if error is not None:
            raise error
        remove = rt.admission.add_room_wait(wait)
        try:
            yield
        finally:
            remove()

    @contextmanager
    def plan_wait(
        self, plan: ResidencyPlan, *, what: str, task: object | None = None
    ) -> Iterator[None]:
        """``with manager.plan_wait(plan, what=...)``: around the wait of a tenant that judges
        its own admission (``controller.scope``) for the room ``plan`` needs, on behalf of
        ``task`` (default: the calling task). As :meth:`room_wait`, for a plan: on entry,
        ``ResidencyPlanError`` (``hold_and_wait``) at once when this wait and the waits other
        tasks registered would wait for one another for ever; inside, the wait is registered
        (:meth:`room_waits` lists it where the plan charges budgeted room), so that a later
        wait closing such a cycle is refused in turn. ``plan`` should need no more than the
        tenant's admission would (it is judged as what the wait needs at least). Loop thread;
        never waits."""
        rt = self._running()
        if not isinstance(plan, ResidencyPlan):
            raise TypeError(f"plan_wait needs a ResidencyPlan, got {type(plan).__name__}")
        remove = rt.admission._register_scope_wait(
            plan, current_task() if task is None else task, what
        )
        try:
            yield
        finally:
            if remove is not None:
                remove()

    def room_waits(self) -> list[tuple[str, Location, int, str]]:
        """The waits for room registered now (:meth:`room_wait`), oldest first, as ``(task
        name, location, bytes needed, what)``. Loop thread."""
        return self._running().admission.room_waits()

    def copy_issued(self, handle: ValueHandle, location: LocationLike) -> bool:
        """Whether a lease at ``location`` could order its stream after the data now: the data
        exists there and every piece of the copy bringing it is enqueued (a staged or loaded
        copy takes a while to issue; a lease entered earlier waits for it)."""
        rt = self._running()
        payload = rt.payloads.get(handle, Location.parse(location))
        return payload is not None and (payload.transfer is None or payload.transfer.issued())

    # ---------------------------------------------------------------- values

    def set_budget(self, location: LocationLike, budget_bytes: ByteSize | None) -> None:
        """Set (or clear with ``None``) a strict budget; refused below the current charge
        (``ResidencyBudgetError`` of kind ``"budget"``, nothing changed). When tenants offer
        caches they give back when asked (:meth:`add_reclaimer`: a model pool's idle models, a
        streamed module's blocks kept between calls), which may hold some of that charge, the
        error has a note saying how to free it first: :meth:`reclaim`, then the budget once
        those releases committed. (The refusal itself releases nothing.)"""
        rt = self._running()
        loc = Location.parse(location)
        rt.backend.check_location(loc)
        try:
            self._state.set_budget(loc, budget_bytes)
        except ResidencyBudgetError as error:
            if error.kind == "budget" and rt.admission.has_reclaimers:
                short = error.used_bytes + error.reserved_bytes - (error.budget_bytes or 0)
                error.add_note(
                    f"some of what is charged at {loc} may be a cache its tenant gives back "
                    "when asked (a model pool's idle models, a streamed module's blocks kept "
                    f"between calls): manager.reclaim({str(loc)!r}, {short}) begins releasing "
                    "up to that much; set the budget once those releases committed (await "
                    "manager.wait_for_change() until the charge there is low enough)"
                )
            raise
        rt.settle()

    def storage_owner(self, tensor: torch.Tensor) -> tuple[ValueHandle, Location] | None:
        """The value and location whose storage ``tensor`` shares (what :meth:`register`
        would refuse it for), or ``None``. Any thread (a dictionary read: a value registered
        or released meanwhile on the loop may or may not be seen); ``None`` once the manager
        is not running."""
        rt = self._rt
        if rt is None or self._status != "running":
            return None
        return rt.payloads.owner_of(tensor)

    def register(
        self,
        tensor: torch.Tensor,
        name: str | None = None,
        replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
        *,
        location: LocationLike | None = None,
        charge_bytes: ByteSize | None = None,
    ) -> ValueHandle:
        """Register ``tensor`` where it lives (or at ``location``, copying it there
        synchronously, which blocks the host: use it at start-up). A copy of
        :data:`~aresidency.progress.LARGE_WORK_BYTES` or more is reported as it runs (log
        records, and a bar on a terminal: see :func:`~aresidency.progress.progress`).

        The charge is the tensor's storage size rounded up to the allocator granularity (at
        least one granule, also for an empty tensor), or a larger ``charge_bytes`` (an int or
        a size such as ``"4MiB"``); it is fixed for the value's life and the same everywhere.
        A tensor whose storage the manager already holds (what ``manager.tensor`` returned, or
        a tensor registered before) is refused: two values must not share memory. Refused
        with ``ResidencyBudgetError`` when it would take room at a budgeted ``location`` that
        a waiting scope needs first (it cannot wait its turn)."""
        rt = self._running()
        _check_tensor(tensor, name)
        if name is not None:
            check_value_name(name)  # before anything is copied or checked against a budget
        if charge_bytes is not None:
            charge_bytes = parse_nbytes(charge_bytes, "charge_bytes", allow_zero=False)
        owner = rt.payloads.owner_of(tensor)
        if owner is not None:
            raise ValueError(
                f"this tensor's storage already belongs to {owner[0]} at {owner[1]}: two values "
                "cannot share memory (register a .clone() to make a new value)"
            )
        here = rt.backend.location_of(tensor)
        loc = here if location is None else Location.parse(location)
        rt.backend.check_location(loc)
        own = tensor.numel() * tensor.element_size()
        storage = max(tensor.untyped_storage().nbytes(), own)
        charge = value_charge(storage, charge_bytes, self._state.granularity)
        label = name if name is not None else f"value-{id(tensor):x}"
        what = f"registering {label!r}"
        if storage > own:
            # A slice of a large tensor: the charge is its whole storage, which a refusal
            # would otherwise call the value's size ("make the value smaller").
            what += (
                f", a view of a storage of {format_bytes(storage)}, charged whole (register "
                f"a .clone() to charge only its own {format_bytes(own)})"
            )
        ledger = self._state.ledger(loc)
        ledger.check_admit(charge, what)
        if ledger.budget_bytes is not None:
            # It cannot wait its turn: the room a waiting scope waits for is not taken first.
            rt.admission.refuse_nowait(
                {loc: (charge, "materialization")}, lambda: f"registering {label!r} at {loc}"
            )
        if loc == here:
            placed = tensor
        else:
            # Seconds for gigabytes into pinned memory: say so, so it is not taken for a hang.
            with progress_if_large(f"register {label!r}: copy to {loc}", storage) as report:
                # Detached: a copy carries no autograd state (a parameter's copy_ would
                # record a CopyBackwards and give the copy requires_grad).
                placed = rt.backend.place(tensor.detach(), loc)
                report.update(storage)
        handle = self._state.register(
            name=label, charge_bytes=charge, replica_mode=replica_mode, location=loc
        )
        rt.payloads.put(handle, loc, Payload(placed))
        rt.settle()
        return handle

    def register_source(
        self,
        source: Source,
        name: str | None = None,
        replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
        *,
        charge_bytes: ByteSize | None = None,
    ) -> ValueHandle:
        """Register a reconstructible value with no materialization yet; ``source.load()`` is
        called (in a worker thread) whenever it must be rebuilt. The source declares
        ``shape``, ``dtype`` and a host ``source_location``; what ``load`` returns is checked
        against them. ``charge_bytes`` is as :meth:`register` takes it."""
        rt = self._running()
        if name is not None:
            check_value_name(name)
        if charge_bytes is not None:
            charge_bytes = parse_nbytes(charge_bytes, "charge_bytes", allow_zero=False)
        for attribute in ("shape", "dtype", "source_location", "load"):
            if not hasattr(source, attribute):
                raise TypeError(f"a source needs {attribute!r}; {source!r} has none")
        if not callable(source.load):
            raise TypeError(f"{source!r}.load is not callable")
        if not isinstance(source.dtype, torch.dtype):
            raise TypeError(f"{source!r}.dtype must be a torch.dtype, got {source.dtype!r}")
        try:
            shape = tuple(int(d) for d in source.shape)
        except (TypeError, ValueError):
            raise TypeError(f"{source!r}.shape must be a sequence of ints") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"{source!r}.shape has a negative dimension: {shape}")
        source_location = Location.parse(source.source_location)
        if source_location.is_cuda:
            raise ValueError(
                f"{source!r} loads into {source_location}: a source loads into host memory "
                "(pageable-host or pinned-host)"
            )
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=source.dtype).element_size()
        charge = value_charge(nbytes, charge_bytes, self._state.granularity)
        handle = self._state.register(
            name=name if name is not None else f"source-{id(source):x}",
            charge_bytes=charge,
            replica_mode=replica_mode,
            has_source=True,
            source_location=source_location,
        )
        rt.sources[handle] = source
        rt.settle()
        return handle

    def _charged_by(self, action: Action) -> frozenset[Location]:
        """Where ``action`` would charge bytes (its destination, and its value's
        ``source_location`` when it must be rebuilt); validates the handle."""
        if isinstance(action, Release):
            self._state.materialization(action.handle, action.location)
            return frozenset()
        value = self._state.value(action.handle)
        out = {action.location}
        if value.has_source and value.source_location is not None and not value.holders():
            out.add(value.source_location)
        return frozenset(out)

    async def _run_direct(self, action: Action) -> None:
        """A direct operation: one action, its own errors raised as they are. Always a
        checkpoint (as every async call of trio's API is): a cancelled caller changes nothing,
        and an operation that had nothing to wait for (a value already there) still lets the
        loop run once it is done, so a loop of them never starves the other tasks.

        A release charges nothing and usually commits at once: its checkpoint comes first (a
        cancellation there changes nothing), and none follows it (the loop ran already). A
        placement checks for a cancellation first and lets the loop run after it began (its
        copy completes meanwhile), or once done when there was nothing to do."""
        rt = self._running()
        rt.backend.check_location(action.location)
        if type(action) is Release:
            await rt.checkpoint()
            if rt.closing:  # it began closing meanwhile: it carries out nothing more
                rt.check_thread()
            run = PhaseRun(rt, "execute", [action], record=False).start()
            finished_at_once = False  # the loop ran before it
        else:
            await rt.checkpoint_if_cancelled()
            if len(rt.admission):
                charged = self._charged_by(action)
                if charged:
                    await rt.admission.wait_turn(charged)
            else:  # nobody to wait behind; the handle is checked as _charged_by checks it
                self._state.value(action.handle)
            run = PhaseRun(rt, "execute", [action], record=False).start()
            finished_at_once = run.finished
        error: BaseException | None = None
        try:
            await run.wait()
        except ActionFailed as failed:
            error = failed.cause
        if error is not None:
            # Raised here, not in the except block (which would make the ActionFailed its
            # context, and that refers to it); the run and this frame let go of it: each is
            # in its traceback, and would be a cycle only the garbage collector frees.
            run.error = None
            try:
                raise self._failed(rt, error)
            finally:
                error = None
        if finished_at_once:  # a run that waited has let the loop run already
            await rt.cancel_shielded_checkpoint()

    @staticmethod
    def _failed(rt: Runtime, error: BaseException) -> BaseException:
        """A direct operation's error, on its way out: a ``ResidencyInUseError`` names the
        tasks owning the leases and holds; a budget error is logged (INFO)."""
        add_owners(rt, error)
        if isinstance(error, ResidencyBudgetError) and _log.isEnabledFor(logging.INFO):
            _log.info("direct operation refused: %s", error)
        return error

    async def materialize(self, handle: ValueHandle, location: LocationLike) -> None:
        """Make the value present at ``location`` (EXCLUSIVE: a move; REPLICABLE: a replica;
        with no copy anywhere, rebuilt from its source through ``source_location``). Awaits the
        transfer; the host does not block. Cancelling the call cancels the transfer (unless a
        lease was entered on the incoming copy) and leaves nothing behind."""
        await self._run_direct(Materialize(handle, Location.parse(location)))

    async def move(self, handle: ValueHandle, location: LocationLike) -> None:
        """Copy to ``location``, then free the copy it came from once the transfer and its
        readers completed."""
        await self._run_direct(Move(handle, Location.parse(location)))

    async def release(self, handle: ValueHandle, location: LocationLike) -> None:
        """Drop one materialization. Waits for its pending consumer events; an active lease or
        hold is ``ResidencyInUseError``; the last copy of a value without a source is refused."""
        await self._run_direct(Release(handle, Location.parse(location)))

    def materialize_nowait(self, handle: ValueHandle, location: LocationLike) -> PendingOperation:
        """Begin materializing now, synchronously, and return what completes it.

        The destination is charged before this returns (a budget, protection or endpoint error
        is raised here, changing nothing), and a copy's device work is already enqueued on its
        copy stream, so a lease at ``location`` may be entered at once: its stream waits for the
        copy on the device. The returned :class:`PendingOperation` commits the transfer
        when it completes, whether or not anyone awaits it; awaiting it raises a transfer
        error, and cancelling the await cancels it. A value already there gives one that is
        already done. Refused with ``ResidencyBudgetError`` when a waiting scope needs room
        at that location first (it cannot wait its turn)."""
        rt = self._running()
        loc = Location.parse(location)
        rt.backend.check_location(loc)
        action = Materialize(handle, loc)
        charged = self._charged_by(action)
        if charged and len(rt.admission):
            value = self._state.value(handle)
            charges = {
                where: (
                    value.charge_bytes,
                    "materialization" if where == loc else "reconstruction",
                )
                for where in charged
                if where not in value.materializations
            }
            rt.admission.refuse_nowait(charges, lambda: f"{handle} to {loc}", handle)
        run = PhaseRun(rt, "execute", [action], record=False).start()
        if run.finished and isinstance(run.error, ActionFailed):
            raise self._failed(rt, run.error.cause) from None
        return PendingOperation(run)

    def release_nowait(self, handle: ValueHandle, location: LocationLike) -> PendingOperation:
        """Begin releasing now and return what completes it: the release commits (and frees
        the budget) once the materialization's consumer events completed, whether or not
        anyone awaits it. A lease or hold on it is ``ResidencyInUseError`` here; so is the
        last copy of a value without a source (``ResidencyPlanError``)."""
        rt = self._running()
        loc = Location.parse(location)
        rt.backend.check_location(loc)
        run = PhaseRun(rt, "execute", [Release(handle, loc)], record=False).start()
        if run.finished and isinstance(run.error, ActionFailed):
            raise self._failed(rt, run.error.cause) from None
        return PendingOperation(run)

    def when_copy_issued(
        self, handle: ValueHandle, location: LocationLike, callback: Callable[[], None]
    ) -> None:
        """Call ``callback()`` on the loop once :meth:`copy_issued` would say true (soon, on
        the loop, if it already does; never if the materialization goes away first)."""
        rt = self._running()
        loc = Location.parse(location)
        payload = rt.payloads.get(handle, loc)
        transfer = None if payload is None else payload.transfer
        if transfer is None or transfer.issued():
            rt.bridge.call_soon(callback)
            return
        transfer.when_issued(lambda: rt.bridge.call_soon_quietly(callback))

    def discard_nowait(self, handle: ValueHandle) -> None:
        """:meth:`discard` now, synchronously, for a value without pending consumer events
        (``ResidencyInUseError`` otherwise, changing nothing)."""
        rt = self._running()
        try:
            self._state.discard(handle)
        except BaseException as error:
            raise self._failed(rt, error) from None
        rt.sources.pop(handle, None)
        rt.settle()

    async def discard(self, handle: ValueHandle) -> None:
        """Forget the value: waits for its consumer events, then frees every materialization
        and removes the value from the state. Active leases or holds are
        ``ResidencyInUseError``. Always a checkpoint: a cancelled caller discards nothing, and
        one that had nothing to wait for still lets the loop run (after the discard), so a
        loop of discards never starves the other tasks."""
        rt = self._running()
        await rt.checkpoint_if_cancelled()
        waited = False
        while True:
            value = self._state.value(handle)
            if not any(m.pending_event_count for m in value.materializations.values()):
                break
            await rt.signal.wait()
            waited = True
        try:
            self._state.discard(handle)
        except BaseException as error:
            raise self._failed(rt, error) from None
        rt.sources.pop(handle, None)
        rt.settle()
        if not waited:
            await rt.cancel_shielded_checkpoint()

    def _materialization(self, rt: Runtime, handle: ValueHandle, loc: Location) -> Materialization:
        """The materialization of ``handle`` at ``loc``; where there is none, a location this
        backend does not have is the ``ValueError`` every call gives for it (checked only
        then: the lookup is on the leases' fast path)."""
        try:
            return self._state.materialization(handle, loc)
        except ResidencyUnavailableError:
            rt.backend.check_location(loc)
            raise

    def acquire(
        self,
        handle: ValueHandle,
        location: LocationLike,
        *,
        stream: Any = None,
        mode: str = "read",
        order_stream: bool = True,
        on_behalf_of: TaskRef | None = None,
    ) -> Lease:
        """A lease on the materialization at ``location`` (never places it). See ``Lease``.
        The materialization, ``mode`` and ``stream`` are checked here, before ``async with``.
        The lease is the task's that enters it (its name in reports; admission counts it as
        that task's own), or ``on_behalf_of``'s (a ``TaskRef`` from ``current_task_ref()``),
        for a tenant that enters leases for a task in loop callbacks, as for :meth:`hold`."""
        rt = self._running()
        loc = Location.parse(location)
        self._materialization(rt, handle, loc)  # fail fast, before 'async with'
        return Lease(
            rt,
            handle,
            loc,
            stream=stream,
            mode=mode,
            order_stream=order_stream,
            on_behalf_of=on_behalf_of,
        )

    def hold(
        self,
        handle: ValueHandle,
        location: LocationLike,
        *,
        on_behalf_of: TaskRef | None = None,
    ) -> Hold:
        """Protect the materialization from removal until ``hold.release()``. The hold is
        the calling task's (its name in reports; admission counts it as that task's own), or
        ``on_behalf_of``'s: a :class:`~aresidency.runtime.leases.TaskRef` taken in a task by
        ``current_task_ref()``, for a tenant that takes holds for it in a loop callback."""
        rt = self._running()
        loc = Location.parse(location)
        self._materialization(rt, handle, loc)
        return Hold(rt, handle, loc, on_behalf_of)

    def held_tensor(self, handle: ValueHandle, location: LocationLike) -> torch.Tensor | None:
        """The tensor behind a held materialization, when it can be read at once: its data is
        there (no copy in flight, none failed or being cancelled). ``None`` otherwise (read
        through a lease then: it waits for the copy and reports its failure).

        For a caller that protects the materialization with a :meth:`hold` of its own for as
        long as it reads it, and reads it many times (a model's weights, call after call): no
        lease per read. Its reads on a device are reported with :meth:`track_readers` before
        the hold ends. ``ValueError`` if the materialization has no hold."""
        rt = self._running()
        loc = Location.parse(location)
        mat = self._materialization(rt, handle, loc)
        if not mat.hold_count:
            raise ValueError(
                f"{handle} at {loc} has no hold: held_tensor is for reads a hold protects "
                "(use acquire for a lease)"
            )
        payload = rt.payloads.get(handle, loc)
        if payload is None or payload.transfer is not None:
            return None
        if payload.failure is not None or payload.aborting:
            return None
        return payload.tensor

    def track_readers(self, handle: ValueHandle, location: LocationLike, events: list[Any]) -> None:
        """Count device ``events`` (recorded after kernels that read the materialization's
        tensor) as its pending consumers: it is not released or moved before they complete.
        For reads a hold protected (:meth:`held_tensor`), reported before the hold ends; a
        lease records its own. Events already complete are not counted."""
        rt = self._running()
        loc = Location.parse(location)
        self._materialization(rt, handle, loc)
        pending = [event for event in events if not event.query()]
        if pending:
            rt.reaper.track_readers(handle, loc, pending)
            rt.settle()

    def tensor(self, handle: ValueHandle, location: LocationLike) -> torch.Tensor:
        """The tensor behind a materialization, for inspection only: it is not protected, so
        use ``acquire`` for real work (and never register it again: it is the manager's)."""
        rt = self._running()
        loc = Location.parse(location)
        self._materialization(rt, handle, loc)
        payload = rt.payloads.get(handle, loc)
        if payload is None:
            raise ResidencyUnavailableError(handle, loc, "its data is still being loaded")
        return payload.tensor

    # ------------------------------------------------------------- evidence

    def snapshot(self) -> ResidencySnapshot:
        """Atomic, tensor-free view (taken in one synchronous step on the loop). The pinned
        arena's spare bytes are read now: its blocks return when their last tensor dies,
        which is no state change of the manager's. Once the manager closed, the final state
        (what was active at close included, as :meth:`dump` writes it), from any thread."""
        if self._status == "closed":
            return take_snapshot(self._state)
        self._running().sync_spare()
        return take_snapshot(self._state)

    async def snapshot_async(self, *, slice_seconds: float = 0.0005) -> ResidencySnapshot:
        """:meth:`snapshot`, without blocking the loop however many values changed: the value
        records are brought up to date in slices of at most ``slice_seconds``, letting the
        loop run between them, and the snapshot is taken (atomically, in one step) once a
        slice left nothing to do. For endpoints and dashboards of managers with many values
        (the first :meth:`snapshot` of 100,000 values builds every record at once: about a
        second of loop time on a slow CPU)."""
        check_timeout(slice_seconds, "slice_seconds")
        while True:
            rt = self._running()
            if bring_up_to_date(rt.state, slice_seconds):
                return self.snapshot()
            await anyio.lowlevel.checkpoint()

    def reset_peak_bytes(self, location: LocationLike | None = None) -> None:
        """Set the peak of one location (or of all) to its current charge, as
        ``torch.cuda.reset_peak_memory_stats`` does for the allocator. Bumps the version.
        ``ValueError`` for a location this manager does not have."""
        rt = self._running()
        self._state.reset_peak_bytes(location)
        rt.settle()

    def trace(self) -> ResidencyTrace:
        """The bounded trace of committed transitions; once the manager closed, the final
        one, from any thread."""
        if self._status != "closed":
            self._running()
        return self._state.trace_ring.view()

    # ---------------------------------------------------------------- plans

    def explain(self, plan: Any) -> PlanExplanation:
        """Simulate ``plan`` (or a decision's plan) against the current state; nothing
        changes."""
        rt = self._running()
        resolved = plan_of(plan, self.id)
        for action in (*resolved.reclaim, *resolved.enter, *resolved.exit, *resolved.reserve):
            rt.backend.check_location(action.location)
        return explain_plan(self._state, resolved)

    async def execute(self, plan: Any) -> ExecutionReport:
        """Run a plan now (phase ``execute``): reclaim, reservations, enter, end of the
        reservations, exit. It never waits for room: preflight (staleness, ``explain``) raises
        ``ResidencyPlanError`` before anything changes; a later failure is
        ``ResidencyPlanExecutionError``. Like ``move``, it first waits its turn behind scopes
        already waiting for room where it charges (unless the caller holds room, such as a
        lease, hold, scope or reservation block: see :mod:`~aresidency.runtime.admission`), so
        it does not overtake them."""
        scope = Scope(self._running(), plan, timeout=0, phase_name="execute")
        async with scope:
            pass
        return scope.report

    def scope(
        self,
        plan_or_decision: Any,
        timeout: float | None = None,
        *,
        turn: AdmissionTurn | None = None,
    ) -> Scope:
        """A single-use async context manager that enters the plan (or a controller decision)
        and undoes its reservations and runs its exit actions at the end. See ``Scope``.
        ``turn``: a place in the admission queue taken with :meth:`take_turn`, where the
        scope waits instead of at the back of the queue (``ValueError`` for one this manager
        did not give, or that ended)."""
        return Scope(self._running(), plan_or_decision, timeout=timeout, turn=turn)

    def take_turn(
        self, locations: Iterable[LocationLike], *, only_behind_others: bool = False
    ) -> AdmissionTurn | None:
        """A place at the back of the admission queue, for a scope charging ``locations``
        that judges its own admission and waits for room outside the queue's own check
        (``controller.scope``: each change of the state means a new decision). While the
        turn is in the queue it counts as a scope waiting for room there: later scopes and
        direct operations charging those locations queue behind it, and operations that
        cannot wait are refused (see :meth:`reservation`). Its owner judges whenever
        ``await turn.wait(deadline)`` returns (woken by a change while the turn is first
        among the waiters it contends with), enters with ``manager.scope(decision,
        turn=turn)`` (admitted there, it ends the turn) and calls ``turn.leave()`` in any
        case (once admitted, that does nothing). A task that holds room of this manager (a
        lease, hold, entered scope or reservation) waits behind no one, as its scopes do. The
        task's own calls never wait behind its turn, nor are refused for overtaking it (it is
        not waiting in it while it makes them: they would wait for ever).
        ``only_behind_others``: ``None`` unless the turn would wait behind an earlier waiter.
        Loop thread; never waits."""
        rt = self._running()
        locs = [Location.parse(location) for location in locations]
        for loc in locs:
            rt.backend.check_location(loc)
        return rt.admission.take_turn(locs, only_behind_others=only_behind_others)

    def reservation(
        self, name: str, location: LocationLike, nbytes: ByteSize
    ) -> AbstractAsyncContextManager[None]:
        """A named reservation held for the ``async with`` block (no waiting: over budget is
        ``ResidencyBudgetError`` at once, and so is one that would take room a waiting scope
        needs first: ``waiting_scopes`` says so, its byte fields are true). A block that ends
        after the manager closed changes nothing and raises ``ManagerClosedError`` (unless the
        body raised). Single use, as a scope: entering the returned object again is a
        ``RuntimeError`` (call ``reservation`` again for another block)."""
        try:
            size = f"{parse_nbytes(nbytes)} B"
        except (TypeError, ValueError):
            size = repr(nbytes)  # refused when the block is entered
        return _SingleUse(
            self._reservation_block(name, location, nbytes),
            f"manager.reservation({name!r}, {location!r}, ...)",
            f"manager.reservation({name!r}, {str(location)!r}, {size})",
        )

    @asynccontextmanager
    async def _reservation_block(
        self, name: str, location: LocationLike, nbytes: ByteSize
    ) -> AsyncIterator[None]:
        rt = self._running()
        loc = Location.parse(location)
        rt.backend.check_location(loc)
        self._refuse_reservation(rt, name, loc, nbytes)
        self._state.reserve(name, loc, nbytes, owner="block")
        # The block's task keeps it: a scope or wait of that task never waits on its room.
        rt.blocks[name, loc] = current_task()
        rt.settle()
        try:
            yield
        except BaseException:
            rt.blocks.pop((name, loc), None)
            if not rt.frozen:
                self._state.unreserve(name, loc)
                rt.settle()
            raise
        rt.blocks.pop((name, loc), None)
        rt.check_not_frozen(f"the reservation {name!r} at {loc}")
        self._state.unreserve(name, loc)
        rt.settle()

    def reserve_nowait(
        self, name: str, location: LocationLike, nbytes: ByteSize, *, task_owned: bool = True
    ) -> None:
        """Admit a named reservation of ``nbytes`` at ``location`` now, held until
        :meth:`unreserve_nowait` (``ResidencyBudgetError`` at once when it does not fit;
        ``DuplicateReservationError`` for a name already active there; refused while a scope
        waits for room there: see :meth:`reservation`). Loop thread.

        The reservation is the calling task's own room until it ends (whichever task ends
        it), as a reservation block is: a scope, controller scope or other wait of that task
        that only it keeps out is refused at once (``ResidencyPlanError``, ``hold_and_wait``)
        instead of waiting for itself, and the task's direct operations and scopes do not
        queue behind scopes that may wait for that room. ``task_owned=False``: nobody's, for a
        tenant that reserves for itself and gives the room back on its own (a loader's ring
        slots, reserved from a change listener, which runs in whichever task changed the
        state); one made outside any task (a loop callback) is nobody's too. Nobody's room
        counts as transient for every waiter."""
        if not isinstance(task_owned, bool):
            raise TypeError(f"task_owned must be True or False, got {task_owned!r}")
        rt = self._running()
        loc = Location.parse(location)
        rt.backend.check_location(loc)
        self._refuse_reservation(rt, name, loc, nbytes)
        self._state.reserve(name, loc, nbytes, owner="direct")
        # The task that made it keeps it until it ends it: a wait of that task that only this
        # room keeps out would never end (see AdmissionQueue).
        task = current_task() if task_owned else None
        if task is not None:
            rt.nowaits[name, loc] = task
        rt.settle()

    @staticmethod
    def _refuse_reservation(rt: Runtime, name: str, location: Location, nbytes: Any) -> None:
        """A direct reservation cannot wait: refused while a scope waits for room there (its
        size read as the reservation will read it: ``"8KiB"`` and ``8192.0`` too)."""
        if len(rt.admission):
            size = parse_nbytes(nbytes, f"reservation {name!r}")
            if size > 0:
                rt.admission.refuse_nowait(
                    {location: (size, "reservation")}, lambda: f"reservation {name!r}"
                )

    def unreserve_nowait(self, name: str, location: LocationLike) -> int:
        """End the reservation ``name`` at ``location`` that :meth:`reserve_nowait` made;
        returns its bytes. ``ValueError`` if none is active, and for one that a scope, a
        :meth:`reservation` block or the backend holds (each ends its own). Loop thread."""
        rt = self._running()
        loc = Location.parse(location)
        rt.backend.check_location(loc)
        ledger = self._state.find_ledger(loc)
        entry = None if ledger is None else ledger.reservations.get(name)
        if entry is not None and entry[1] != "direct":
            owner = entry[1]
            held_by = (
                "the backend, for the manager's lifetime"
                if owner == "backend"
                else "a 'manager.reservation' block, which ends it when the block ends"
                if owner == "block"
                else f"{owner!r}, which ends it when its body ends"
            )
            raise ValueError(
                f"the reservation {name!r} at {loc} was not made by reserve_nowait: it is held "
                f"by {held_by}; unreserve_nowait ends only reservations reserve_nowait made"
            )
        nbytes = self._state.unreserve(name, loc)
        rt.nowaits.pop((name, loc), None)
        rt.settle()
        return nbytes

    # ------------------------------------------------------------- diagnosis

    def owners(self) -> list[tuple[ValueHandle, Location, str, str]]:
        """Every active lease and hold as ``(handle, location, kind, task name)``: the task
        that entered it (``kind`` is ``"read lease"``, ``"write lease"`` or ``"hold"``).
        Loop thread; empty once the manager closed."""
        rt = self._rt
        if rt is None or self._status != "running":
            return []
        rt.check_thread()
        return lease_owners(rt).entries()

    def dump(self, path: str | os.PathLike[str], error: BaseException | None = None) -> Path:
        """Write the evidence for a diagnosis to ``path`` as JSON: the snapshot, the trace,
        the owners of active leases and holds, ``error.to_dict()`` and, for an error that
        carries a plan, ``explain`` of it against the current state. ``python -m aresidency
        diagnose PATH`` prints the report :func:`aresidency.diagnose` would from it.

        Taken in one synchronous step on the loop (so it is one state), also after the
        manager closed; the host then waits for the file to be written (a few hundred KiB
        at most for the default trace capacity; call it off the hot path). Returns the path."""
        from ..diagnosis.evidence import collect, write_dump

        if error is not None and not isinstance(error, BaseException):
            raise TypeError(
                f"manager.dump(path, error): error is the exception that was raised (or "
                f"None), got {type(error).__name__}"
            )
        return write_dump(path, collect(self, error), error)

    def export_timeline(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace as a Chrome trace-event JSON file (open it in Perfetto or
        chrome://tracing): each value a track with its copies, moves and loads (begin to
        commit or abort), leases and holds as durations; each location's used and reserved
        bytes as counters; reservations on tracks of their own. Covers what the trace kept
        (``trace_capacity``). One synchronous step on the loop, then the host waits for the
        file to be written. Returns the path."""
        from ..diagnosis.timeline import write_timeline

        if self.running:
            self.check_thread()
        return write_timeline(path, self._state.trace_ring.view(), take_snapshot(self._state))
