"""``DeviceBatch``: one batch on the device, as ``DeviceLoader.batches()`` hands it out."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..runtime.leases import current_task

__all__ = ["DeviceBatch"]


def _released(stream: Any) -> None:  # pragma: no cover - register_stream checks first
    raise RuntimeError("the batch was released")


class DeviceBatch:
    """A batch whose tensors are on ``device``, under leases, until it is released.

    ``data`` is the batch as the source yielded it (same containers, non-tensor leaves as they
    were) with every tensor replaced by its device copy; ``index`` its position in the epoch;
    ``nbytes`` the bytes copied for it.

    It is released (its leases exit, recording an event on each reader stream: the device
    memory returns to the budget once the kernels enqueued so far have read it; the host never
    waits) at the first of:

    * the end of ``async with batch as data:`` (a block may span several steps: the batch is
      then kept until the block ends);
    * ``batch.release()``;
    * the loader's next step (``__anext__``), unless an ``async with batch`` block is open:
      the step that finds the source's end too (and a next pass started after it), so a
      batch a worker task keeps in its ``async with`` stays its own until that block ends;
    * the end of its pass otherwise (a ``break`` or an exception out of the loop, a
      cancellation, a newer pass that ends a running one);
    * the end of the loader (``aclose``, or its ``async with`` block), kept or not.

    Batches kept by another task (a worker you hand them to) are waited for when the
    consumer's next batch needs their room: that task may release them. (Those the consuming
    task keeps itself, and that leave the next batch too little room ever to fit, make it
    ``ResidencyBudgetError`` at once.)

    Do not use its tensors after that: the memory may hold the next batch (on CUDA). The
    simulated backend poisons it (NaN, or the byte 0xA5) once the device passed the release:
    the ring before its slot takes another batch, managed values when they are discarded; so
    such a read shows up in tests (``await loader.drain()`` first to be sure it has).
    ``.clone()`` what you keep. Kernels on a stream other than the lease's (the consumer's
    current stream when the batch was handed out, or the loader's ``stream=``) must be
    declared with :meth:`register_stream` before the release.

    State: ``_release`` (the loader's callback, ``None`` once released), ``_entered`` (open
    ``async with`` blocks), ``_keeper`` (the task
    that entered them), ``_register (adds a reader stream to the leases).
    """

    __slots__ = (
        "_entered",
        "_keeper",
        "_on_loop",
        "_register",
        "_release",
        "data",
        "device",
        "index",
        "nbytes",
    )

    def __init__(
        self,
        index: int,
        data: Any,
        nbytes: int,
        device: Location,
        release: Callable[[], None],
        register_stream: Callable[[Any], None],
        on_loop: Callable[[], bool] | None = None,
    ) -> None:
        self.index = index
        self.data = data
        self.nbytes = nbytes
        self.device = device
        self._release: Callable[[], None] | None = release
        self._register = register_stream
        self._entered = 0
        self._keeper: object | None = None  # the task whose ``async with`` keeps it
        self._on_loop = on_loop  # whether the calling thread is the loader's loop's

    def _check_thread(self, what: str) -> None:
        """``RuntimeError`` off the loop's thread: the release and the reader streams change
        the loader's state (and, through managed values, the manager's), which only the
        loop's thread may touch."""
        if self._on_loop is not None and not self._on_loop():
            raise RuntimeError(
                f"{what} of {self!r} was called from another thread than its event loop's; "
                "the batch belongs to the loop that handed it out: call it there (from a "
                "worker thread of anyio.to_thread, anyio.from_thread.run_sync(batch.release); "
                "from any thread, loop.call_soon_threadsafe(batch.release))"
            )

    @property
    def released(self) -> bool:
        return self._release is None

    @property
    def kept(self) -> bool:
        """Whether an ``async with`` block holds the batch (the next step does not release it)."""
        return self._entered > 0 and self._release is not None

    @property
    def kept_by(self) -> object | None:
        """The task whose open ``async with`` blocks keep the batch (``None`` when none does,
        when blocks of several tasks do, or outside a task)."""
        return self._keeper if self.kept else None

    def release(self) -> None:
        """Release the batch now (see the class docstring); later calls do nothing. Loop
        thread (another thread gets ``RuntimeError`` and the batch stays as it was); the host
        does not wait."""
        if self._release is not None:
            self._check_thread("release()")
        release, self._release = self._release, None
        if release is not None:
            # The callbacks reach the loader's record of this batch, which holds the batch:
            # dropped, so that no cycle keeps the device tensors alive until a collection.
            self._register = _released
            release()

    def register_stream(self, stream: Any) -> None:
        """Also protect the batch's memory from kernels enqueued on ``stream`` (an event is
        recorded there too at the release). ``RuntimeError`` once released."""
        if self._release is None:
            raise RuntimeError(f"{self!r} was released: register_stream protects nothing now")
        self._check_thread("register_stream()")
        self._register(stream)

    async def __aenter__(self) -> Any:
        """Keep the batch until the block ends; returns :attr:`data`."""
        if self._release is None:
            raise RuntimeError(f"{self!r} was released: its tensors may hold another batch")
        task = current_task()
        if self._entered == 0:
            self._keeper = task
        elif self._keeper is not task:
            self._keeper = None  # kept from several tasks: any of them may end it
        self._entered += 1
        return self.data

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered -= 1
        if self._entered == 0:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._release is None else "kept" if self._entered else "live"
        return f"<DeviceBatch #{self.index} {format_nbytes(self.nbytes)} @ {self.device} {state}>"
