"""Streaming tests: the loop-stall guard of tests/_loop_guard.py (one intra-op thread for the
whole run: tests/conftest.py), and a check that no test leaves grad mode off in the loop's
thread (grad mode is the thread's: a ``torch.no_grad()`` around awaits of tasks that run
concurrently, exited out of order, leaves it off for every later test there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _loop_guard import loop_never_blocked, loop_stall_guard

__all__ = ["grad_mode_left_on", "loop_never_blocked", "loop_stall_guard"]


@pytest.fixture(autouse=True)
def grad_mode_left_on() -> Iterator[None]:
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left grad mode disabled in the loop's thread")
