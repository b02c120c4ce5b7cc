"""Reading host batches from the source without blocking the event loop.

A synchronous iterable (a ``DataLoader``, a generator, a list) is iterated in a dedicated
thread, :class:`ThreadFeeder`: ``iter(source)`` and every ``next`` run there (a ``DataLoader``
starts its worker processes in ``iter``), and so does :func:`prepare`, which takes the batch's
tensors out of its structure and makes each one a value the manager can own. An asynchronous
iterable is iterated by a task (:func:`feed_async`) in the loader's task group. Either way the
prepared batches go into :class:`Arrivals`, a bounded FIFO that the loop side empties: the feeder
waits (its thread blocks, or its task parks) while it is full, so the source never runs more than
``capacity`` batches ahead of what the loader has taken, and each batch added wakes the loop
through the manager's bridge (no polling).

The end of the source, or its exception, goes into the FIFO as an :class:`End` after the batches
before it, so the consumer meets it in order. The exception object is the source's own, with the
traceback of the ``next`` call that raised it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..backends.bridge import LoopBridge
from ..runtime.tensors import tensor_problem
from .stats import BusyClock
from .structure import Structure, flatten

_log = logging.getLogger("aresidency")

# Whether a tensor's storage is a managed value already, one the loader did not make (any
# thread: a dictionary read): such a tensor is copied into memory of its own.
Managed = Callable[[torch.Tensor], bool]

__all__ = [
    "Arrivals",
    "End",
    "HostBatch",
    "ThreadFeeder",
    "bridge_wake",
    "changed_since_yielded",
    "feed_async",
    "needs_copy",
    "prepare",
    "version_of",
]


@dataclass(slots=True)
class HostBatch:
    """One batch from a (non-staged) source, ready to be registered: its ``structure``, the
    distinct tensors to register (``parts``, in first-seen order), and for each tensor leaf of
    the structure the part it is (``leaf_part``). ``host_copies``: tensors copied to own their
    memory. ``nbytes``: the parts' bytes. ``start``/``end``: when the source worked on it.
    ``versions``: each part's version counter as the source yielded it (``None`` where torch
    refuses to give one), for :func:`changed_since_yielded`."""

    index: int
    structure: Structure
    parts: list[torch.Tensor]
    leaf_part: list[int]
    nbytes: int
    host_copies: int = 0
    start: float = 0.0
    end: float = 0.0
    versions: list[int | None] = field(default_factory=list)


@dataclass(slots=True)
class End:
    """The source ended after ``index`` batches: exhausted (``error is None``) or raising.

    A ``StopIteration`` or ``StopAsyncIteration`` that the source raised (not its own end: a
    ``next`` that leaked one, a staged read, an ``__aiter__``) is kept as the ``__cause__`` of
    a ``RuntimeError`` naming the batch, as Python does for a generator (PEP 479): raised as
    it is inside the consumer's ``__anext__``, it would end the pass as if the source had run
    out, and a truncated pass would look whole. So is an ``asyncio.CancelledError`` the source
    raised itself (a thread's, or an async source's while nothing cancelled the loader: an
    await on something cancelled elsewhere): raised as it is, it would pass for a
    cancellation of the consumer, which a task group takes for a quiet end."""

    index: int
    error: BaseException | None = None

    def __post_init__(self) -> None:
        error = self.error
        if isinstance(error, asyncio.CancelledError):
            wrapped = RuntimeError(
                f"the source raised CancelledError at batch {self.index} ({error!r}) while "
                "nothing cancelled the loader (an await of the source's on something cancelled "
                "elsewhere, say): raised as it is, it would pass for a cancellation of the "
                "consumer and end its pass without an error"
            )
            wrapped.__cause__ = error
            self.error = wrapped
        elif isinstance(error, (StopIteration, StopAsyncIteration)):
            wrapped = RuntimeError(
                f"the source raised {type(error).__name__} at batch {self.index} ({error!r}), "
                "which is not how a source ends (a synchronous one stops with StopIteration "
                "from its own __next__, an async one with StopAsyncIteration from its "
                "__anext__): taken for the end, it would cut the pass short without an error"
            )
            wrapped.__cause__ = error
            self.error = wrapped


def _owns_its_memory(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage holds exactly its elements (so that registering it charges
    what it holds and no other tensor can share it unnoticed)."""
    storage = tensor.untyped_storage()
    return storage.nbytes() == tensor.numel() * tensor.element_size()


