"""Streaming tests: one intra-op thread, and the loop-stall guard of tests/_loop_guard.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _loop_guard import loop_never_blocked, loop_stall_guard

__all__ = ["loop_never_blocked", "loop_stall_guard"]


@pytest.fixture(autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """The blocks of these tests run on the simulated streams' worker threads: with one OpenMP
    team per calling thread, spinning teams starve a small CI machine (two cores: stalls of
    100 ms). One intra-op thread keeps the tests about streaming, not about CPU contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
