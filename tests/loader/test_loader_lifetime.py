"""When a pass ends without the consumer ending it: the manager closes under it, its iterator is
dropped (a ``break`` or an exception out of ``async for`` with no ``async with``), or the
source runs out. Each time it ends for good: no thread left, nothing charged, and a consumer
that asks for more is told why (``ManagerClosedError``), never left waiting. Both ways through
(``ring``: managed values, and the loader's choice, the ring) on the simulated backend."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.loader import DeviceLoader, ShardSource
from aresidency.runtime.signal import ManagerClosedError

from ._support import Gate, assert_nothing_left, batches, gated, until

pytestmark = pytest.mark.anyio


def loader_threads(loader: DeviceLoader) -> list[str]:
    """The threads of ``loader`` still alive (its source's, its ring's, their helpers)."""
    return [t.name for t in threading.enumerate() if loader.name in t.name]


def nothing_charged(manager: ResidencyManager) -> bool:
    """No value registered, nothing used or reserved at the device (the manager's own
    reservations aside: see ``assert_nothing_left``)."""
    record = manager.snapshot().location("cuda:0")
    return not list(manager.state.values()) and not record.used_bytes and not record.reserved_bytes


# ---------------------------------------------------------------------- the manager's close


async def test_closing_the_manager_under_a_waiting_consumer_raises_manager_closed(
    ring: bool | None,
) -> None:
    """The consumer waits for a batch the source has not made yet when the manager closes: it
    gets ``ManagerClosedError`` (it used to wait forever: the ring's thread died calling the
    closed manager's loop)."""
    gate = Gate()
    first = anyio.Event()
    raised: list[BaseException] = []
    ended = anyio.Event()
    try:
        async with anyio.create_task_group() as tasks:
            async with ResidencyManager(backend=SimBackend()) as m:

                async def consume() -> None:
                    source = gated(batches(4), gate, 1)
                    async with DeviceLoader(m, source, "cuda:0", prefetch=1, ring=ring) as loader:
                        try:
                            async for _batch in loader:
                                first.set()
                        except ManagerClosedError as error:
                            raised.append(error)
                        finally:
                            ended.set()
                            gate.open.set()  # the source's thread may end now (exit joins it)

                tasks.start_soon(consume)
                await first.wait()
                await anyio.to_thread.run_sync(gate.reached.wait)
                await anyio.wait_all_tasks_blocked()  # the consumer waits for batch 1
            with anyio.fail_after(5):
                await ended.wait()
    finally:
        gate.open.set()
    assert [type(e) for e in raised] == [ManagerClosedError], raised
    assert "the manager closed while loader-" in str(raised[0])  # the loader's own account


async def test_closing_the_manager_during_a_step_ends_the_block_with_manager_closed(
    ring: bool | None,
) -> None:
    """The manager closes while the consumer is in its step, inside ``async with loader``:
    the next step raises ``ManagerClosedError`` and the block's exit neither hangs (it waited
    for a source thread that was never told to stop) nor replaces the error with the closed
    device's ``RuntimeError``."""
    in_step = anyio.Event()
    resume = anyio.Event()
    raised: list[BaseException] = []
    ended = anyio.Event()
    async with anyio.create_task_group() as tasks:
        async with ResidencyManager(backend=SimBackend()) as m:

            async def consume() -> None:
                try:
                    async with DeviceLoader(
                        m, batches(50), "cuda:0", prefetch=2, ring=ring
                    ) as loader:
                        async for _batch in loader:
                            in_step.set()
                            await resume.wait()
                except BaseException as error:
                    raised.append(error)
                finally:
                    ended.set()

            tasks.start_soon(consume)
            await in_step.wait()
        resume.set()
        with anyio.fail_after(5):
            await ended.wait()
    assert [type(e) for e in raised] == [ManagerClosedError], raised


async def test_aclose_after_the_manager_closed_under_a_pass_says_so_once(
    ring: bool | None,
) -> None:
    """A pass still running (its iterator kept) when the manager closes: the close ends its
    threads; ``aclose`` afterwards raises ``ManagerClosedError`` once (nobody was told), at
    once (it used to hang, or raise the closed device's ``RuntimeError``); then nothing."""
    async with ResidencyManager(backend=SimBackend()) as m:
        loader = DeviceLoader(m, batches(50), "cuda:0", prefetch=2, ring=ring)
        iterator = aiter(loader)
        await anext(iterator)
    await until(lambda: not loader_threads(loader))
    with anyio.fail_after(5):
        with pytest.raises(ManagerClosedError, match="manager closed"):
            await loader.aclose()
        await loader.aclose()
    del iterator


async def test_a_consumer_is_told_of_the_manager_s_close_after_the_loader_closed_too(
    ring: bool | None,
) -> None:
    """The manager closes under a running pass, then the loader is closed (its ``aclose``
    reports the manager's close): the pass's consumer, asking for its next batch, got
    ``StopAsyncIteration``, a quiet end after 1 of 50 batches; before the loader's close it
    got ``ManagerClosedError``, and it still does."""
    async with ResidencyManager(backend=SimBackend()) as m:
        loader = DeviceLoader(m, batches(50), "cuda:0", prefetch=2, ring=ring)
        iterator = aiter(loader)
        await anext(iterator)
    await until(lambda: not loader_threads(loader))
    with anyio.fail_after(5):
        with pytest.raises(ManagerClosedError, match="manager closed"):
            await loader.aclose()
        for _ in range(2):
            with pytest.raises(ManagerClosedError, match="manager closed"):
                await anext(iterator)
    del iterator


async def test_the_manager_close_ends_the_threads_of_a_loader_nobody_closes(
    ring: bool | None,
) -> None:
    """No ``async with``, no ``aclose``, the iterator still referenced: the manager's close
    ends the source's and the ring's threads (they used to live on, blocked)."""
    gate = Gate()
    async with ResidencyManager(backend=SimBackend()) as m:
        loader = DeviceLoader(m, gated(batches(8), gate, 3), "cuda:0", prefetch=1, ring=ring)
        iterator = aiter(loader)
        await anext(iterator)
        assert loader_threads(loader)
    gate.open.set()
    await until(lambda: not loader_threads(loader))
    with pytest.raises(ManagerClosedError):
        await anext(iterator)


# ---------------------------------------------------------------------- one pass at a time


class SharedSource:
    """An iterable whose iterators share one state (as a DataLoader's persistent workers
    do): ``overlaps`` counts calls that came while another iterator's ``next`` ran. The
    first pass's ``next`` of item ``at`` stops at ``gate``."""

    def __init__(self, items: list[torch.Tensor], gate: Gate, at: int) -> None:
        self.items = items
        self.gate = gate
        self.at = at
        self.iters = 0
        self.overlaps = 0
        self._busy = 0
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[torch.Tensor]:
        with self._lock:
            self.iters += 1
            self.overlaps += self._busy
        return self._run(self.iters)

    def _run(self, number: int) -> Iterator[torch.Tensor]:
        for index, item in enumerate(self.items):
            with self._lock:
                self.overlaps += self._busy
                self._busy += 1
            if number == 1 and index == self.at:
                self.gate.hold()
            with self._lock:
                self._busy -= 1
            yield item


async def test_a_new_pass_waits_for_the_previous_pass_to_leave_the_source(
    ring: bool | None,
) -> None:
    """Breaking out of a pass while its source thread is inside ``next`` and iterating
    again: the new pass calls ``iter`` only once that ``next`` returned (a DataLoader with
    persistent workers raised ``Invalid iterator state``, a generator ``already
    executing``)."""
    data = batches(6)
    gate = Gate()
    source = SharedSource(data, gate, 2)
    got: list[torch.Tensor] = []
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, source, "cuda:0", prefetch=1, ring=ring) as loader:
            async for _batch in loader:
                break
            del _batch
            old = loader._epoch
            await anyio.to_thread.run_sync(gate.reached.wait)  # the old thread is in next

            async def second_pass() -> None:
                async for batch in loader:
                    got.append(batch.clone())

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(second_pass)
                with anyio.fail_after(5):
                    while True:
                        if source.iters == 2:
                            break  # the new pass iterates already, beside the old next
                        await anyio.wait_all_tasks_blocked()
                        if loader._epoch is old and old is not None and old.status == "closed":
                            break  # the new pass waits for the old thread
                        await anyio.sleep(0.001)
                gate.open.set()
        assert_nothing_left(m)
    assert source.overlaps == 0
    assert source.iters == 2
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True)) and len(got) == 6


