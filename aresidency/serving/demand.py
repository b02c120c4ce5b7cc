"""Recent demand per model, and the controller's demand-weighted view of the manager.

:class:`DemandTracker` keeps an exponentially decayed request count per model: every request
adds one, and the sum halves every ``half_life`` seconds, so ``rate(name)`` (the count times
``ln 2 / half_life``) follows a model's request rate over the last few half-lives.

:class:`DemandView` is what a :class:`~aresidency.serving.ModelPool` gives its
:class:`~aresidency.controller.ResidencyController` instead of the manager. It is the manager
(its ``state_version``, ``check_thread``, ``wait_for_change`` and ``scope`` are the
manager's), except that ``state`` is a copy of the manager's state (``ResidencyState.clone``,
the copy ``explain`` simulates on) in which each pool value's recency says how much its model
is in demand. The controller's cost of an eviction is ``charge * (now + reuse_weight *
restore)`` with ``reuse_weight = 2 ** -(age / recency_half_life)`` (see
``controller/policy.py``); the view sets each value's age to ``recency_half_life *
log2(top demand / its model's demand)``, so its reuse weight is its model's share of the
top demand, and the cost of evicting it is the expected cost of bringing it back: reload
bytes times transfer time (pinned memory, or a checkpoint) times how soon it will be asked
for again. The search's own invariant (within an eviction class, cost per byte grows with
recency) holds, because the weight is a function of the recency it reads.

Why a copy and not a cost model: the search reads per-value weights only through
``last_used_version``, and the candidate index orders values by it; a cost model that
weighed values by something else would break that order. The copy is made once per state
version and demand change (cached), so a search that is not disturbed copies once; it costs
O(values), the size of a pool's blocks (hundreds), not of the tensors.

The decision the controller derives on the view names the manager's real state version: it
is entered with ``manager.scope`` like any other, and is refused as stale if the manager moved
in between.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.state import ResidencyState
from ..core.values import ValueHandle
from ..runtime.manager import ResidencyManager

__all__ = ["DEMAND_HALF_LIFE_VERSIONS", "DemandTracker", "DemandView"]

#: The ``recency_half_life`` (in state versions) of the pool's cost model: a model with half
#: the top demand is encoded this many versions older. Small, so that a wide range of demand
#: ratios fits in the versions a young manager has (ages are capped at the state version).
DEMAND_HALF_LIFE_VERSIONS = 8.0

#: Demand ratios below this are treated as this (an idle model is not infinitely cheap).
MIN_WEIGHT = 2.0**-24


class DemandTracker:
    """An exponentially decayed request count per model.

    State: ``half_life`` (seconds), ``clock`` (``time.monotonic`` by default), ``_counts``
    (name -> (count, when it was last brought up to date)). Invariant: a count only decays
    between records; ``record`` brings it up to date, then adds one.
    """

    def __init__(
        self,
        half_life: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        argument: str = "half_life",
    ) -> None:
        # ``argument``: the name the caller took ``half_life`` under, for its errors (a
        # pool's ``demand_half_life``).
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)):
            raise TypeError(f"{argument} must be a number of seconds, got {half_life!r}")
        if not (half_life > 0 and math.isfinite(half_life)):
            raise ValueError(f"{argument} must be a finite number of seconds > 0, got {half_life}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        # Read once now: a clock of another kind (datetime.now) would fail every request, the
        # statistics and the pool's close, far from the cause.
        now = clock()
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise TypeError(
                f"clock must return seconds as a finite number (like time.monotonic), got "
                f"{now!r} from {clock!r}"
            )
        self.half_life = float(half_life)
        self.clock = clock
        self._counts: dict[str, tuple[float, float]] = {}

    def _decayed(self, name: str, now: float) -> float:
        count, then = self._counts.get(name, (0.0, now))
        return float(count * 2.0 ** (-max(0.0, now - then) / self.half_life))

    def record(self, name: str) -> None:
        """One more request for ``name`` now."""
        now = self.clock()
        self._counts[name] = (self._decayed(name, now) + 1.0, now)

    def count(self, name: str) -> float:
        """The decayed request count of ``name`` now (0 for a model never asked for)."""
        return self._decayed(name, self.clock())

    def rate(self, name: str) -> float:
        """Requests per second, over the last few half-lives (a steady rate ``r`` gives ``r``)."""
        return self.count(name) * math.log(2) / self.half_life

    def rates(self, names: list[str]) -> dict[str, float]:
        now = self.clock()
        scale = math.log(2) / self.half_life
        return {name: self._decayed(name, now) * scale for name in names}

    def forget(self, name: str) -> None:
        """Drop the history of ``name`` (a model that left the pool)."""
        self._counts.pop(name, None)

    def __repr__(self) -> str:
        top = sorted(self.rates(list(self._counts)).items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{name}={rate:.3g}/s" for name, rate in top)
        return f"<DemandTracker half_life={self.half_life:g} s [{shown}]>"


def weight_ages(weights: Mapping[ValueHandle, float]) -> dict[ValueHandle, int]:
    """Each handle's age in state versions for its weight (a share of the top demand, in
    ``(0, 1]``): ``DEMAND_HALF_LIFE_VERSIONS * log2(1 / weight)``, rounded."""
    ages: dict[ValueHandle, int] = {}
    for handle, weight in weights.items():
        share = min(1.0, max(MIN_WEIGHT, weight))
        ages[handle] = round(DEMAND_HALF_LIFE_VERSIONS * -math.log2(share))
    return ages


class DemandView:
    """The manager as the pool's controller sees it (see the module docstring).

    State: ``manager``; ``_ages`` (handle -> age in versions, set by :meth:`weigh` before
    each decision); the cached copy and the (state version, weighing) it was made for.
    Invariant: ``state`` is the same object for as long as neither the manager's state nor
    the weights changed (the controller restarts a search when it is not).
    """

    def __init__(self, manager: ResidencyManager) -> None:
        self.manager = manager
        self._ages: dict[ValueHandle, int] = {}
        self._epoch = 0
        self._copy: ResidencyState | None = None
        self._made_for: tuple[int, int] = (-1, -1)

    def weigh(self, weights: Mapping[ValueHandle, float]) -> None:
        """Use these weights (a value's model's share of the top demand) from now on; values
        not named keep their own recency."""
        self._ages = weight_ages(weights)
        self._epoch += 1

    @property
    def state(self) -> ResidencyState:
        """A copy of the manager's state with the pool values' recency set from their demand
        (made now if the state or the weights changed since the last one). Loop thread."""
        real = self.manager.state
        key = (real.state_version, self._epoch)
        if self._copy is None or self._made_for != key:
            copy = real.clone()
            now = copy.state_version
            for handle, age in self._ages.items():
                value = copy.find_value(handle)
                if value is not None:
                    value.last_used_version = max(0, now - age)
            self._copy, self._made_for = copy, key
        return self._copy

    @property
    def state_version(self) -> int:
        return self.manager.state_version

    def check_thread(self) -> None:
        self.manager.check_thread()

    async def wait_for_change(self, timeout: float | None = None) -> bool:
        return await self.manager.wait_for_change(timeout)

    def scope(self, plan_or_decision: Any, timeout: float | None = None) -> Any:
        return self.manager.scope(plan_or_decision, timeout=timeout)

    def __repr__(self) -> str:
        return f"<DemandView of {self.manager!r} [{len(self._ages)} weighed values]>"
