"""Streaming tests: the loop-stall guard of tests/_loop_guard.py (one intra-op thread for the
whole run: tests/conftest.py)."""

from __future__ import annotations

from _loop_guard import loop_never_blocked, loop_stall_guard

__all__ = ["loop_never_blocked", "loop_stall_guard"]
