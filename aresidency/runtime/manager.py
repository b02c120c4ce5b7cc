"""``ResidencyManager``: the event-loop side of the model.

State (all owned by one event loop, mutated only on it; a call from another thread raises
``RuntimeError``):

* ``_state``: the pure model (``core.ResidencyState``): ledger, values, materializations.
* ``_payloads[(handle, location)]``: the tensor behind each materialization, the transfer still
  writing it (``None`` once committed) and its pending consumer events.
* ``_admission``: scopes waiting for admission, first come first served.
* ``_background``: reaper tasks, one per pending device event, each committing an
  ``event_reaped`` transition when its event completes.

Invariants: a payload exists exactly for each materialization of the model; a tensor is handed
to ``backend.free`` only after the model removed its materialization, which it allows only once
every transfer out of it and every consumer event has completed (DESIGN.md rule 3).

Each state change is computed synchronously on the model (which validates first, then commits)
and returns the device work; the manager then issues that work and awaits it. Cleanup after
failure or cancellation finishes the device work already issued before giving up.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from ..backends.base import Backend, DeviceEvent, Transfer
from ..core.errors import (
    ResidencyError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyStaleStateError,
)
from ..core.locations import Location, LocationLike
from ..core.plans import (
    ActionFailed,
    ExecutionReport,
    Materialize,
    Move,
    PlanExplanation,
    Release,
    ResidencyPlan,
    SettleRequest,
    TransferRequest,
    TransitionRecorder,
    explain_plan,
    plan_fits,
    run_phase,
)
from ..core.snapshot import ResidencySnapshot, take_snapshot
from ..core.state import (
    DEFAULT_GRANULARITY,
    CopyTicket,
    ReplicaMode,
    ResidencyState,
    ValueHandle,
    value_charge,
)
from ..core.trace import ResidencyTrace, Transition
from .leases import Hold, Lease
from .sources import Source

__all__ = ["ResidencyManager", "Scope"]

STAGING_RESERVATION = "aresidency.staging"


@dataclass(slots=True)
class _Payload:
    tensor: torch.Tensor
    transfer: Transfer | None = None
    ready_event: DeviceEvent | None = None
    events: list[DeviceEvent] = field(default_factory=list)


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


def _where(tensor: torch.Tensor, backend: Backend) -> Location:
    if tensor.device.type == "cuda":
        return Location("cuda", tensor.device.index or 0)
    if tensor.device.type != "cpu":
        raise ValueError(f"cannot manage a tensor on device {tensor.device}")
    sim_location = getattr(backend, "location_of", None)
    if sim_location is not None:
        found = sim_location(tensor)
        if found is not None:
            return Location.parse(found)
    return Location("pinned-host") if tensor.is_pinned() else Location("pageable-host")


class ResidencyManager:
    """Owns residency state and carries out transitions on a device backend.

    ``budgets`` maps locations to strict byte budgets (``None`` or absent: no strict budget).
    ``backend`` is ``"auto"`` (CUDA when available, else the simulation), ``"cuda"``, ``"sim"``
    (a simulation of CUDA devices in host memory) or a ``Backend`` instance.
    ``trace_capacity=0`` disables the trace. Use as ``async with ResidencyManager(...) as m``.
    """

    def __init__(
        self,
        budgets: Mapping[Any, int | None] | None = None,
        backend: Any = "auto",
        trace_capacity: int = 4096,
        *,
        granularity: int = DEFAULT_GRANULARITY,
        reserve_staging: bool = True,
    ) -> None:
        self._state = ResidencyState(
            budgets=dict(budgets or {}), trace_capacity=trace_capacity, granularity=granularity
        )
        self._backend_spec = backend
        self._backend: Backend | None = None
        self._reserve_staging = reserve_staging
        self._payloads: dict[tuple[ValueHandle, Location], _Payload] = {}
        self._sources: dict[ValueHandle, Source] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._changed: list[asyncio.Future[None]] = []
        self._admission: collections.deque[asyncio.Future[None]] = collections.deque()
        self._running = False
        self._closed = False
        self._state.observers.append(self._on_transition)

    # ---------------------------------------------------------------- lifecycle

    @property
    def id(self) -> str:
        return self._state.manager_id

    @property
    def state_version(self) -> int:
        return self._state.state_version

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("the manager is not running: use 'async with ResidencyManager()'")
        return self._backend

    async def __aenter__(self) -> ResidencyManager:
        if self._running or self._closed:
            raise RuntimeError("a ResidencyManager can be entered once")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        backend = _make_backend(self._backend_spec)
        for location in self._state.locations():
            backend.check_location(location)
        # Every location of the machine appears in snapshots from the start.
        for host in ("pageable-host", "pinned-host"):
            self._state.ledger(host)
        for index in range(backend.device_count()):
            self._state.ledger(Location("cuda", index))
        backend.start()
        self._backend = backend
        staging = backend.staging_nbytes()
        if self._reserve_staging and staging:
            self._state.reserve(STAGING_RESERVATION, "pinned-host", staging, owner="backend")
        self._running = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Wait for in-flight transfers and consumer events, then stop the backend."""
        try:
            while True:
                # Only tasks still running are awaited: a finished one whose done-callback has
                # not removed it yet must not make this loop spin.
                self._background.difference_update([t for t in self._background if t.done()])
                if not self._background:
                    break
                await asyncio.wait(list(self._background))
        finally:
            self._running = False
            self._closed = True
            if self._backend is not None:
                await self._backend.aclose()

    def _check_loop(self) -> None:
        if not self._running:
            raise RuntimeError("the manager is not running: use 'async with ResidencyManager()'")
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "ResidencyManager state is owned by its event loop's thread; call it from that "
                "thread (use loop.call_soon_threadsafe or asyncio.run_coroutine_threadsafe)"
            )

    def __repr__(self) -> str:
        backend = self._backend.name if self._backend is not None else self._backend_spec
        return (
            f"<ResidencyManager {self.id} v{self.state_version} backend={backend} "
            f"[{sum(1 for v in self._state.values() if not v.discarded)} values, "
            f"{len(self._admission)} waiting]>"
        )

    # ---------------------------------------------------------- notifications

    def _notify(self) -> None:
        """Wake tasks waiting for a state change: all generic waiters, and the head of the
        admission queue (the others wait their turn)."""
        waiters, self._changed = self._changed, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        if self._admission and not self._admission[0].done():
            self._admission[0].set_result(None)

    async def _wait_change(self, deadline: float | None = None) -> bool:
        """Park until the state changes (False if ``deadline`` passed first)."""
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        self._changed.append(fut)
        try:
            if deadline is None:
                await fut
                return True
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            await asyncio.wait_for(fut, remaining)
            return True
        except TimeoutError:
            return False
        finally:
            if fut in self._changed:
                self._changed.remove(fut)

    def _on_transition(self, transition: Transition) -> None:
        """Keep payloads in step with the model; free tensors the model no longer references."""
        kind = transition.kind
        handle = transition.handle
        if kind in ("release", "invalidate", "move_commit", "copy_abort"):
            assert transition.location is not None
            payload = self._payloads.pop((handle, transition.location), None)
            if payload is not None and self._backend is not None:
                self._backend.free(payload.tensor, transition.location)
        elif kind == "discard":
            for key in [k for k in self._payloads if k[0] == handle]:
                payload = self._payloads.pop(key)
                if self._backend is not None:
                    self._backend.free(payload.tensor, key[1])
        elif kind in ("copy_commit", "load_commit"):
            assert transition.location is not None
            payload = self._payloads.get((handle, transition.location))
            if payload is not None and payload.transfer is not None:
                payload.transfer = None

    # -------------------------------------------------------------- reaping

    def _track_events(
        self, handle: ValueHandle, location: Location, events: list[DeviceEvent]
    ) -> None:
        """Count ``events`` as pending consumers of the materialization; reap each when done."""
        payload = self._payloads[(handle, location)]
        payload.events.extend(events)
        self._state.record_events(handle, location, len(events))
        for event in events:
            self._spawn(self._reap(handle, location, event))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reap(self, handle: ValueHandle, location: Location, event: DeviceEvent) -> None:
        # The device event will complete whatever happens to the awaiting task; this task is
        # never cancelled by the manager, so no event is ever forgotten (rule 3).
        await self._wait_device_event(event)
        payload = self._payloads.get((handle, location))
        if payload is not None and event in payload.events:
            payload.events.remove(event)
        value = self._state.value(handle, allow_discarded=True)
        mat = value.materializations.get(location)
        if mat is not None and mat.pending_event_count > 0:
            self._state.reap_events(handle, location, 1)
        self._notify()

    async def _wait_device_event(self, event: DeviceEvent) -> None:
        """``backend.wait_event``, with a safety net: every 50 ms of waiting the event is also
        queried here, so a wake-up the backend lost can delay reaping but never hang it. The
        net costs nothing on waits shorter than 50 ms."""
        waiting = asyncio.ensure_future(self.backend.wait_event(event))
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=0.05)
                if done:
                    waiting.result()
                    return
                if event.query():
                    return
        finally:
            if not waiting.done():
                waiting.cancel()

    async def _settle_unused(self, handle: ValueHandle, location: Location) -> None:
        """Wait until nothing uses, holds or reads the materialization (shielded: the wait
        continues through cancellation, which is re-raised afterwards)."""
        cancelled = False
        while True:
            value = self._state.value(handle, allow_discarded=True)
            mat = value.materializations.get(location)
            if mat is None or not mat.protected:
                break
            try:
                await self._wait_change()
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    async def _settle(self, handle: ValueHandle, location: Location, keep: int = 0) -> None:
        """Wait until the materialization has at most ``keep`` pending events."""
        while True:
            value = self._state.value(handle, allow_discarded=True)
            mat = value.materializations.get(location)
            if mat is None or mat.pending_event_count <= keep:
                return
            await self._wait_change()

    # -------------------------------------------------------------- transfers

    def _start_copy(self, ticket: CopyTicket) -> Transfer:
        """Issue a begun copy's device work now (the host does not wait); record its payload."""
        assert ticket.source is not None
        src = self._payloads[(ticket.handle, ticket.source)]
        waits = list(src.events)
        if src.ready_event is not None:
            waits.append(src.ready_event)
        transfer = self.backend.copy(
            src.tensor, ticket.source, ticket.destination, wait_events=waits
        )
        self._payloads[(ticket.handle, ticket.destination)] = _Payload(
            transfer.tensor, transfer=transfer
        )
        return transfer

    async def _perform(
        self,
        ticket: CopyTicket,
        transfer: Transfer | None = None,
        siblings: tuple[CopyTicket, ...] = (),
    ) -> None:
        """Carry out one begun transfer; raise its error. Leaves the commit to the caller, which
        commits ``siblings`` (the other tickets of the same request) together with it."""
        key = (ticket.handle, ticket.destination)
        if ticket.source is None:
            # A rebuild: load in a worker thread (never on the loop), into the source location,
            # then, for another destination, copy from that temporary copy.
            source = self._sources[ticket.handle]
            loop = asyncio.get_running_loop()
            tensor = (await loop.run_in_executor(None, source.load)).contiguous()
            first = ticket.via if ticket.via is not None else ticket.destination
            if first.is_pinned:
                tensor = await loop.run_in_executor(None, self.backend.place, tensor, first)
            if ticket.via is None:
                self._payloads[key] = _Payload(tensor)
                return
            if ticket.destination.is_host:
                placed = await loop.run_in_executor(
                    None, self.backend.place, tensor, ticket.destination
                )
                self._payloads[key] = _Payload(placed)
                return
            transfer = self.backend.copy(tensor, ticket.via, ticket.destination)
            self._payloads[key] = _Payload(transfer.tensor, transfer=transfer)
            await transfer.wait()
            return
        if transfer is None:
            transfer = self._start_copy(ticket)
        try:
            await transfer.wait()
        except BaseException:
            # Leases entered on the incoming copy may have enqueued readers: its storage is
            # freed (by the abort) only once they have exited and their events completed.
            await self._settle_unused(ticket.handle, ticket.destination)
            raise
        if ticket.move:
            # The source is freed at commit: its consumers and the copies out of it begun
            # elsewhere must have completed first. Copies of the same request that read it
            # commit with this one, so they are not waited for (that would never end).
            ours = sum(
                1
                for other in siblings
                if other is not ticket
                and other.handle == ticket.handle
                and other.source == ticket.source
            )
            await self._settle(ticket.handle, ticket.source, keep=1 + ours)

    async def _serve_transfers(
        self, tickets: tuple[CopyTicket, ...]
    ) -> tuple[dict[int, BaseException | None], bool]:
        """Run tickets concurrently; always wait for all of them (device work already issued
        completes even if this task is cancelled). Returns errors by ticket id and whether a
        cancellation arrived meanwhile."""
        tasks = {
            t.ticket_id: asyncio.ensure_future(self._perform(t, siblings=tickets)) for t in tickets
        }
        cancelled = False
        while True:
            try:
                await asyncio.wait(list(tasks.values()))
                break
            except asyncio.CancelledError:
                cancelled = True
                for ticket in tickets:
                    payload = self._payloads.get((ticket.handle, ticket.destination))
                    if payload is not None and payload.transfer is not None:
                        payload.transfer.cancel()
        errors: dict[int, BaseException | None] = {}
        for ticket_id, task in tasks.items():
            if task.cancelled():
                errors[ticket_id] = asyncio.CancelledError()
            else:
                errors[ticket_id] = task.exception()
        return errors, cancelled

    async def _drive(self, state: ResidencyState, phase: str, actions: Any) -> None:
        """Drive one phase of :func:`run_phase` on the live state."""
        gen = run_phase(state, phase, actions)
        try:
            request = next(gen)
        except StopIteration:
            self._notify()  # committed at once (a release without pending events): wake waiters
            return
        while True:
            cancelled = False
            response: Any = None
            if isinstance(request, SettleRequest):
                try:
                    await self._settle(request.handle, request.location)
                except BaseException as error:
                    gen.throw(error)  # aborts what the phase began, then re-raises
                    raise
            else:
                assert isinstance(request, TransferRequest)
                response, cancelled = await self._serve_transfers(request.tickets)
            try:
                request = gen.send(response)
            except StopIteration:
                if cancelled:
                    raise asyncio.CancelledError from None
                return
            except ActionFailed:
                if cancelled:
                    raise asyncio.CancelledError from None
                raise
            finally:
                self._notify()
            if cancelled:
                try:
                    gen.throw(asyncio.CancelledError())
                except StopIteration:
                    pass
                raise asyncio.CancelledError

    # ---------------------------------------------------------------- values

    def set_budget(self, location: LocationLike, budget_bytes: int | None) -> None:
        """Set (or clear with ``None``) a strict budget; refused below the current charge."""
        self._check_loop()
        loc = Location.parse(location)
        self.backend.check_location(loc)
        self._state.set_budget(loc, budget_bytes)
        self._notify()

    def register(
        self,
        tensor: torch.Tensor,
        name: str | None = None,
        replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
        *,
        location: LocationLike | None = None,
        charge_bytes: int | None = None,
    ) -> ValueHandle:
        """Register ``tensor`` where it lives (or at ``location``, copying it there
        synchronously, which blocks the host: use it at start-up).

        The charge is the tensor's storage size rounded up to the allocator granularity, or a
        larger ``charge_bytes``; it is fixed for the value's life and the same everywhere."""
        self._check_loop()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register takes a torch.Tensor, got {type(tensor).__name__}")
        here = _where(tensor, self.backend)
        loc = here if location is None else Location.parse(location)
        self.backend.check_location(loc)
        storage = max(tensor.untyped_storage().nbytes(), tensor.numel() * tensor.element_size())
        charge = value_charge(storage, charge_bytes, self._state.granularity)
        self._state.ledger(loc).check_admit(charge, f"registering {name or 'a value'!r}")
        placed = tensor if loc == here else self.backend.place(tensor, loc)
        handle = self._state.register(
            name=name if name is not None else f"value-{id(tensor):x}",
            charge_bytes=charge,
            replica_mode=replica_mode,
            location=loc,
        )
        self._payloads[(handle, loc)] = _Payload(placed)
        return handle

    def register_source(
        self,
        source: Source,
        name: str | None = None,
        replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
        *,
        charge_bytes: int | None = None,
    ) -> ValueHandle:
        """Register a reconstructible value with no materialization yet; ``source.load()`` is
        called (in a worker thread) whenever it must be rebuilt."""
        self._check_loop()
        for attribute in ("shape", "dtype", "source_location", "load"):
            if not hasattr(source, attribute):
                raise TypeError(f"a source needs {attribute!r}; {source!r} has none")
        numel = 1
        for dim in source.shape:
            numel *= int(dim)
        nbytes = numel * torch.empty((), dtype=source.dtype).element_size()
        charge = value_charge(nbytes, charge_bytes, self._state.granularity)
        handle = self._state.register(
            name=name if name is not None else f"source-{id(source):x}",
            charge_bytes=charge,
            replica_mode=replica_mode,
            has_source=True,
            source_location=source.source_location,
        )
        self._sources[handle] = source
        return handle

    async def _run_one(self, action: Any) -> None:
        """A direct operation: one action, its own errors raised as they are."""
        self._check_loop()
        self.backend.check_location(action.location)
        try:
            await self._drive(self._state, "execute", [action])
        except ActionFailed as failed:
            raise failed.cause from None

    async def materialize(self, handle: ValueHandle, location: LocationLike) -> None:
        """Make the value present at ``location`` (EXCLUSIVE: a move; REPLICABLE: a replica;
        with no copy anywhere, rebuilt from its source through ``source_location``). Awaits the
        transfer; the host does not block."""
        await self._run_one(Materialize(handle, Location.parse(location)))

    async def move(self, handle: ValueHandle, location: LocationLike) -> None:
        """Copy to ``location``, then free the copy it came from once the transfer and its
        readers completed."""
        await self._run_one(Move(handle, Location.parse(location)))

    async def release(self, handle: ValueHandle, location: LocationLike) -> None:
        """Drop one materialization. Waits for its pending consumer events; an active lease or
        hold is ``ResidencyInUseError``; the last copy of a value without a source is refused."""
        await self._run_one(Release(handle, Location.parse(location)))

    def materialize_nowait(self, handle: ValueHandle, location: LocationLike) -> asyncio.Task[None]:
        """Begin materializing now, synchronously, and return the task that completes it.

        The destination is charged before this returns (a budget, protection or endpoint error
        is raised here, changing nothing), and a copy's device work is already enqueued on its
        copy stream, so a lease at ``location`` may be entered at once: its stream waits for the
        copy on the device. The returned task commits the transfer when it completes (await it
        to see a transfer error). A value already there gives a task that is already done."""
        self._check_loop()
        loc = Location.parse(location)
        self.backend.check_location(loc)
        gen = run_phase(self._state, "execute", [Materialize(handle, loc)])
        try:
            request = next(gen)
        except StopIteration:
            request = None
        except ActionFailed as failed:
            raise failed.cause from None
        if request is None:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return asyncio.ensure_future(done)
        assert isinstance(request, TransferRequest)
        started: dict[int, Transfer] = {}
        for ticket in request.tickets:
            if ticket.source is not None:
                try:
                    started[ticket.ticket_id] = self._start_copy(ticket)
                except BaseException:
                    gen.throw(ResidencyPlanError(f"could not start the copy of {handle}"))
                    raise
        task = asyncio.ensure_future(self._finish_nowait(gen, request, started))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _issued(self, handle: ValueHandle, location: Location) -> bool:
        """Whether a lease at ``location`` could order its stream after the data now: the
        payload exists and its copy's device work is all enqueued (a staged or loaded copy
        takes a while to issue; the lease then waits for it)."""
        payload = self._payloads.get((handle, location))
        return payload is not None and (payload.transfer is None or payload.transfer.issued())

    async def _finish_nowait(
        self,
        gen: Any,
        request: TransferRequest,
        started: dict[int, Transfer],
    ) -> None:
        while True:
            tasks = {
                t.ticket_id: asyncio.ensure_future(
                    self._perform(t, started.pop(t.ticket_id, None), request.tickets)
                )
                for t in request.tickets
            }
            await asyncio.wait(list(tasks.values()))
            errors = {i: (None if t.cancelled() else t.exception()) for i, t in tasks.items()}
            try:
                nxt = gen.send(errors)
            except StopIteration:
                return
            except ActionFailed as failed:
                raise failed.cause from None
            finally:
                self._notify()
            assert isinstance(nxt, TransferRequest)
            request = nxt

    async def discard(self, handle: ValueHandle) -> None:
        """Forget the value: waits for its consumer events, then frees every materialization.
        Active leases or holds are ``ResidencyInUseError``."""
        self._check_loop()
        value = self._state.value(handle)
        for location in list(value.materializations):
            await self._settle(handle, location)
        self._state.discard(handle)
        self._sources.pop(handle, None)
        self._notify()

    def acquire(
        self,
        handle: ValueHandle,
        location: LocationLike,
        *,
        stream: Any = None,
        mode: str = "read",
    ) -> Lease:
        """A lease on the materialization at ``location`` (never places it). See ``Lease``."""
        self._check_loop()
        loc = Location.parse(location)
        self._state.materialization(handle, loc)  # fail fast, before 'async with'
        return Lease(self, handle, loc, stream=stream, mode=mode)

    def hold(self, handle: ValueHandle, location: LocationLike) -> Hold:
        """Protect the materialization from removal until ``hold.release()``."""
        self._check_loop()
        loc = Location.parse(location)
        self._state.hold(handle, loc)
        return Hold(self, handle, loc)

    def tensor(self, handle: ValueHandle, location: LocationLike) -> torch.Tensor:
        """The tensor behind a resident materialization, for inspection only: it is not
        protected, so use ``acquire`` for real work."""
        self._check_loop()
        loc = Location.parse(location)
        self._state.materialization(handle, loc)
        return self._payloads[(handle, loc)].tensor

    # ------------------------------------------------------------- evidence

    def snapshot(self) -> ResidencySnapshot:
        """Atomic, tensor-free view (taken in one synchronous step on the loop)."""
        self._check_loop()
        return take_snapshot(self._state)

    def reset_peak_bytes(self, location: LocationLike | None = None) -> None:
        """Set the peak of one location (or of all) to its current charge, as
        ``torch.cuda.reset_peak_memory_stats`` does for the allocator. Bumps the version."""
        self._check_loop()
        self._state.reset_peak_bytes(location)

    def trace(self) -> ResidencyTrace:
        self._check_loop()
        return self._state.trace_ring.view()

    # ---------------------------------------------------------------- plans

    def explain(self, plan: ResidencyPlan) -> PlanExplanation:
        """Simulate ``plan`` against the current state; nothing changes."""
        self._check_loop()
        plan = getattr(plan, "plan", plan)
        for action in (*plan.reclaim, *plan.enter, *plan.exit, *plan.reserve):
            self.backend.check_location(action.location)
        return explain_plan(self._state, plan)

    def _check_stale(self, expected: int | None) -> None:
        if expected is not None and expected != self._state.state_version:
            raise ResidencyStaleStateError(expected, self._state.state_version)

    async def execute(self, plan: Any) -> ExecutionReport:
        """Run a plan now (phase ``execute``): reclaim, reservations, enter, end of the
        reservations, exit. Preflight (staleness, ``explain``) raises ``ResidencyPlanError``
        before anything changes; a later failure is ``ResidencyPlanExecutionError``."""
        scope = Scope(self, plan, timeout=0, phase_name="execute")
        async with scope:
            pass
        return scope.report

    def scope(self, plan_or_decision: Any, timeout: float | None = None) -> Scope:
        """A single-use async context manager that enters the plan (or a controller decision)
        and undoes its reservations and runs its exit actions at the end. See ``Scope``."""
        self._check_loop()
        return Scope(self, plan_or_decision, timeout=timeout)

    @asynccontextmanager
    async def reservation(
        self, name: str, location: LocationLike, nbytes: int
    ) -> AsyncIterator[None]:
        """A named reservation held for the ``async with`` block (no waiting: over budget is
        ``ResidencyBudgetError`` at once)."""
        self._check_loop()
        loc = Location.parse(location)
        self.backend.check_location(loc)
        self._state.reserve(name, loc, nbytes, owner="direct")
        try:
            yield
        finally:
            self._state.unreserve(name, loc)
            self._notify()

    async def _admit(
        self, plan: ResidencyPlan, expected: int | None, timeout: float | None
    ) -> None:
        """Wait (FIFO) until ``plan`` is feasible, or fail: at once if it could never fit or
        ``timeout`` is 0, with ``TimeoutError`` after ``timeout`` seconds."""
        assert self._loop is not None
        self._check_stale(expected)
        if not self._admission and plan_fits(self._state, plan):
            return
        explanation = explain_plan(self._state, plan)
        if explanation.feasible and not self._admission:
            return
        if not explanation.feasible and (not explanation.transient or timeout == 0):
            raise ResidencyPlanError(explanation.reason)
        deadline = None if timeout is None else self._loop.time() + timeout
        ticket: asyncio.Future[None] = self._loop.create_future()
        self._admission.append(ticket)
        if self._admission[0] is ticket:
            ticket.set_result(None)  # first in line: check at once
        try:
            while True:
                remaining = None if deadline is None else deadline - self._loop.time()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"plan not admitted within {timeout} s: {explanation.reason}"
                    )
                try:
                    await asyncio.wait_for(asyncio.shield(ticket), remaining)
                except TimeoutError:
                    continue
                self._check_stale(expected)
                if plan_fits(self._state, plan):
                    return
                explanation = explain_plan(self._state, plan)
                if not explanation.transient:
                    raise ResidencyPlanError(explanation.reason)
                ticket = self._loop.create_future()
                self._admission[0] = ticket
        finally:
            if ticket in self._admission:
                self._admission.remove(ticket)
            elif self._admission and self._admission[0] is not ticket:
                pass
            self._notify()


