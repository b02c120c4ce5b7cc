"""aresidency's SIMULATION as a test bench for code built on aresidency.

Everything here runs on the simulated backend (``cuda:N`` made of host memory, with in-order
simulated streams: see :mod:`aresidency.backends.sim`), so the tests of a server, a loader or a
pipeline built on aresidency run on any CPU machine, in CI, with budgets, transfers in flight,
cancellation and injected faults behaving as on a GPU.

* :func:`simulated_manager` and :class:`SimulationConfig`: a manager on a simulated machine
  (budgets as sizes such as ``"64MiB"``, simulated copy speed, number of simulated devices,
  fault injection);
* :func:`settled`, :func:`until`: wait for the manager without sleeping;
  :func:`assert_quiet`, :func:`assert_within_budgets`: what a finished test should find;
* the pytest plugin (:mod:`aresidency.testing.plugin`, loaded automatically through the
  ``pytest11`` entry point): the fixtures ``residency_manager``, ``residency_config``,
  ``residency_defaults`` and ``loop_stall_guard``, the markers ``residency(**options)`` and
  ``allow_loop_stall``, the ini option ``residency_max_loop_stall``;
* :func:`loop_never_blocked` (import it into a ``conftest.py``) and :func:`loop_stall_guard`:
  the loop-stall guard, which fails an async test that blocked its event loop.

The pytest parts (``loop_never_blocked``, ``loop_stall_guard``) are imported on first use, so
this module works without pytest installed. See docs/testing.md for a worked example.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checks import (
    DEFAULT_TIMEOUT,
    assert_quiet,
    assert_within_budgets,
    in_flight,
    settled,
    until,
)
from .simulation import SimulationConfig, simulated_manager

if TYPE_CHECKING:
    from .guard import MAX_LOOP_STALL, loop_never_blocked, loop_stall_guard

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_LOOP_STALL",
    "SimulationConfig",
    "assert_quiet",
    "assert_within_budgets",
    "in_flight",
    "loop_never_blocked",
    "loop_stall_guard",
    "settled",
    "simulated_manager",
    "until",
]

# The names that need pytest, imported from .guard when first asked for.
_FROM_GUARD = frozenset({"MAX_LOOP_STALL", "loop_never_blocked", "loop_stall_guard"})


def __getattr__(name: str) -> Any:
    if name in _FROM_GUARD:
        from . import guard

        return getattr(guard, name)
    raise AttributeError(f"module 'aresidency.testing' has no attribute {name!r}")