# ---------------------------------------------------------------------- a pass that ends


async def test_a_pass_run_to_its_end_gives_its_slots_back(ring: bool | None) -> None:
    """``async for batch in DeviceLoader(...)`` to the end, with no ``async with``: the
    pass's slots return to the budget (the ring kept them until the next pass or aclose:
    for as long as the manager lived), so a next loader under the same budget gets room."""
    budget = 3 * 1024  # the three slots (prefetch=2) of one loader
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend()) as m:
        for round_ in range(3):
            data = batches(5, seed=round_)
            got = []
            with anyio.fail_after(5):
                async for batch in DeviceLoader(m, data, "cuda:0", prefetch=2, ring=ring):
                    got.append(batch.clone())
            assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        await until(lambda: nothing_charged(m))
        assert_nothing_left(m)


# ---------------------------------------------------------------------- a dropped iterator


async def test_a_break_without_async_with_gives_everything_back(ring: bool | None) -> None:
    """``async for batch in DeviceLoader(...): break`` (the form in the contract): the
    dropped iterator ends its pass, as an async generator's finalizer would: the source's
    thread stops (a generator's ``finally`` runs), nothing stays charged."""
    closed = threading.Event()

    def source() -> Iterator[torch.Tensor]:
        try:
            yield from batches(50)
        finally:
            closed.set()

    async with ResidencyManager(backend=SimBackend()) as m:
        loader = DeviceLoader(m, source(), "cuda:0", prefetch=2, ring=ring)
        async for batch in loader:
            if batch.sum() != 0:
                break
        del batch
        await until(lambda: not loader_threads(loader) and closed.is_set())
        await until(lambda: nothing_charged(m))
        assert_nothing_left(m)


