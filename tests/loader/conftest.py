"""Loader tests fail if anything blocks the event loop: see tests/_loop_guard.py."""

from _loop_guard import loop_never_blocked, loop_stall_guard

__all__ = ["loop_never_blocked", "loop_stall_guard"]
