"""One ``async for`` over a :class:`~aresidency.loader.loader.DeviceLoader`: the iterator that
``aiter(loader)`` and ``loader.batches()`` return, which starts its pass at the first
``anext()`` and says how a pass ended (a newer pass, the loader's close, its own aclose(), a
cancelled wait) instead of ending quietly."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import anyio

from ..runtime.shield import finish_shielded
from .lifetime import (
    end_on_loop,
    ended_by_aclose,
    ended_by_cancelled_wait,
    ended_by_close,
    ended_by_newer_pass,
)
from .pipeline import Epoch
from .ring import RingEpoch

if TYPE_CHECKING:
    from .loader import DeviceLoader

__all__ = ["Iteration"]


class Iteration:
    """One ``async for`` over a loader: its epoch starts at the first ``__anext__``."""

    def __init__(self, loader: DeviceLoader, *, wrap: bool) -> None:
        self._loader = loader
        self._wrap = wrap
        self._epoch: Epoch | RingEpoch | None = None
        self._handed = 0  # batches this iteration handed out
        self._cancelled = False  # a wait for a batch was cancelled (which ended the pass)
        self._closed = False  # its aclose() ended the pass while it ran
        self._waiting = False  # a task is in __anext__

    def __aiter__(self) -> Iteration:
        return self

    async def __anext__(self) -> Any:
        if self._waiting:
            raise RuntimeError(
                f"anext() of an iterator of {self._loader.name} was called while another task "
                "waits in this iterator's anext(): an iterator has one consumer (a batch is "
                "released when its consumer asks for the next one, so a second one would "
                "release the first one's batch, or start a second pass). Iterate from one task "
                "and hand the batches to the others (loader.batches(), each kept with "
                "'async with batch')"
            )
        self._waiting = True
        try:
            epoch = self._epoch
            if self._cancelled and epoch is not None:
                raise ended_by_cancelled_wait(self._loader.name, epoch.number, self._handed)
            if self._closed and epoch is not None:
                raise ended_by_aclose(self._loader.name, epoch.number, self._handed)
            if epoch is None:
                epoch = self._epoch = await self._loader._begin()
            elif not self._loader.current(epoch):
                if epoch.ended_by is not None:
                    raise ended_by_newer_pass(self._loader.name, epoch.number, epoch.ended_by)
                if epoch.ended_by_close:
                    raise ended_by_close(self._loader.name, epoch.number, self._handed)
                if epoch.closed_by_manager:  # the manager's close ended it, the loader closed since
                    raise epoch.closed_error()
                raise StopAsyncIteration
            try:
                batch = await epoch.next()
            except StopAsyncIteration:
                if epoch.ended_by is not None:  # a newer pass ended it while this consumer waited
                    raise ended_by_newer_pass(
                        self._loader.name, epoch.number, epoch.ended_by
                    ) from None
                if epoch.ended_by_close:  # the loader closed while this consumer waited
                    raise ended_by_close(self._loader.name, epoch.number, self._handed) from None
                if self._closed:  # this iterator's aclose(), from another task, while it waited
                    raise ended_by_aclose(self._loader.name, epoch.number, self._handed) from None
                raise
            except anyio.get_cancelled_exc_class():
                self._cancelled = True  # the pass ended (epoch.next releases everything)
                raise
            self._handed += 1
            return batch if self._wrap else batch.data
        finally:
            self._waiting = False

    def __del__(self) -> None:
        # Dropped mid-pass (a break or an exception out of ``async for``, no one calling
        # aclose): as an async generator's finalizer, schedule the pass's end on the loop.
        epoch = self._epoch
        if epoch is not None and epoch.status == "running":
            epoch.dropped = True  # (a loader of its name may open now: see DeviceLoader)
            end_on_loop(epoch.bridge, functools.partial(self._loader._dropped, epoch))

    async def aclose(self) -> None:
        """End this pass now (as breaking out of it and starting the next would). If it was
        still running, a consumer of this iterator waiting for a batch, or asking for the
        next one, gets ``anyio.ClosedResourceError``: never the quiet end of a truncated
        pass."""
        self._loader._check_loop("aclose() of an iterator")
        epoch = self._epoch
        if epoch is not None and self._loader.current(epoch):
            if epoch.status == "running":
                self._closed = True
            epoch.shutdown()
            await finish_shielded(epoch.drain)
