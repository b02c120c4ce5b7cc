"""Shared test set-up: every async test runs on asyncio, on asyncio+uvloop and on trio (anyio's
pytest plugin, through the parametrized ``anyio_backend`` fixture below; the uvloop runs of
the parts named in ``UVLOOP_ONLY_WITH_ALL`` only with ``ARESIDENCY_TEST_UVLOOP=all``); GPU tests
are marked ``cuda`` (one GPU) or ``cuda2`` (two GPUs) and skipped where the hardware is missing.

An async test takes part by being marked ``pytest.mark.anyio`` (a module's ``pytestmark``).
A test about asyncio itself would narrow the loops with its own
``@pytest.mark.parametrize("anyio_backend", [...])`` (the asyncio entries below) and say why;
none needs to today."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from aresidency.backends.waiter import EventWaiter

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is in the test extra (not on Windows)
    uvloop = None

try:
    import trio
except ImportError:  # pragma: no cover - trio is in the test extra
    trio = None

# One intra-op thread for the whole run, set before any thread starts. Torch reads the count
# once per thread (at the thread's first parallel op) and trio reuses its worker threads from
# test to test: a count set per test left a cached worker thread with another count than the
# loop's thread, where the same matmul rounded differently (shared calls then differed from
# their reference in the last bits, now and then, under trio). One thread also keeps the
# simulated streams' threads, each with its own OpenMP team, from starving a two-core machine.
torch.set_num_threads(1)

# (backend name, options) as anyio's plugin takes them, one pytest.param per event loop.
ASYNCIO_BACKENDS = [pytest.param(("asyncio", {}), id="asyncio")]
if uvloop is not None:
    ASYNCIO_BACKENDS.append(
        pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop")
    )
BACKENDS = list(ASYNCIO_BACKENDS)
if trio is not None:
    BACKENDS.append(pytest.param(("trio", {}), id="trio"))


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """The event loop an async test (and its async fixtures) runs on: each test once per loop."""
    return request.param  # type: ignore[no-any-return]


#: Where the uvloop runs are left out unless ``ARESIDENCY_TEST_UVLOOP=all``: the parts built on
#: the runtime's public calls only (streaming, serving, diagnosis, the test plugin, the
#: controller). What depends on the loop itself (event waits, thread-safe wake-ups, timers,
#: admission, the loader's tasks) is in the backends', runtime's and loader's tests, which run
#: on uvloop always; the rest runs on asyncio and trio, and the whole of it on uvloop with the
#: variable set (the CPU-only CI would pass ten minutes with it).
UVLOOP_ONLY_WITH_ALL = ("controller", "diagnosis", "integrations", "serving", "testing")


def _left_out_on_uvloop(item: pytest.Item) -> bool:
    if os.environ.get("ARESIDENCY_TEST_UVLOOP") == "all" or "[uvloop" not in item.nodeid:
        return False
    parts = item.nodeid.split("/")
    return len(parts) > 2 and parts[0] == "tests" and parts[1] in UVLOOP_ONLY_WITH_ALL


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    left_out = [item for item in items if _left_out_on_uvloop(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not _left_out_on_uvloop(item)]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip1 = pytest.mark.skip(reason="needs a CUDA GPU")
    skip2 = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if item.get_closest_marker("cuda") is not None and count < 1:
            item.add_marker(skip1)
        if item.get_closest_marker("cuda2") is not None and count < 2:
            item.add_marker(skip2)


@pytest.fixture(autouse=True)
def _loop_timer_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ARESIDENCY_TEST_LOOP_TIMER=0`` (or ``1``) sets ``loop_timer`` for every event waiter
    the tests make (the CUDA backend's included) unless the test says otherwise: the whole
    CUDA suite can run with the thread's polls as well as with the loop's (the default)."""
    setting = os.environ.get("ARESIDENCY_TEST_LOOP_TIMER")
    if setting not in ("0", "1"):
        return
    init = EventWaiter.__init__

    def with_loop_timer(self: EventWaiter, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("loop_timer", setting == "1")
        init(self, *args, **kwargs)

    monkeypatch.setattr(EventWaiter, "__init__", with_loop_timer)
