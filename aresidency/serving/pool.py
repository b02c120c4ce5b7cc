"""``ModelPool``: many models behind one device budget, request by request.

See the package docstring for what the pool decides and why. This module holds the pool
(registration, admission, the end of a request, statistics), the awaitable model a request
body gets (:class:`PooledModel`), and the record of each admission (:class:`PoolDecision`).

Why this module is long: admission is one procedure (first come first served, the mode, the
demand-weighted decision, entering it, loading, protecting, and undoing each step when a
later one fails or is cancelled) whose cancellation argument spans all of it; split, the
steps' undo paths would no longer be read side by side.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
from torch import nn

from ..controller import (
    CostModel,
    FallbackGraph,
    ResidencyController,
    ResidencyDecision,
    ResidencyRequest,
    ResidencyRequirement,
)
from ..controller.index import classify
from ..core.errors import (
    ResidencyBudgetError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
    ResidencyUnavailableError,
)
from ..core.locations import Location, LocationLike
from ..core.plans import MemoryReservation, ResidencyPlan
from ..core.sizes import ByteSize, format_nbytes, parse_nbytes
from ..core.timeouts import check_timeout
from ..core.trace import Transition
from ..core.values import MaterializationState, ValueHandle, check_flag
from ..integrations.streaming import HostKind
from ..integrations.streaming.packing import TensorGroup
from ..integrations.streaming.readroom import make_read_room
from ..runtime.admission import Kept
from ..runtime.checkpoints import Checkpoint
from ..runtime.leases import Hold, current_owner, current_task, current_task_ref
from ..runtime.manager import ResidencyManager
from ..runtime.pending import PendingOperation
from ..runtime.scopes import Scope
from ..runtime.shield import finish_shielded, wait_shielded
from ..runtime.signal import ManagerClosedError
from .demand import DEMAND_HALF_LIFE_VERSIONS, DemandTracker, DemandView
from .entry import (
    CHECKPOINT_READ_INTO,
    Mode,
    ModelEntry,
    PooledStreamedModule,
    fixed_reserved_bytes,
)

__all__ = ["ModelPool", "PoolDecision", "PooledModel"]

logger = logging.getLogger("aresidency.serving")

_RESIDENT = MaterializationState.RESIDENT
_OUTGOING = MaterializationState.OUTGOING

#: How often a request parked for progress looks again without being woken: the safety net for
#: changes that commit no transition (another tenant's scope leaving the queue, cancelled).
_RECHECK_S = 0.5

#: The room a device without a budget counts as having (more than any budget): lifting a
#: budget (``set_budget(device, None)``) is growth of the free room a waiting request sees.
_UNLIMITED = 1 << 62

#: What a parked request watches (see :meth:`ModelPool._progress`).
_Progress = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class PoolDecision:
    """What the pool decided for one request, with its evidence.

    ``decision`` is the controller's (its ``evictions`` say which groups left the device and
    why, with the demand-weighted cost; ``explanation`` the predicted peak); ``evicted`` sums
    the evictions per model (other values by name); ``loaded_bytes`` is what the admission
    copied in; ``kept_groups`` how many groups the request held on the device; ``demand`` the
    request rates (per second) the decision weighed; ``headroom_bytes`` what the decision left
    free for streamed requests in flight; ``transitions`` what entering it committed in the
    manager's trace (the evictions and the workspace reservation; the loads follow there).
    ``passed``: for a request that joined its model's residency past the head of the line
    (see :meth:`ModelPool._try_express`), what that head waited for. ``decision`` is ``None``
    for such a request and for every *hit* (its model was resident whole, so nothing was
    decided and nothing moved: the controller is not asked).
    """

    request_id: int
    model: str
    mode: Mode
    reserve_bytes: int
    prefetch: int
    decision: ResidencyDecision | None
    loaded_bytes: int
    kept_groups: int
    evicted: dict[str, int]
    demand: dict[str, float]
    headroom_bytes: int
    waited_seconds: float
    transitions: tuple[Transition, ...] = field(repr=False)
    passed: str | None = None

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly summary (for logs and the example server's ``/decisions``)."""
        return {
            "request_id": self.request_id,
            "model": self.model,
            "mode": self.mode,
            "reserve_bytes": self.reserve_bytes,
            "prefetch": self.prefetch,
            "loaded_bytes": self.loaded_bytes,
            "kept_groups": self.kept_groups,
            "evicted": dict(self.evicted),
            "demand_per_s": {k: round(v, 6) for k, v in self.demand.items()},
            "headroom_bytes": self.headroom_bytes,
            "waited_seconds": self.waited_seconds,
            "explored_states": 0 if self.decision is None else self.decision.explored_states,
            "evictions": [str(e) for e in self._evictions],
            "reasons": [e.reason for e in self._evictions],
            "transitions": [t.kind for t in self.transitions],
            "passed": self.passed,
        }

    @property
    def _evictions(self) -> tuple[Any, ...]:
        return () if self.decision is None else self.decision.evictions

    def __str__(self) -> str:
        parts = [f"request {self.request_id} for {self.model!r}: {self.mode}"]
        if self.mode == "streamed":
            parts.append(f"prefetch {self.prefetch}")
        if self.loaded_bytes:
            parts.append(f"loaded {format_nbytes(self.loaded_bytes)}")
        else:
            parts.append("nothing to load")
        for name, nbytes in self.evicted.items():
            rate = self.demand.get(name)
            demand = "" if rate is None else f" (demand {rate:.3g}/s)"
            parts.append(f"evicted {name!r} {format_nbytes(nbytes)}{demand}")
        if self.reserve_bytes:
            parts.append(f"reserved {format_nbytes(self.reserve_bytes)}")
        if self.headroom_bytes:
            parts.append(f"left {format_nbytes(self.headroom_bytes)} for streams in flight")
        parts.append(f"waited {self.waited_seconds * 1e3:.1f} ms")
        if self.passed is not None:
            parts.append(f"joined past {self.passed}")
        return ", ".join(parts)


def _span_of(tensor: Any) -> tuple[int, int] | None:
    """The memory ``tensor`` covers, ``(first byte, end)``, or ``None`` when it has none to
    compare (meta, no elements, or a tensor subclass without plain memory)."""
    try:
        if tensor.is_meta or not tensor.numel():
            return None
        start = int(tensor.data_ptr())
        extent = 1 + sum(
            (size - 1) * abs(step) for size, step in zip(tensor.shape, tensor.stride())
        )
        end = start + extent * tensor.element_size()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None
    return (start, end) if start else None