async def test_an_exception_in_the_body_without_async_with_gives_everything_back(
    ring: bool | None,
) -> None:
    async with ResidencyManager(backend=SimBackend()) as m:
        loader = DeviceLoader(m, batches(50), "cuda:0", prefetch=2, ring=ring)
        with pytest.raises(ValueError, match="step failed"):
            async for batch in loader:
                if batch.sum() != 0:
                    raise ValueError("step failed")
        await until(lambda: not loader_threads(loader))
        await until(lambda: nothing_charged(m))
        assert_nothing_left(m)


async def test_a_break_inside_async_with_ends_the_pass_at_once(ring: bool | None) -> None:
    """Breaking out inside ``async with loader``: the pass ends when the loop is left (its
    source's ``finally`` runs then), not only when the block ends."""
    closed = threading.Event()

    def source() -> Iterator[torch.Tensor]:
        try:
            yield from batches(50)
        finally:
            closed.set()

    async with (
        ResidencyManager(backend=SimBackend()) as m,
        DeviceLoader(m, source(), "cuda:0", prefetch=2, ring=ring) as loader,
    ):
        async for _batch in loader:
            break
        del _batch
        await until(closed.is_set)
        await loader.drain()
        await until(lambda: nothing_charged(m))
        assert_nothing_left(m)


# ---------------------------------------------------------------- errors that must not hide


class _SourceError(Exception):
    pass


class _AsyncSourceThatCannotStart:
    """An async iterable whose ``__aiter__`` itself raises (a client that cannot connect)."""

    def __aiter__(self) -> Any:
        raise _SourceError("the source cannot start")


async def test_an_async_source_that_cannot_start_gives_the_consumer_its_error(
    ring: bool | None,
) -> None:
    async with ResidencyManager(backend=SimBackend()) as m:
        with anyio.fail_after(10), pytest.raises(_SourceError, match="cannot start"):
            async with DeviceLoader(m, _AsyncSourceThatCannotStart(), "cuda:0", ring=ring) as L:
                async for _ in L:
                    pytest.fail("a batch from a source that never started")
        assert_nothing_left(m)


