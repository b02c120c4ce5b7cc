"""The loader's own pinned staging buffers, for sources that read batches straight into them.

A *staged source* (:class:`StagedSource`, such as :class:`~aresidency.loader.ShardSource`) does
not hand out batches in memory of its own: it writes each batch into a flat byte buffer the
loader gives it (:meth:`StagedSource.read_into`, in a worker thread) and describes where each
tensor lies in it (:class:`TensorSpec`). The loader gives it :class:`StagingSlots`: a fixed
number of equally sized buffers, page-locked when CUDA is available (exactly sized, through
:class:`~aresidency.backends.staging.PinnedAllocator`; plain host memory on a machine without
CUDA, where only the simulated backend runs), and a pool of ``workers`` threads that fill them.
So on a GPU the bytes go from the page cache into pinned memory once, in several threads at
once, and from there to the device by DMA: no pageable copy in between, no staging pass on the
backend's lane thread.

Accounting: the buffers are charged to ``pinned-host`` as one named reservation
(``"<loader name>.staging"``), taken before they are allocated and kept until the loader
closes, whatever they hold; the pinned-host ledger therefore shows exactly the memory the loader
pinned. A batch in a buffer becomes a value of the manager through a :class:`SlotSource` (a
reconstructible value whose source is the buffer): materializing it on the device is a load
through ``pageable-host``, the page cache the bytes came from, charged there only while its copy
runs, then a host-to-device copy that the CUDA backend issues directly because the buffer is
pinned. A buffer is filled again only after the copy out of it completed.

What the host waits on: :meth:`StagingSlots.open` pins the buffers in a worker thread (page-locking
faults in and locks every page: tens of milliseconds per GiB); fills run in the worker threads;
nothing here runs on the event loop for longer than a queue operation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import anyio
import torch

from ..backends import PinnedAllocator
from ..core.errors import ResidencyBudgetError
from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..runtime.manager import ResidencyManager
from ..runtime.shield import finish_shielded
from .structure import Structure, flatten

__all__ = [
    "SlotSource",
    "StagedFill",
    "StagedSource",
    "StagingSlots",
    "TensorSpec",
    "staged_layout",
]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor of a staged batch lies in its flat byte buffer: ``offset`` bytes from the
    start (a multiple of the dtype's size), ``dtype`` and ``shape``, contiguous."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of ``flat`` (a ``uint8`` buffer holding the batch)."""
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def staged_layout(
    index: int, layout: Any, buffer: torch.Tensor
) -> tuple[list[TensorSpec], Structure, int]:
    """What :meth:`StagedSource.read_into` returned for batch ``index``, checked against the
    ``buffer`` it filled: its specs, its structure and the bytes it laid out. ``ValueError``
    naming the batch for a layout without specs or one larger than the buffer."""
    specs, structure = flatten(layout, TensorSpec)
    if not specs:
        raise ValueError(f"read_into returned no TensorSpec for batch {index}: {layout!r}")
    nbytes = max(spec.offset + spec.nbytes for spec in specs)
    if nbytes > buffer.numel():
        raise ValueError(
            f"read_into laid batch {index} out over {nbytes} B, more than the "
            f"{buffer.numel()} B buffer it was given"
        )
    return specs, structure, nbytes


@runtime_checkable
class StagedSource(Protocol):
    """A source that writes each batch into a host buffer the loader provides.

    ``workers``: how many threads may call :meth:`read_into` at once; ``max_batch_nbytes``: the
    buffer size a batch needs at most. :meth:`plan_epoch` is called on the event loop at the
    start of each iteration and returns one opaque plan per batch, in order (it must be quick);
    :meth:`read_into` is called in a worker thread with one plan and a flat ``uint8`` buffer of
    ``max_batch_nbytes`` bytes, writes the batch into it and returns the batch's structure with a
    :class:`TensorSpec` where each tensor goes (a spec, or dicts, lists, tuples of specs).
    Optionally, ``read_pieces(plan, out, parts)`` returns that structure at once with a list
    of independent zero-argument reads that together fill ``out`` (about ``parts`` of them):
    the loader then runs them in several threads at once (see :class:`StagedFill`).
    """

    workers: int
    max_batch_nbytes: int

    def plan_epoch(self) -> Sequence[Any]: ...

    def read_into(self, plan: Any, out: torch.Tensor) -> Any: ...


