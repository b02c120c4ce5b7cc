"""The tests of aresidency.testing use it themselves: every async test here runs under the
public loop-stall guard (``loop_never_blocked``, imported, is autouse for this directory), and
the ``residency_manager`` fixture comes from the plugin, loaded through its entry point."""

from __future__ import annotations

from aresidency.testing import loop_never_blocked

__all__ = ["loop_never_blocked"]
