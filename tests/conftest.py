"""Shared test set-up: every async test runs on asyncio and on asyncio+uvloop; GPU tests are
marked ``cuda`` (one GPU) or ``cuda2`` (two GPUs) and skipped where the hardware is missing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import torch

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is in the test extra
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """pytest-asyncio runs each async test once per loop implementation."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip1 = pytest.mark.skip(reason="needs a CUDA GPU")
    skip2 = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if item.get_closest_marker("cuda") is not None and count < 1:
            item.add_marker(skip1)
        if item.get_closest_marker("cuda2") is not None and count < 2:
            item.add_marker(skip2)
