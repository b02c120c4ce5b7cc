"""The pure residency model: no event loop, no device calls.

Everything here is synchronous and deterministic. The runtime owns one ``ResidencyState`` and
turns its transitions into device work; ``explain`` runs the same transitions on a copy.
"""

from .errors import (
    ResidencyBudgetError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
    ResidencyUnavailableError,
)
from .explain import PeakLedger, PlanExplanation, explain_plan, plan_fits
from .locations import PAGEABLE_HOST, PINNED_HOST, Location, LocationLike, LocationMap
from .plans import Materialize, MemoryReservation, Move, Release, ResidencyPlan
from .snapshot import (
    LocationRecord,
    MaterializationRecord,
    ResidencySnapshot,
    ValueSnapshot,
    take_snapshot,
)
from .state import ResidencyState
from .trace import ExecutionReport, ResidencyTrace, Transition
from .values import (
    DEFAULT_GRANULARITY,
    CopyTicket,
    MaterializationState,
    ReplicaMode,
    ValueHandle,
    value_charge,
)

__all__ = [
    "DEFAULT_GRANULARITY",
    "PAGEABLE_HOST",
    "PINNED_HOST",
    "CopyTicket",
    "ExecutionReport",
    "Location",
    "LocationLike",
    "LocationMap",
    "LocationRecord",
    "MaterializationRecord",
    "MaterializationState",
    "Materialize",
    "MemoryReservation",
    "Move",
    "PeakLedger",
    "PlanExplanation",
    "Release",
    "ReplicaMode",
    "ResidencyBudgetError",
    "ResidencyError",
    "ResidencyInUseError",
    "ResidencyPlan",
    "ResidencyPlanError",
    "ResidencyPlanExecutionError",
    "ResidencySearchLimitError",
    "ResidencySnapshot",
    "ResidencyStaleStateError",
    "ResidencyState",
    "ResidencyTrace",
    "ResidencyUnavailableError",
    "Transition",
    "ValueHandle",
    "ValueSnapshot",
    "explain_plan",
    "plan_fits",
    "take_snapshot",
    "value_charge",
]