def needs_copy(tensors: list[Any], managed: Managed | None = None) -> bool:
    """Whether :func:`prepare` would copy any of these tensors (cheap; for async sources, whose
    preparation runs on the loop unless it has a copy to make)."""
    seen: set[int] = set()
    for tensor in tensors:
        if not _owns_its_memory(tensor) or (managed is not None and managed(tensor)):
            return True
        if tensor.untyped_storage().nbytes():
            key = tensor.untyped_storage().data_ptr()
            if key in seen:
                return True
            seen.add(key)
    return False


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (torch adds one at every in-place change), or ``None``
    where torch refuses to give one (an inference-mode tensor itself; the detached view the
    loader keeps of one reads 0, and in-place writes under inference mode do not count)."""
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def changed_since_yielded(
    index: int,
    structure: Structure,
    leaf_part: Sequence[int],
    parts: Sequence[torch.Tensor | None],
    versions: Sequence[int | None],
) -> RuntimeError | None:
    """The error for batch ``index`` if one of its tensors was changed in place after the
    source yielded it (its version counter moved), before the loader had read it: the device
    copy may then hold something the source never yielded (a source that refills one buffer
    for every batch does this). ``None`` if none was; parts without a version are not
    checked."""
    for number, (part, version) in enumerate(zip(parts, versions, strict=False)):
        if part is None or version is None:
            continue
        now = version_of(part)
        if now is None or now == version:
            continue
        path = structure.part_path(leaf_part, number)
        return RuntimeError(
            f"batch {index} was changed in place after the source yielded it: its tensor at "
            f"{path} went from version {version} to {now} before the loader had read it, so "
            f"its copy on the device may not hold what the source yielded. A source must not "
            f"write to a batch it has yielded: yield a new tensor for every batch (or a "
            f".clone() of a buffer it refills)"
        )
    return None


def check_tensors(tensors: list[torch.Tensor], structure: Structure, index: int) -> None:
    """Refuse batch ``index`` if one of its tensors cannot be copied whole (sparse, nested,
    quantized, meta, a lazy conj() view...: see
    :func:`~aresidency.runtime.tensors.tensor_problem`), naming where it lies in the batch."""
    for position, tensor in enumerate(tensors):
        problem = tensor_problem(tensor)
        if problem is not None:
            kind, what, instead = problem
            raise kind(
                f"batch {index} holds {what} at {structure.paths[position]}, which the loader "
                f"cannot copy to the device: {instead}"
            )


def prepare(
    item: Any, index: int, *, own_memory: bool = True, managed: Managed | None = None
) -> HostBatch:
    """Take the tensors out of ``item`` (any thread; copies block it).

    With ``own_memory`` (the managed values), a tensor that is a view into a larger storage (a
    slice of a bigger tensor) or shares its storage with an earlier tensor of the batch is
    copied into memory of its own first: a value must own its memory (the manager charges the
    whole storage, and two values cannot share one); so is one whose storage ``managed`` says
    is a value already (one the application registered itself). The ring copies every tensor
    to the device at once and needs no such copy. The same tensor object twice is one part.
    Tensors requiring grad are detached."""
    tensors, structure = flatten(item)
    check_tensors(tensors, structure, index)
    parts: list[torch.Tensor] = []
    leaf_part: list[int] = []
    by_id: dict[int, int] = {}
    storages: set[tuple[str, int]] = set()
    copies = 0
    nbytes = 0
    for tensor in tensors:
        known = by_id.get(id(tensor))
        if known is not None:
            leaf_part.append(known)
            continue
        part = tensor.detach()
        key = (str(part.device), part.untyped_storage().data_ptr())
        shared = part.untyped_storage().nbytes() > 0 and key in storages
        registered = managed is not None and managed(part)
        if own_memory and (shared or registered or not _owns_its_memory(part)):
            part = part.clone(memory_format=torch.contiguous_format)
            key = (str(part.device), part.untyped_storage().data_ptr())
            copies += 1
        if part.untyped_storage().nbytes():
            storages.add(key)
        by_id[id(tensor)] = len(parts)
        leaf_part.append(len(parts))
        parts.append(part)
        nbytes += part.numel() * part.element_size()
    versions = [version_of(part) for part in parts]
    return HostBatch(index, structure, parts, leaf_part, nbytes, copies, versions=versions)


class Arrivals:
    """A bounded FIFO of prepared batches (and one final :class:`End`) between a feeder and the
    loop. ``put`` (feeder thread) blocks while full; ``put_async`` (feeder task) parks;
    :meth:`take` (loop) never waits and makes room. ``wake`` is called (from the feeder's thread
    or task) after each item.

    State (under ``_cond``): ``_items``, ``stopped`` (the loop wants no more: puts return
    False at once), ``_room`` (an ``anyio.Event`` a feeder task parks on; loop thread).
    """

    def __init__(self, capacity: int, wake: Callable[[], None]) -> None:
        self.capacity = max(1, capacity)
        self._wake = wake
        self._cond = threading.Condition()
        self._items: deque[HostBatch | End] = deque()
        self.stopped = False
        self._room: anyio.Event | None = None

    def put(self, item: HostBatch | End) -> bool:
        """Add ``item`` once there is room (blocking the calling feeder thread until then);
        False if the loop stopped taking."""
        with self._cond:
            while (
                len(self._items) >= self.capacity and not self.stopped and not isinstance(item, End)
            ):
                self._cond.wait()
            if self.stopped:
                return False
            self._items.append(item)
            self._cond.notify_all()  # a consumer thread in take_blocking
        self._wake()
        return True

    async def put_async(self, item: HostBatch | End) -> bool:
        """:meth:`put` for a feeder task on the loop: parks while full."""
        while True:
            with self._cond:
                if self.stopped:
                    return False
                if len(self._items) < self.capacity or isinstance(item, End):
                    self._items.append(item)
                    self._cond.notify_all()  # a consumer thread in take_blocking
                    break
                room = self._room = anyio.Event()
            await room.wait()
        self._wake()
        return True

    def take(self) -> HostBatch | End | None:
        """The oldest item, or None; never waits (loop thread)."""
        with self._cond:
            if not self._items:
                return None
            item = self._items.popleft()
            self._cond.notify()
            room, self._room = self._room, None
        if room is not None:
            room.set()
        return item

    def take_blocking(
        self, on_loop: Callable[[Callable[[], None]], None]
    ) -> HostBatch | End | None:
        """The oldest item, once there is one (blocking the calling consumer thread, never the
        loop); ``None`` once stopped. A feeder task parked for room is woken through
        ``on_loop`` (which runs a callable on the loop)."""
        with self._cond:
            while not self._items and not self.stopped:
                self._cond.wait()
            if self.stopped:
                return None
            item = self._items.popleft()
            self._cond.notify_all()
            room, self._room = self._room, None
        if room is not None:
            on_loop(room.set)
        return item

    def stop(self) -> None:
        """Take no more: wake a blocked feeder (its puts return False) and drop what is queued
        (loop thread)."""
        with self._cond:
            self.stopped = True
            self._items.clear()
            self._cond.notify_all()
            # Nothing is put once stopped, so nobody is woken: the callback (which refers to
            # the pass) goes, and with it a reference cycle pass -> arrivals -> pass.
            self._wake = _nothing
        room, self._room = self._room, None
        if room is not None:
            room.set()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


def _nothing() -> None:
    pass


class ThreadFeeder:
    """Iterates a synchronous iterable in a thread of its own and feeds :class:`Arrivals`.

    The thread stops after the source ends or raises, or once :meth:`stop` was called and the
    ``next`` call in progress returned (a call in progress cannot be interrupted). It then closes
    the iterator (a generator's ``finally`` blocks run; a ``DataLoader`` iterator is dropped,
    which shuts its workers down) in that same thread; an error the close raises is logged.

    State: ``thread``, ``arrivals``, ``clock`` (the source's busy time), ``_stop``.
    """

    def __init__(
        self,
        source: Iterable[Any],
        arrivals: Arrivals,
        clock: BusyClock,
        name: str,
        *,
        own_memory: bool = True,
        managed: Managed | None = None,
    ) -> None:
        self.source: Iterable[Any] | None = source
        self.own_memory = own_memory
        self.managed = managed
        self.arrivals = arrivals
        self.clock = clock
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"aresidency-loader-{name}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ask the thread to stop after its current ``next`` (any thread; never waits)."""
        self._stop.set()
        self.arrivals.stop()

    async def join(self) -> None:
        """Park until the thread finished (a worker thread joins it; cancelling this wait
        abandons the join, not the thread)."""
        if self.thread.is_alive():
            await anyio.to_thread.run_sync(self.thread.join, abandon_on_cancel=True)

    def _run(self) -> None:
        iterator: Any = None
        index = 0
        try:
            start = time.perf_counter()
            assert self.source is not None
            iterator = iter(self.source)
            while not self._stop.is_set():
                try:
                    item = next(iterator)
                except StopIteration:
                    self.arrivals.put(End(index))
                    return
                batch = prepare(item, index, own_memory=self.own_memory, managed=self.managed)
                end = time.perf_counter()
                batch.start, batch.end = start, end
                self.clock.add(start, end)
                if not self.arrivals.put(batch):
                    return
                # Not held while the next one is read: a batch in a worker's shared memory
                # is given back by the ring only when nothing else holds it.
                del item, batch
                index += 1
                start = time.perf_counter()
        except BaseException as error:  # the source's own error, for the consumer
            self.arrivals.put(End(index, error))
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    # A generator that fails in its finally: nobody is left to raise it to (the
                    # pass has ended), so it is logged, as Python reports a generator's error
                    # in a finalizer, never dropped unsaid.
                    _log.exception("closing the source's iterator %r raised", iterator)
            del iterator
            self.source = None  # the pass may outlive its loader: the source goes with it


async def feed_async(
    source: AsyncIterable[Any],
    arrivals: Arrivals,
    clock: BusyClock,
    *,
    own_memory: bool = True,
    managed: Managed | None = None,
) -> None:
    """Iterate an async iterable into ``arrivals`` (a task of the loader's task group; cancel
    its scope to stop it). Preparation runs on the loop unless it has tensors to copy (only
    with ``own_memory``, see :func:`prepare`), which go to a worker thread. Closes an async
    generator in this same task when done."""
    try:
        iterator = source.__aiter__()
    except BaseException as error:  # as an error of its first batch: the consumer's
        await arrivals.put_async(End(0, error))
        return
    index = 0
    try:
        while not arrivals.stopped:
            start = time.perf_counter()
            try:
                try:
                    item = await iterator.__anext__()
                except StopAsyncIteration:  # the source's end (from ``__anext__`` only)
                    await arrivals.put_async(End(index))
                    return
                tensors, structure = flatten(item)
                check_tensors(tensors, structure, index)
                if own_memory and needs_copy(tensors, managed):
                    batch = await anyio.to_thread.run_sync(
                        functools.partial(prepare, item, index, managed=managed)
                    )
                else:
                    batch = prepare(item, index, own_memory=own_memory)
            except anyio.get_cancelled_exc_class() as error:
                if _cancelled_for_real():
                    raise
                # Raised by the source itself, nothing cancels this task: its error.
                await arrivals.put_async(End(index, error))
                return
            except BaseException as error:  # the source's own error, for the consumer
                await arrivals.put_async(End(index, error))
                return
            end = time.perf_counter()
            batch.start, batch.end = start, end
            clock.add(start, end)
            if not await arrivals.put_async(batch):
                return
            del item, batch, tensors  # (not held while the next one is read)
            index += 1
    finally:
        aclose = getattr(iterator, "aclose", None)
        if callable(aclose):
            with anyio.CancelScope(shield=True):
                try:
                    await aclose()
                except Exception:
                    _log.exception("closing the source's iterator %r raised", iterator)


def _cancelled_for_real() -> bool:
    """Whether the calling task is being cancelled (under asyncio, a cancellation request is
    pending for it: anyio's cancel scopes make one too); trio's ``Cancelled`` always is."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop: trio
        return True
    return task is None or task.cancelling() > 0


def bridge_wake(bridge: LoopBridge, fn: Callable[[], None]) -> Callable[[], None]:
    """A wake-up callable for :class:`Arrivals`: ``fn()`` on the loop, soon (any thread; a loop
    that has finished is not woken)."""

    def wake() -> None:
        if bridge.on_loop():
            fn()
        else:
            bridge.call_soon_quietly(fn)

    return wake
