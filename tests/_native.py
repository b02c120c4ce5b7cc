"""Shared by the tests that cancel tasks natively (``task.cancel()``, which only asyncio and
uvloop have; trio has no such call)."""

from __future__ import annotations

import asyncio


def on_asyncio() -> bool:
    """Whether the running test runs on an asyncio loop (asyncio or uvloop), where a task can
    be cancelled natively."""
    try:
        asyncio.current_task()
    except RuntimeError:
        return False
    return True
