"""Diagnosis tests: the loop-stall guard of tests/_loop_guard.py on every async test."""

from _loop_guard import loop_never_blocked, loop_stall_guard

__all__ = ["loop_never_blocked", "loop_stall_guard"]
