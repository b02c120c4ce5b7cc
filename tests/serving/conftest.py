"""Serving tests: the loop-stall guard of tests/_loop_guard.py (one intra-op thread for the
whole run: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _loop_guard import loop_never_blocked, loop_stall_guard

__all__ = ["loop_never_blocked", "loop_stall_guard"]


@pytest.fixture(autouse=True)
def grad_mode_left_as_found() -> Iterator[None]:
    """A grad-mode context around an await in concurrent tasks of one thread leaks (the mode
    is the thread's; the tasks exit out of order): the tests' models are built without
    autograd instead, and this fails a test that leaves grad mode off."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left grad mode disabled in the loop's thread")
