"""``PendingOperation``: what ``manager.materialize_nowait`` and ``release_nowait`` return."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NoReturn

from ..core.plans import ActionFailed
from .driver import PhaseRun
from .signal import check_callback, refuse_copy

__all__ = ["PendingOperation"]


class PendingOperation:
    """An operation begun synchronously; the manager completes it in the background.

    It completes whether or not anyone awaits it (a transfer commits, or aborts if it failed;
    a release commits once its readers finished): nothing stays incoming because a caller went
    away. A copy that failed while a lease or hold protects its destination is done at once
    (its error known); the destination is dropped when that lease or hold ends.
    ``await pending`` parks until done and raises the transfer's error; cancelling that await
    cancels the materialization (unless a lease was entered on the incoming copy: then it
    completes) and re-raises the cancellation once it settled. ``done()``, ``cancelled()``,
    ``exception()``, ``cancel()`` and ``add_done_callback(fn)`` mirror a future's, on the
    manager's loop.
    """

    __slots__ = ("_run",)

    def __init__(self, run: PhaseRun) -> None:
        self._run = run

    def done(self) -> bool:
        return self._run.finished

    def cancel(self) -> bool:
        """Cancel the transfer if nobody uses its destination yet (synchronous; it settles
        later, through the normal path). Returns whether this call asked for it: ``False``
        once the operation finished or a cancellation was asked before (as
        ``Future.cancel``; :meth:`cancelled` says, once done, whether it ended cancelled). On
        the manager's loop only: from another thread it raises ``RuntimeError`` and cancels
        nothing (it would drive the run off the loop)."""
        self._run._rt.check_loop_thread()
        run = self._run
        if run.finished or run.cancel_requested:
            return False
        run.cancel()
        return True

    def cancelled(self) -> bool:
        """Whether it finished cancelled (the value did not arrive because of :meth:`cancel`)."""
        return self._run.finished and self._run.cancel_requested and self.exception() is not None

    def exception(self) -> BaseException | None:
        """The error once done (``None`` if it succeeded); ``RuntimeError`` if not done yet."""
        if not self._run.finished:
            raise RuntimeError("the materialization has not finished yet")
        error = self._run.error
        if isinstance(error, ActionFailed):
            return error.cause
        return error

    def add_done_callback(self, callback: Callable[[PendingOperation], None]) -> None:
        """Call ``callback(self)`` on the loop when done (now, if it is). A callback that
        raises is logged (logger ``aresidency``) and the other callbacks still run. On the
        manager's loop only: from another thread it raises ``RuntimeError`` and adds nothing
        (the callback would run on that thread, or join a list the loop owns)."""
        self._run._rt.check_loop_thread()
        check_callback(callback, "PendingOperation.add_done_callback")
        self._run.add_done_callback(lambda _run: callback(self))

    async def wait(self) -> None:
        """Park until done; raise its error (see the class docstring for cancellation)."""
        try:
            await self._run.wait()
        except ActionFailed as failed:
            raise failed.cause from None

    async def wait_settled(self) -> None:
        """Park until done, raising nothing; cancelling this wait does not cancel the
        operation (for whoever only needs to know it settled)."""
        await self._run.wait_finished()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy(
            self,
            "it is an operation its manager carries out, and a copy would cancel or wait "
            "for it as if it were another",
            "keep the PendingOperation itself (await it, or add a done callback)",
        )

    def __repr__(self) -> str:
        if not self._run.finished:
            state = "pending"
        else:
            error = self.exception()
            state = "done" if error is None else f"failed ({type(error).__name__})"
        return f"<PendingOperation {state}>"
