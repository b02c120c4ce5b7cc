"""One model of a pool: its streamed module, its byte arithmetic, its counters.

:class:`PooledStreamedModule` is a :class:`~aresidency.integrations.StreamedModule` whose
residency between calls the pool decides instead of the module: a call keeps on the device
exactly the groups the pool's requests hold (``pool_keep``) and releases the others after
use, and never releases at its start what an earlier call kept (the pool's controller evicts
those when another model needs the room, by demand). :class:`ModelEntry` is the pool's record
of one model; :class:`ModelStats` its counters.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import anyio
import anyio.lowlevel
import torch

from ..core.errors import ResidencyBudgetError
from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.state import ResidencyState
from ..core.values import MaterializationState, ValueHandle
from ..integrations.streaming import StreamedModule, nesting
from ..integrations.streaming.packing import TensorGroup
from ..integrations.streaming.runners import TorchState, run_once
from ..runtime.leases import Lease, LeaseWouldWait, current_task

__all__ = [
    "CHECKPOINT_READ_INTO",
    "Mode",
    "ModelEntry",
    "ModelStats",
    "PooledStreamedModule",
    "fixed_reserved_bytes",
]

Mode = Literal["resident", "streamed"]

#: Where a checkpoint's group is read on its way to the device (``stream_module`` registers
#: each as a source loading there): temporary storage, charged there until its copy landed.
CHECKPOINT_READ_INTO = Location.parse("pageable-host")


def fixed_reserved_bytes(state: ResidencyState, location: Location) -> int:
    """Bytes reserved at ``location`` that never go away (the backend's own reservations)."""
    ledger = state.find_ledger(location)
    if ledger is None:
        return 0
    return sum(nbytes for nbytes, owner in ledger.reservations.values() if owner == "backend")


class PooledStreamedModule(StreamedModule):
    """A streamed module whose residency between calls is the pool's (module docstring).

    Shared calls (:meth:`begin_shared`, :meth:`call_shared`): while every group is resident
    and held, calls need no pipeline, so they run at the same time, each in a worker thread of
    its own, with the module's tensors swapped to their device replicas once for all of them.
    A pipeline call (:meth:`_run`) runs alone: it waits for the shared calls in progress, and
    no shared call starts while it runs or waits.

    State beyond the module's: ``pool_keep`` (group indexes the next call keeps on the device:
    those the pool's active requests hold), ``constructed``, ``pool_executor`` (the pool's one
    thread, if it runs the calls on resident models there: :meth:`call_executor`),
    ``shared_calls`` (shared calls in progress), ``shared_peak`` (most at once),
    ``_exclusive`` (pipeline calls running or waiting), ``_shared_idle``. Invariants: a call
    never releases a group in ``pool_keep`` (the pool holds them, so a release would fail);
    the module's tensors are the device replicas exactly while ``shared_calls > 0``, and
    shared and pipeline calls never overlap.
    """

    offers_kept = False  # the pool offers its idle models' groups itself

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.pool_keep: set[int] = set()
        self.constructed = False
        self.pool_executor: concurrent.futures.Executor | None = None
        self.shared_calls = 0
        self.shared_peak = 0
        self._exclusive = 0
        self._shared_idle = anyio.Event()
        self._shared_idle.set()
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        # The pool's arithmetic counts a streamed call's blocks as managed values at the
        # device (its window_need): no ring here.
        kwargs["ring"] = False
        super().__init__(*args, **kwargs)
        self.constructed = True

    def _plan_keep(self) -> set[int]:
        # Nothing kept by an earlier call is released here: whether it stays is the pool's
        # controller's choice (by demand), not the module's (by what fits beside the window).
        self.kept = set()
        return set(self.pool_keep)

    def call_executor(self) -> concurrent.futures.Executor | None:
        """The pool's one thread (``ModelPool(one_thread=True)``) for a call whose every group
        the pool's requests hold (all on the device: the call never waits there); the
        module's own thread otherwise (a streamed call may wait for room that another
        model's call must give back)."""
        if self.pool_executor is None:
            return None
        if any(group.index not in self.pool_keep for group in self.all_groups):
            return None
        return self.pool_executor

    async def _run(self, generate: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A pipeline call: after the shared calls in progress, none meanwhile."""
        self._exclusive += 1
        try:
            while self.shared_calls:
                await self._shared_idle.wait()
            return await super()._run(generate, args, kwargs)
        finally:
            self._exclusive -= 1

    def begin_shared(self) -> list[Lease] | None:
        """A shared call's leases on every group's device replica, entered now; ``None``
        (nothing entered) when a shared call cannot start: a pipeline call runs or waits, or
        a group's data is not all there yet (a copy not issued or still arriving: the pipeline
        way waits for it and reports its failure). Pass them to :meth:`call_shared`."""
        if self._exclusive or self._lock.locked() or self._closed:
            return None
        stream = self._compute_stream()
        leases: list[Lease] = []
        try:
            for group in self.all_groups:
                assert group.handle is not None
                lease = self.manager.acquire(
                    group.handle, self.device, stream=stream, order_stream=False
                )
                lease.enter_nowait()
                leases.append(lease)
        except BaseException as error:
            for lease in leases:
                lease.exit_nowait(reader_events=[])
            if isinstance(error, LeaseWouldWait):
                return None
            raise
        if any(lease.ready_event is not None for lease in leases):
            for lease in leases:
                lease.exit_nowait(reader_events=[])
            return None
        return leases

    async def call_shared(
        self, leases: list[Lease], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the module on its resident groups beside the other shared calls (class
        docstring), in a worker thread, with the ``leases`` of :meth:`begin_shared` (ended
        here, whatever happens). The pool calls this only while its requests hold every
        group. Cancelling the await lets the thread finish its forward, then raises (the
        output is dropped): no lease outlives the thread."""
        backend = self.manager.backend
        stream = self._compute_stream()
        reader: Any = None
        try:
            self.manager.check_thread()
            self._check_inference(args, kwargs)
            if self.shared_calls == 0:
                for group, lease in zip(self.all_groups, leases):
                    group.swap_in(group.views(lease.tensor))
                self._shared_idle = anyio.Event()
            self.shared_calls += 1
            self.shared_peak = max(self.shared_peak, self.shared_calls)
            self.calls += 1
            try:
                # The worker thread lets go of the call before it returns (see run_once).
                forward = nesting.Forward(self, current_task())
                work: list[Callable[[], tuple[Any, Any]]] = [
                    functools.partial(
                        self._threaded.run_direct,
                        stream,
                        TorchState.capture(),
                        self.module,
                        args,
                        kwargs,
                        forward,
                    )
                ]
                # (cancelled, a call made from inside the forward is too: see nesting)
                try:
                    result, reader = await nesting.run_sync(
                        functools.partial(run_once, work), forward
                    )
                finally:
                    forward.done = True
            finally:
                self.shared_calls -= 1
                if self.shared_calls == 0:
                    for group in self.all_groups:
                        group.restore()
                    self._shared_idle.set()
        finally:
            if reader is None:
                # The thread raised (or never ran): an event after whatever it enqueued.
                reader = backend.record_event(None if self.host_compute else stream)
            for lease in leases:
                lease.exit_nowait(reader_events=[reader])
        # Cancelled while the thread ran: the call ends cancelled, its output dropped.
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    def held_views(self) -> list[list[torch.Tensor]] | None:
        """Each group's tensors as views of its device replica, for a direct call
        (:meth:`call_held`): when every group's data is there (its copy committed, none
        failed); ``None`` otherwise (a pipeline call waits for the copies and reports their
        failures). The pool asks only while its requests hold every group. The views are
        made once per replica and kept until :meth:`forget_views` (the pool calls it when a
        group is no longer held, before the replica can go)."""
        out: list[list[torch.Tensor]] = []
        for group in self.all_groups:
            assert group.handle is not None
            flat = self.manager.held_tensor(group.handle, self.device)
            if flat is None:
                return None
            cached = self._views.get(group.index)
            if cached is None or cached[0] is not flat:
                cached = (flat, group.views(flat))
                self._views[group.index] = cached
            out.append(cached[1])
        return out

    def forget_views(self) -> None:
        self._views.clear()

    async def call_held(
        self,
        views: list[list[torch.Tensor]],
        readers: dict[Any, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fn: Callable[..., Any] | None = None,
    ) -> Any:
        """A direct call: the module run on the device replicas ``views`` (from
        :meth:`held_views`), which the caller's holds keep there, with no pipeline and no
        lease: one thread hop, one event. That event (after the call's kernels) goes to
        ``readers`` (stream -> the latest event on it; streams compare equal when they are the
        same device stream, as the ``torch.cuda.current_stream()`` objects made at each call
        are), which the caller reports
        with :meth:`~aresidency.ResidencyManager.track_readers` before its holds end.
        Runs alone, like a pipeline call. ``fn``: what to run instead of the module itself
        (its ``generate``). Cancelling the await lets the thread finish its forward (or its
        generation), then raises (the output is dropped)."""
        self._exclusive += 1
        try:
            while self.shared_calls:
                await self._shared_idle.wait()
            async with self._lock:
                if self._closed:
                    raise RuntimeError(f"{self!r} is closed")
                self.manager.check_thread()
                self._check_inference(args, kwargs)
                stream = self._compute_stream()
                backend = self.manager.backend
                self.calls += 1
                for group, tensors in zip(self.all_groups, views):
                    group.swap_in(tensors)
                reader: Any = None
                try:
                    forward = nesting.Forward(self, current_task())
                    work = functools.partial(
                        self._threaded.run_direct,
                        stream,
                        TorchState.capture(),
                        self.module if fn is None else fn,
                        args,
                        kwargs,
                        forward,
                    )
                    # (cancelled, a call made from inside the forward is too: see nesting)
                    try:
                        result, reader = await self._threaded.submit(work, on_cancel=forward.cancel)
                    finally:
                        forward.done = True
                finally:
                    for group in self.all_groups:
                        group.restore()
                    if reader is None:
                        # The thread raised (or was never reached): after what it enqueued.
                        reader = backend.record_event(None if self.host_compute else stream)
                    readers[stream] = reader
                return result
        finally:
            self._exclusive -= 1

    def source_short(self) -> tuple[str, ResidencyBudgetError] | None:
        """For a model rebuilt from its checkpoint whose largest group ``pageable-host``
        (where a checkpoint's group is read on its way to the device: temporary storage,
        charged there until the copy landed) can never hold, its budget less fixed
        reservations too small: why the model can never be loaded, and the refusal with the
        bytes as fields. ``None`` otherwise, and for a model whose host copies are kept
        (nothing is loaded from a source)."""
        if self._checkpoint is None or not self.all_groups:
            return None
        where = CHECKPOINT_READ_INTO
        state = self.manager.state
        ledger = state.find_ledger(where)
        if ledger is None or ledger.budget_bytes is None:
            return None
        fixed = fixed_reserved_bytes(state, where)
        largest = max(self.all_groups, key=lambda group: group.charge_bytes)
        if largest.charge_bytes <= ledger.budget_bytes - fixed:
            return None
        error = ResidencyBudgetError(
            where,
            ledger.budget_bytes,
            0,
            fixed,
            largest.charge_bytes,
            what=f"{largest.name} (read from its checkpoint on its way to {self.device})",
            handle=largest.handle,
            kind="reconstruction",
        )
        reason = (
            f"model {self.name!r} can never be loaded: each of its groups is read from its "
            f"checkpoint into {where} on its way to {self.device}, and its largest "
            f"({largest.name}, {format_nbytes(largest.charge_bytes)}) needs more than the "
            f"{where} budget ({format_nbytes(ledger.budget_bytes)}) less fixed reservations "
            f"({format_nbytes(fixed)}); raise the {where} budget or split the blocks"
        )
        return reason, error

    def _check_budget(self) -> None:
        """At construction: refuse a model that could never run at all, even streamed with no
        prefetch and nothing else on the device (the module's own check would also count the
        reservations of requests in flight), or one rebuilt from a checkpoint whose largest
        group the pageable-host budget can never hold on its way (:meth:`source_short`). At a
        call: nothing, the pool did the arithmetic when it admitted the request."""
        if self.constructed:
            return
        short = self.source_short()
        if short is not None:
            raise ValueError(short[0]) from short[1]
        ledger = self.manager.state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return
        fixed = fixed_reserved_bytes(self.manager.state, self.device)
        floor = self.resident_bytes + max(self.block_bytes, default=0)
        if floor > ledger.budget_bytes - fixed:
            raise ValueError(
                f"model {self.name!r} can never run on {self.device}: its tensors outside the "
                f"blocks ({format_nbytes(self.resident_bytes)}) plus its largest block "
                f"({format_nbytes(max(self.block_bytes, default=0))}) need "
                f"{format_nbytes(floor)}, more than the budget "
                f"({format_nbytes(ledger.budget_bytes)}) less fixed reservations "
                f"({format_nbytes(fixed)}); raise the budget or split the blocks"
            )


@dataclass
class ModelStats:
    """Counters of one model (``ModelPool.stats()``): ``requests`` (asked), ``hits`` (admitted
    with every group already on the device), ``loads`` (admissions that copied groups in),
    ``evictions`` (times the pool took groups of it off the device: its decisions, and room
    given back to another tenant, ``manager.reclaim``) and ``evicted_bytes``,
    ``bytes_copied`` (host to device: admission loads, a cancelled or failed one's copies that
    landed included, and what streamed calls copied),
    ``wait_seconds`` (time from arrival to admission, summed), ``failures`` (requests that
    raised before or during their body), ``last_mode`` (``resident`` or ``streamed``),
    ``joined_past`` (hits admitted at once past a head of the line waiting for other models),
    ``calls`` (calls on the model), ``shared_calls`` (of those, run beside its other calls on
    its resident groups), ``direct_calls`` (of those, run one at a time on its held device
    replicas without the streaming pipeline), ``call_seconds`` (time in calls, summed, waits
    included) and ``call_wait_seconds`` (of that, waiting for the model's earlier calls)."""

    requests: int = 0
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    bytes_copied: int = 0
    wait_seconds: float = 0.0
    failures: int = 0
    last_mode: Mode | None = None
    joined_past: int = 0
    calls: int = 0
    shared_calls: int = 0
    direct_calls: int = 0
    call_seconds: float = 0.0
    call_wait_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ModelEntry:
    """The pool's record of one model.

    State: ``name``, ``streamed`` (its :class:`PooledStreamedModule`), ``prefetch`` (the
    deepest window it streams with), ``stats``, ``active``
    (admitted requests per mode), ``windows`` (request id -> prefetch window bytes of each
    admitted streamed request), ``held`` (group index -> holds the active requests have on
    its device replica), ``call_lock`` (pipeline calls on the module, first come first served),
    ``in_flight`` (its requests between arrival and end; ``leaving``: of them, those that dropped
    their holds and are ending), ``removing`` (set while
    :meth:`ModelPool.remove <aresidency.serving.ModelPool.remove>` waits for them: the event
    set when none is left; back to ``None`` when every removal waiting was cancelled or
    refused), ``removers`` (the removals waiting), ``removal_wake`` (set, then replaced, to
    make them look again: a request ended or parked), ``removed`` (set once it left the
    pool). Invariants: ``active``
    has requests of one mode at a time (a model switches mode only when idle); ``held`` counts
    exactly the holds of active requests.
    """

    def __init__(self, name: str, streamed: PooledStreamedModule, prefetch: int) -> None:
        self.name = name
        self.streamed = streamed
        self.prefetch = prefetch
        self.stats = ModelStats()
        self.active: dict[Mode, int] = {"resident": 0, "streamed": 0}
        self.windows: dict[int, int] = {}
        self.held: Counter[int] = Counter()
        self.call_lock = anyio.Lock()
        self.in_flight = 0
        self.leaving = 0  # of them, those whose holds were dropped (ending)
        self.removing: anyio.Event | None = None
        self.removers = 0  # the remove() calls waiting for its requests to end
        self.removal_wake = anyio.Event()  # set (and replaced) for them to look again
        self.removed = anyio.Event()
        self.closing: anyio.Event | None = None  # its streamed module's close (set: done)
        self.groups: list[TensorGroup] = streamed.all_groups
        self.handles: list[ValueHandle] = streamed.handles
        self.by_handle: dict[ValueHandle, TensorGroup] = {}
        for group in self.groups:
            assert group.handle is not None
            self.by_handle[group.handle] = group
        self.total_bytes = sum(g.charge_bytes for g in self.groups)
        self.largest_block = max(streamed.block_bytes, default=0)
        self.outside_bytes = streamed.resident_bytes
        self.outside = streamed.resident_group

    # -- where its groups are

    def states_at(self, state: ResidencyState, device: Location) -> dict[int, MaterializationState]:
        """Group index -> state of its materialization at ``device`` (absent: none there)."""
        out: dict[int, MaterializationState] = {}
        for group in self.groups:
            assert group.handle is not None
            value = state.find_value(group.handle)
            if value is None:
                continue
            mat = value.materializations.get(device)
            if mat is not None:
                out[group.index] = mat.state
        return out

    def resident_bytes_at(self, state: ResidencyState, device: Location) -> int:
        """Device bytes of its groups that are resident there now."""
        states = self.states_at(state, device)
        return sum(
            g.charge_bytes
            for g in self.groups
            if states.get(g.index) is MaterializationState.RESIDENT
        )

    def window_need(self, state: ResidencyState, device: Location) -> int:
        """Bytes its active streamed requests may still charge at ``device``: the largest
        prefetch window among them, less the groups outside what they hold that are there
        now (the window in flight). 0 when no streamed request is active."""
        if not self.windows:
            return 0
        window = max(self.windows.values())
        states = self.states_at(state, device)
        in_flight = sum(
            g.charge_bytes for g in self.groups if g.index in states and not self.held[g.index]
        )
        return max(0, window - in_flight)

    def window_bytes(self, prefetch: int) -> int:
        return (prefetch + 1) * self.largest_block

    @property
    def busy(self) -> bool:
        return any(self.active.values())

    def __repr__(self) -> str:
        mode = next((m for m, n in self.active.items() if n), "idle")
        return (
            f"<ModelEntry {self.name!r} {len(self.groups)} groups "
            f"{format_nbytes(self.total_bytes)} {mode} [{sum(self.active.values())} active, "
            f"{sum(1 for n in self.held.values() if n)} groups held]>"
        )
