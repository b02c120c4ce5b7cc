"""Timeouts as the API takes them: ``None`` (no limit) or a number of seconds >= 0."""

from __future__ import annotations

import math

__all__ = ["check_timeout"]


def check_timeout(timeout: object, what: str = "timeout") -> float | None:
    """``timeout`` as seconds (``None``: no limit; ``inf`` means the same). Refuses what is
    not a real number >= 0: ``True``, ``nan``, ``-1``, ``"5"``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what} must be None or a number of seconds >= 0, got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{what} must be None or a number of seconds >= 0, got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)
