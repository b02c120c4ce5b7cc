"""The pytest plugin of :mod:`aresidency.testing` (entry point ``pytest11: aresidency``).

Installed with the package, so every pytest run in an environment that has aresidency loads it
(``-p no:aresidency`` turns it off). It adds:

* the fixture ``residency_manager``: an entered ``ResidencyManager`` on a SIMULATION of CUDA
  devices, closed after the test; configured by ``residency_config``;
* the fixture ``residency_config``: the :class:`~aresidency.testing.SimulationConfig` of the
  test: ``residency_defaults``, then every ``@pytest.mark.residency(**options)`` from the
  farthest (module) to the closest (function), then ``request.param`` when the fixture is
  parametrized indirectly;
* the fixture ``residency_defaults``: ``SimulationConfig()``; override it in a ``conftest.py``
  to change the defaults of a directory (the markers still apply on top);
* the fixture ``loop_stall_guard`` (see :mod:`aresidency.testing.guard`);
* the markers ``residency(**options)`` and ``allow_loop_stall``, and the ini option
  ``residency_max_loop_stall``.

The async fixtures are anyio fixtures: the tests that use them are run by anyio's pytest plugin
(mark them ``pytest.mark.anyio``), which runs the fixture and the test on the same event loop,
chosen by the ``anyio_backend`` fixture (asyncio by default; parametrize it to run each test on
asyncio, uvloop and trio). pytest-asyncio in its default strict mode leaves such tests to
anyio; a test marked ``pytest.mark.asyncio`` instead gets a clear error, since the manager
would live on another loop than the test.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from ..runtime.manager import ResidencyManager
from .guard import ALLOW_MARKER, MAX_LOOP_STALL, MAX_LOOP_STALL_INI, loop_stall_guard
from .simulation import SimulationConfig, simulated_manager

__all__ = [
    "loop_stall_guard",
    "pytest_addoption",
    "pytest_configure",
    "residency_config",
    "residency_defaults",
    "residency_manager",
]

MARKER = "residency"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        MAX_LOOP_STALL_INI,
        f"aresidency: seconds the event loop may be blocked in a test guarded by "
        f"loop_stall_guard (default {MAX_LOOP_STALL})",
        default="",
    )


def pytest_configure(config: pytest.Config) -> None:
    options = ", ".join(SimulationConfig.options())
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**options): the simulated machine of the residency_manager fixture "
        f"(a simulation of CUDA devices); options: {options}",
    )
    config.addinivalue_line(
        "markers",
        f"{ALLOW_MARKER}(seconds=None): the test blocks its event loop on purpose; the "
        "loop-stall guard leaves it alone, or, given seconds, allows stalls that long",
    )


def _options(source: object, where: str) -> dict[str, Any]:
    if isinstance(source, SimulationConfig):
        return {name: getattr(source, name) for name in source.options()}
    if isinstance(source, Mapping) and all(isinstance(key, str) for key in source):
        return dict(source)
    raise TypeError(
        f"{where} must be a SimulationConfig or a dict of simulation options "
        f"({', '.join(SimulationConfig.options())}), got {source!r}"
    )


@pytest.fixture
def residency_defaults() -> SimulationConfig:
    """The simulated machine before any marker: ``SimulationConfig()``. Override this fixture
    in a ``conftest.py`` to give a directory other defaults."""
    return SimulationConfig()


@pytest.fixture
def residency_config(
    residency_defaults: SimulationConfig, request: pytest.FixtureRequest
) -> SimulationConfig:
    """The simulated machine of this test: ``residency_defaults``, then the ``residency``
    markers from module to function (a closer marker's option replaces a farther one's, the
    budgets as a whole), then ``request.param`` (indirect parametrization), then the
    parameter of ``residency_manager`` when that is parametrized indirectly. ``TypeError`` or
    ``ValueError`` for an unknown or bad option, naming it."""
    if not isinstance(residency_defaults, SimulationConfig):
        raise TypeError(
            f"the residency_defaults fixture must return a SimulationConfig, got "
            f"{residency_defaults!r}"
        )
    config = residency_defaults
    for marker in reversed(list(request.node.iter_markers(MARKER))):
        if marker.args:
            raise TypeError(
                f"@pytest.mark.{MARKER} takes keyword options only "
                f"({', '.join(SimulationConfig.options())}), got positional {marker.args!r}"
            )
        config = config.replace(**marker.kwargs)
    param = getattr(request, "param", None)
    if param is not None:
        config = config.replace(**_options(param, "residency_config's parameter"))
    # The manager's own parameter (indirect parametrization of residency_manager) is part of
    # the test's machine too: this fixture says what the manager was made with.
    callspec = getattr(request.node, "callspec", None)
    manager_param = None if callspec is None else callspec.params.get("residency_manager")
    if manager_param is not None:
        config = config.replace(**_options(manager_param, "residency_manager's parameter"))
    return config


def _check_run_by_anyio(request: pytest.FixtureRequest, fixture: str) -> None:
    """The manager lives on the loop anyio runs this fixture on: the test must run there
    too, which anyio's plugin does for the async tests it runs (marked ``anyio``)."""
    function = getattr(request, "function", None)
    if not inspect.iscoroutinefunction(function):
        raise RuntimeError(
            f"{fixture} is an async fixture for async tests: make the test 'async def' and "
            "mark it pytest.mark.anyio"
        )
    try:
        auto = request.config.getini("anyio_mode") == "auto"
    except ValueError:  # anyio's plugin is off: nothing runs the fixture's loop
        auto = False
    auto = auto or request.config.getoption("anyio_mode", default=None) == "auto"
    if request.node.get_closest_marker("anyio") is None and not auto:
        raise RuntimeError(
            f"{fixture} runs on anyio's event loop, so the test must too: mark it "
            "pytest.mark.anyio (not pytest.mark.asyncio); see docs/testing.md"
        )


@pytest.fixture
async def residency_manager(
    residency_config: SimulationConfig,
    request: pytest.FixtureRequest,
    anyio_backend: Any,
) -> AsyncIterator[ResidencyManager]:
    """An entered ``ResidencyManager`` on a SIMULATION of CUDA devices configured by
    ``residency_config`` (or by ``request.param`` when this fixture is parametrized
    indirectly), closed after the test. Closing waits (the host does not block) for the
    transfers and consumer events still in flight."""
    _check_run_by_anyio(request, "residency_manager")
    config = residency_config
    param = getattr(request, "param", None)
    if param is not None:
        config = config.replace(**_options(param, "residency_manager's parameter"))
    async with simulated_manager(config) as manager:
        yield manager
