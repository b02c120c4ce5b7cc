"""The SIMULATION as a test bench: a manager on simulated CUDA devices, configured in one value.

:class:`SimulationConfig` says what the simulated machine looks like (budgets, how many
simulated devices, how fast a simulated copy runs, which transfer or allocation fails);
:func:`simulated_manager` enters a :class:`~aresidency.runtime.manager.ResidencyManager` on it.
The ``residency_manager`` fixture of :mod:`aresidency.testing.plugin` is this function under a
pytest fixture; code that runs outside pytest, or under another test runner, uses it directly.

The devices are a simulation (:class:`~aresidency.backends.sim.SimBackend`): ``cuda:N`` is host
memory, each simulated stream runs its work in order on a worker thread, and memory the
simulation hands out is poisoned until a copy fills it, so a read that is not ordered after
its copy sees NaN. Budgets, admission, leases, cancellation and fault injection behave as on a
GPU; timings do not (throttle copies with ``copy_gbps`` to keep transfers in flight long enough
to observe).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..backends.sim import SimBackend
from ..core.locations import Location
from ..core.sizes import ByteSize, format_nbytes, parse_nbytes
from ..runtime.manager import ResidencyManager

__all__ = ["SimulationConfig", "simulated_manager"]


def _check_count(value: object, what: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def _check_optional_count(value: object, what: str) -> None:
    if value is not None:
        _check_count(value, what, minimum=1)


@dataclass(frozen=True, slots=True, init=False)
class SimulationConfig:
    """What a simulated machine looks like to :func:`simulated_manager`. Immutable.

    ``budgets``: strict byte budgets per location, sizes as people write them
    (``{"cuda:0": "64MiB", "pinned-host": "1GB"}``; ``None`` or absent: no strict budget).
    ``devices``: how many simulated CUDA devices (``cuda:0`` .. ``cuda:{devices-1}``).
    ``copy_gbps``: every simulated copy runs at this many GB/s (``None``: as fast as a host
    memcpy); a slow copy stays in flight long enough for a test to cancel it or watch it.
    ``fail_transfer_at=k``: the k-th transfer from the manager's start completes with an
    injected ``RuntimeError`` (its destination is left poisoned). ``oom_at_allocation=k``: the
    k-th allocation the simulation makes raises ``torch.OutOfMemoryError`` (as a full GPU
    would). Both count from 1 and fire once; set ``manager.backend.faults`` for more.
    ``staging_bytes``: the pinned staging pool the simulated backend reports (0: none, so small
    pinned budgets stay free). ``trace_capacity``: transitions the trace keeps.

    State: the fields above, checked and normalized when made (budgets keyed by location
    strings, in exact bytes). Invariant: every instance describes a machine that can be
    started, except for a budget naming a device beyond ``devices`` (the manager says so).
    """

    budgets: Mapping[str, int | None]
    devices: int
    copy_gbps: float | None
    fail_transfer_at: int | None
    oom_at_allocation: int | None
    staging_bytes: int
    trace_capacity: int

    def __init__(
        self,
        budgets: Mapping[Any, ByteSize | None] | None = None,
        *,
        devices: int = 2,
        copy_gbps: float | None = None,
        fail_transfer_at: int | None = None,
        oom_at_allocation: int | None = None,
        staging_bytes: ByteSize = 0,
        trace_capacity: int = 4096,
    ) -> None:
        if budgets is None:
            budgets = {}
        if not isinstance(budgets, Mapping):
            raise TypeError(
                f"budgets must be a mapping from location to size, such as "
                f"{{'cuda:0': '64MiB'}}; got {budgets!r}"
            )
        parsed: dict[str, int | None] = {}
        for key, budget in budgets.items():
            location = str(Location.parse(key))
            what = f"budget for {location}"
            parsed[location] = None if budget is None else parse_nbytes(budget, what)
        _check_count(devices, "devices (the number of simulated CUDA devices)", minimum=0)
        if copy_gbps is not None:
            if isinstance(copy_gbps, bool) or not isinstance(copy_gbps, int | float):
                raise TypeError(f"copy_gbps must be a number of GB/s or None, got {copy_gbps!r}")
            if not math.isfinite(copy_gbps) or copy_gbps <= 0:
                raise ValueError(
                    f"copy_gbps must be a finite number of GB/s > 0 (or None for no limit), "
                    f"got {copy_gbps!r}"
                )
        _check_optional_count(fail_transfer_at, "fail_transfer_at (the k-th transfer, from 1)")
        _check_optional_count(oom_at_allocation, "oom_at_allocation (the k-th allocation, from 1)")
        _check_count(trace_capacity, "trace_capacity", minimum=0)
        staging = parse_nbytes(staging_bytes, "staging_bytes")
        set_field = object.__setattr__
        set_field(self, "budgets", MappingProxyType(parsed))
        set_field(self, "devices", devices)
        set_field(self, "copy_gbps", None if copy_gbps is None else float(copy_gbps))
        set_field(self, "fail_transfer_at", fail_transfer_at)
        set_field(self, "oom_at_allocation", oom_at_allocation)
        set_field(self, "staging_bytes", staging)
        set_field(self, "trace_capacity", trace_capacity)

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The names :meth:`replace` (and the ``residency`` marker) accept."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> SimulationConfig:
        """A copy with ``changes`` applied (checked as the constructor checks them); an unknown
        name is a ``TypeError`` that lists the known ones."""
        unknown = sorted(set(changes) - set(self.options()))
        if unknown:
            raise TypeError(
                f"unknown simulation option(s) {', '.join(map(repr, unknown))}: the options are "
                f"{', '.join(self.options())}"
            )
        current = {name: getattr(self, name) for name in self.options()}
        current.update(changes)
        budgets = current.pop("budgets")
        return SimulationConfig(budgets, **current)

    def __hash__(self) -> int:
        # The budgets are a read-only view of a dict: hash their items instead.
        fields = tuple(getattr(self, name) for name in self.options()[1:])
        return hash((tuple(self.budgets.items()), *fields))

    def __repr__(self) -> str:
        budgets = ", ".join(
            f"{loc}: {'unlimited' if nbytes is None else format_nbytes(nbytes)}"
            for loc, nbytes in self.budgets.items()
        )
        faults = [
            f"{name}={getattr(self, name)}"
            for name in ("fail_transfer_at", "oom_at_allocation")
            if getattr(self, name) is not None
        ]
        speed = "unthrottled" if self.copy_gbps is None else f"{self.copy_gbps:g} GB/s"
        return (
            f"<SimulationConfig (a simulation) {self.devices} simulated device(s), copies "
            f"{speed}, budgets {{{budgets}}}{''.join(' ' + f for f in faults)}>"
        )


@asynccontextmanager
async def simulated_manager(
    config: SimulationConfig | None = None, /, **options: Any
) -> AsyncIterator[ResidencyManager]:
    """Enter a ``ResidencyManager`` on a SIMULATION of CUDA devices; close it on exit.

    ``config`` (a :class:`SimulationConfig`, default ``SimulationConfig()``) with ``options``
    applied (``budgets=``, ``devices=``, ``copy_gbps=``, ``fail_transfer_at=``,
    ``oom_at_allocation=``, ``staging_bytes=``, ``trace_capacity=``). Fault injection is armed
    once the manager has started, so ``fail_transfer_at=1`` fails the first transfer the code
    under test makes. Use it from the event loop's task (asyncio, uvloop or trio):
    ``async with simulated_manager(budgets={"cuda:0": "64MiB"}) as manager: ...``. On exit the
    manager waits for the transfers and consumer events still in flight (the host does not
    block: it awaits their completion) and stops the simulated streams.

    Raises ``TypeError``/``ValueError`` for a bad option (before anything starts), and the
    manager's ``ValueError`` for a budget at a location the simulation does not have.
    """
    if config is None:
        config = SimulationConfig()
    elif not isinstance(config, SimulationConfig):
        raise TypeError(
            f"simulated_manager takes a SimulationConfig (or keyword options), got {config!r}"
        )
    if options:
        config = config.replace(**options)
    backend = SimBackend(
        num_devices=config.devices,
        copy_gbps=config.copy_gbps,
        staging_nbytes=config.staging_bytes,
    )
    manager = ResidencyManager(
        budgets=config.budgets, backend=backend, trace_capacity=config.trace_capacity
    )
    async with manager:
        # Armed now, not before: the manager's start makes no transfer today, but counting
        # from here keeps "the k-th transfer" meaning the k-th of the code under test.
        if config.fail_transfer_at is not None:
            backend.faults.fail_transfer_at = config.fail_transfer_at
        if config.oom_at_allocation is not None:
            backend.faults.oom_at_allocation = config.oom_at_allocation
        yield manager