class StagedFill:
    """One batch being read into a staging buffer by the fill threads: in one call of
    :meth:`StagedSource.read_into`, or, when the source has ``read_pieces(plan, out, parts)``
    (returning the layout and a list of independent reads, as
    :meth:`~aresidency.loader.ShardSource.read_pieces` does), in pieces spread over the
    threads, so that one batch is read several threads wide and is ready sooner (the first
    batch of a pass most of all). Each piece first waits, in its thread, for ``after`` (the last
    copy out of the buffer). ``parts``: how many pieces to ask for (the number of threads).

    :meth:`result` blocks until every piece ended (so that no piece still writes the buffer when
    it returns or raises) and gives the layout with the reading's first start and last end
    (``perf_counter``); :meth:`cancel` drops the pieces not started, :meth:`futures` the ones to
    wait for before the buffer may be used again."""

    __slots__ = ("_layout", "_lock", "_pieces", "_remaining")

    _FROM_READ: Any = object()  # the layout is what the single read returns

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        source: Any,
        plan: Any,
        buffer: torch.Tensor,
        after: Any,
        wait: Callable[[Any], None],
        parts: int,
    ) -> None:
        self._pieces: list[concurrent.futures.Future[tuple[Any, float, float]]] = []
        self._lock = threading.Lock()
        self._remaining = 0
        split = getattr(source, "read_pieces", None)
        try:
            if callable(split):
                self._layout, reads = split(plan, buffer, parts)
            else:
                self._layout = self._FROM_READ
                reads = [functools.partial(source.read_into, plan, buffer)]
        except BaseException as error:  # the source refused the plan: the batch raises it
            failed: concurrent.futures.Future[tuple[Any, float, float]] = (
                concurrent.futures.Future()
            )
            failed.set_exception(error)
            self._pieces.append(failed)
            return
        for read in reads:
            self._pieces.append(executor.submit(_timed_piece, read, after, wait))

    def when_done(self, done: Callable[[Any, BaseException | None, float, float], None]) -> None:
        """Call ``done(layout, error, start, end)`` once every piece ended (``layout`` ``None``
        and ``error`` the first piece's when one failed), in the thread that ended the last
        one, or at once in this one if all had ended."""

        # The fill and ``done`` are dropped once called: a future keeps its callbacks, so
        # without that the fill (its source and buffer, and through ``done`` the epoch and
        # its loader) would stay in a cycle fill -> piece -> callback -> fill.
        waiting: list[Any] = [self, done]

        def ended(_piece: concurrent.futures.Future[Any]) -> None:
            fill, then = waiting
            with fill._lock:
                fill._remaining -= 1
                if fill._remaining > 0:
                    return
            waiting.clear()
            try:
                layout, start, end = fill.result()
            except BaseException as error:
                now = time.perf_counter()
                then(None, error, now, now)
                return
            then(layout, None, start, end)

        with self._lock:
            self._remaining = len(self._pieces)
        for piece in self._pieces:
            piece.add_done_callback(ended)

    def futures(self) -> list[concurrent.futures.Future[tuple[Any, float, float]]]:
        return list(self._pieces)

    def cancel(self) -> None:
        for piece in self._pieces:
            piece.cancel()

    def result(self) -> tuple[Any, float, float]:
        concurrent.futures.wait(self._pieces)
        results = [piece.result() for piece in self._pieces]  # the first piece's error raises
        layout = results[0][0] if self._layout is self._FROM_READ else self._layout
        return layout, min(r[1] for r in results), max(r[2] for r in results)


def _timed_piece(
    read: Callable[[], Any], after: Any, wait: Callable[[Any], None]
) -> tuple[Any, float, float]:
    if after is not None:
        wait(after)
    start = time.perf_counter()
    value = read()
    return value, start, time.perf_counter()


class SlotSource:
    """The source of a value whose data is one staged batch: ``load()`` returns the filled part
    of its buffer (no copy). Retired once the copy out of the buffer completed: the buffer may
    then hold another batch, so a later load would be wrong and raises instead.

    State: ``shape`` (``(nbytes,)``), ``dtype`` (``uint8``), ``source_location``
    (``pageable-host``: the page cache the batch was read from), ``_view`` (``None`` once
    retired).
    """

    source_location = Location("pageable-host")
    dtype = torch.uint8

    def __init__(self, view: torch.Tensor, label: str) -> None:
        self.shape: tuple[int, ...] = (view.numel(),)
        self._view: torch.Tensor | None = view
        self.label = label

    def load(self) -> torch.Tensor:
        view = self._view
        if view is None:
            raise RuntimeError(
                f"{self.label} was copied to the device and its staging buffer reused: it can "
                "no longer be loaded (the loader discards the value after its step)"
            )
        return view

    def retire(self) -> None:
        self._view = None

    def __repr__(self) -> str:
        state = "retired" if self._view is None else "live"
        return f"<SlotSource {self.label} {format_nbytes(self.shape[0])} {state}>"


