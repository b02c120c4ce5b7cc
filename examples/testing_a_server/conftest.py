"""Set-up for the example's tests, as a project using aresidency would write it.

aresidency's pytest plugin is loaded automatically (it is installed with the package); it gives
the ``residency_manager`` fixture, configured per test with ``@pytest.mark.residency(...)``.
This file adds what a project usually wants on top:

* every async test runs on asyncio and on trio (anyio's own default is asyncio only): the
  ``anyio_backend`` fixture, parametrized, chooses the event loop of the test and its fixtures;
* every async test runs under the loop-stall guard: importing ``loop_never_blocked`` (an
  autouse fixture) here applies it to every test of this directory;
* torch computes with one intra-op thread: the simulated device runs the model on a simulated
  stream's worker thread, and an OpenMP team spinning there starves the event loop of a small
  CI machine (two cores: stalls over 100 ms, which the guard reports).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from aresidency.testing import loop_never_blocked

__all__ = ["loop_never_blocked"]

LOOPS = ["asyncio"] + (["trio"] if importlib.util.find_spec("trio") is not None else [])


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The event loop of each async test (and of the residency_manager it uses)."""
    return str(request.param)


@pytest.fixture(autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """torch's intra-op threads limited to one for the test (see the module docstring)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
