"""aresidency: an asyncio runtime that decides and carries out where PyTorch tensors live.

Pageable host memory, pinned host memory or ``cuda:N``, under strict per-location byte budgets,
with transfers on dedicated copy streams overlapped with compute. Start with
``async with ResidencyManager(budgets=...) as manager``; see README.md and ``examples/``.
Budgets and other byte counts may be written as people write them (``"10GiB"``, ``"512MB"``);
:func:`budgets_from_max_memory` converts accelerate's ``max_memory``. Test code built on the
simulated backend lives in :mod:`aresidency.testing` (a pytest plugin too).
"""

from .controller import (
    CostModel,
    Eviction,
    FallbackGraph,
    ResidencyController,
    ResidencyDecision,
    ResidencyRequest,
    ResidencyRequirement,
)
from .core import (
    PAGEABLE_HOST,
    PINNED_HOST,
    ExecutionReport,
    Location,
    LocationMap,
    LocationRecord,
    MaterializationRecord,
    MaterializationState,
    Materialize,
    MemoryReservation,
    Move,
    PeakLedger,
    PlanExplanation,
    Release,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencySearchLimitError,
    ResidencySnapshot,
    ResidencyStaleStateError,
    ResidencyTrace,
    ResidencyUnavailableError,
    Transition,
    ValueHandle,
    ValueSnapshot,
)
from .core.sizes import budgets_from_max_memory, format_nbytes, parse_nbytes
from .diagnosis import DiagnosisReport, diagnose
from .integrations import StreamedModule, stream_module
from .loader import DeviceLoader as DeviceLoader  # re-exported: aresidency.DeviceLoader
from .runtime import (
    CallableSource,
    Hold,
    Lease,
    ResidencyManager,
    SafetensorsSource,
    Scope,
    Source,
)
from .serving import ModelPool as ModelPool  # re-exported: aresidency.ModelPool

__version__ = "0.1.0"

__all__ = [
    "PAGEABLE_HOST",
    "PINNED_HOST",
    "CallableSource",
    "CostModel",
    "DeviceLoader",
    "DiagnosisReport",
    "Eviction",
    "ExecutionReport",
    "FallbackGraph",
    "Hold",
    "Lease",
    "Location",
    "LocationMap",
    "LocationRecord",
    "MaterializationRecord",
    "MaterializationState",
    "Materialize",
    "MemoryReservation",
    "ModelPool",
    "Move",
    "PeakLedger",
    "PlanExplanation",
    "Release",
    "ReplicaMode",
    "ResidencyBudgetError",
    "ResidencyController",
    "ResidencyDecision",
    "ResidencyError",
    "ResidencyInUseError",
    "ResidencyManager",
    "ResidencyPlan",
    "ResidencyPlanError",
    "ResidencyPlanExecutionError",
    "ResidencyRequest",
    "ResidencyRequirement",
    "ResidencySearchLimitError",
    "ResidencySnapshot",
    "ResidencyStaleStateError",
    "ResidencyTrace",
    "ResidencyUnavailableError",
    "SafetensorsSource",
    "Scope",
    "Source",
    "StreamedModule",
    "Transition",
    "ValueHandle",
    "ValueSnapshot",
    "__version__",
    "budgets_from_max_memory",
    "diagnose",
    "format_nbytes",
    "parse_nbytes",
    "stream_module",
]
