"""The loop-stall guard of the runtime and streaming tests: the public one of
:mod:`aresidency.testing.guard` (what our users get from the pytest plugin), with one rule of
ours added: tests marked ``cuda`` are exempt, since they synchronize the device on purpose.
``NO_LOOP_GUARD=1`` turns the guard off (to tell a stall from another failure)."""

from __future__ import annotations

import pytest

from aresidency.testing.guard import MAX_LOOP_STALL, guard_applies, loop_stall_guard

__all__ = ["MAX_LOOP_STALL", "loop_never_blocked", "loop_stall_guard"]


@pytest.fixture(autouse=True)
def loop_never_blocked(request: pytest.FixtureRequest) -> None:
    """The guard for every async test of the directory, except tests marked ``cuda`` (or
    ``allow_loop_stall``) and runs with ``NO_LOOP_GUARD`` set."""
    if guard_applies(request) and request.node.get_closest_marker("cuda") is None:
        request.getfixturevalue("loop_stall_guard")