class StagingSlots:
    """``count`` buffers of ``nbytes`` each and ``workers`` threads to fill them (see the module
    docstring).

    State: ``buffers`` (allocated by :meth:`open`), ``free`` (indexes of buffers holding nothing
    the loader still needs), ``_executor``, ``_stack`` (the reservation), ``_allocator`` (the
    pinned allocator, ``None`` without CUDA), ``status`` (``new`` -> ``open`` -> ``closed``).
    Invariant: a buffer is in ``free`` only while no fill writes it and no copy reads it.
    """

    def __init__(self, count: int, nbytes: int, workers: int, name: str) -> None:
        if count < 1:
            raise ValueError(f"staging_slots must be >= 1, got {count}")
        if workers < 1:
            raise ValueError(f"a staged source needs workers >= 1, got {workers}")
        self.count = count
        # Whole pages: what page-locking really locks, so the reservation is what is pinned.
        page = mmap.PAGESIZE
        self.nbytes = max(page, -(-nbytes // page) * page)
        self.workers = workers
        self.name = name
        self.buffers: list[torch.Tensor] = []
        # Per buffer, the event after the last copy out of it (the ring's passes): the next
        # fill waits for it, in the pass that comes next too.
        self.last_copy: list[Any] = [None] * count
        self.free: list[int] = []
        self.pinned = False
        self._allocator: PinnedAllocator | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stack = contextlib.AsyncExitStack()
        self.status = "new"

    @property
    def total_nbytes(self) -> int:
        return self.count * self.nbytes

    async def open(self, manager: ResidencyManager) -> None:
        """Take the ``pinned-host`` reservation (``ResidencyBudgetError`` at once if it does not
        fit), then allocate the buffers in a worker thread. Loop thread."""
        if self.status != "new":
            raise RuntimeError(f"{self!r} was opened already")
        what = f"{self.name}.staging"
        try:
            await self._stack.enter_async_context(
                manager.reservation(what, "pinned-host", self.total_nbytes)
            )
        except ResidencyBudgetError as error:
            error.add_note(
                f"the loader's staging buffers ({self.count} x {format_nbytes(self.nbytes)}) do "
                "not fit pinned-host: lower staging_slots or the batch size, or raise the "
                "pinned-host budget"
            )
            raise
        self.status = "open"
        try:
            # To the end, even under a native asyncio cancellation (raised once it is done):
            # interrupted, the thread would go on starting the fill threads and allocating
            # buffers after the clean-up below had looked for them, and leak both.
            await finish_shielded(anyio.to_thread.run_sync, self._allocate)
        except BaseException:
            await self.aclose()
            raise
        self.free = list(range(self.count))

    def _allocate(self) -> None:
        # Worker thread: page-locking blocks, and so does starting threads. The fill threads
        # start here, all of them: an executor starts a thread on a submit that finds none
        # idle, and waits for it to run, which on a busy machine blocked the event loop (the
        # managed-value pass submits from the loop) for a fifth of a second.
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix=f"aresidency-loader-fill-{self.name}"
        )
        self._executor = executor
        meet = threading.Barrier(self.workers)
        started = [executor.submit(_meet, meet) for _ in range(self.workers)]
        concurrent.futures.wait(started)
        # Without CUDA there is no pinned memory to ask for (only the simulated backend runs
        # there); a GPU machine pins whatever backend runs.
        if torch.cuda.is_available():
            self._allocator = PinnedAllocator()
            self.pinned = True
        for _ in range(self.count):
            if self._allocator is not None:
                buffer = self._allocator.empty((self.nbytes,), torch.uint8)
            else:
                buffer = torch.empty(self.nbytes, dtype=torch.uint8)
            self.buffers.append(buffer)

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The ``workers`` threads that fill the buffers (while open)."""
        executor = self._executor
        if executor is None:
            raise RuntimeError(f"{self!r} is not open")
        return executor

    async def aclose(self) -> None:
        """Stop the threads (after the fills in flight), drop the reservation and unpin the
        buffers. The caller makes sure no copy reads a buffer any more."""
        if self.status == "closed":
            return
        self.status = "closed"
        executor, self._executor = self._executor, None
        buffers, self.buffers = self.buffers, []
        allocator = self._allocator
        self.free = []

        def stop() -> None:
            if executor is not None:
                executor.shutdown(wait=True)
            if allocator is not None:
                for buffer in buffers:
                    allocator.release(buffer)

        # Both to the end, whatever cancels the task (a native asyncio cancellation too, which
        # is raised afterwards): an anyio shield alone let one through before the thread got
        # the stop, and the fill threads were left waiting for work.
        try:
            await finish_shielded(anyio.to_thread.run_sync, stop)
        finally:
            with contextlib.suppress(Exception):  # a closed manager took its ledger with it
                await finish_shielded(self._stack.aclose)

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "host (no CUDA: not pinned)"
        return (
            f"<StagingSlots {self.name} {self.count} x {format_nbytes(self.nbytes)} {kind} "
            f"{self.workers} workers {self.status} free={len(self.free)}>"
        )


def _meet(barrier: threading.Barrier) -> None:
    """A fill thread's first task: wait until every fill thread runs (each task takes its own
    thread), or give up after a while (they start anyway, only later)."""
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(timeout=10)
