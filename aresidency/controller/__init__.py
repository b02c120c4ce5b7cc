"""The automatic controller: request -> decision by a deterministic bounded search.

``ResidencyController(manager)`` derives :class:`ResidencyDecision` s for
:class:`ResidencyRequest` s without blocking the event loop (``decide``) and enters them,
re-deriving a decision that went stale (``scope``). The search itself is pure and synchronous
(:func:`decide_nowait` over a ``ResidencyState``); :class:`FallbackGraph` says where victims may
go and :class:`CostModel` what an eviction costs.
"""

from .controller import ControllerScope, PendingDecision, ResidencyController
from .index import CandidateIndex, EvictionClass
from .policy import CUDA_ANY, CostModel, FallbackGraph
from .requests import (
    Eviction,
    Placement,
    ResidencyDecision,
    ResidencyRequest,
    ResidencyRequirement,
)
from .search import DEFAULT_SEARCH_STATE_LIMIT, decide_nowait, iter_decide, simulate_entry

__all__ = [
    "CUDA_ANY",
    "DEFAULT_SEARCH_STATE_LIMIT",
    "CandidateIndex",
    "ControllerScope",
    "CostModel",
    "EvictionClass",
    "Eviction",
    "FallbackGraph",
    "PendingDecision",
    "Placement",
    "ResidencyController",
    "ResidencyDecision",
    "ResidencyRequest",
    "ResidencyRequirement",
    "decide_nowait",
    "iter_decide",
    "simulate_entry",
]
