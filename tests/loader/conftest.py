"""Loader tests fail if anything blocks the event loop: see tests/_loop_guard.py. Tests that
take ``ring`` run twice: every batch a managed value (``False``) and the loader's choice
(``None``: the ring for a synchronous source on a backend with ``copy_into``)."""

import pytest
from _loop_guard import loop_never_blocked, loop_stall_guard

__all__ = ["loop_never_blocked", "loop_stall_guard", "ring"]


@pytest.fixture(params=[False, None], ids=["values", "auto"])
def ring(request: pytest.FixtureRequest) -> bool | None:
    return request.param  # type: ignore[no-any-return]
