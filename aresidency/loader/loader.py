"""``DeviceLoader``: batches already on the device when the step starts (see the package
docstring for the design and the lifetimes)."""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import torch

from ..core.locations import Location, LocationLike
from ..core.sizes import parse_nbytes
from ..core.timeouts import check_timeout
from ..core.values import check_flag, check_optional_name
from ..runtime.manager import ResidencyManager
from ..runtime.shield import finish_shielded
from .batch import DeviceBatch
from .iteration import Iteration
from .pinnedfiles import PinnedFiles
from .pipeline import Epoch
from .ring import RingEpoch
from .staging import StagedSource, StagingSlots
from .stats import LoaderCounters, LoaderStats

__all__ = ["DeviceLoader"]

_NAMES = itertools.count()
#: The loaders of each manager by name (the last made with each): their reservations are
#: named after them, so two open loaders of one manager may not share a name (a closed
#: loader's name is free again, and so is that of one only ending a dropped pass).
_open: weakref.WeakKeyDictionary[ResidencyManager, weakref.WeakValueDictionary[str, Any]] = (
    weakref.WeakKeyDictionary()
)
#: The numbers of the ring slots' reservations, per manager and loader name.
_serials: weakref.WeakKeyDictionary[ResidencyManager, dict[str, Iterator[int]]] = (
    weakref.WeakKeyDictionary()
)