class Scope:
    """``async with manager.scope(plan_or_decision, timeout=None) as scope``: single use.

    Entry: compare the decision's ``expected_state_version`` (``ResidencyStaleStateError`` before
    anything changes), wait for admission while only transient state blocks it (FIFO, up to
    ``timeout``; ``timeout=0`` never waits; a plan that could never fit fails at once), then run
    ``reclaim``, admit ``reserve``, run ``enter`` and await its transfers. Exit: end the
    reservations, run ``exit``. A failure after admission is ``ResidencyPlanExecutionError``;
    nothing committed is rolled back, and the reservations a failed entry admitted are released.
    A body exception stays primary; a failing exit is kept on ``exit_error`` (and raised when
    the body succeeded). ``report`` lists every committed transition.
    """

    def __init__(
        self,
        manager: ResidencyManager,
        plan_or_decision: Any,
        *,
        timeout: float | None = None,
        phase_name: str | None = None,
    ) -> None:
        plan = getattr(plan_or_decision, "plan", plan_or_decision)
        if not isinstance(plan, ResidencyPlan):
            raise TypeError(
                f"scope takes a ResidencyPlan or a ResidencyDecision, got {plan_or_decision!r}"
            )
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be None or a number >= 0, got {timeout!r}")
        self._manager = manager
        self.plan = plan
        self.decision = plan_or_decision if plan_or_decision is not plan else None
        expected = getattr(plan_or_decision, "expected_state_version", None)
        self.expected_state_version: int | None = (
            expected if expected is not None else plan.expected_state_version
        )
        self.timeout = timeout
        self._phase_name = phase_name
        self._transitions: list[Transition] = []
        self._reserved: list[tuple[str, Location]] = []
        self.exit_error: BaseException | None = None
        self.status = "new"  # new -> entering -> entered -> exited | failed

    @property
    def report(self) -> ExecutionReport:
        return ExecutionReport(tuple(self._transitions))

    def __repr__(self) -> str:
        return f"<Scope {self.status} [{len(self._transitions)} transitions]>"

    def _fail(
        self, phase: str, cause: BaseException, index: int | None = None, action: Any = None
    ) -> ResidencyPlanExecutionError:
        reservation = action if phase == "reserve" else None
        error = ResidencyPlanExecutionError(
            self._phase_name or phase,
            failed_action=None if phase == "reserve" else action,
            failed_action_index=None if phase == "reserve" else index,
            failed_reservation=reservation,
            failed_reservation_index=index if phase == "reserve" else None,
            partial_report=self.report,
            detail=f"{phase} failed: {cause}",
        )
        error.__cause__ = cause
        return error

    async def _run_phase(self, phase: str, actions: tuple[Any, ...]) -> None:
        manager = self._manager
        with TransitionRecorder(manager._state) as recorder:
            try:
                await manager._drive(manager._state, phase, actions)
            except ActionFailed as failed:
                action = failed.action if failed.action is not None else actions[failed.index]
                raise self._fail(phase, failed.cause, failed.index, action) from failed.cause
            except ResidencyError as error:
                raise self._fail(phase, error) from error
            finally:
                self._transitions.extend(recorder.transitions)

    def _unreserve_all(self) -> None:
        state = self._manager._state
        with TransitionRecorder(state) as recorder:
            while self._reserved:
                name, location = self._reserved.pop()
                state.unreserve(name, location)
        self._transitions.extend(recorder.transitions)
        self._manager._notify()

    async def __aenter__(self) -> Scope:
        manager = self._manager
        manager._check_loop()
        if self.status != "new":
            raise RuntimeError(
                f"a scope is single use and this one is {self.status}; make a new scope (and a "
                "new decision) from the current state"
            )
        self.status = "entering"
        for action in (*self.plan.reclaim, *self.plan.enter, *self.plan.exit, *self.plan.reserve):
            manager.backend.check_location(action.location)
        try:
            await manager._admit(self.plan, self.expected_state_version, self.timeout)
            await self._run_phase("reclaim", self.plan.reclaim)
            state = manager._state
            for index, reservation in enumerate(self.plan.reserve):
                with TransitionRecorder(state) as recorder:
                    try:
                        state.reserve(
                            reservation.name, reservation.location, reservation.nbytes, owner=self
                        )
                    except (ResidencyError, ValueError) as error:
                        raise self._fail("reserve", error, index, reservation) from error
                    finally:
                        self._transitions.extend(recorder.transitions)
                self._reserved.append((reservation.name, reservation.location))
            await self._run_phase("enter", self.plan.enter)
        except BaseException as error:
            self.status = "failed"
            self._unreserve_all()
            if isinstance(error, ResidencyPlanExecutionError):
                error.partial_report = self.report  # with the reservation clean-up included
            raise
        self.status = "entered"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.status != "entered":
            return
        try:
            self._unreserve_all()
            await self._run_phase("exit", self.plan.exit)
            self.status = "exited"
        except BaseException as error:
            self.status = "failed"
            self.exit_error = error
            if exc is None:
                raise
        finally:
            self._manager._notify()