class _Place:
    """A request's place in :class:`_Line`: woken to look again (loop thread)."""

    __slots__ = ("_event", "entry")

    def __init__(self, entry: ModelEntry | None = None) -> None:
        self._event = anyio.Event()
        self.entry = entry  # the model its request is for

    def wake(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()  # (no await since the set: no wake-up is lost)


class _Line:
    """The pool's admission line: first come, first served, the first place decides and
    enters (the head); the places behind it are woken when they become first, and when the
    head parks (to look for a way past it, :meth:`ModelPool._try_express`). Loop thread."""

    def __init__(self) -> None:
        self._places: deque[_Place] = deque()

    def __len__(self) -> int:
        return len(self._places)

    def join(self, entry: ModelEntry | None = None) -> _Place:
        place = _Place(entry)
        self._places.append(place)
        return place

    def first(self, place: _Place) -> bool:
        return self._places[0] is place

    def leave(self, place: _Place) -> None:
        """Leave the line (admitted, joined past, failed or cancelled); the next place is woken
        when this one was first."""
        was_first = bool(self._places) and self._places[0] is place
        try:
            self._places.remove(place)
        except ValueError:
            return
        if was_first and self._places:
            self._places[0].wake()

    def wake_all(self, blockers: frozenset[str] | None = None) -> None:
        """Wake the places behind the head that may join past it (their model resident and
        in use resident, and not one of the head's ``blockers``: what
        :meth:`ModelPool._try_express` asks first), all of them without ``blockers``. The
        others could not pass: waking them all, thousands of requests in line each time the
        head parks, kept the loop from every other task for as long as they took to look."""
        for place in self._places:
            entry = place.entry
            if (
                blockers is None
                or entry is None
                or (
                    entry.name not in blockers
                    and entry.active["resident"]
                    and not entry.active["streamed"]
                )
            ):
                place.wake()


class _Loading:
    """The copies that bring one request's groups to the device, and the holds that protect
    each group from the moment it is there (loop thread).

    The pool's decision made room for the model, but nothing protects a group between its
    landing and the request's admission: another tenant of the manager (a second pool, a
    scope's reclaim, a direct release) may release an unprotected resident value, and a
    hold taken only once the last copy landed found it gone. So a group already at the
    device is held before any await, and a copied one in the done callback of its copy (the
    first code of the pool's that runs after the copy committed); a group taken before that
    (by a change listener of another tenant, which runs at the commit) is copied again, as
    often as that happens (each round awaits copies: the loop is never held, and the
    request's ``timeout`` bounds it).

    State: ``graph`` (what may be evicted where a checkpoint's group is read: the pool's
    controller's fallback graph), ``holds`` (group index -> the hold on its device
    materialization), ``open``
    (cleared when the loading gave up: a copy that lands later is not held), ``closed`` (the
    ``ManagerClosedError`` a hold got: the manager closed, :meth:`run` raises it; a done
    callback never raises), ``landed`` (bytes of its copies that landed). Invariant: once
    :meth:`run` raised, nothing is held and nothing it copied is in flight."""

    def __init__(
        self,
        manager: ResidencyManager,
        device: Location,
        entry: ModelEntry,
        graph: FallbackGraph | None = None,
    ) -> None:
        self.manager = manager
        self.device = device
        self.entry = entry
        self.graph = graph  # what may be evicted where a checkpoint's group is read
        self.holds: dict[int, Hold] = {}
        self.open = True
        self.closed: ManagerClosedError | None = None  # a hold refused: the manager closed
        self.landed = 0  # bytes of the copies it issued that landed (a failed run's too)
        # The request's task (made in it): the holds are that task's, also those taken in
        # a copy's done callback, where no task runs.
        self.task = current_task_ref()

    def _hold(self, index: int) -> None:
        if not self.open or index in self.holds:
            return
        group = self.entry.streamed.group(index)
        assert group.handle is not None
        try:
            self.holds[index] = self.manager.hold(group.handle, self.device, on_behalf_of=self.task)
        except ResidencyError:
            pass  # gone, or moving out: copied again in the next round
        except ManagerClosedError as error:
            # The manager closed (as the copy landed: in its done callback an error would
            # only be logged): raised to the request by run.
            self.closed = error

    def _landed(self, index: int, operation: PendingOperation) -> None:
        if operation.exception() is None:
            self.landed += self.entry.streamed.group(index).charge_bytes
            self._hold(index)

    def _begin(self, handle: ValueHandle) -> PendingOperation:
        """``materialize_nowait`` at the device; a load refused where a checkpoint's group is
        read on its way (pageable-host) because values nobody needs fill it (a replica of a
        value resident elsewhere, another model's idle groups moved there) evicts them, as
        a decision would, and is tried once more (see :func:`make_read_room`)."""
        try:
            return self.manager.materialize_nowait(handle, self.device)
        except ResidencyBudgetError as error:
            if error.location == self.device or not make_read_room(
                self.manager, error, graph=self.graph
            ):
                raise
        return self.manager.materialize_nowait(handle, self.device)

    async def run(self, keep: list[int]) -> int:
        """Hold every group of ``keep`` at the device, copying in those not there; returns
        the bytes copied. Raises the first copy's error (or a refusal of the budget)."""
        pending: list[PendingOperation] = []
        copied = 0
        try:
            while True:
                states = self.entry.states_at(self.manager.state, self.device)
                for index in keep:
                    if index in states and states[index] is not _OUTGOING:
                        self._hold(index)
                if self.closed is not None:
                    raise self.closed
                missing = [index for index in keep if index not in self.holds]
                if not missing:
                    return copied
                pending = []
                for index in missing:
                    if index in states:
                        continue  # moving out: copied once it left (the next round)
                    group = self.entry.streamed.group(index)
                    assert group.handle is not None
                    try:
                        operation = self._begin(group.handle)
                    except ResidencyBudgetError as error:
                        if error.location == self.device or not pending:
                            raise
                        # Where its source loads it on the way (a checkpoint's groups are
                        # read into pageable-host) holds fewer groups than are missing: the
                        # rest are copied in the next round, once these landed and gave that
                        # room back.
                        break
                    operation.add_done_callback(functools.partial(self._landed, index))
                    pending.append(operation)
                    copied += group.charge_bytes
                if not pending:
                    await self.manager.wait_for_change()
                for operation in pending:
                    await operation
        except BaseException:
            self.open = False
            for hold in self.holds.values():
                try:
                    hold.release()  # first: a held incoming copy would not be cancelled
                except ManagerClosedError:
                    pass  # the manager closed: its state is final
            self.holds.clear()
            for operation in pending:
                if not operation.done():
                    operation.cancel()
            for operation in pending:  # (native cancellations too: raised after)
                await finish_shielded(operation.wait_settled)
            raise


class _Request:
    """One request from arrival to its end. State: ``id``, ``entry``, ``reserve``,
    ``arrived``, ``why`` (what it waits for, for a timeout's message), ``drain`` (at the head
    of the line, waiting for room: the model it waits to see idle, kept while it still would
    do), and once admitted: ``mode``, ``prefetch``, ``scope`` (holds the workspace
    reservation), ``holds``, ``record``, ``active``, ``readers``, ``calls`` (calls made while
    ``active`` that have not returned). Invariant: the holds outlive every call counted in
    ``calls``: a direct call reads the held replicas with no lease of its own."""

    def __init__(self, request_id: int, entry: ModelEntry, reserve: int) -> None:
        self.id = request_id
        self.entry = entry
        self.reserve = reserve
        self.arrived = time.perf_counter()
        self.why = "its turn (first come, first served)"
        self.drain: str | None = None
        self.no_wait = False  # timeout=0: admitted at once or TimeoutError, never parked
        # The task that made the request, and whether it already held an admitted request of
        # the pool then (a nested request: it does not queue in the line, see ModelPool.use).
        self.task = current_task()
        self.owner = current_owner()  # its name, for messages
        self.left = False  # its holds were dropped (ModelPool._leave)
        self.nested = False
        self.mode: Mode = "resident"
        self.prefetch = 0
        self.scope: Scope | None = None
        self.holds: list[Hold] = []
        self.kept: list[int] = []
        self.record: PoolDecision | None = None
        self.active = False
        # Direct calls' reader events, the latest per compute stream (stream -> event).
        self.readers: dict[Any, Any] = {}
        # Calls made inside the block and not returned yet (a task of an outer task group may
        # still run one when the block exits), and the event the exit waits on for them.
        self.calls = 0
        self.calls_done: anyio.Event | None = None

    @property
    def label(self) -> str:
        return f"{self.entry.name}#{self.id}"


class PooledModel:
    """The model one request uses inside ``async with pool.use(name) as model``.

    ``y = await model(*args, **kwargs)`` runs the module (see
    :class:`~aresidency.integrations.StreamedModule`: on CUDA the call returns once the work is
    enqueued on the compute stream; the host waits for no copy). Calls of one model are run one
    at a time, in arrival order, whichever request makes them. ``mode`` is ``"resident"``
    (every group held on the device for the request: no copy) or ``"streamed"`` (the groups
    the request holds stay, the rest go through a prefetch window of ``prefetch`` blocks).
    ``module`` is the ``nn.Module`` (its config, its generation helpers), ``decision`` the
    admission's :class:`PoolDecision`. Usable only inside its ``async with`` block.
    """

    def __init__(self, pool: ModelPool, request: _Request) -> None:
        self._pool = pool
        self._request = request

    @property
    def name(self) -> str:
        return self._request.entry.name

    @property
    def mode(self) -> Mode:
        return self._request.mode

    @property
    def prefetch(self) -> int:
        return self._request.prefetch

    @property
    def reserve_bytes(self) -> int:
        return self._request.reserve

    @property
    def module(self) -> nn.Module:
        return self._request.entry.streamed.module

    @property
    def decision(self) -> PoolDecision:
        record = self._request.record
        assert record is not None
        return record

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this request's residency. Awaits the model's earlier calls, then
        the call itself (a streamed call awaits only blocks not admitted yet)."""
        return await self._call(False, args, kwargs)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Run Hugging Face generation (``module.generate(*args, **kwargs)``) on this
        request's residency and return what it returns. The whole generate loop runs in one
        worker thread: on a resident request, directly on the held device replicas (one
        thread hop for every token); streamed, through the pipeline, its prefetch window
        wrapping around from one forward to the next (see
        :meth:`~aresidency.integrations.StreamedModule.generate`). One call of the model, in
        turn with its others. ``TypeError`` for a module without ``generate``."""
        if not callable(getattr(self.module, "generate", None)):
            raise TypeError(
                f"{type(self.module).__name__} has no generate() method: pool a Hugging Face "
                "model with GenerationMixin (such as LlamaForCausalLM) to generate, or await "
                "the model itself for a forward pass"
            )
        return await self._call(True, args, kwargs)

    async def _call(self, generate: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self._request
        if not request.active:
            raise RuntimeError(
                f"{self.name!r} was used outside its 'async with pool.use(...)' block; make the "
                "calls inside the block that admitted the request"
            )
        entry = request.entry
        self._refuse_stale(entry)
        stats = entry.stats
        started = time.perf_counter()
        request.calls += 1  # the block's exit waits for this call (see ModelPool._leave)
        try:
            if request.mode == "resident" and self._pool.shared_calls and not generate:
                # Every group is resident and held: no pipeline, beside the model's other
                # calls (unless a pipeline call runs or waits, or a copy is still arriving).
                leases = entry.streamed.begin_shared()
                if leases is not None:
                    stats.shared_calls += 1
                    return await entry.streamed.call_shared(leases, args, kwargs)
            async with entry.call_lock:
                stats.call_wait_seconds += time.perf_counter() - started
                streamed = entry.streamed
                # The groups the active requests hold stay; only a streamed call has a window.
                streamed.pool_keep = {index for index, n in entry.held.items() if n}
                if request.mode == "resident" and self._pool.direct_calls:
                    # Every group is held on the device and its copy landed: no pipeline, no
                    # lease per block; the call's event is reported when the request ends.
                    views = streamed.held_views()
                    if views is not None:
                        stats.direct_calls += 1
                        fn: Callable[..., Any] | None = None
                        if generate:
                            fn = streamed.module.generate  # type: ignore[assignment]
                        return await streamed.call_held(views, request.readers, args, kwargs, fn)
                if request.mode == "streamed":
                    streamed.prefetch = request.prefetch
                states = entry.states_at(self._pool.manager.state, self._pool.device)
                stats.bytes_copied += sum(
                    g.charge_bytes for g in entry.groups if g.index not in states
                )
                if generate:
                    return await streamed.generate(*args, **kwargs)
                return await streamed(*args, **kwargs)
        finally:
            stats.calls += 1
            stats.call_seconds += time.perf_counter() - started
            request.calls -= 1
            if not request.calls and request.calls_done is not None:
                request.calls_done.set()

    def _refuse_stale(self, entry: ModelEntry) -> None:
        """Raise if the model's weights were written in place (``load_state_dict``, ``copy_``
        under ``no_grad``), or an earlier call's forward put new tensors in place of some
        (a dynamic RoPE's ``inv_freq``), while requests hold its device replicas: the call
        would run the replicas as they were copied. A group not held is copied again by the
        call itself. ``ValueError`` (from the check) for a tensor replaced from outside a
        call instead of written. The message says which happened: they call for different
        things."""
        streamed = entry.streamed
        held = [g for g in streamed._changed_groups() if entry.held[g.index]]
        if not held:
            return
        by_forward = [g for g in held if g.replaced]
        if by_forward:
            tensors = [g.entries[i].names[0] for g in by_forward for i in sorted(g.replaced)]
            more = f" and {len(tensors) - 4} more" if len(tensors) > 4 else ""
            blocks = ", ".join(streamed.block_label(g) for g in by_forward[:4])
            raise RuntimeError(
                f"{self.name!r}: an earlier call's forward replaced {', '.join(tensors[:4])}"
                f"{more} (it put a new tensor in its place, as a dynamic RoPE does with "
                "inv_freq once a sequence outgrows the longest it has seen), and requests hold "
                f"the device copy of {blocks}, so this call would run the old value. The pool "
                "writes the new value into the model once the model's active requests end: "
                "make this call in a new request (async with pool.use(...)), which runs it"
            )
        names = ", ".join(streamed.block_label(g) for g in held[:4])
        more = f" and {len(held) - 4} more" if len(held) > 4 else ""
        raise RuntimeError(
            f"{self.name!r}: weights of {names}{more} were written in place while requests "
            "hold them on the device, so this call would run the old weights; write them "
            "between requests (the next request admitted once the model's active requests "
            "ended copies them again)"
        )

    def __repr__(self) -> str:
        state = "active" if self._request.active else "ended"
        return f"<PooledModel {self.name!r} {self.mode} request {self._request.id} {state}>"


class ModelPool:
    """Models (or adapters) that share one device budget, kept resident or streamed by demand.

    ``ModelPool(manager, device="cuda:0")`` on the manager's loop; :meth:`add` models, then
    serve each request with ``async with pool.use(name, reserve=..., timeout=...) as model``.
    ``demand_half_life``: seconds over which a model's request rate is measured (see
    :class:`~aresidency.serving.demand.DemandTracker`); ``cost_model``: transfer rates for
    the controller (its ``recency_half_life`` is the pool's, which encodes demand);
    ``fallback_graph``, ``search_state_limit``: the controller's; ``decision_log``: how many
    :class:`PoolDecision` s :attr:`decisions` keeps; ``defer_hot_evictions``: wait for a
    colder model in use to finish rather than evict a hotter idle one (see
    :meth:`_colder_in_use`); ``clock``: the demand clock; ``express_joins``: a request for a
    model already resident and in use joins it at once, past a head of the line that waits for
    other models (see :meth:`_try_express`); ``shared_calls``: calls on a resident model run at
    the same time, each in a worker thread, rather than one after the other through the
    streaming pipeline (see :meth:`PooledStreamedModule.call_shared
    <aresidency.serving.entry.PooledStreamedModule.call_shared>`). Off by default: where the
    host launches the kernels (eager Hugging Face decoders), threads that launch at the same
    time contend for the interpreter lock and every call slows down (on an H200 the benchmark
    served 5.2 requests/s with it, 6.5 without). ``one_thread``: the calls on resident models
    run in one thread for the whole pool, one after the other across models, as a server that
    runs one request at a time does (streamed calls keep their model's own thread: they may
    wait for room another model's call gives back). ``direct_calls`` (on by default): a call of
    a resident request whose model's copies have all landed runs the module on the held device
    replicas directly, without the streaming pipeline's lease per block: one thread hop and
    one event per call, its event reported as the replicas' reader when the request ends
    (see :meth:`~aresidency.serving.entry.PooledStreamedModule.call_held`); ``False`` sends
    every call through the pipeline (for comparison).

    State: ``manager``, ``device``, ``demand``, ``view`` (the controller's
    :class:`~aresidency.serving.demand.DemandView`), ``controller``, ``decisions``;
    ``_entries`` (name -> :class:`~aresidency.serving.entry.ModelEntry`), ``_owner`` (value
    handle -> entry), ``_line`` (admission, first come first served), ``_requests`` (requests
    between arrival and end), ``_admitted``, ``_active`` (the admitted requests by id),
    ``_waiting`` (the requests not admitted yet, in arrival order), ``_ended`` (requests
    ended so far), ``_wakes`` (the parked requests' waits for the manager's next change, cut
    short at the end of every request and when the pool closes),
    ``_deciding`` (held by the request that decides and enters: the head of the line, or a
    nested request; released while it parks). Invariants: one request at a time decides and
    enters (the holder of ``_deciding``); every hold the pool takes belongs to an
    admitted request and is released when it ends; the device budget is the manager's, never
    exceeded.
    """

    def __init__(
        self,
        manager: ResidencyManager,
        device: LocationLike = "cuda:0",
        *,
        demand_half_life: float = 30.0,
        cost_model: CostModel | None = None,
        fallback_graph: FallbackGraph | None = None,
        search_state_limit: int = 10_000,
        decision_log: int = 256,
        defer_hot_evictions: bool = True,
        clock: Callable[[], float] = time.monotonic,
        express_joins: bool = True,
        shared_calls: bool = False,
        one_thread: bool = False,
        direct_calls: bool = True,
    ) -> None:
        manager.check_thread()
        self.manager = manager
        self.device = Location.parse(device)
        if not self.device.is_cuda:
            raise ValueError(f"a pool serves from a cuda device, got {self.device}")
        manager.backend.check_location(self.device)
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        if isinstance(decision_log, bool) or not isinstance(decision_log, int):
            raise TypeError(
                f"decision_log must be an int (how many decisions to keep), got {decision_log!r}"
            )
        if decision_log < 0:
            raise ValueError(f"decision_log must be >= 0, got {decision_log}")
        self.defer_hot_evictions = check_flag(defer_hot_evictions, "defer_hot_evictions")
        self.express_joins = check_flag(express_joins, "express_joins")
        self.shared_calls = check_flag(shared_calls, "shared_calls")
        self.one_thread = check_flag(one_thread, "one_thread")
        self.direct_calls = check_flag(direct_calls, "direct_calls")
        # Checked here, not when the first request needs an eviction (an AttributeError deep
        # in the search, for every request from then on).
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(
                f"cost_model must be an aresidency.CostModel (transfer rates) or None, got "
                f"{cost_model!r}"
            )
        if fallback_graph is not None and not isinstance(fallback_graph, FallbackGraph):
            raise TypeError(
                f"fallback_graph must be an aresidency.FallbackGraph or None, got "
                f"{fallback_graph!r}; build one with FallbackGraph(...) or FallbackGraph.default()"
            )
        self.demand = DemandTracker(demand_half_life, clock=clock, argument="demand_half_life")
        self.view = DemandView(manager)
        base = cost_model if cost_model is not None else CostModel()
        pool_costs = CostModel(
            base.bandwidths,
            base.source_bandwidth,
            base.default_bandwidth,
            DEMAND_HALF_LIFE_VERSIONS,
        )
        self.controller = ResidencyController(
            self.view,
            search_state_limit,
            fallback_graph=fallback_graph,
            cost_model=pool_costs,
        )
        self.decisions: deque[PoolDecision] = deque(maxlen=decision_log)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # What the head of the line waits for (while it waits): the models whose requests it
        # waits to see end (None: unknown, nobody passes it), and why.
        self._head_blockers: frozenset[str] | None = None
        self._head_why = ""
        self._entries: dict[str, ModelEntry] = {}
        self._owner: dict[ValueHandle, ModelEntry] = {}
        self._line = _Line()
        self._ids = itertools.count(1)
        self._requests = 0
        self._admitted = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._closed = False
        self._final_stats: dict[str, dict[str, Any]] | None = None  # stats() once closed
        self._ended = 0
        # The parks (cancel scopes around each parked request's wait for a change): cancelled
        # to make them look again at once (a request ended, the pool closes).
        self._wakes: set[anyio.CancelScope] = set()
        # Admitted requests (id -> request), and the lock held by the request that decides and
        # enters (the head of the line, or a nested request), released while it parks.
        self._active: dict[int, _Request] = {}
        self._deciding = anyio.Lock()
        # The requests not admitted yet (id -> request), in arrival order (the line's, for
        # those not nested): what a removal checks it would not wait for for ever.
        self._waiting: dict[int, _Request] = {}
        # The groups a task's admitted requests hold count as that task's own for the
        # manager (they end only when it goes on): its scopes, streamed calls and loaders
        # that could fit only once they ended are refused at once instead of waiting.
        self._unkeep = manager.add_task_keeper(self._kept_for)
        # Idle models on the device are a cache: another tenant short of room there (a
        # loader's next batch) may ask for it back (manager.reclaim).
        self._unreclaim = manager.add_reclaimer(self._reclaim)

    # ------------------------------------------------------------------ models

    def add(
        self,
        name: str,
        module: nn.Module,
        *,
        host: HostKind = "pinned-host",
        checkpoint: str | Path | Checkpoint | None = None,
        prefetch: int = 2,
        blocks: Sequence[nn.Module] | None = None,
    ) -> PooledStreamedModule:
        """Register ``module`` under ``name``, nothing on the device yet.

        Its blocks become managed values (see :func:`~aresidency.integrations.stream_module`):
        kept in ``host`` memory, or rebuilt from the safetensors ``checkpoint`` (the module may
        then be on the ``meta`` device). ``prefetch``: blocks copied ahead when it is streamed.
        Registration copies the weights into host memory synchronously (a start-up cost).
        ``ValueError`` for a name in use, or a model that could never run on the device (its
        tensors outside the blocks plus its largest block exceed the budget), or one rebuilt
        from a checkpoint whose largest group the ``pageable-host`` budget can never hold (each
        is read there on its way to the device; a request loads them as few at a time as that
        budget needs). Loop thread."""
        self._check_open()
        self.manager.check_thread()
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"a model needs a non-empty, non-blank str name (requests, statistics and "
                f"errors name it by it), got {name!r}"
            )
        if name in self._entries:
            if self._entries[name].removing is not None:
                # A hot swap (remove the old version, add the new one under its name): the
                # name is free only once the removal returned.
                raise ValueError(
                    f"the model named {name!r} is being removed from the pool (its requests "
                    "are still served): the name is free once 'await pool.remove(...)' "
                    "returned; add the new version after it, or under another name"
                )
            raise ValueError(f"a model named {name!r} is already in the pool; pick another name")
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"pool.add takes an nn.Module as the model named {name!r}, got "
                f"{type(module).__name__}"
            )
        mine = {id(sub) for sub in module.modules()}
        for other in self._entries.values():
            if any(id(sub) in mine for sub in other.streamed.module.modules()):
                # Its tensors would be registered twice: twice the device bytes, and two
                # copies of one weight that could disagree.
                raise ValueError(
                    f"{type(module).__name__} is (or shares submodules with) the module "
                    f"already pooled as {other.name!r}; use that name for its requests, or "
                    "pool a separate copy (copy.deepcopy) under a new name"
                )
        self._refuse_shared_tensors(module)
        streamed = PooledStreamedModule(
            self.manager,
            module,
            device=self.device,
            prefetch=prefetch,
            host=host,
            checkpoint=checkpoint,
            blocks=blocks,
            name=name,
            keep_resident=True,
        )
        if self.one_thread:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="aresidency-pool"
                )
            streamed.pool_executor = self._executor
        entry = ModelEntry(name, streamed, prefetch)
        self._entries[name] = entry
        for handle in entry.handles:
            self._owner[handle] = entry
        logger.info(
            "pool: added %r: %d groups, %s (largest block %s, outside the blocks %s)",
            name,
            len(entry.groups),
            format_nbytes(entry.total_bytes),
            format_nbytes(entry.largest_block),
            format_nbytes(entry.outside_bytes),
        )
        return streamed

    def _refuse_shared_tensors(self, module: nn.Module) -> None:
        """``ValueError`` naming the tensor if ``module`` holds a tensor (a parameter or a
        buffer) of a model in the pool, or one sharing its memory (tied weights across two
        modules, a view): streaming it would point the tensor at the new model's host copy,
        and the pooled model would find its weight replaced (every later request for it
        failing), or the two would silently stop sharing it."""
        named = [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
        if not named or not self._entries:
            return
        by_id: dict[int, tuple[str, str]] = {}
        spans: list[tuple[int, int, str, str]] = []  # (start, end, model, tensor) in memory
        for other in self._entries.values():
            for group in other.streamed.all_groups:
                for packed in group.entries:
                    by_id.setdefault(id(packed.tensor), (other.name, packed.names[0]))
                    span = _span_of(packed.tensor)
                    if span is not None:
                        spans.append((*span, other.name, packed.names[0]))
        spans.sort()
        starts = [span[0] for span in spans]
        for tensor_name, tensor in named:
            found = by_id.get(id(tensor))
            how = "is"
            if found is None:
                span = _span_of(tensor)
                # The pooled tensors are disjoint in memory (each packed into its group's
                # host buffer): only the last one that begins before this one ends may
                # overlap it.
                before = 0 if span is None else bisect.bisect_left(starts, span[1])
                if span is not None and before and spans[before - 1][1] > span[0]:
                    found = spans[before - 1][2:]
                    how = "shares its memory with"
            if found is not None:
                other_name, other_tensor = found
                raise ValueError(
                    f"{type(module).__name__}'s {tensor_name!r} {how} {other_tensor!r} of the "
                    f"model already pooled as {other_name!r} (tied weights across two models): "
                    "pooled, each model gets its own copy of its tensors, which would replace "
                    f"it under {other_name!r}; untie them (give this module its own copy, "
                    "copy.deepcopy) or pool one module that holds both"
                )

    async def remove(self, name: str) -> None:
        """Take model ``name`` out of the pool: new requests for it get ``KeyError`` at once;
        the ones that arrived before (waiting or admitted) are served first; then its values
        leave the manager (device, pinned and host copies: its module gets its own host
        tensors back, as at :meth:`aclose`) and its name is free for :meth:`add`. The other
        models' requests go on meanwhile. Several removals of one model wait for the same
        end; one of them cancelled, the others go on.

        ``RuntimeError`` at once if the calling task is inside a request for it (the wait
        would never end). ``ResidencyPlanError`` (nothing changed) when a request for it
        waits, in line or for room, for room the calling task holds (its own requests of the
        pool, a reservation block, a scope: hold and wait, as for nested requests), at once
        or as soon as such a wait begins. Cancelled (or refused) while it waits, and no other
        removal of it waiting, the model stays in the pool, serving.

        Its demand history goes with it: a model added later under the same name (a hot
        swap) starts with no demand, as any new model."""
        self._check_open()
        self.manager.check_thread()
        entry = self._entry(name)
        task = current_task()
        if any(r.entry is entry for r in self._own_requests(task)):
            raise RuntimeError(
                f"cannot remove model {name!r} from inside a request for it: the removal waits "
                "for its requests to end, this one included; leave the pool.use block first"
            )
        self._refuse_removal_waiting_on_itself(entry, task)
        if entry.removing is None:
            entry.removing = anyio.Event()
            if entry.in_flight == 0:
                entry.removing.set()
        entry.removers += 1
        try:
            while not entry.removing.is_set():
                await entry.removal_wake.wait()  # (a request ended or parked: look again)
                self._refuse_removal_waiting_on_itself(entry, task)
        except BaseException:
            entry.removers -= 1
            if not entry.removers and entry.closing is None:
                # Nobody removes it now (nothing else changed): it serves. Even when its last
                # request ended as the cancellation came (the removal was free to go on): left
                # marked, it took no request and its name stayed taken, for ever.
                entry.removing = None
            raise
        entry.removers -= 1
        # From here on the removal completes (every remover closes it: once, see _close_entry;
        # a cancellation, native ones too, is raised once it is out).
        try:
            await self._close_entry(entry)  # (once, if aclose does it meanwhile)
        except ManagerClosedError:
            pass  # the manager closed: its state is final, nothing left to give back
        finally:
            removed = self._entries.get(name) is entry
            if removed:
                del self._entries[name]
                self.demand.forget(name)  # (unique names, added and removed, would pile up)
            for handle in entry.handles:
                self._owner.pop(handle, None)
            entry.removed.set()
        if removed:
            logger.info("pool: removed %r", name)

    def _refuse_removal_waiting_on_itself(self, entry: ModelEntry, task: object | None) -> None:
        """``ResidencyPlanError`` if a removal of ``entry`` by ``task`` would wait for ever:
        a request for it that is not admitted waits (first come, first served: behind every
        request ahead of it in the line too) for room that could appear only once what
        ``task`` holds ended (its requests of the pool, a reservation block, a scope), which
        ends only when the removal returned. Loop thread; never waits."""
        if task is None or entry.in_flight == 0:
            return
        line = [r for r in self._waiting.values() if not r.nested]
        mine = [i for i, r in enumerate(line) if r.entry is entry]
        # The requests for it in line, those ahead of its last one, and its nested ones.
        ahead = line[: mine[-1] + 1] if mine else []
        ahead += [r for r in self._waiting.values() if r.nested and r.entry is entry]
        if not ahead:
            return
        exempt = self._exempt_for((task,))
        for request in ahead:
            try:
                mode, need = self._need(request)
            except ResidencyPlanError:
                continue  # (it can never fit: it fails, it does not wait)
            error = self.manager.waiting_on_itself(
                need,
                self.device,
                exempt=exempt,
                what=f"request {request.id} for {request.entry.name!r} ({mode})",
                task=task,
            )
            if error is None:
                continue
            which = (
                f"request {request.id} for it waits for room"
                if request.entry is entry
                else f"its requests wait in line behind request {request.id} for "
                f"{request.entry.name!r}, which waits for room"
            )
            raise ResidencyPlanError(
                f"the removal of model {entry.name!r} would wait for ever (hold and wait): it "
                f"waits for the model's requests to end, and {which} that this task holds "
                f"(given back only once the removal returned): {error}"
            ) from error

    def _wake_removers(self, entry: ModelEntry | None = None) -> None:
        """Make the removals waiting (of ``entry``, or of every model) look again."""
        entries = [entry] if entry is not None else list(self._entries.values())
        for each in entries:
            if each.removers:
                each.removal_wake.set()
                each.removal_wake = anyio.Event()

    async def _close_entry(self, entry: ModelEntry) -> None:
        """Close the model's streamed module once (a removal and the pool's close may both
        ask); a second caller waits for the first. The close is carried out to the end even
        when the caller is cancelled (a native asyncio cancellation too: see
        :mod:`aresidency.runtime.shield`), which is raised after it."""
        if entry.closing is not None:
            cancelled = await wait_shielded(entry.closing)
            if cancelled is not None:
                raise cancelled
            return
        entry.closing = anyio.Event()
        try:
            await finish_shielded(entry.streamed.aclose)
        finally:
            entry.closing.set()

    @property
    def models(self) -> list[str]:
        return list(self._entries)

    def module(self, name: str) -> PooledStreamedModule:
        """The streamed module of ``name`` (its handles, block sizes, ``residency()``)."""
        return self._entry(name).streamed

    def _entry(self, name: str) -> ModelEntry:
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(repr(n) for n in self._entries) or "none"
            raise KeyError(f"no model named {name!r} in the pool (it has: {known})")
        return entry

    # ---------------------------------------------------------------- requests

    @asynccontextmanager
    async def use(
        self, name: str, *, reserve: ByteSize = 0, timeout: float | None = None
    ) -> AsyncIterator[PooledModel]:
        """``async with pool.use(name, reserve=..., timeout=...) as model``: one request.

        Waits (without blocking the loop) for the request's turn, first come first served
        among the pool's requests, then until its model and its ``reserve`` (the request's own
        workspace: activations, KV cache; bytes or a size string like ``"64MiB"``) fit:
        *resident* when the whole model plus the reserve fit the budget (its missing groups
        are copied in, evicting the groups the controller finds cheapest to bring back given
        each model's demand), *streamed* otherwise (its tensors outside the blocks, and the
        leading blocks that fit in free room, stay; the rest stream through a prefetch window
        as deep as the budget allows). The reserve is a named ``MemoryReservation`` for the
        whole block; the model's device groups are held for it.

        ``ResidencyPlanError`` at once when the request could never fit (its model's
        smallest streaming footprint plus its reserve exceed the budget: the message gives
        the bytes); ``TimeoutError`` if not admitted within ``timeout`` seconds; a failed load
        raises its error to this request only. Cancellation at any point (waiting, loading,
        in the body) leaves no reservation, hold or transfer behind.

        A request made by a task that holds one already (nested blocks) is judged against
        the room the task's own requests leave (they end only when it goes on): resident if
        the model fits there whole, streamed if its smallest footprint does, else
        ``ResidencyPlanError`` at once; it joins the task's request for the same model, and
        does not queue behind the line's head (which may wait for what the task holds)."""
        self._check_open()
        self.manager.check_thread()
        entry = self._entry(name)
        if entry.removing is not None:
            raise KeyError(
                f"model {name!r} is being removed from the pool: it takes no new requests"
            )
        nbytes = parse_nbytes(reserve, "reserve")
        timeout = check_timeout(timeout)
        request = _Request(next(self._ids), entry, nbytes)
        request.no_wait = timeout == 0
        request.nested = bool(self._own_requests(request.task))
        self.demand.record(name)
        entry.stats.requests += 1
        try:
            self._mode_for(entry, nbytes, request.task)  # one that could never fit fails now
            short = entry.streamed.source_short()  # (a budget lowered since it was added)
            if short is not None:
                raise ResidencyPlanError(short[0]) from short[1]
        except ResidencyPlanError:
            entry.stats.failures += 1
            raise
        if self._requests == 0:
            self._idle = anyio.Event()
        self._requests += 1
        entry.in_flight += 1
        self._waiting[request.id] = request
        try:
            try:
                await self._admit(request, timeout)
            except BaseException:
                entry.stats.failures += 1
                raise
            finally:
                del self._waiting[request.id]
            try:
                yield PooledModel(self, request)
            except BaseException:
                entry.stats.failures += 1
                raise
            finally:
                await self._leave(request)
        finally:
            self._requests -= 1
            if self._requests == 0:
                self._idle.set()
            entry.in_flight -= 1
            if request.left:
                entry.leaving -= 1
            if entry.in_flight == 0 and entry.removing is not None:
                entry.removing.set()
                self._wake_removers(entry)
            if entry.in_flight == entry.leaving and not entry.busy:
                # Its model may be given back now (no request waits for it any more), which
                # no transition announces: whoever waits for room asks the pool again.
                self.manager.reclaimable_changed()

    async def _admit(self, request: _Request, timeout: float | None) -> None:
        """Wait for the request's turn and admit it (see :meth:`use`)."""
        try:
            # timeout=0 sets no deadline: such a request never parks (see _park), and what
            # it does await (the decision, its copies) is not a wait for admission.
            with anyio.fail_after(None if request.no_wait else timeout):
                if request.nested:
                    # Its task holds an admitted request: in the line, it could wait behind
                    # a head that waits for what that request holds, which ends only once
                    # this one was admitted. It takes its turn to decide at once instead.
                    request.why = "its admission (deciding, and entering with the manager)"
                    async with self._deciding:
                        await self._admit_in_turn(request)
                    return
                place = self._line.join(request.entry)
                try:
                    while not self._line.first(place):
                        # Woken when the head parks (and when it leaves): a request that
                        # moves nothing may join its model past it, keeping its place if not.
                        if self.express_joins and await self._try_express(request):
                            return
                        if request.no_wait:
                            raise TimeoutError
                        await place.wait()
                    request.why = "its admission (deciding, and entering with the manager)"
                    async with self._deciding:
                        await self._admit_in_turn(request)
                finally:
                    self._line.leave(place)
        except ManagerClosedError as error:
            error.add_note(
                f"the request for {request.entry.name!r} was not admitted: it waited for "
                f"{request.why} when the manager closed"
            )
            raise
        except TimeoutError:
            if request.no_wait:
                raise TimeoutError(
                    f"request for {request.entry.name!r} was not admitted at once "
                    f"(timeout=0 never waits): it would have waited for {request.why}"
                ) from None
            raise TimeoutError(
                f"request for {request.entry.name!r} was not admitted within {timeout} s: it "
                f"waited for {request.why}"
            ) from None

    async def _admit_in_turn(self, request: _Request) -> None:
        entry = request.entry
        manager = self.manager
        while True:
            # A request that arrived before the pool closed is served (aclose waits for it).
            before = self._progress()
            mode, prefetch = self._mode_for(entry, request.reserve, request.task)
            other: Mode = "streamed" if mode == "resident" else "resident"
            if entry.active[other]:
                # Holds of one mode would make the other's releases fail: switch when idle.
                request.why = f"{entry.name!r} to finish its {other} requests"
                await self._park(request, before, frozenset({entry.name}))
                continue
            # Weights written in place since the model's replicas were copied (ValueError for
            # a tensor replaced instead): the stale replicas go once no request holds them.
            changed = entry.streamed._changed_groups()
            if changed and entry.active[mode]:
                how = (
                    "replaced by a call's forward"
                    if any(g.replaced for g in changed)
                    else "written in place"
                )
                request.why = (
                    f"{entry.name!r} to finish its requests (its weights were {how} since "
                    "they were copied: its device replicas are stale)"
                )
                await self._park(request, before, frozenset({entry.name}))
                continue
            joining = entry.active[mode] > 0
            if not joining:
                await self._settle(entry)
                if changed:
                    await entry.streamed._refresh(changed)  # (nothing holds them: idle)
                    await self._settle(entry)  # the stale replicas' releases finish first
            # Every judgement below reads the state as it is now: the room a park waits to see
            # grow is measured from here (or from the refusal itself), never from before an
            # await (see _wait_for_progress).
            before = self._progress()
            headroom = self._headroom()
            if mode == "streamed":
                window = entry.window_bytes(prefetch)
                current = max(entry.windows.values(), default=0)
                own_window = max(0, window - current) if joining else window
            else:
                own_window = 0
            if (
                mode == "resident"
                and not manager.waiting_for_room(self.device)
                and self._is_hit(entry, request.reserve, headroom)
            ):
                # A hit: nothing to evict, so no decision (the controller's search costs
                # milliseconds of the loop per request); refused only if a scope came first.
                refused = await self._enter_hit(request, headroom, joining=joining)
                if refused is None:
                    return
                request.why = f"room for the reserve of {request.reserve} B"
                await self._park(request, refused, None)
                continue
            spec = self._request_spec(request, mode, joining, own_window, headroom)
            if self._surely_short(entry, mode, joining, request.reserve + own_window + headroom):
                request.why = self._short_reason(entry, mode, request.reserve, headroom)
                await self._park(request, before, self._drain_target(request, mode, headroom))
                continue
            self.view.weigh(self._weights())
            try:
                decision = await self.controller.decide(spec)
            except ResidencySearchLimitError as error:
                # Many models of many equal blocks make the exact search space huge. Shrink
                # it as a swapping server would: evict the coldest idle model whole, then
                # decide again; with nothing idle to evict, wait for a request to end.
                victim = await self._evict_coldest_idle(entry)
                if victim is not None:
                    request.why = f"a search past its limit; evicted the coldest idle {victim!r}"
                    continue
                # No idle model: the room must come from other tenants' values. Evict the
                # least recently used of those the search could evict, as many bytes as the
                # request lacks (at least one), then decide again (a smaller search).
                evicted = await self._evict_greedily(spec)
                if evicted:
                    request.why = (
                        f"a search past its limit; evicted {format_nbytes(evicted)} of other "
                        "tenants' values (least recently used first)"
                    )
                    continue
                # Nothing evictable: what stands in the way is protected (in use, held,
                # reserved) and ends on its own; wait for it.
                before = self._progress()  # the state the search judged
                request.why = f"a search past its limit with nothing idle to evict: {error}"
                await self._park(request, before, self._drain_target(request, mode, headroom))
                continue
            except ResidencyPlanError as error:
                before = self._progress()  # the state the search judged infeasible
                request.why = f"room: {error.reason}"
                await self._park(request, before, self._drain_target(request, mode, headroom))
                continue
            # (Never for a nested request: the colder model in use may be its own task's.)
            defer = self.defer_hot_evictions and not request.nested
            colder = self._colder_in_use(entry, decision) if defer else None
            if colder is not None:
                request.why, colder_name = colder
                await self._park(request, before, frozenset({colder_name, entry.name}))
                continue
            reserve = (
                [MemoryReservation(self._reservation_name(request), self.device, request.reserve)]
                if request.reserve
                else []
            )
            plan = ResidencyPlan(
                reclaim=decision.plan.reclaim,
                reserve=reserve,
                expected_state_version=decision.expected_state_version,
            )
            scope = manager.scope(plan, timeout=0 if request.no_wait else None)
            try:
                await scope.__aenter__()
            except ResidencyStaleStateError:
                continue  # the manager moved since the decision: decide again
            except ResidencyPlanExecutionError as error:
                if error.phase != "reclaim" or not isinstance(
                    error.__cause__, (ResidencyUnavailableError, ResidencyInUseError)
                ):
                    raise
                # Another tenant released (or protected) a victim while the reclaim ran, after
                # the decision's state check: what was committed stays; decide again.
                continue
            except ResidencyPlanError as error:
                before = self._progress()  # the state the scope's admission refused
                request.why = f"room: {error.reason}"
                await self._park(request, before, self._drain_target(request, mode, headroom))
                continue
            request.scope = scope
            request.mode, request.prefetch = mode, prefetch
            try:
                if self.express_joins and mode == "resident" and not request.nested:
                    # Its copies only remain: the requests in line may join models that are
                    # there meanwhile (room is theirs only if it is free beside the copies; a
                    # streamed head's window is not charged yet, so it lets nobody by).
                    self._head_blockers = frozenset({entry.name})
                    self._head_why = f"request {request.id} for {entry.name!r}, which loads it"
                    self._line.wake_all(self._head_blockers)
                try:
                    loaded = await self._load_and_hold(request, joining)
                finally:
                    self._head_blockers = None
            except ResidencyBudgetError as error:
                # Refused synchronously (another tenant's scope waits for room first): undo
                # and wait for our turn again.
                refused = await self._undo_refused(request, error)
                request.why = f"room: {error}"
                await self._park(request, refused, None)
                continue
            except BaseException:
                await self._exit_scope(request)
                raise
            self._record(request, decision, loaded, headroom, scope)
            return

    # -- joining past the head of the line

    async def _park(
        self,
        request: _Request,
        before: _Progress,
        blockers: frozenset[str] | None,
    ) -> None:
        """The head of the line parks until progress, naming the models whose requests it
        waits to see end (``None``: unknown); requests for other models may join theirs
        meanwhile (:meth:`_try_express`), never while the head decides or enters. A request
        with ``timeout=0`` raises ``TimeoutError`` instead (its message is ``request.why``)."""
        if request.no_wait:
            raise TimeoutError
        self._refuse_waiting_on_itself(request)
        with contextlib.ExitStack() as registered:
            # The park is a wait for room its task may hold some of: registered with the
            # manager, which refuses the wait that would close a cycle of tasks each holding
            # room the others wait for (hold and wait: two nested requests, or one and a
            # loader of a task inside its own request).
            mode, need = self._need(request)
            try:
                registered.enter_context(
                    self.manager.room_wait(
                        need,
                        self.device,
                        what=f"request {request.id} for {request.entry.name!r} ({mode})",
                        task=request.task,
                        exempt=self._owner,
                    )
                )
            except ResidencyBudgetError as error:
                raise ResidencyPlanError(
                    f"the request for {request.entry.name!r} would wait for ever: {error}"
                ) from error
            self._deciding.release()  # a nested request may decide meanwhile
            self._wake_removers()  # (a removal that this park makes wait for ever is refused)
            try:
                if request.nested:  # (the line's head, if it parks too, names its blockers)
                    await self._wait_for_progress(before)
                    return
                self._head_blockers = blockers
                self._head_why = (
                    f"request {request.id} for {request.entry.name!r}, which waits for "
                    f"{request.why}"
                )
                if blockers is not None and self.express_joins:
                    self._line.wake_all(blockers)  # (those that may pass look for a way now)
                try:
                    await self._wait_for_progress(before)
                finally:
                    self._head_blockers = None
            finally:
                await self._reacquire_deciding()

    def _refuse_waiting_on_itself(self, request: _Request) -> None:
        """Before a park: ``ResidencyPlanError`` if the request could be admitted only once
        what its own task holds ended (a ``manager.reservation`` block, a scope, leases and
        holds, its other requests): those end only when the task goes on, so the park would
        never end. The pool's idle groups count as gone (it evicts them); the model's own
        groups are counted in full."""
        entry = request.entry
        mode, need = self._need(request)
        error = self.manager.waiting_on_itself(
            need,
            self.device,
            exempt=self._exempt_for((request.task,)),
            what=f"request {request.id} for {entry.name!r} ({mode})",
            task=request.task,
        )
        if error is not None:
            raise ResidencyPlanError(
                f"the request for {entry.name!r} would wait for ever: {error}"
            ) from error

    def _need(self, request: _Request) -> tuple[Mode, int]:
        """The mode the request would be admitted in, and the room it needs at the device for
        it (the whole model, or its smallest streaming footprint, and its reserve)."""
        entry = request.entry
        mode, prefetch = self._mode_for(entry, request.reserve, request.task)
        if mode == "resident":
            return mode, entry.total_bytes + request.reserve
        return mode, entry.outside_bytes + entry.window_bytes(prefetch) + request.reserve

    def _exempt_for(self, tasks: Iterable[object]) -> list[ValueHandle]:
        """The pool's groups that ``tasks``' admitted requests do not keep: idle to them
        (the pool evicts them for a request), what a check of their wait counts as gone."""
        mine = {
            group.handle
            for task in tasks
            for other in self._own_requests(task)
            for group in other.entry.groups
            if group.index in other.kept
        }
        return [h for e in self._entries.values() for h in e.handles if h not in mine]

    def _drain_target(self, request: _Request, mode: Mode, headroom: int) -> frozenset[str] | None:
        """For a head that waits for room to load its model resident: the model it waits to
        see idle (the least demanded busy one whose resident bytes make up the shortfall; the
        same one as last time while it still would, so that requests for the others keep
        joining theirs and this one does go idle), with its own; ``None`` when no single model
        would (then nobody passes the head)."""
        entry = request.entry
        if mode != "resident":
            return None
        state = self.manager.state
        ledger = state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return None
        missing = entry.total_bytes - entry.resident_bytes_at(state, self.device)
        free = ledger.budget_bytes - ledger.charged_bytes
        shortfall = missing + request.reserve + headroom - free
        candidates = {
            other.name: other
            for other in self._entries.values()
            if other is not entry
            and other.busy
            and other.resident_bytes_at(state, self.device) >= shortfall
        }
        if not candidates:
            request.drain = None
            return None
        if request.drain not in candidates:
            rates = self.demand.rates(list(self._entries))
            request.drain = min(candidates, key=lambda name: (rates[name], name))
        return frozenset({request.drain, entry.name})

    async def _try_express(self, request: _Request) -> bool:
        """Admit ``request`` at once, past the head of the line, if that cannot delay the head:
        its model is resident whole and in use resident (so the request moves nothing and only
        joins the holds), the head waits for other models' requests to end (it named them),
        no scope of another tenant waits for room, and the request's reserve fits the free
        room beside the streams' headroom. False (nothing changed) otherwise: the request then
        takes its turn. Without this, every request queued behind a head that waits for a
        busy model (to evict it) waits too, even for a model that is already on the GPU.
        Looked at on arrival, whenever the head parks and when it starts copying its model in
        (its decision is carried out by then); a request that may not pass keeps its place in
        the line."""
        entry = request.entry
        blockers = self._head_blockers
        if blockers is None or entry.name in blockers:
            return False
        if entry.active["resident"] == 0 or entry.active["streamed"]:
            return False
        if self.manager.waiting_for_room(self.device):
            return False
        if entry.streamed._changed_groups():
            return False  # written in place: the request waits for the model to be idle
        if self._mode_for(entry, request.reserve, request.task)[0] != "resident":
            return False
        headroom = self._headroom()
        if not self._is_hit(entry, request.reserve, headroom):
            return False
        refused = await self._enter_hit(request, headroom, joining=True, passed=self._head_why)
        return refused is None

    def _is_hit(self, entry: ModelEntry, reserve: int, headroom: int) -> bool:
        """Whether the model is resident whole on the device and the request's reserve fits
        the free room beside the streams' headroom: admitting it moves nothing."""
        state = self.manager.state
        states = entry.states_at(state, self.device)
        if any(states.get(group.index) is not _RESIDENT for group in entry.groups):
            return False
        ledger = state.ledger(self.device)
        return (
            ledger.budget_bytes is None
            or ledger.charged_bytes + reserve + headroom <= ledger.budget_bytes
        )

    async def _enter_hit(
        self, request: _Request, headroom: int, *, joining: bool, passed: str | None = None
    ) -> _Progress | None:
        """Admit a request whose model is resident whole without a decision (there is
        nothing to evict): a scope for its reserve, then its holds. ``None`` once admitted;
        if the reserve or a copy is refused (another tenant's scope came first), nothing
        changed and the return is the :meth:`_progress` reading of the refusal (to park on)."""
        manager = self.manager
        reserve = (
            [MemoryReservation(self._reservation_name(request), self.device, request.reserve)]
            if request.reserve
            else []
        )
        scope = manager.scope(
            ResidencyPlan(reserve=reserve), timeout=0 if request.no_wait else None
        )
        try:
            await scope.__aenter__()
        except ResidencyPlanError:
            return self._progress()
        request.scope = scope
        request.mode, request.prefetch = "resident", 0
        try:
            loaded = await self._load_and_hold(request, joining=joining)
        except ResidencyBudgetError as error:
            return await self._undo_refused(request, error)
        except BaseException:
            await self._exit_scope(request)
            raise
        self._record(request, None, loaded, headroom, scope, passed=passed)
        return None

    async def _undo_refused(self, request: _Request, error: ResidencyBudgetError) -> _Progress:
        """Exit the scope of a request whose copies the manager refused (``error``: another
        tenant's scope waits for room first, or the room a checkpoint's groups are read into
        is short) and return the reading to park on: the room as it is once the request's own
        reserve went, and the manager's queue and the room where the groups are read as they
        were at the refusal (a scope that entered, or room there that another tenant's copies
        gave back, while this one exited is progress)."""
        queued = self.manager.waiting
        await self._exit_scope(request)
        ended, free, unprotected, incoming, now_queued, read_free = self._progress()
        if error.location == CHECKPOINT_READ_INTO and error.budget_bytes is not None:
            read_free = min(read_free, error.budget_bytes - error.current_bytes)
        return ended, free, unprotected, incoming, max(queued, now_queued), read_free

    async def _evict_coldest_idle(self, entry: ModelEntry) -> str | None:
        """Release every resident device replica of the idle model with the lowest demand
        (other than ``entry``, and none a stream is releasing); returns its name, or ``None``
        when no idle model has anything resident at the device."""
        state = self.manager.state
        rates = self.demand.rates(list(self._entries))
        idle = [
            other
            for other in self._entries.values()
            if other is not entry
            and not other.busy
            and not other.streamed.releasing
            and other.resident_bytes_at(state, self.device)
        ]
        if not idle:
            return None
        victim = min(idle, key=lambda other: (rates[other.name], other.name))
        states = victim.states_at(state, self.device)
        evicted = 0
        for group in victim.groups:
            if states.get(group.index) is not _RESIDENT:
                continue
            assert group.handle is not None
            try:
                await self.manager.release(group.handle, self.device)
            except ResidencyError:
                continue  # taken meanwhile (a hold, a lease): the next decision sees it
            evicted += group.charge_bytes
        if not evicted:
            return None
        victim.stats.evictions += 1
        victim.stats.evicted_bytes += evicted
        return victim.name

    async def _evict_greedily(self, spec: ResidencyRequest) -> int:
        """For a search past its limit with no idle model to evict: move off the device, least
        recently used first, the values of other tenants that the search could evict there
        (resident, unprotected, with a replica elsewhere, a source to rebuild from, or a
        fallback tier to move to: the controller's candidates), until what ``spec`` needs there
        fits beside the charge (at least one value). Returns the bytes evicted (0: none could
        be). A value taken meanwhile is skipped."""
        state = self.manager.state
        ledger = state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return 0
        graph = self.controller.fallback_graph
        missing = 0
        wanted = set()
        for requirement in spec.requirements:
            wanted.add(requirement.handle)
            value = state.find_value(requirement.handle)
            if value is not None and self.device not in value.materializations:
                missing += value.charge_bytes
        needed = missing + sum(r.nbytes for r in spec.reservations if r.location == self.device)
        short = ledger.charged_bytes + needed - ledger.budget_bytes
        candidates: list[tuple[int, int, ValueHandle, int, Location | None]] = []
        for value in state.values():
            if value.handle in self._owner or value.handle in wanted:
                continue  # (the pool's own: idle models go whole, see _evict_coldest_idle)
            for location, cls, (recency, value_id, handle, charge) in classify(value, graph):
                if location == self.device:
                    move = None if cls.releasable else cls.moves[0]
                    candidates.append((recency, value_id, handle, charge, move))
        candidates.sort(key=lambda c: (c[0], c[1]))
        evicted = 0
        for _, _, handle, charge, move in candidates:
            if evicted and evicted >= short:
                break
            try:
                if move is None:
                    await self.manager.release(handle, self.device)
                else:
                    await self.manager.move(handle, move)
            except ResidencyError:
                continue  # taken meanwhile (a lease, a hold), or no room where it goes
            evicted += charge
        if evicted:
            logger.info(
                "pool: a search past its limit: evicted %s of other tenants' values at %s",
                format_nbytes(evicted),
                self.device,
            )
        return evicted

    # -- waiting

    def _progress(self) -> _Progress:
        """What a waiting request watches: requests ended, free room at the device, the room
        nothing protects there, the bytes still arriving (a landed copy can be evicted), the
        scopes waiting in the manager's admission queue (another tenant's), and the free room
        at pageable-host, where a checkpoint's groups are read on their way (another tenant's
        loads, a pool's on another device, give it back with no change at this device)."""
        state = self.manager.state
        ledger = state.ledger(self.device)
        # No budget (none set, or lifted: set_budget(device, None)) is more room than any.
        budget = _UNLIMITED if ledger.budget_bytes is None else ledger.budget_bytes
        free = budget - ledger.charged_bytes
        unprotected = budget - ledger.reserved_bytes - ledger.protected_bytes
        read = state.find_ledger(CHECKPOINT_READ_INTO)
        read_free = (
            _UNLIMITED
            if read is None or read.budget_bytes is None
            else read.budget_bytes - read.charged_bytes
        )
        return (
            self._ended,
            free,
            unprotected,
            ledger.incoming_bytes,
            self.manager.waiting,
            read_free,
        )

    async def _wait_for_progress(self, before: _Progress) -> None:
        """Park until something happened since ``before`` that could admit a waiting request:
        a request ended (its model is idle, its mode over), free room grew, the room nothing
        protects grew (a hold or a lease ended, readers' events were reaped: an eviction became
        possible), a copy landed, a scope of another tenant left the manager's queue (the
        manager refuses the pool's copies while one waits there for room: first come, first
        served), or room at pageable-host grew (where a checkpoint's groups are read on their
        way: another pool's loads give it back). Only those can turn a refusal into an
        admission, so the head of the line does not decide again on every transition of the
        calls in flight.

        ``before`` must be read in the same synchronous step as the judgement that refused the
        request (see :meth:`_admit_in_turn`): room that shrank while an await ran and came back
        to the earlier level is progress for a judgement made on the shrunken state; compared
        with a reading from before the shrinking, it would never wake the request.

        Woken by every change of the manager's state and cut short at the end of each request
        and when the pool closes; a scope that leaves the manager's queue without a transition
        (cancelled, timed out) is seen by a look every ``_RECHECK_S`` seconds.
        ``ManagerClosedError`` as soon as the manager closes."""
        closed = self._closed
        while True:
            ended, free, unprotected, incoming, queued, read_free = self._progress()
            if ended != before[0] or free > before[1] or unprotected > before[2]:
                return
            if incoming < before[3] or queued < before[4] or self._closed != closed:
                return
            if read_free > before[5]:
                return
            with anyio.move_on_after(_RECHECK_S) as wake:
                self._wakes.add(wake)
                try:
                    await self.manager.wait_for_change()
                finally:
                    self._wakes.discard(wake)

    async def _reacquire_deciding(self) -> None:
        """Take ``_deciding`` back after a park, even when cancelled meanwhile (the caller's
        ``async with`` releases it on the way out), then raise the cancellation.

        The shield holds anyio's (and trio's) cancellations off; a native asyncio one
        (``task.cancel()``) gets through it, and anyio's ``Lock.acquire`` then gives the lock
        up (or leaves the queue) before raising: caught here, the lock is asked for again and
        the cancellation raised once it is held (see :mod:`aresidency.runtime.shield`)."""
        cancelled: BaseException | None = None
        with anyio.CancelScope(shield=True):
            while True:
                try:
                    await self._deciding.acquire()
                    break
                except anyio.get_cancelled_exc_class() as error:
                    cancelled = error  # (not held now: asked for again)
        if cancelled is not None:
            raise cancelled

    def _poke(self) -> None:
        """Make the parked requests look again now (a request ended, the pool closes)."""
        for wake in self._wakes:
            wake.cancel()

    # -- the parts of an admission

    def _own_requests(self, task: object | None) -> list[_Request]:
        """The admitted requests of ``task`` (they end only when it goes on)."""
        if task is None:
            return []
        return [r for r in self._active.values() if r.task is task]

    def _reclaim(self, location: Location, nbytes: int) -> int:
        """For :meth:`ResidencyManager.reclaim`: begin releasing up to about ``nbytes`` of
        idle models' groups at ``location`` (the least demanded model first; a model with a
        request in flight, waiting or admitted, is left alone), each released only if nothing
        protects it (its host copy stays). Returns the bytes whose release began."""
        if location != self.device or self._closed or not self.manager.running:
            return 0
        state = self.manager.state
        rates = self.demand.rates(list(self._entries))
        freed = 0
        for entry in sorted(self._entries.values(), key=lambda e: (rates[e.name], e.name)):
            if entry.in_flight > entry.leaving or entry.busy or entry.removing is not None:
                continue
            releasing = set(entry.streamed.releasing)
            given = 0  # of this model's bytes (counted in its evictions, as a decision's are)
            for group in entry.groups:
                if freed >= nbytes:
                    break
                handle = group.handle
                value = None if handle is None else state.find_value(handle)
                if handle is None or value is None or group.index in releasing:
                    continue
                mat = value.materializations.get(location)
                if mat is None or mat.state is not _RESIDENT or mat.protected:
                    continue
                if len(value.materializations) < 2:
                    continue  # (its only copy: never, though a pool keeps a host one)
                try:
                    self.manager.release_nowait(handle, location)
                except ResidencyError:
                    continue
                freed += mat.charged_bytes
                given += mat.charged_bytes
            if given:
                entry.stats.evictions += 1
                entry.stats.evicted_bytes += given
            if freed >= nbytes:
                break
        if freed:
            logger.info("pool: gave back %s of idle models at %s", format_nbytes(freed), location)
        return freed

    def _kept_for(self, task: object) -> Kept | None:
        """For admission: what ``task``'s admitted requests hold on the device."""
        own = self._own_requests(task)
        if not own:
            return None
        held = tuple(
            (group.handle, self.device)
            for request in own
            for group in request.entry.groups
            if group.index in request.kept and group.handle is not None
        )
        names = ", ".join(f"{r.id} for {r.entry.name!r}" for r in own)
        kept = sum(self._kept_bytes(request) for request in own)
        return Kept(
            what=(
                f"{len(own)} request(s) of the model pool ({names}: {format_nbytes(kept)} "
                f"at {self.device}), which end only when this task leaves their 'pool.use' "
                "block"
            ),
            materializations=held,
            hint="Leave the pool.use block first, or do this from another task.",
        )

    def _kept_bytes(self, request: _Request) -> int:
        """What an admitted request keeps charged at the device: its held groups, its
        workspace reservation, its prefetch window."""
        groups = {group.index: group for group in request.entry.groups}
        held = sum(groups[index].charge_bytes for index in request.kept if index in groups)
        return held + request.reserve + request.entry.windows.get(request.id, 0)

    def _mode_for(
        self, entry: ModelEntry, reserve: int, task: object | None = None
    ) -> tuple[Mode, int]:
        """``("resident", 0)`` when the whole model plus ``reserve`` fit the budget; else
        ``("streamed", prefetch)`` with the deepest prefetch (up to the model's) that fits
        beside the tensors outside the blocks and the reserve. ``ResidencyPlanError`` when not
        even one block fits: the request could never run.

        For a request of a ``task`` that holds admitted requests of the pool already (nested
        ``use`` blocks), the budget is what those leave (they end only when the task goes
        on); a nested request for a model the task uses already takes that request's mode."""
        own = self._own_requests(task)
        for request in own:
            if request.entry is entry:
                return request.mode, request.prefetch
        state = self.manager.state
        ledger = state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return "resident", 0
        fixed = fixed_reserved_bytes(state, self.device)
        kept = sum(self._kept_bytes(request) for request in own)
        available = ledger.budget_bytes - fixed - kept
        if entry.total_bytes + reserve <= available:
            return "resident", 0
        floor = entry.outside_bytes + entry.largest_block + reserve
        if floor > available and own:
            names = ", ".join(sorted({f"{r.entry.name!r} ({r.mode})" for r in own}))
            cause = ResidencyBudgetError(
                self.device,
                ledger.budget_bytes,
                kept,
                fixed,
                floor,
                what=f"the smallest streaming footprint of {entry.name!r} plus the reserve",
                kind="reservation",
            )
            raise ResidencyPlanError(
                f"the request for {entry.name!r} can never fit {self.device} while this task "
                f"holds its request(s) for {names}: they keep {format_nbytes(kept)} there "
                f"and end only when the task goes on, and {entry.name!r} needs at least "
                f"{format_nbytes(floor)} (its tensors outside the blocks, "
                f"{format_nbytes(entry.outside_bytes)}, its largest block, "
                f"{format_nbytes(entry.largest_block)}, and the reserve, "
                f"{format_nbytes(reserve)}) of the budget's "
                f"{format_nbytes(ledger.budget_bytes)} less fixed reservations "
                f"({format_nbytes(fixed)}); leave the outer block first, or make the request "
                "from another task"
            ) from cause
        if floor > available:
            # The bytes as fields, on the cause (as the manager's infeasible plans carry them):
            # the device empty but for its fixed reservations, the request's smallest need.
            cause = ResidencyBudgetError(
                self.device,
                ledger.budget_bytes,
                0,
                fixed,
                floor,
                what=f"the smallest streaming footprint of {entry.name!r} plus the reserve",
                kind="reservation",
            )
            raise ResidencyPlanError(
                f"the request for {entry.name!r} can never fit {self.device}: the model needs "
                f"at least {format_nbytes(entry.outside_bytes + entry.largest_block)} to be "
                f"streamed (its tensors outside the blocks, "
                f"{format_nbytes(entry.outside_bytes)}, plus its largest block, "
                f"{format_nbytes(entry.largest_block)}) and the request reserves "
                f"{format_nbytes(reserve)}: {format_nbytes(floor)} in all, more than the "
                f"budget ({format_nbytes(ledger.budget_bytes)}) less fixed reservations "
                f"({format_nbytes(fixed)}); ask for a smaller reserve or raise the budget"
            ) from cause
        depth = (available - entry.outside_bytes - reserve) // max(1, entry.largest_block) - 1
        return "streamed", max(0, min(entry.prefetch, depth))

    def _headroom(self) -> int:
        """Bytes the streamed requests in flight may still charge at the device (their
        prefetch windows): every admission leaves them free, so a stream always progresses."""
        state = self.manager.state
        return sum(e.window_need(state, self.device) for e in self._entries.values() if e.windows)

    def _reservation_name(self, request: _Request) -> str:
        return f"pool:{request.label}:workspace"

    def _request_spec(
        self, request: _Request, mode: Mode, joining: bool, window: int, headroom: int
    ) -> ResidencyRequest:
        """The controller request: the groups that must be on the device, the workspace, and
        (only for the decision: never reserved) the room streams in flight and this request's
        own prefetch window need. The blocks streams in flight have on the device, and the
        blocks a module is releasing, stay too: once its readers' events are reaped and before
        the release commits, such a block is protected by nothing, and a release whose block
        was evicted meanwhile fails."""
        entry = request.entry
        loaded_in_rounds: list[TensorGroup] = []
        if mode == "resident":
            loaded_in_rounds = self._loaded_in_rounds(entry)
            needed = [g for g in entry.groups if g not in loaded_in_rounds]
        elif joining or entry.outside is None:
            needed = []
        else:
            needed = [entry.outside]
        state = self.manager.state
        for other in self._entries.values():
            if other.windows:
                at_device = other.states_at(state, self.device)
                needed += [g for g in other.groups if g.index in at_device]
            needed += [other.streamed.group(index) for index in other.streamed.releasing]
        handles = dict.fromkeys(g.handle for g in needed if g.handle is not None)
        requirements = [ResidencyRequirement(handle, self.device) for handle in handles]
        reservations = []
        if request.reserve:
            name = self._reservation_name(request)
            reservations.append(MemoryReservation(name, self.device, request.reserve))
        if loaded_in_rounds:
            nbytes = sum(g.charge_bytes for g in loaded_in_rounds)
            reservations.append(
                MemoryReservation(f"pool:{request.label}:load", self.device, nbytes)
            )
        if window:
            reservations.append(
                MemoryReservation(f"pool:{request.label}:window", self.device, window)
            )
        if headroom:
            reservations.append(
                MemoryReservation(f"pool:{request.label}:streams", self.device, headroom)
            )
        return ResidencyRequest(f"pool:{request.label}", requirements, reservations)

    def _loaded_in_rounds(self, entry: ModelEntry) -> list[TensorGroup]:
        """The groups of a model rebuilt from its checkpoint that are nowhere now, when
        pageable-host (where each is read on its way to the device, charged there until its
        copy landed) cannot hold them all at once, even with everything evictable gone: the
        controller would count them all there at once and find the request infeasible (for
        as long as what it cannot evict stays), while :class:`_Loading` copies them in as
        many rounds as that room needs. The decision counts their room at the device instead
        (a reservation of their bytes). Empty otherwise: the decision makes their room."""
        if not any(group.from_source for group in entry.groups):
            return []
        state = self.manager.state
        source = CHECKPOINT_READ_INTO
        ledger = state.find_ledger(source)
        if ledger is None or ledger.budget_bytes is None:
            return []
        nowhere = []
        for group in entry.groups:
            value = None if group.handle is None else state.find_value(group.handle)
            if group.from_source and value is not None and not value.materializations:
                nowhere.append(group)
        if not nowhere:
            return []
        # What no decision can evict there: protected copies, and sole ones with no source.
        stuck = 0
        for value in state.values():
            mat = value.materializations.get(source)
            if mat is not None and (
                mat.protected or (len(value.materializations) < 2 and not value.has_source)
            ):
                stuck += mat.charged_bytes
        room = ledger.budget_bytes - fixed_reserved_bytes(state, source) - stuck
        return nowhere if sum(g.charge_bytes for g in nowhere) > room else []

    def _surely_short(self, entry: ModelEntry, mode: Mode, joining: bool, extra: int) -> bool:
        """Whether the request cannot fit now even if every unprotected value left the device
        (an upper bound on the room: a cheap test before a search)."""
        ledger = self.manager.state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return False
        states = entry.states_at(self.manager.state, self.device)
        if mode == "resident":
            missing = sum(g.charge_bytes for g in entry.groups if g.index not in states)
        elif joining or entry.outside is None or entry.outside.index in states:
            missing = 0
        else:
            missing = entry.outside.charge_bytes
        room = ledger.budget_bytes - ledger.reserved_bytes - ledger.protected_bytes
        return missing + extra > room

    def _short_reason(self, entry: ModelEntry, mode: Mode, reserve: int, headroom: int) -> str:
        ledger = self.manager.state.ledger(self.device)
        return (
            f"room at {self.device} for {entry.name!r} ({mode}, reserve "
            f"{format_nbytes(reserve)}): in use or held {format_nbytes(ledger.protected_bytes)}, "
            f"reserved {format_nbytes(ledger.reserved_bytes)}, streams in flight "
            f"{format_nbytes(headroom)}, budget "
            f"{'unlimited' if ledger.budget_bytes is None else format_nbytes(ledger.budget_bytes)}"
        )

    def _weights(self) -> dict[ValueHandle, float]:
        """Each pool value's model's share of the top demand now (what the view encodes)."""
        rates = self.demand.rates(list(self._entries))
        top = max(rates.values(), default=0.0)
        weights: dict[ValueHandle, float] = {}
        for name, entry in self._entries.items():
            share = 1.0 if top <= 0 else rates[name] / top
            for handle in entry.handles:
                weights[handle] = share
        return weights

    def _colder_in_use(
        self, entry: ModelEntry, decision: ResidencyDecision
    ) -> tuple[str, str] | None:
        """Why the request should wait rather than enter ``decision`` and the model it waits
        for, or ``None``.

        The controller evicts only what nothing holds, so it may take an idle hot model while
        a colder one is in use; and the requests that keep the hot model busy wait behind this
        one (first come, first served), so the hot model is idle precisely because of the
        wait. When a model in use is colder than a victim and holds at least as many bytes as
        the decision evicts, waiting for it to finish is cheaper than reloading the hot one
        soon. It does finish: the requests that would keep it busy wait behind this one."""
        evicted: dict[str, int] = {}
        for eviction in decision.evictions:
            owner = self._owner.get(eviction.handle)
            if owner is not None and owner is not entry:
                evicted[owner.name] = evicted.get(owner.name, 0) + eviction.charge_bytes
        if not evicted:
            return None
        rates = self.demand.rates(list(self._entries))
        hottest = max(evicted, key=lambda name: rates[name])
        needed = sum(evicted.values())
        state = self.manager.state
        for other in self._entries.values():
            if other is entry or not other.busy or rates[other.name] >= rates[hottest]:
                continue
            if other.resident_bytes_at(state, self.device) >= needed:
                return (
                    f"{other.name!r} (in use, {rates[other.name]:.3g} requests/s) to finish "
                    f"rather than evict {hottest!r} ({rates[hottest]:.3g} requests/s)",
                    other.name,
                )
        return None

    async def _settle(self, entry: ModelEntry) -> None:
        """Let an idle model's earlier releases finish before its groups are held (a hold
        would make a release still waiting for its readers fail)."""
        try:
            await entry.streamed.drain()
        except Exception as error:  # an earlier call's error: its request saw it already
            logger.warning("pool: %r: an earlier call left an error: %s", entry.name, error)

    async def _load_and_hold(self, request: _Request, joining: bool) -> int:
        """Copy in what the request needs that is not on the device and hold what it keeps,
        each group as soon as it is there (see :class:`_Loading`). Returns the bytes copied.
        On failure or cancellation, nothing is held, the copies still in flight are cancelled
        and every one settled, so nothing is left incoming."""
        entry, mode = request.entry, request.mode
        state = self.manager.state
        states = entry.states_at(state, self.device)
        if mode == "resident":
            keep = [g.index for g in entry.groups]
        elif joining:
            keep = [index for index, n in entry.held.items() if n]
        else:
            keep = [index for index, st in states.items() if st is _RESIDENT]
            if entry.outside is not None and entry.outside.index not in keep:
                keep.append(entry.outside.index)
            # Partial residency: the leading blocks that fit in room nobody else needs stay.
            ledger = state.ledger(self.device)
            budget = _UNLIMITED if ledger.budget_bytes is None else ledger.budget_bytes
            room = budget - ledger.charged_bytes - self._headroom()
            room -= entry.window_bytes(request.prefetch)
            if entry.outside is not None and entry.outside.index not in states:
                room -= entry.outside.charge_bytes
            for group in entry.streamed.groups:
                if group.index in states:
                    continue
                if group.charge_bytes > room:
                    break
                room -= group.charge_bytes
                keep.append(group.index)
        copies = [
            g for g in entry.groups if g.index in keep and states.get(g.index) is not _RESIDENT
        ]
        if copies:  # (what a timeout, or the manager's close, then says it waited for)
            request.why = (
                f"the copies of {entry.name!r} to {self.device} to land ({len(copies)} "
                f"group(s), {format_nbytes(sum(g.charge_bytes for g in copies))})"
            )
        loading = _Loading(self.manager, self.device, entry, self.controller.fallback_graph)
        try:
            loaded = await loading.run(keep)
        except BaseException as error:
            # What landed stays on the device (evictable): host-to-device bytes all the same.
            entry.stats.bytes_copied += loading.landed
            if isinstance(error, Exception) and not isinstance(
                error, (ResidencyBudgetError, ManagerClosedError)
            ):
                error.add_note(
                    f"while loading model {entry.name!r} for request {request.id} (the "
                    "model's other requests are not affected; the next one loads it again)"
                )
            raise
        for index in keep:
            request.holds.append(loading.holds[index])
            entry.held[index] += 1
        request.kept = keep
        entry.active[mode] += 1
        if mode == "streamed":
            entry.windows[request.id] = entry.window_bytes(request.prefetch)
        request.active = True
        self._admitted += 1
        self._active[request.id] = request
        return loaded

    def _record(
        self,
        request: _Request,
        decision: ResidencyDecision | None,
        loaded: int,
        headroom: int,
        scope: Scope,
        passed: str | None = None,
    ) -> None:
        entry = request.entry
        waited = time.perf_counter() - request.arrived
        evicted: dict[str, int] = {}
        for eviction in () if decision is None else decision.evictions:
            owner = self._owner.get(eviction.handle)
            key = owner.name if owner is not None else (eviction.handle.name or "?")
            evicted[key] = evicted.get(key, 0) + eviction.charge_bytes
        for key, nbytes in evicted.items():
            victim = self._entries.get(key)
            if victim is not None:
                victim.stats.evictions += 1
                victim.stats.evicted_bytes += nbytes
        stats = entry.stats
        stats.wait_seconds += waited
        if passed is not None:
            stats.joined_past += 1
        stats.last_mode = request.mode
        stats.bytes_copied += loaded
        if loaded:
            stats.loads += 1
        elif request.mode == "resident":
            stats.hits += 1
        record = PoolDecision(
            request_id=request.id,
            model=entry.name,
            mode=request.mode,
            reserve_bytes=request.reserve,
            prefetch=request.prefetch,
            decision=decision,
            loaded_bytes=loaded,
            kept_groups=len(request.kept),
            evicted=evicted,
            demand=self.demand.rates(list(self._entries)),
            headroom_bytes=headroom,
            waited_seconds=waited,
            transitions=scope.report.transitions,
            passed=passed,
        )
        request.record = record
        self.decisions.append(record)
        level = logging.INFO if (loaded or evicted) else logging.DEBUG
        if logger.isEnabledFor(level):
            logger.log(level, "pool: %s", record)

    # -- the end of a request

    async def _leave(self, request: _Request) -> None:
        """End an admitted request: wait for the calls made inside its block that are still
        running (a call in a task that outlives the block: a direct one reads the held
        replicas with no lease of its own, so its holds must outlive it), report the direct
        calls' events as readers, drop its holds (its groups stay on the device, now
        evictable), end its workspace reservation. Runs shielded from cancellation."""
        entry = request.entry
        cancelled: BaseException | None = None
        if request.active:
            request.active = False  # no call starts from now on
            self._active.pop(request.id, None)
            if request.calls:
                request.calls_done = anyio.Event()
                # (a native asyncio cancellation meanwhile is raised once the request ended)
                cancelled = await wait_shielded(request.calls_done)
            self._admitted -= 1
            events = list(request.readers.values())
            request.readers.clear()
            holds, request.holds = request.holds, []
            # The pool's own bookkeeping first: nothing below may skip it.
            for index in request.kept:
                entry.held[index] -= 1
                if not entry.held[index]:
                    del entry.held[index]
                    entry.streamed.forget_views()  # the replica may go now
            entry.active[request.mode] -= 1
            entry.windows.pop(request.id, None)
            entry.leaving += 1  # (ended for the reclaimers: its model may be given back)
            request.left = True
            self._ended += 1
            try:
                if events:  # the direct calls' kernels read the held replicas
                    for hold in holds:
                        self.manager.track_readers(hold.handle, hold.location, events)
            except ManagerClosedError:
                pass  # the manager closed under the request: its state is final
            finally:
                for hold in holds:
                    try:
                        hold.release()
                    except ManagerClosedError:
                        pass
            self._poke()
        await self._exit_scope(request)
        if cancelled is not None:
            raise cancelled

    async def _exit_scope(self, request: _Request) -> None:
        """End the request's scope (its workspace reservation), shielded. After the manager
        closed there is nothing left to end: the request ends quietly (its body's work is
        done; a call it makes after the close raises ``ManagerClosedError``)."""
        scope, request.scope = request.scope, None
        if scope is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await scope.__aexit__(None, None, None)
                except ManagerClosedError:
                    logger.debug("pool: request %d ended after its manager closed", request.id)

    # ------------------------------------------------------------------ reading

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per model: ``requests``, ``hits``, ``loads``, ``evictions``, ``evicted_bytes``,
        ``bytes_copied``, ``wait_seconds``, ``failures``, ``last_mode``, ``joined_past``,
        ``calls``, ``shared_calls``, ``direct_calls``, ``call_seconds``, ``call_wait_seconds``,
        and now:
        ``demand_per_s``, ``resident_bytes`` (on the device), ``total_bytes``, ``active``
        (admitted requests). JSON-friendly. Loop thread; still readable once the manager
        closed (its final state), and once the pool closed (the reading :meth:`aclose` took
        as it finished: its models then have nothing resident and nothing active)."""
        if self._final_stats is not None:
            return {name: dict(row) for name, row in self._final_stats.items()}
        if self.manager.running:
            self.manager.check_thread()
        state = self.manager.state
        rates = self.demand.rates(list(self._entries))
        out: dict[str, dict[str, Any]] = {}
        for name, entry in self._entries.items():
            row = entry.stats.to_dict()
            row["demand_per_s"] = rates[name]
            row["resident_bytes"] = entry.resident_bytes_at(state, self.device)
            row["total_bytes"] = entry.total_bytes
            row["active"] = sum(entry.active.values())
            out[name] = row
        return out

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` began: from then on the pool admits no new request
        (``use`` raises ``RuntimeError``; a server answers 503 while it shuts down)."""
        return self._closed

    @property
    def waiting(self) -> int:
        """Requests that arrived and are not admitted yet."""
        return self._requests - self._admitted

    @property
    def admitted(self) -> int:
        return self._admitted

    # ------------------------------------------------------------------- the end

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the pool is closed: it admits no more requests")

    async def aclose(self) -> None:
        """Admit nothing new, wait for the requests in flight (waiting ones included) to
        finish, then give every model its own host tensors back and discard its values. The
        requests waiting are served, not refused: only those that arrive later are. Waking
        the head of the line (it looks again at once) changes nothing else.

        ``RuntimeError`` at once (the pool left open) if the calling task is inside a request
        of the pool: the wait would never end (as for :meth:`remove`). Cancelled while it
        waits, the pool stays closed (it admits nothing new) with its models registered; a
        later ``aclose()`` finishes the close."""
        own = self._own_requests(current_task())
        if own:
            names = ", ".join(f"{r.id} for {r.entry.name!r}" for r in own)
            raise RuntimeError(
                f"cannot close the model pool from inside its request(s) ({names}): the close "
                "waits for every request to end, these included; leave the pool.use block "
                "first, or close the pool from another task"
            )
        self._closed = True
        self._poke()
        await self._idle.wait()
        self._unkeep()
        self._unreclaim()
        for entry in list(self._entries.values()):
            try:
                await self._close_entry(entry)
            except Exception as error:
                logger.warning("pool: closing %r: %s", entry.name, error)
        if self._entries or self._final_stats is None:
            self._final_stats = self.stats()  # what stats() answers from now on
        self._entries.clear()
        self._owner.clear()
        self.controller.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # idle: every call has returned
            self._executor = None

    async def __aenter__(self) -> ModelPool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        ledger = self.manager.state.find_ledger(self.device)
        used = "?" if ledger is None else format_nbytes(ledger.charged_bytes)
        budget = (
            "unlimited"
            if ledger is None or ledger.budget_bytes is None
            else (format_nbytes(ledger.budget_bytes))
        )
        if self._closed:
            state = "closed"
        else:
            state = "open" if self.manager.running else "open, its manager closed"
        return (
            f"<ModelPool {self.device} {state} [{len(self._entries)} models, "
            f"{self._admitted} admitted, {self.waiting} waiting, {used} of {budget}]>"
        )