class DeviceLoader:
    """An async iterator over batches already on ``device`` when handed out.

    ``source``: any iterable of host batches (a ``torch.utils.data.DataLoader``, a generator, a
    list; iterated in a thread of its own), any async iterable (read by a task: enter the loader
    with ``async with`` first), or a staged source such as :class:`~aresidency.loader.ShardSource`
    (read straight into the loader's pinned staging buffers). Each pass iterates the source
    anew; a generator (any iterator) is read by one pass only, and a second pass over it is
    refused with ``RuntimeError``. A batch is a tensor or nested
    dicts, lists, tuples, namedtuples and dataclasses of tensors; other leaves pass through.

    ``prefetch``: how many batches may be copied ahead of the one the consumer holds (the
    device budget may allow fewer; the loader then waits for room and never fails for lack of
    it, unless one batch alone exceeds the whole budget). ``stream``: the stream the consumer's
    kernels run on (default: the device's current stream when each batch is handed out).
    ``timeout``: seconds a batch may wait for room at the device before ``TimeoutError``
    (``None``: as long as it takes; the wait for the loader's own released batches or retired
    slots to leave it, as the device passes them, is not counted: :meth:`leaving_bytes`).
    ``staging_slots``: pinned buffers for a staged source (default: its ``workers`` + 2).
    ``read_ahead``: batches the source may run ahead of the loader's admission (default
    ``prefetch + 1``). ``ring``: copy through a ring of device buffers the pass owns, from a
    thread, with no per-batch work on the loop
    (:mod:`~aresidency.loader.ring`; ``None``: whenever the backend has ``copy_into``, for
    every kind of source; ``False``: every batch a managed value). ``pack_min_bytes``: in the
    ring, a batch with pageable tensors of at least this many bytes (an int, or a size such as
    ``"4MiB"``) is packed into its slot's
    pinned twin by the ring's thread and copied with one DMA; a smaller one is copied through
    the driver's own staging. ``4 << 20`` (4 MiB) by default; ``None``: none, every pageable
    batch goes through the driver; ``0``: every one. From a source in memory, twins were
    2.2-3.5x faster than the driver from 16 MiB up on an H200 (1 and 4 MiB: no gain), and
    behind a ``DataLoader`` with worker processes 20-57% faster at 16 and 64 MiB (see
    ``docs/loader.md``). ``pin_source``: page-lock a
    staged source's files in host memory when the first pass starts and copy each batch to the
    device straight out of them, with no host copy (:mod:`~aresidency.loader.pinnedfiles`; a
    :class:`~aresidency.loader.ShardSource` without ``shuffle``; a shuffled one still goes
    through the staging buffers): the whole dataset is then locked, and charged to
    ``pinned-host``, until the loader closes. ``run_ahead`` (the ring): how many released
    batches' steps the device may still have to run when the consumer asks for the next batch;
    beyond it the consumer parks until the device catches up (default ``2 * (prefetch + 1)``),
    so that a consumer faster than the device waits on the loop for an event instead of
    blocking its thread in a kernel launch once the launch queue is full.

    Use::

        async with DeviceLoader(manager, dataloader, "cuda:0", prefetch=4) as loader:
            for epoch in range(epochs):
                async for batch in loader:       # each one is released at the next step
                    loss = model(batch["x"]).sum()
                    ...

    ``async for batch in loader.batches()`` hands out :class:`DeviceBatch` objects instead,
    whose lifetime can be explicit (``async with batch as data``). Each ``async for`` is one
    pass over the source (an epoch); starting one ends the previous one (once the previous
    pass's source thread left its ``next``), and so does leaving the loop (a ``break`` or an
    exception drops the iterator, which ends its pass without waiting). Enter the loader with
    ``async with`` (or ``await loader.aclose()``) for a release that is waited for, before the
    manager closes; the manager's close ends every pass with ``ManagerClosedError``.

    Call on the manager's event loop. State: ``manager``, ``source``, ``device``, ``prefetch``,
    ``ring``, ``stream``, ``timeout``, ``name``, ``counters``, ``staging`` (the staged
    source's buffers, while open), ``task_group`` (while entered), ``_epoch`` (the current
    iteration), ``status`` (``open`` -> ``closed``).
    """

    def __init__(
        self,
        manager: ResidencyManager,
        source: Any,
        device: LocationLike = "cuda:0",
        prefetch: int = 4,
        *,
        stream: Any = None,
        timeout: float | None = None,
        name: str | None = None,
        staging_slots: int | None = None,
        read_ahead: int | None = None,
        ring: bool | None = None,
        pack_min_bytes: int | str | None = 4 << 20,
        pin_source: bool = False,
        run_ahead: int | None = None,
    ) -> None:
        if not isinstance(manager, ResidencyManager):
            raise TypeError(f"DeviceLoader needs a ResidencyManager, got {type(manager).__name__}")
        manager.check_thread()
        _check_count(prefetch, "prefetch", 0)
        self.manager = manager
        # The manager's loop thread (checked just above): the loader's state is that loop's,
        # after the manager closed too (when the manager's own check says only "closed").
        self._loop_thread = threading.get_ident()
        self.device = Location.parse(device)
        backend = manager.backend
        backend.check_location(self.device)
        if not self.device.is_cuda:
            raise ValueError(f"device must be a cuda location, got {self.device}")
        if stream is not None:
            backend.check_stream(stream, self.device)
        self.stream = stream
        self.prefetch = prefetch
        self.timeout = check_timeout(timeout)
        check_optional_name(name, "loader", "its reservations, errors and statistics")
        self.name = name if name is not None else f"loader-{next(_NAMES)}"
        named = _open.get(manager)
        other = None if named is None else named.get(self.name)
        if other is not None and other.status == "open" and not other._only_ending():
            raise ValueError(
                f"another DeviceLoader named {self.name!r} is open on this manager; a "
                "loader's reservations are named after it, so the two would collide: give "
                "each loader its own name= (or close the other one first)"
            )
        self.source = source
        self.is_staged = isinstance(source, StagedSource)
        self.is_async_source = not self.is_staged and hasattr(source, "__aiter__")
        if isinstance(source, (str, bytes, bytearray, memoryview, Mapping)):
            what = "a mapping (iterated, it yields its keys)"
            if not isinstance(source, Mapping):
                what = f"a {type(source).__name__} (iterated, it yields characters or bytes)"
            raise TypeError(
                f"DeviceLoader reads an iterable of batches, got {what}: pass a list, a "
                "generator or a DataLoader of batches (a dict of tensors is one batch: wrap it "
                "in a list)"
            )
        if isinstance(source, torch.Tensor) or (
            type(source).__module__ == "numpy" and hasattr(source, "__array__")
        ):
            # Iterable, but over its rows: each row would be a batch of its own (and a NumPy
            # row, which is no tensor, would stay in host memory).
            what = "a tensor" if isinstance(source, torch.Tensor) else "a NumPy array"
            rows = "its rows" if isinstance(source, torch.Tensor) else "its rows (not tensors)"
            raise TypeError(
                f"DeviceLoader reads an iterable of batches, got {what} of shape "
                f"{tuple(source.shape)} (iterated, it yields {rows} one at a time, each a batch "
                "of its own): pass a list of batches, such as list(tensor.split(batch_size)), "
                "or a DataLoader(TensorDataset(tensor), batch_size=...)"
            )
        if not (self.is_staged or self.is_async_source or hasattr(source, "__iter__")):
            if hasattr(source, "__getitem__"):  # a map-style torch Dataset, say
                raise TypeError(
                    f"DeviceLoader reads an iterable of batches, got {type(source).__name__}, "
                    "which is indexed (a map-style Dataset: samples, not batches): wrap it in a "
                    "DataLoader(dataset, batch_size=...) and pass that"
                )
            raise TypeError(
                f"DeviceLoader reads an iterable or async iterable of batches (a DataLoader, a "
                f"generator, a ShardSource), got {type(source).__name__}"
            )
        # A generator (any iterator, or async iterator) is read once: the first pass reads it,
        # and closes it when it ends, so a second pass would get nothing, or what the first
        # left of it less the batches it read ahead. Such a pass is refused (:meth:`_begin`).
        self._one_shot = not self.is_staged and (
            isinstance(source, Iterator) or hasattr(source, "__anext__")
        )
        if read_ahead is None:
            read_ahead = prefetch + 1
        _check_count(read_ahead, "read_ahead", 1)
        self.read_ahead = read_ahead
        if staging_slots is not None:
            _check_count(staging_slots, "staging_slots", 1)
        if staging_slots is not None and not self.is_staged:
            raise ValueError(
                "staging_slots is for staged sources (such as ShardSource), which read into the "
                "loader's pinned buffers; this source hands out batches of its own"
            )
        self.staging_slots = staging_slots
        can_ring = backend.has_copy_into
        if ring is not None and not isinstance(ring, bool):
            raise TypeError(f"ring must be True, False or None, got {ring!r}")
        if ring and not can_ring:
            raise ValueError(
                f"ring=True needs a backend with copy_into; {type(backend).__name__} has none "
                "(its batches go through managed values)"
            )
        self.ring = can_ring if ring is None else ring
        if pack_min_bytes is not None:
            # A size as budgets take it: 4 << 20, "4MiB", "4 MB".
            pack_min_bytes = parse_nbytes(pack_min_bytes, "pack_min_bytes")
        self.pack_min_bytes = pack_min_bytes
        check_flag(pin_source, "pin_source")
        if pin_source and not (
            self.is_staged
            and callable(getattr(source, "files", None))
            and callable(getattr(source, "direct_reads", None))
            and hasattr(source, "reads_direct")
        ):
            raise ValueError(
                "pin_source page-locks a staged source's files (such as a ShardSource's) and "
                f"copies batches straight out of them; {type(source).__name__} has no files to "
                "lock (it needs files(), direct_reads() and reads_direct)"
            )
        if pin_source and not self.ring:
            raise ValueError(
                "pin_source copies batches out of the locked files in the ring's thread; it "
                "needs ring=True (or None, with a backend that has copy_into)"
            )
        self.pin_source = pin_source
        if run_ahead is None:
            run_ahead = 2 * (prefetch + 1)
        _check_count(run_ahead, "run_ahead", 1, "or None")
        self.run_ahead = run_ahead
        self.counters = LoaderCounters()
        self.staging: StagingSlots | None = None
        self.pinned_files: PinnedFiles | None = None
        self.task_group: anyio.abc.TaskGroup | None = None
        self._epoch: Epoch | RingEpoch | None = None
        # Ended passes whose slots may still wait for the device (freed by then at close),
        # or with batches that ``async with`` blocks kept past the pass's end (released at
        # close).
        self._handed_over: list[Epoch | RingEpoch] = []
        self._epochs = 0
        self._lock = anyio.Lock()
        self._closing: anyio.Event | None = None  # set once a close has ended
        self.status = "open"
        _open.setdefault(manager, weakref.WeakValueDictionary())[self.name] = self
        serials = _serials.setdefault(manager, {})
        self.ring_serial = serials.setdefault(self.name, itertools.count())

    def _only_ending(self) -> bool:
        """Whether this loader only ends a pass its iterator dropped (``async for batch in
        DeviceLoader(...)`` left by a ``break`` or an exception): not entered, holding no
        staging buffers or page-locked files (named after it), its pass ending on its own.
        A loader of the same name may then open beside it (a quick script's next pass): the
        ring's reservations are numbered per name, so theirs never collide."""
        epoch = self._epoch
        return (
            self.task_group is None
            and self.staging is None
            and self.pinned_files is None
            and epoch is not None
            and epoch.dropped
        )

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> AsyncIterator[Any]:
        """One pass over the source, handing out each batch's data (the source's structure,
        with device tensors). A batch is released when the next one is asked for."""
        return Iteration(self, wrap=False)

    def batches(self) -> AsyncIterator[DeviceBatch]:
        """One pass over the source, handing out :class:`DeviceBatch` objects (released at the
        end of their ``async with`` block, by ``release()``, or at the next step)."""
        return Iteration(self, wrap=True)

    def __len__(self) -> int:
        """Batches per pass, when the source knows (``TypeError`` otherwise)."""
        return len(self.source)

    async def _begin(self) -> Epoch | RingEpoch:
        """End the previous pass (releasing what it held), then start a new one."""
        self.manager.check_thread()
        self._check_open()
        if self._one_shot and self._epochs:
            kind = "an async iterator" if self.is_async_source else "an iterator"
            raise RuntimeError(
                f"pass {self._epochs + 1} of {self.name} would read its source again, but the "
                f"source is {kind} ({type(self.source).__name__}), which is read once: pass "
                f"{self._epochs} read it (and closed it when it ended), so this pass would get "
                "no batch, or what that pass left less the batches it read ahead. Pass a source "
                "that starts again at each pass (a list, a DataLoader, an object whose "
                "__iter__ or __aiter__ makes a new generator), or make a new DeviceLoader for "
                "each generator"
            )
        async with self._lock:
            self._check_open()  # closed while this task waited for the lock
            previous = self._epoch
            if previous is not None:
                if previous.status == "running":
                    previous.ended_by = self._epochs + 1  # its consumer is told, not stopped
                previous.shutdown()
                await finish_shielded(functools.partial(previous.drain, handover=True))
                self._handed_over = [e for e in self._handed_over if e.retiring]
                if previous.retiring:
                    self._handed_over.append(previous)
                # The source is iterated by one pass at a time: the previous pass's thread
                # (or task) may still be in a ``next`` it cannot be interrupted in (a
                # DataLoader's persistent workers, a generator).
                await previous.join_feeder()
            plans = None
            if self.is_staged:
                if self.pin_source:
                    await self._open_pinned_files()
                if self.pinned_files is None or not self.source.reads_direct:
                    await self._open_staging()
                plans = await anyio.to_thread.run_sync(self.source.plan_epoch)
            # Closed meanwhile (by another task: its close waits for this one to leave the
            # lock, then releases what was opened here): no pass starts on a closed loader.
            self._check_open()
            self._epochs += 1
            self.counters.epochs += 1
            epoch: Epoch | RingEpoch
            if self.ring:
                after = previous if isinstance(previous, RingEpoch) else None
                epoch = RingEpoch(self, self._epochs, after=after)
            else:
                epoch = Epoch(self, self._epochs)
            self._epoch = epoch
            epoch.start(list(plans) if plans is not None else None)
            return epoch

    def _check_loop(self, what: str) -> None:
        """``RuntimeError`` unless called on the thread of the event loop the loader belongs
        to (its manager's): everything the loader holds is that loop's."""
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(
                f"{what} of {self.name} was called from another thread than its manager's event "
                "loop; the loader belongs to that loop: call it there (from a worker thread of "
                "anyio.to_thread, with anyio.from_thread.run)"
            )

    def _check_open(self) -> None:
        if self.status != "open":
            raise RuntimeError(f"{self.name} is closed")

    async def _wait_for_begin(self) -> None:
        """Park until no task is in :meth:`_begin` (which holds the lock)."""
        async with self._lock:
            pass

    async def _open_staging(self) -> None:
        if self.staging is not None:
            return
        source: StagedSource = self.source
        count = self.staging_slots if self.staging_slots is not None else source.workers + 2
        slots = StagingSlots(count, source.max_batch_nbytes, source.workers, self.name)
        await slots.open(self.manager)
        self.staging = slots
        self.counters.pinned_bytes = slots.total_nbytes

    async def _open_pinned_files(self) -> None:
        if self.pinned_files is not None:
            return
        files = PinnedFiles(await anyio.to_thread.run_sync(self.source.files), self.name)
        await files.open(self.manager)
        self.pinned_files = files
        self.counters.locked_file_bytes = files.nbytes
        self.counters.lock_s = files.lock_s

    def current(self, epoch: Epoch | RingEpoch) -> bool:
        return self._epoch is epoch and self.status == "open"

    # ------------------------------------------------------------------ evidence

    def stats(self) -> LoaderStats:
        """What the loader measured since it was made (see :class:`LoaderStats`)."""
        return self.counters.snapshot()

    def leaving_bytes(self) -> int:
        """Bytes at the device that the loader's passes hold only until the device has run
        the consumer's last steps (released batches through managed values, retired slots
        through the ring), the current pass's and the ended ones'. A batch that waits for
        them waits for the device, not for room others hold: ``timeout`` does not count
        that wait. Loop."""
        epochs = list(self._handed_over)
        if self._epoch is not None and all(self._epoch is not e for e in epochs):
            epochs.append(self._epoch)
        return sum(epoch.leaving_bytes for epoch in epochs)

    @property
    def pinned_bytes(self) -> int:
        """Pinned staging memory the loader holds (charged to ``pinned-host``); 0 when its
        source hands out batches of its own."""
        return 0 if self.staging is None else self.staging.total_nbytes

    def __repr__(self) -> str:
        kind = "staged" if self.is_staged else "async" if self.is_async_source else "sync"
        epoch = "" if self._epoch is None else f" {self._epoch!r}"
        return (
            f"<DeviceLoader {self.name} {kind} source -> {self.device} prefetch={self.prefetch} "
            f"{self.status}{epoch}>"
        )

    # ------------------------------------------------------------------ the end

    async def drain(self) -> None:
        """Park until every batch released so far has left the device budget (its readers'
        events completed and its values were discarded), the slots of ended passes
        included. The host does not block."""
        self._check_loop("drain()")
        epoch = self._epoch
        if epoch is not None:
            await epoch.drain(releases_only=epoch.status == "running")
            if isinstance(epoch, RingEpoch) and epoch.status != "running":
                await epoch.settle()  # an ended pass's slots, retiring
        for ended in list(self._handed_over):
            await ended.settle()

    async def aclose(self) -> None:
        """End the current pass and release everything: batches handed out (their tensors must
        not be used afterwards), copies in flight (cancelled), the staging buffers and their
        reservation. The manager-side cleanup completes even if this call is cancelled; then
        it waits for the source's thread to finish its current ``next``. Raises a copy failure
        that no step reported, and ``ManagerClosedError`` when the manager closed under a pass
        that no step reported it for (then everything was released by the manager's close).
        After the manager closed it never waits for the device (it stopped). While another
        task's close is under way (an ``aclose``, the end of ``async with``), it returns once
        that close is done; what that close raises is reported to that task only."""
        self._check_loop("aclose()")
        await self._close(raise_deferred=True)

    async def _close(self, *, raise_deferred: bool) -> None:
        if self.status == "closed":
            # Another task's close is under way: this one returns once it is done (what it
            # raises is the first caller's to report).
            if self._closing is not None:
                await self._closing.wait()
            return
        self.status = "closed"
        closing = self._closing = anyio.Event()
        try:
            await self._close_now(raise_deferred=raise_deferred)
        finally:
            closing.set()

    async def _close_now(self, *, raise_deferred: bool) -> None:
        # Said now, before any await: a consumer that asks for its next batch meanwhile sees
        # the loader closed and must learn why (never a quiet end of the pass).
        running = self._epoch
        if running is not None and running.status == "running":
            running.ended_by_close = True
        deferred: list[BaseException] = []
        cancelled: BaseException | None = None

        async def finish(fn: Callable[[], Awaitable[object]]) -> None:
            # To the end, whatever cancels the task; a native asyncio cancellation that
            # arrived meanwhile is raised once the whole close is done.
            nonlocal cancelled
            try:
                await finish_shielded(fn)
            except anyio.get_cancelled_exc_class() as exc:
                cancelled = cancelled or exc

        # A pass another task is starting (mapping the files, planning, ending the pass
        # before) finishes first: what it opens (the locked files, the staging buffers, the
        # pass) is released below with the rest, and it starts no pass (it sees the loader
        # closed).
        await finish(self._wait_for_begin)
        epoch = self._epoch
        try:
            if epoch is not None:
                # Its consumer (another task's loop, or a later anext) is told, not stopped.
                epoch.ended_by_close = epoch.ended_by_close or epoch.status == "running"
                epoch.shutdown()
                epoch.release_kept()  # kept in 'async with' past the pass's end: released now
                await finish(epoch.drain)
                deferred = epoch.take_deferred()
            for ended in self._handed_over:
                ended.release_kept()
                await finish(ended.settle)
            self._handed_over = []
        finally:
            try:
                try:
                    if self.staging is not None:
                        await self.staging.aclose()
                finally:
                    if self.pinned_files is not None:
                        await self.pinned_files.aclose()
            finally:
                if epoch is not None:
                    await epoch.join_feeder()
                # A closed loader refers to no pass: nothing keeps it (and its source) alive
                # once the application drops it.
                self._epoch = None
        if cancelled is not None:
            raise cancelled
        if raise_deferred and deferred:
            raise deferred[0]
        closed = epoch is not None and epoch.closed_by_manager and not epoch.closed_reported
        if raise_deferred and closed:
            assert epoch is not None
            raise epoch.closed_error()

    def _dropped(self, epoch: Epoch | RingEpoch) -> None:
        """The iterator of ``epoch`` was garbage collected while the pass ran (a ``break`` or
        an exception out of ``async for`` without ``async with``): end it as ``aclose`` would,
        without waiting (its memory returns to the budget as the device passes it). Loop."""
        if epoch.status == "running":
            epoch.end_soon()

    async def __aenter__(self) -> DeviceLoader:
        self._check_loop("async with")
        if self.task_group is not None:
            raise RuntimeError(f"{self.name} is entered already")
        if self.status != "open":
            raise RuntimeError(f"{self.name} is closed")
        tasks = anyio.create_task_group()
        await tasks.__aenter__()
        self.task_group = tasks
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks, self.task_group = self.task_group, None
        try:
            await self._close(raise_deferred=exc is None)
        finally:
            if tasks is not None:
                # The body's exception is not handed to the group (it would come back wrapped
                # in an exception group); the feeder task was cancelled by the close.
                tasks.cancel_scope.cancel()
                try:
                    await tasks.__aexit__(None, None, None)
                except Exception as group:
                    # A task of the loader failed: the group cancelled the body, and that
                    # cancellation must not leave the block as if the caller were cancelled.
                    if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
                        raise _unwrapped(group) from None


def _unwrapped(error: Exception) -> Exception:
    """The one error of an exception group of one (as it was raised), else ``error``."""
    while isinstance(error, ExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _check_count(value: object, what: str, minimum: int, also: str = "") -> None:
    """``value`` is an int (not a bool) of at least ``minimum``: ``TypeError`` when it is no
    int, ``ValueError`` when it is too small, naming the argument and what it got."""
    wanted = f"{what} must be an int >= {minimum}{' ' + also if also else ''}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{wanted}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{wanted}, got {value!r}")