async def test_a_failing_task_of_the_loader_ends_the_block_with_its_error_not_a_cancellation(
    ring: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's task group cancels the block's body when one of its tasks fails; leaving
    the block must raise that task's error, never the cancellation (which would look to the
    caller as if it had been cancelled from outside)."""
    from aresidency.loader import pipeline
    from aresidency.loader import ring as ring_module

    async def broken_feed(*args: Any, **kwargs: Any) -> None:
        raise _SourceError("the feeding task failed")

    monkeypatch.setattr(pipeline, "feed_async", broken_feed)
    monkeypatch.setattr(ring_module, "feed_async", broken_feed)

    async def source() -> Any:
        yield torch.ones(4)

    async with ResidencyManager(backend=SimBackend()) as m:
        with anyio.fail_after(10), pytest.raises(_SourceError, match="feeding task failed"):
            async with DeviceLoader(m, source(), "cuda:0", ring=ring) as loader:
                async for _ in loader:
                    pass
        assert_nothing_left(m)


async def test_a_cancelled_wait_for_a_batch_is_not_taken_for_the_end_of_the_source(
    ring: bool | None,
) -> None:
    """A deadline around one ``anext`` that expires ends the pass (everything it held is given
    back); the same iterator must then say so, not end quietly as if the source had run out."""
    data = batches(6)
    gate = Gate()
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, gated(data, gate, 2), "cuda:0", prefetch=2, ring=ring) as L:
            it = aiter(L)
            first = [(await anext(it)).clone(), (await anext(it)).clone()]
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(anext, it)  # waits for batch 2, held at the gate
                    await anyio.to_thread.run_sync(gate.reached.wait, 10)
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
            gate.open.set()
            assert scope.cancelled_caught
            with pytest.raises(RuntimeError, match="cancelled, after 2 batch") as raised:
                await anext(it)
            assert "the rest of the source was not read" in str(raised.value)
            with pytest.raises(RuntimeError, match="ended when a wait"):  # and again
                await anext(it)
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(first, data, strict=False))


# ---------------------------------------------------------------- what a loader keeps alive


class _Source:
    """A synchronous or async source a weak reference can watch (a list cannot be one)."""

    def __init__(self, data: list[torch.Tensor]) -> None:
        self.data = data

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.data)


class _AsyncSource(_Source):
    async def _batches(self) -> AsyncIterator[torch.Tensor]:
        for batch in self.data:
            await anyio.lowlevel.checkpoint()
            yield batch

    def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        return self._batches()


@contextlib.contextmanager
def _no_collector() -> Iterator[None]:
    """What reference counting alone frees (the collector may never run: ``gc.freeze()``)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("kind", ["sync", "async", "staged"])
async def test_a_closed_loader_and_its_source_go_as_soon_as_they_are_dropped(
    kind: str, ring: bool | None, tmp_path: Path
) -> None:
    """After ``async with DeviceLoader(...)`` ended (two passes), the loader and its source
    go when the application drops them, by reference counting alone: no cycle loader ->
    pass -> loader keeps them (and a persistent ``DataLoader``'s worker processes) alive
    until a collection that may never come."""
    from .test_shards import write_safetensors

    data = batches(5)
    source: Any
    if kind == "staged":
        source = ShardSource(write_safetensors(tmp_path)[0], batch_size=4)
    else:
        source = _Source(data) if kind == "sync" else _AsyncSource(data)
    async with ResidencyManager(backend=SimBackend()) as m:
        with _no_collector():
            gone = weakref.ref(source)
            async with DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring) as loader:
                for _ in range(2):
                    async for _batch in loader:
                        pass
            loader_gone = weakref.ref(loader)
            if kind == "staged":
                source.close()
            del loader, source, _batch
            assert loader_gone() is None
            assert gone() is None
        assert_nothing_left(m)


async def test_a_loader_whose_pass_ran_to_its_end_goes_with_its_source_when_dropped(
    ring: bool | None,
) -> None:
    """``async for batch in DeviceLoader(...)`` to the end, no ``async with``: once the pass
    ended (it finished: nothing left to give back), dropping the loader frees it and its
    source by reference counting alone."""
    source = _Source(batches(5))
    async with ResidencyManager(backend=SimBackend()) as m:
        with _no_collector():
            gone = weakref.ref(source)
            loader = DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring)
            async for _batch in loader:
                pass
            await loader.drain()  # the pass finished: its slots, or values, gone
            loader_gone = weakref.ref(loader)
            del loader, source, _batch
            assert loader_gone() is None
            assert gone() is None
        assert_nothing_left(m)
