"""One model of a pool: its streamed module, its byte arithmetic, its counters.

:class:`PooledStreamedModule` is a :class:`~aresidency.integrations.StreamedModule` whose
residency between calls the pool decides instead of the module: a call keeps on the device
exactly the groups the pool's requests hold (``pool_keep``) and releases the others after
use, and never releases at its start what an earlier call kept (the pool's controller evicts
those when another model needs the room, by demand). :class:`ModelEntry` is the pool's record
of one model; :class:`ModelStats` its counters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Literal

import anyio

from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.state import ResidencyState
from ..core.values import MaterializationState, ValueHandle
from ..integrations.streaming import StreamedModule
from ..integrations.streaming.packing import TensorGroup

__all__ = ["Mode", "ModelEntry", "ModelStats", "PooledStreamedModule", "fixed_reserved_bytes"]

Mode = Literal["resident", "streamed"]


def fixed_reserved_bytes(state: ResidencyState, location: Location) -> int:
    """Bytes reserved at ``location`` that never go away (the backend's own reservations)."""
    ledger = state.find_ledger(location)
    if ledger is None:
        return 0
    return sum(nbytes for nbytes, owner in ledger.reservations.values() if owner == "backend")


class PooledStreamedModule(StreamedModule):
    """A streamed module whose residency between calls is the pool's (module docstring).

    State beyond the module's: ``pool_keep`` (group indexes the next call keeps on the device:
    those the pool's active requests hold), ``constructed``. Invariant: a call never releases
    a group in ``pool_keep`` (the pool holds them, so a release would fail).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.pool_keep: set[int] = set()
        self.constructed = False
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

    def _check_budget(self) -> None:
        """At construction: refuse a model that could never run at all, even streamed with no
        prefetch and nothing else on the device (the module's own check would also count the
        reservations of requests in flight). At a call: nothing, the pool did the arithmetic
        when it admitted the request."""
        if self.constructed:
            return
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
    ``evictions`` (decisions that took groups of it off the device) and ``evicted_bytes``,
    ``bytes_copied`` (host to device: admission loads and what streamed calls copied),
    ``wait_seconds`` (time from arrival to admission, summed), ``failures`` (requests that
    raised before or during their body), ``last_mode`` (``resident`` or ``streamed``),
    ``joined_past`` (hits admitted at once past a head of the line waiting for other models)."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ModelEntry:
    """The pool's record of one model.

    State: ``name``, ``streamed`` (its :class:`PooledStreamedModule`), ``prefetch`` (the
    deepest window it streams with), ``stats``, ``active``
    (admitted requests per mode), ``windows`` (request id -> prefetch window bytes of each
    admitted streamed request), ``held`` (group index -> holds the active requests have on
    its device replica), ``call_lock`` (calls on the module, first come first served).
    Invariants: ``active`` has requests of one mode at a time (a model switches mode only
    when idle); ``held`` counts exactly the holds of active requests.
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
