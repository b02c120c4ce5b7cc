"""``DeviceLoader`` on the simulated backend (a simulation of CUDA devices in host memory: its
copies run on worker threads, optionally throttled with ``copy_gbps``; memory it frees is
poisoned, so a batch used after its release shows NaN).

Every batch is compared bit for bit with what the source yielded; the device budget is checked
by replaying the manager's trace; after every way a pass can end, nothing may be leased, held,
charged or registered."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from aresidency import (
    MemoryReservation,
    ResidencyBudgetError,
    ResidencyManager,
    ResidencyPlan,
)
from aresidency.backends import is_poisoned
from aresidency.backends.sim import SimBackend
from aresidency.core.errors import format_bytes
from aresidency.core.locations import Location
from aresidency.loader import DeviceBatch, DeviceLoader, LoaderStats

from ._support import (
    AheadProbe,
    Gate,
    KiB,
    assert_nothing_left,
    batches,
    gated,
    max_charge,
    until,
)

pytestmark = pytest.mark.anyio

CHARGE = 1 * KiB  # what a 256-float batch costs at the device (1024 B, a multiple of 512)


def sim(copy_gbps: float | None = None) -> SimBackend:
    return SimBackend(copy_gbps=copy_gbps)


async def collect(loader: DeviceLoader) -> list[Any]:
    """Every batch of one pass, cloned (the loader's tensors are released at the next step)."""
    out = []
    async for batch in loader:
        out.append(_clone(batch))
    return out


def _clone(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_clone(v) for v in batch)
    return batch


# ---------------------------------------------------------------- order and identity


async def test_batches_arrive_in_source_order_and_bit_identical(ring: bool | None) -> None:
    data = batches(12)
    async with ResidencyManager(backend=sim(copy_gbps=2.0)) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=3, ring=ring) as loader:
            seen = []
            async for batch in loader:
                assert str(m.backend.location_of(batch)) == "cuda:0"
                seen.append(batch.clone())
            assert [s.view(torch.int32).tolist() for s in seen] == [
                d.view(torch.int32).tolist() for d in data
            ]
            stats = loader.stats()
            assert (stats.batches, stats.bytes) == (12, 12 * 1024)
        assert_nothing_left(m)


async def test_the_source_tensors_are_left_as_they_were(ring: bool | None) -> None:
    data = batches(5)
    before = [d.clone() for d in data]
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, data, "cuda:0", ring=ring) as loader:
            await collect(loader)
        assert all(torch.equal(a, b) for a, b in zip(data, before))


Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass(frozen=True)
class Example:
    image: torch.Tensor
    label: torch.Tensor
    note: str
    cached: Any = dataclasses.field(default=None, init=False)


async def test_nested_structures_come_back_with_their_types_and_non_tensor_leaves() -> None:
    x, y, z = batches(3, 16)
    shared = torch.arange(4)
    counts: defaultdict[str, Any] = defaultdict(list)
    counts["a"] = torch.ones(2)
    batch = {
        "pair": Pair(x, [y, (z, "tag", 3)]),
        "example": Example(x + 1, torch.tensor(7), "seven"),
        "ordered": OrderedDict(b=shared, a=shared),
        "counts": counts,
        "none": None,
        "plain": [1.5, "text"],
    }
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, [batch], "cuda:0", ring=False) as loader:
            async for got in loader:
                assert isinstance(got["pair"], Pair)
                assert torch.equal(got["pair"].left, x)
                assert torch.equal(got["pair"].right[0], y)
                assert isinstance(got["pair"].right[1], tuple)
                assert torch.equal(got["pair"].right[1][0], z)
                assert got["pair"].right[1][1:] == ("tag", 3)
                assert isinstance(got["example"], Example)
                assert got["example"].note == "seven" and got["example"].label.item() == 7
                assert str(m.backend.location_of(got["example"].image)) == "cuda:0"
                assert isinstance(got["ordered"], OrderedDict)
                assert list(got["ordered"]) == ["b", "a"]
                # the same tensor twice is one value, copied once: still one tensor
                assert got["ordered"]["a"] is got["ordered"]["b"]
                assert isinstance(got["counts"], defaultdict)
                assert got["counts"].default_factory is list
                assert got["none"] is None and got["plain"] == [1.5, "text"]
                handles = [v.handle.name for v in m.state.values()]
                assert len(handles) == 7  # x, y, z, x + 1, 7, shared, ones
        assert_nothing_left(m)


async def test_a_bare_tensor_batch_is_handed_out_as_a_tensor(ring: bool | None) -> None:
    data = batches(3)
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, iter(data), "cuda:0", ring=ring) as loader,
    ):
        got = await collect(loader)
    assert all(torch.equal(a, b) for a, b in zip(got, data))


async def test_torch_result_tuples_in_a_batch_keep_their_type_and_field_names(
    ring: bool | None,
) -> None:
    # A collate_fn that keeps what torch.sort / torch.max return (structseqs: tuples with
    # named fields that take exactly their items): the batch came back with plain tuples,
    # without .values and .indices, because the type was probed with an empty tuple.
    scores = [torch.randn(4, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    data = [{"sorted": torch.sort(s, dim=1), "best": torch.max(s, dim=1)} for s in scores]
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring) as loader:
            seen = 0
            async for batch in loader:
                for key in ("sorted", "best"):
                    got, want = batch[key], data[seen][key]
                    assert type(got) is type(want)
                    assert str(m.backend.location_of(got.values)) == "cuda:0"
                    assert torch.equal(got.values, want.values)
                    assert torch.equal(got.indices, want.indices)
                seen += 1
            assert seen == 3
        assert_nothing_left(m)


async def test_views_into_a_larger_tensor_are_copied_to_memory_of_their_own() -> None:
    big = torch.randn(10, 64)
    rows = [big[i : i + 2] for i in range(0, 10, 2)]
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, rows, "cuda:0", ring=False) as loader,
    ):
        got = await collect(loader)
        assert loader.stats().host_copies == 5
    assert torch.equal(torch.cat(got), big)


@pytest.mark.parametrize("source", ["sync", "async"])
async def test_a_tensor_the_application_registered_is_copied_into_its_batch(
    ring: bool | None, source: str
) -> None:
    # A batch may hold a tensor whose storage the application registered with the manager
    # itself (an embedding table, a mask): the batch gets a copy of it (a value of its own),
    # and the application's value is left where it was, untouched.
    data = batches(3, 64)
    table = torch.randn(32)
    items = [{"x": x, "table": table} for x in data]

    async def agen() -> Any:
        for item in items:
            yield item

    async with ResidencyManager(backend=sim()) as m:
        handle = m.register(table, name="app-table")
        loader = DeviceLoader(m, items if source == "sync" else agen(), "cuda:0", ring=ring)
        async with loader:
            got = [(b["x"].clone(), b["table"].clone()) async for b in loader]
            if ring is False:
                assert loader.stats().host_copies == 3  # one per batch: the table
        assert [str(loc) for loc in m.snapshot().value(handle).locations] == ["pageable-host"]
        assert [v.handle.name for v in m.state.values()] == ["app-table"]
        await m.discard(handle)
        assert_nothing_left(m)
    assert all(torch.equal(x, a) and torch.equal(t, table) for (x, t), a in zip(got, data))


@pytest.mark.parametrize("source", ["sync", "async"])
async def test_a_tensor_another_loader_registered_after_the_source_read_it_is_copied(
    source: str,
) -> None:
    # Two loaders through managed values over the same tensors: the source's thread saw
    # batch 0's tensor unregistered, then the other loader registered it (its copy still in
    # flight) while the batch waited for room. Its registration was refused ("this tensor's
    # storage already belongs to value ...") and the pass failed; the batch gets a copy, as
    # if it had been seen.
    data = batches(2)

    async def agen() -> Any:
        for x in data:
            yield x

    backend = SimBackend(num_devices=2)
    gate = threading.Event()
    backend.device_streams(1).h2d.submit(lambda: gate.wait(10))  # holds the other's copies
    async with ResidencyManager(budgets={"cuda:0": 2 * CHARGE}, backend=backend) as m:
        first = DeviceLoader(m, data if source == "sync" else agen(), "cuda:0", ring=False)
        other = DeviceLoader(m, data, "cuda:1", ring=False)
        got: dict[str, list[torch.Tensor]] = {"first": [], "other": []}

        async def consume(loader: DeviceLoader, into: list[torch.Tensor]) -> None:
            try:
                into.extend([b.clone() async for b in loader])
            finally:
                gate.set()  # the first loader's pass ended: the other's copies may land

        with anyio.fail_after(10):
            async with first, other, anyio.create_task_group() as tasks:
                hog = m.reservation("hog", "cuda:0", 2 * CHARGE)  # all of cuda:0, for a while
                async with hog:
                    tasks.start_soon(consume, first, got["first"])
                    await until(lambda: first.stats().source_batches >= 1)  # waits for room
                    tasks.start_soon(consume, other, got["other"])
                    # (the first registers nothing while the hog holds its room)
                    await until(lambda: all(m.storage_owner(t) is not None for t in data))
        assert first.stats().host_copies == 2  # both tensors: the other's, copies held up
        assert_nothing_left(m)
    for tensors in got.values():
        assert len(tensors) == 2 and all(map(torch.equal, tensors, data))


async def test_a_source_that_hands_out_the_same_tensor_again_gets_it_each_time(
    ring: bool | None,
) -> None:
    static = torch.randn(256)
    async with ResidencyManager(backend=sim(copy_gbps=1.0)) as m:
        async with DeviceLoader(m, [static] * 6, "cuda:0", prefetch=3, ring=ring) as loader:
            got = await collect(loader)
        assert_nothing_left(m)
    assert len(got) == 6 and all(torch.equal(g, static) for g in got)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_batch_the_source_changed_after_yielding_it_raises_at_its_place(
    kind: str, ring: bool | None
) -> None:
    """The source yields batch 2, then (before the loader copied it: ``prefetch=0`` copies a
    batch only when asked) its tensor is changed in place: batch 2 raises, naming itself and
    the tensor, instead of handing out what the source never yielded."""
    data = [{"x": torch.full((256,), float(i)), "i": i} for i in range(5)]
    yielded = threading.Event()  # set once the source is asked for batch 3 (2 was prepared)

    def sync_source() -> Iterator[dict[str, Any]]:
        for i, batch in enumerate(data):
            if i == 3:
                yielded.set()
            yield batch

    async def async_source() -> AsyncIterator[dict[str, Any]]:
        for batch in sync_source():
            await anyio.lowlevel.checkpoint()
            yield batch

    source = sync_source() if kind == "sync" else async_source()
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, source, "cuda:0", prefetch=0, read_ahead=4, ring=ring) as ld:
            got = []
            with pytest.raises(RuntimeError) as info:
                async for batch in ld:
                    got.append(_clone(batch))
                    if batch["i"] == 1:
                        with anyio.fail_after(10):
                            await anyio.to_thread.run_sync(yielded.wait)
                        data[2]["x"].add_(100.0)  # written to after the source yielded it
        assert "batch 2 was changed in place after the source yielded it" in str(info.value)
        assert "['x'] went from version 0 to 1" in str(info.value)
        assert [g["i"] for g in got] == [0, 1]
        assert all(torch.equal(g["x"], data[g["i"]]["x"]) for g in got)
        assert_nothing_left(m)


async def test_a_tensor_the_manager_refuses_as_a_value_is_named_by_its_batch_and_place() -> None:
    """Through managed values each tensor is registered: one that is a device value's memory
    is refused with the manager's message, and a note names the batch and the tensor (a host
    value's is copied: see the test above)."""
    async with ResidencyManager(backend=sim()) as m:
        other = m.register(torch.arange(8.0), name="w", location="cuda:0")
        async with m.acquire(other, "cuda:0") as lease:
            source = [{"ok": torch.ones(4)}, {"y": torch.ones(2), "x": lease.tensor}]
            async with DeviceLoader(m, source, "cuda:0", ring=False) as loader:
                with pytest.raises(ValueError, match="already belongs to value w") as info:
                    async for _ in loader:
                        pass
        notes = "".join(getattr(info.value, "__notes__", []))
        assert "the tensor at ['x'] of batch 1 could not be registered" in notes
        await m.discard(other)
        assert_nothing_left(m)


async def test_inference_mode_tensors_without_a_version_counter_are_loaded(
    ring: bool | None,
) -> None:
    with torch.inference_mode():
        data = [torch.full((256,), float(i)) for i in range(4)]
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2, ring=ring) as loader:
            got = await collect(loader)
        assert_nothing_left(m)
    assert len(got) == 4 and all(torch.equal(g, d) for g, d in zip(got, data))


# ---------------------------------------------------------------- DataLoader sources


class Numbered(Dataset[dict[str, Any]]):
    """Sample i: a vector of i's, its index, and a name (collated into a list of str)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": torch.full((32,), float(index)), "i": index, "name": f"s{index}"}


@pytest.mark.parametrize(
    "workers",
    [
        0,
        # Forking a worker holds the interpreter lock while the process is copied: tens of
        # milliseconds per worker, past the guard's 100 ms on a loaded 2-core machine. That is
        # the DataLoader's stall, not the loader's (the case without workers is guarded fully).
        pytest.param(2, marks=pytest.mark.allow_loop_stall(1.0)),
    ],
)
async def test_a_dataloader_is_a_source_with_or_without_workers(
    workers: int, ring: bool | None
) -> None:
    dataloader = DataLoader(Numbered(), batch_size=4, num_workers=workers)
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, dataloader, "cuda:0", prefetch=2, ring=ring) as loader:
            assert len(loader) == 6
            for _epoch in range(2):  # a DataLoader is iterated again for each pass
                got = await collect(loader)
                assert [b["name"] for b in got] == [
                    [f"s{i}" for i in range(k, k + 4)] for k in range(0, 24, 4)
                ]
                assert torch.equal(torch.cat([b["i"] for b in got]), torch.arange(24))
                expected = torch.arange(24, dtype=torch.float32)[:, None].expand(24, 32)
                assert torch.equal(torch.cat([b["x"] for b in got]), expected)
            assert loader.stats().epochs == 2
        assert_nothing_left(m)


# ---------------------------------------------------------------- budgets and prefetch


async def test_prefetch_bounds_the_batches_copied_ahead_of_the_consumer() -> None:
    data = batches(16)
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=3, ring=False) as loader:
            probe = AheadProbe(m, loader)
            async for _batch in loader:
                # Hold each batch until the loader has filled its window (three ahead, or
                # what is left) and those copies completed: the probe then shows it never went
                # further, and the next hand-out, which no copy completes after, must refill
                # the window by itself while this step runs.
                left = 16 - loader.stats().batches
                with anyio.fail_after(5):
                    while probe.ahead(complete=True) < min(3, left):
                        await m.wait_for_change()
        probe.close()
    assert probe.most == 3


async def test_prefetch_zero_copies_each_batch_only_when_asked() -> None:
    async with ResidencyManager(backend=sim()) as m:
        got = []
        async with DeviceLoader(m, batches(6), "cuda:0", prefetch=0, ring=False) as loader:
            probe = AheadProbe(m, loader)
            async for batch in loader:
                got.append(batch.clone())
                # Give the loader every chance to copy ahead: it must not.
                await anyio.wait_all_tasks_blocked()
                assert probe.ahead() == 0
        probe.close()
        assert probe.most == 1
    assert len(got) == 6


async def test_a_budget_smaller_than_the_prefetch_window_is_never_exceeded() -> None:
    data = batches(20)
    budget = 3 * CHARGE
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=sim(copy_gbps=1.0)) as m:
        got = []
        async with DeviceLoader(m, data, "cuda:0", prefetch=8, ring=False) as loader:
            probe = AheadProbe(m, loader)
            async for batch in loader:
                got.append(batch.clone())
                # The loop variable would hold this batch's tensors while the next is fetched
                # (torch counts memory until its last reference dies; docs/loader.md).
                del batch
                with anyio.fail_after(5):  # the window must fill while the step runs
                    while probe.ahead() < 2 and loader.stats().source_batches < 20:
                        await m.wait_for_change()
        probe.close()
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        # the memory really allocated (simulated, counted as torch counts it) too
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert max_charge(m.trace()) <= budget
        # The budget (three batches: all ahead while the consumer waits with none in hand),
        # not prefetch=8, was the limit.
        assert probe.most == 3
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data))


async def test_the_loader_waits_for_another_tenant_and_never_exceeds_the_shared_budget() -> None:
    data = batches(24)
    budget = 4 * CHARGE
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=sim()) as m:
        entered = anyio.Event()
        leave = anyio.Event()
        plan = ResidencyPlan(reserve=[MemoryReservation("tenant", "cuda:0", 3 * CHARGE)])

        async def tenant() -> None:
            async with m.scope(plan):
                entered.set()
                await leave.wait()

        got = []
        async with (
            anyio.create_task_group() as tasks,
            DeviceLoader(m, data, "cuda:0", prefetch=3, ring=False) as loader,
        ):
            async for batch in loader:
                got.append(batch.clone())
                # The loop variable would hold this batch's tensors while the next is fetched
                # (torch counts memory until its last reference dies; docs/loader.md).
                del batch
                if len(got) == 2:
                    # The loader holds the whole budget now: the scope queues for room
                    # and the loader, which never overtakes it, lets it in.
                    tasks.start_soon(tenant)
                if len(got) == 12:
                    assert entered.is_set()
                    assert m.snapshot().location("cuda:0").reserved_bytes == 3 * CHARGE
                    leave.set()
            stats = loader.stats()
        assert max_charge(m.trace()) <= budget
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        # the memory really allocated (simulated, counted as torch counts it) too
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert stats.wait_budget_s > 0
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data))


async def test_a_reservation_held_for_a_while_only_narrows_the_window() -> None:
    data = batches(10)
    budget = 3 * CHARGE
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=sim()) as m:
        workspace = m.reservation("workspace", "cuda:0", 2 * CHARGE)
        await workspace.__aenter__()
        async with DeviceLoader(m, data, "cuda:0", prefetch=4, ring=False) as loader:
            probe = AheadProbe(m, loader)
            got = []
            iterator = aiter(loader)
            for _ in range(3):  # room for the batch in use only: nothing ahead of it
                got.append((await anext(iterator)).clone())
                await anyio.wait_all_tasks_blocked()
                assert probe.ahead() == 0
            await workspace.__aexit__(None, None, None)
            async for batch in iterator:
                got.append(batch.clone())
                with anyio.fail_after(5):  # the window must fill while the step runs
                    while probe.ahead() < 2 and loader.stats().source_batches < 10:
                        await m.wait_for_change()
            assert 2 <= probe.most <= 3  # with the room back, the window opened up
        probe.close()
        assert max_charge(m.trace()) <= budget
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data))


async def test_a_batch_larger_than_the_whole_budget_fails_with_the_arithmetic(
    ring: bool | None,
) -> None:
    data = [torch.randn(256), torch.randn(256), torch.randn(4096)]
    async with (
        ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend=sim()) as m,
        DeviceLoader(m, data, "cuda:0", ring=ring) as loader,
    ):
        got = []
        with pytest.raises(ResidencyBudgetError) as info:
            async for batch in loader:
                got.append(batch.clone())
        assert len(got) == 2  # the batches before it were handed out
        error = info.value
        assert error.requested_bytes == 16 * KiB and error.budget_bytes == 8 * KiB
        assert "batch 2" in str(error) and "could never be copied" in str(error)
        # Freeing room cannot help (even an empty device would not hold it): the message says
        # what would, and the fields stay the arithmetic.
        assert "free " not in str(error) and "release or move" not in str(error)
        assert (
            "; it can never fit under this budget, even with nothing else charged at cuda:0: "
            f"raise the budget to at least {format_bytes(16 * KiB)}, or make the "
        ) in str(error)
        assert str(error).endswith(", a smaller batch size)")
        assert error.location == Location.parse("cuda:0") and error.handle is None
        assert_nothing_left(m)


async def test_a_batch_waiting_for_room_longer_than_the_timeout_raises_timeout_error(
    ring: bool | None,
) -> None:
    # Another task holds the room (its block ends on its own: the wait could end).
    async with ResidencyManager(budgets={"cuda:0": 2 * CHARGE}, backend=sim()) as m:
        holding, done = anyio.Event(), anyio.Event()

        async def hog() -> None:
            async with m.reservation("hog", "cuda:0", 2 * CHARGE):
                holding.set()
                await done.wait()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(hog)
            await holding.wait()
            async with DeviceLoader(m, batches(3), "cuda:0", timeout=0.05, ring=ring) as loader:
                with pytest.raises(TimeoutError, match=r"waited 0\.05 s for room at cuda:0"):
                    await collect(loader)
                assert loader.stats().wait_budget_s > 0  # it waited for room, not the source
            done.set()
        assert_nothing_left(m)


@pytest.mark.parametrize("prefetch", [0, 1])
async def test_timeout_zero_does_not_count_the_wait_for_the_consumers_own_released_batches(
    ring: bool | None, prefetch: int
) -> None:
    # A budget of exactly prefetch + 1 batches (what docs/loader.md says the loader needs) and
    # timeout=0 (never wait for room that others hold). The next batch's room is the one the
    # consumer's own previous batch leaves once the device passed its step: through managed
    # values that wait raised TimeoutError at the second batch; through the ring, the slot
    # the consumer had just released was taken for a wait for room ("batch ? ... needs 0 B").
    # (The ring's race, between its thread taking that slot and the consumer's judging of the
    # wait, is lost in most passes of a dozen batches with steps that enqueue nothing.)
    data = batches(12)
    budget = (prefetch + 1) * CHARGE
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=sim()) as m:
        async with DeviceLoader(
            m, data, "cuda:0", prefetch=prefetch, timeout=0, ring=ring
        ) as loader:
            for number in range(3):
                seen = []
                async for batch in loader:
                    seen.append(batch.clone())
                    if number == 0:  # a step the device takes a while to run
                        step = m.backend.current_stream("cuda:0")
                        m.backend.run_in_stream_order(step, functools.partial(time.sleep, 0.005))
                assert [s.tolist() for s in seen] == [d.tolist() for d in data]
        assert max_charge(m.trace()) <= budget
        assert_nothing_left(m)


async def test_a_batch_that_only_the_consumers_own_holdings_keep_out_fails_at_once(
    ring: bool | None,
) -> None:
    # The consumer's own task holds the room (a reservation block, or a scope), which ends
    # only when it goes on: the batch fails at once, naming what the task holds, even with
    # no timeout.
    async with ResidencyManager(budgets={"cuda:0": 2 * CHARGE}, backend=sim()) as m:
        for holding in ("block", "scope"):
            held = (
                m.reservation("hog", "cuda:0", 2 * CHARGE)
                if holding == "block"
                else m.scope(
                    ResidencyPlan(reserve=[MemoryReservation("hog", "cuda:0", 2 * CHARGE)])
                )
            )
            async with held, DeviceLoader(m, batches(3), "cuda:0", ring=ring) as loader:
                with anyio.fail_after(10), pytest.raises(ResidencyBudgetError) as info:
                    await collect(loader)
            message = str(info.value)
            assert "batch 0 of" in message, message
            assert "only what the waiting task holds itself" in message, message
            assert ("reservation block" if holding == "block" else "entered scope") in message
        assert_nothing_left(m)


async def test_keeping_more_batches_than_the_budget_holds_is_an_error_not_a_hang(
    ring: bool | None,
) -> None:
    """The consumer keeps every batch in an open ``async with`` (as gradient accumulation
    might): the fourth cannot fit a budget of three while its own task keeps the first three,
    and only that task can release them. It gets a ``ResidencyBudgetError`` naming the kept
    batches, with ``timeout=None`` too (it waited forever), and nothing is left behind."""
    async with ResidencyManager(budgets={"cuda:0": 3 * CHARGE}, backend=sim()) as m:
        kept: list[DeviceBatch] = []
        async with DeviceLoader(m, batches(8), "cuda:0", prefetch=2, ring=ring) as loader:
            with anyio.fail_after(10), pytest.raises(ResidencyBudgetError) as info:
                async for batch in loader.batches():
                    await batch.__aenter__()
                    kept.append(batch)
            message = str(info.value)
            assert "batch 3 of" in message and "keeps 3 earlier batch(es)" in message, message
            assert "#0, #1, #2" in message, message
            assert info.value.budget_bytes == 3 * CHARGE
            assert all(batch.released for batch in kept)  # the failed pass released them
            for batch in kept:
                await batch.__aexit__(None, None, None)
        assert [b.index for b in kept] == [0, 1, 2]
        assert_nothing_left(m)


@pytest.mark.parametrize("bound", ["fail_after_each_anext", "loader_timeout"])
async def test_a_bounded_wait_in_the_consuming_task_still_refuses_what_it_keeps_at_once(
    ring: bool | None, bound: str
) -> None:
    """The forms docs/loader.md gives instead of asyncio.wait_for(anext(it), t) (which, on
    Python 3.11, asks in a task of its own, so the kept batches look like a worker's): a
    deadline around each anext() in the consuming task, or the loader's own timeout=. Either
    way the wait is the keeping task's, and it is refused at once, not at the deadline."""
    async with ResidencyManager(budgets={"cuda:0": 3 * CHARGE}, backend=sim()) as m:
        kept: list[DeviceBatch] = []
        timeout = 60.0 if bound == "loader_timeout" else None
        async with DeviceLoader(
            m, batches(8), "cuda:0", prefetch=2, ring=ring, timeout=timeout
        ) as loader:
            it = aiter(loader.batches())
            with pytest.raises(ResidencyBudgetError) as info:
                for _ in range(4):
                    if bound == "fail_after_each_anext":
                        with anyio.fail_after(60):
                            batch = await anext(it)
                    else:
                        batch = await anext(it)
                    await batch.__aenter__()
                    kept.append(batch)
            assert "keeps 3 earlier batch(es)" in str(info.value)
            for batch in kept:
                await batch.__aexit__(None, None, None)
        assert_nothing_left(m)


async def test_batches_kept_by_another_task_are_waited_for(ring: bool | None) -> None:
    """The same keeping, but by a worker task the consumer hands each batch to (three at a
    time, then it releases them): the worker can release them while the consumer waits for
    room, so the consumer waits (no error) and every batch arrives, in order."""
    async with ResidencyManager(budgets={"cuda:0": 3 * CHARGE}, backend=sim()) as m:
        send, receive = anyio.create_memory_object_stream[tuple[DeviceBatch, anyio.Event]](8)
        done: list[int] = []

        async def worker() -> None:
            held: list[DeviceBatch] = []

            async def release_held() -> None:
                for kept in held:
                    done.append(kept.index)
                    await kept.__aexit__(None, None, None)
                held.clear()

            async with receive:
                async for batch, entered in receive:
                    await batch.__aenter__()
                    entered.set()
                    held.append(batch)
                    if len(held) == 3:
                        await anyio.wait_all_tasks_blocked()  # the consumer waits for room
                        await release_held()
                await release_held()

        async with DeviceLoader(m, batches(8), "cuda:0", prefetch=2, ring=ring) as loader:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(worker)
                    async with send:
                        async for batch in loader.batches():
                            entered = anyio.Event()
                            await send.send((batch, entered))
                            await entered.wait()  # the worker keeps it now
        assert done == list(range(8))
        assert_nothing_left(m)


async def test_two_loaders_consumed_by_two_tasks_wait_for_each_others_batches(
    ring: bool | None,
) -> None:
    """Two loaders of one budget that holds one batch, each consumed by a task of its own:
    each consumer waits for the room the other's batch holds (the other releases it at its
    next step). A pass's pump runs in whichever task made a change, here the task that gave
    the room back: loader A's batch taken in that task's change was counted as that task's
    own, so its own wait for loader B's batch was refused as waiting on itself."""
    data_a, data_b = batches(4, seed=1), batches(4, seed=2)
    got_a: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []
    go = anyio.Event()
    async with ResidencyManager(budgets={"cuda:0": CHARGE}, backend=sim()) as m:
        async with (
            DeviceLoader(m, data_a, "cuda:0", prefetch=0, ring=ring, name="A") as loader_a,
            DeviceLoader(m, data_b, "cuda:0", prefetch=0, ring=ring, name="B") as loader_b,
        ):

            async def consume_a() -> None:
                async for batch in loader_a:
                    got_a.append(batch.clone())
                    await go.wait()  # A's first step lasts until B's consumer waits

            async def let_a_go() -> None:
                await anyio.wait_all_tasks_blocked()  # B's consumer waits for A's room
                go.set()

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    async with m.reservation("step", "cuda:0", CHARGE):
                        tasks.start_soon(consume_a)
                        await anyio.wait_all_tasks_blocked()  # A's consumer waits for room
                    # The room given back here went to A's batch 0, in this task's change.
                    tasks.start_soon(let_a_go)
                    async for batch in loader_b:
                        got_b.append(batch.clone())
        assert [t.tolist() for t in got_a] == [t.tolist() for t in data_a]
        assert [t.tolist() for t in got_b] == [t.tolist() for t in data_b]
        assert_nothing_left(m)


async def _hold_in_a_worker(
    loader: DeviceLoader, data: list[torch.Tensor], passes: int, seen: list[tuple[int, bool, bool]]
) -> None:
    """The hand-to-a-worker pattern: this task iterates ``passes`` passes of ``loader`` and
    hands each batch to a worker task, which keeps it in ``async with batch as data:``. The
    last batch of each pass stays kept until this task went on past that pass's end: the
    first batch of the next pass handed out, or (the last pass) the loop left. ``seen``: for
    each batch kept, ``(index, released, intact)`` just before its block ends, after the
    device passed every release (``drain``)."""
    send, receive = anyio.create_memory_object_stream[
        tuple[DeviceBatch, anyio.Event, anyio.Event | None]
    ](8)

    async def worker() -> None:
        async with receive:
            async for batch, entered, hold in receive:
                async with batch as got:
                    entered.set()
                    if hold is not None:
                        await hold.wait()
                    await loader.drain()
                    seen.append((batch.index, batch.released, torch.equal(got, data[batch.index])))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(worker)
        async with send:
            held: anyio.Event | None = None  # the last batch of the pass before: kept
            for _ in range(passes):
                async for batch in loader.batches():
                    if held is not None:
                        held.set()  # a new pass began and handed out its first batch
                        held = None
                    entered = anyio.Event()
                    hold = anyio.Event() if batch.index == len(data) - 1 else None
                    await send.send((batch, entered, hold))
                    await entered.wait()  # the worker keeps it now
                    held = hold or held
            # The last pass ended (its source ran out); the worker still keeps its last batch.
            assert loader.stats().batches == passes * len(data)
            assert held is not None
            held.set()


@pytest.mark.parametrize("passes", [1, 2], ids=["the-source-ends", "a-new-pass-starts"])
async def test_the_end_of_the_source_leaves_a_batch_another_task_keeps(
    passes: int, ring: bool | None
) -> None:
    """A batch kept in a worker's open ``async with batch:`` when the consumer's loop reaches
    the end of the source (and when a new pass starts after that end) is not released under
    it: it reads its own data (not the simulation's poison), ``released`` stays False until
    the block ends, and then everything goes back."""
    data = batches(6)
    async with ResidencyManager(budgets={"cuda:0": 16 * CHARGE}, backend=sim()) as m:
        seen: list[tuple[int, bool, bool]] = []
        async with DeviceLoader(m, data, "cuda:0", prefetch=2, ring=ring) as loader:
            with anyio.fail_after(10):
                await _hold_in_a_worker(loader, data, passes, seen)
            assert len(seen) == passes * len(data)
            last = [entry for entry in seen if entry[0] == len(data) - 1]
            assert last == [(len(data) - 1, False, True)] * passes
            assert all(not released and intact for _, released, intact in seen)
            await loader.drain()
            # Released at the end of its block: nothing of the loader's is charged any more
            # but the new pass's window.
            if passes == 1:
                assert_nothing_left(m)
        assert_nothing_left(m)


async def test_the_loader_s_close_releases_a_batch_kept_past_the_end_of_its_pass(
    ring: bool | None,
) -> None:
    """The end of the loader is a release point for every batch: a batch still kept in a
    worker's ``async with`` after the pass ended is released by the loader's close, which
    gives everything back."""
    data = batches(4)
    async with ResidencyManager(backend=sim()) as m:
        loader = DeviceLoader(m, data, "cuda:0", prefetch=2, ring=ring)
        kept: list[DeviceBatch] = []
        async for batch in loader.batches():
            if batch.index == len(data) - 1:
                await batch.__aenter__()  # kept past the end of the pass
                kept.append(batch)
        assert not kept[0].released and torch.equal(kept[0].data, data[-1])
        await loader.aclose()
        assert kept[0].released
        assert_nothing_left(m)
        await kept[0].__aexit__(None, None, None)  # the block's end: nothing more to do
        assert_nothing_left(m)


async def test_batches_the_consumer_keeps_past_a_pass_s_end_count_as_its_own_next_pass(
    ring: bool | None,
) -> None:
    """Batches kept in the consuming task's own open ``async with`` blocks stay kept past
    the source's end; when they leave the next pass's first batch too little of the budget
    ever to fit, asking for it is the same ``ResidencyBudgetError`` at once (not a wait for
    ever: only this task can release them). Released, the next pass goes on."""
    data = batches(2)
    async with ResidencyManager(budgets={"cuda:0": 2 * CHARGE}, backend=sim()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=0, ring=ring) as loader:
            kept: list[DeviceBatch] = []
            async for batch in loader.batches():
                await batch.__aenter__()
                kept.append(batch)
            with (
                anyio.fail_after(10),
                pytest.raises(ResidencyBudgetError, match="keeps 2 earlier"),
            ):
                async for _batch in loader:
                    pytest.fail("no room for it beside the batches kept")
            assert all(torch.equal(b.data, d) and not b.released for b, d in zip(kept, data))
            for batch in kept:
                await batch.__aexit__(None, None, None)
            with anyio.fail_after(10):
                got = [batch.clone() async for batch in loader]
            assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        assert_nothing_left(m)


# ---------------------------------------------------------------- errors


class SourceBroke(Exception):
    pass


def breaking_source(good: int) -> Iterator[torch.Tensor]:
    yield from batches(good)
    raise SourceBroke(f"the disk failed after {good} batches")


async def breaking_async_source(good: int) -> AsyncIterator[torch.Tensor]:
    for batch in batches(good):
        await anyio.lowlevel.checkpoint()
        yield batch
    raise SourceBroke(f"the disk failed after {good} batches")


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_the_source_error_reaches_the_consumer_in_order_with_its_traceback(
    kind: str, ring: bool | None
) -> None:
    source = breaking_source(3) if kind == "sync" else breaking_async_source(3)
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, source, "cuda:0", prefetch=4, ring=ring) as loader,
    ):
        got = []
        with pytest.raises(SourceBroke, match="after 3 batches") as info:
            async for batch in loader:
                got.append(batch.clone())
        assert got == [] or all(torch.equal(a, b) for a, b in zip(got, batches(3)))
        assert len(got) == 3
        frames = [entry.name for entry in info.traceback]
        assert frames[-1] in ("breaking_source", "breaking_async_source")
        assert_nothing_left(m)
        # A new pass over the generator: refused (it would be empty), not a quiet empty pass.
        with pytest.raises(RuntimeError, match=r"pass 2 of .* is read once"):
            async for _ in loader:
                pytest.fail("the generator was exhausted")


class _LeakingSource:
    """Yields ``good`` batches, then leaks an end-of-iteration signal that is not its own end:
    a synchronous ``__next__`` raising ``StopAsyncIteration`` (a helper wrapping an async
    iterator by hand), an async ``__anext__`` raising ``StopIteration``, or an ``__aiter__``
    raising ``StopAsyncIteration`` before any batch."""

    def __init__(self, kind: str, good: int) -> None:
        self.kind = kind
        self.data = batches(good)
        self.i = 0
        if kind != "sync next":
            self.__aiter__ = self._aiter  # an async source (the loader looks for __aiter__)

    def __iter__(self) -> _LeakingSource:
        return self

    def __next__(self) -> torch.Tensor:
        if self.i == len(self.data):
            raise StopAsyncIteration("leaked from a helper")
        self.i += 1
        return self.data[self.i - 1]

    def _aiter(self) -> _LeakingSource:
        if self.kind == "aiter":
            raise StopAsyncIteration("leaked from __aiter__")
        return self

    async def __anext__(self) -> torch.Tensor:
        await anyio.lowlevel.checkpoint()
        if self.i == len(self.data):
            raise StopIteration("leaked from a helper")
        self.i += 1
        return self.data[self.i - 1]


@pytest.mark.parametrize(
    ("kind", "leaked", "at", "message"),
    [
        ("sync next", StopAsyncIteration, 2, "the source raised StopAsyncIteration at batch 2"),
        # Python itself turns it into "coroutine raised StopIteration" (PEP 479)
        ("async anext", StopIteration, 2, "raised StopIteration"),
        ("aiter", StopAsyncIteration, 0, "the source raised StopAsyncIteration at batch 0"),
    ],
    ids=["sync-next", "async-anext", "aiter"],
)
async def test_a_source_that_leaks_stop_iteration_is_an_error_not_a_short_pass(
    kind: str, leaked: type[BaseException], at: int, message: str, ring: bool | None
) -> None:
    """Raised as it is inside the consumer's ``__anext__``, a ``StopAsyncIteration`` from the
    source would end the pass quietly after the batches before it (a truncated epoch that
    looks whole): it comes as a ``RuntimeError`` naming the batch, the source's own
    exception as its cause (as Python does for a generator, PEP 479)."""
    source = _LeakingSource(kind, 2 if at else 0)
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring) as loader,
    ):
        got = []
        with anyio.fail_after(10), pytest.raises(RuntimeError, match=message) as info:
            async for batch in loader:
                got.append(batch.clone())
        assert type(info.value.__cause__) is leaked
        assert len(got) == at and all(torch.equal(a, b) for a, b in zip(got, source.data))
        assert_nothing_left(m)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_cancelled_error_the_source_raises_itself_is_an_error_not_a_cancellation(
    kind: str, ring: bool | None
) -> None:
    """A source that raises ``asyncio.CancelledError`` itself (an await of its own on
    something cancelled elsewhere), while nothing cancels the loader or the consumer. It
    reached the consumer as a cancellation, which a task group takes for a quiet end: from a
    thread after the batches before it; from an async source it cancelled the loader's task
    group, so the consumer got no batch at all. It is a ``RuntimeError`` naming the batch,
    after the batches before it, with the source's exception as its cause."""
    data = batches(4)

    def sync_source() -> Iterator[torch.Tensor]:
        for index, item in enumerate(data):
            if index == 2:
                raise asyncio.CancelledError("the source's own")
            yield item

    async def async_source() -> AsyncIterator[torch.Tensor]:
        for index, item in enumerate(data):
            await anyio.lowlevel.checkpoint()
            if index == 2:
                raise asyncio.CancelledError("the source's own")
            yield item

    source = sync_source() if kind == "sync" else async_source()
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring) as loader,
    ):
        got = []
        message = "the source raised CancelledError at batch 2"
        with anyio.fail_after(10), pytest.raises(RuntimeError, match=message) as info:
            async for batch in loader:
                got.append(batch.clone())
        assert type(info.value.__cause__) is asyncio.CancelledError
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, data))
        assert_nothing_left(m)


class Wrapper(torch.Tensor):
    """A wrapper subclass (as DTensor or a quantized weight subclass is): no memory of its
    own, every op computed on the tensor it wraps."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        made.inner = inner
        return made  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = [a.inner if isinstance(a, Wrapper) else a for a in args]
        return func(*unwrap, **(kwargs or {}))


UNCOPYABLE = {
    "sparse": (lambda: torch.eye(4).to_sparse(), TypeError, "layout torch.sparse_coo"),
    "sparse csr": (lambda: torch.eye(4).to_sparse_csr(), TypeError, "layout torch.sparse_csr"),
    "nested": (
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        TypeError,
        "a nested tensor",
    ),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8),
        TypeError,
        "quantized torch.quint8",
    ),
    "meta": (lambda: torch.empty(4, device="meta"), ValueError, "meta device"),
    "conj view": (
        lambda: torch.ones(4, dtype=torch.complex64).conj(),
        TypeError,
        r"lazy conj\(\) view",
    ),
    "negative view": (
        lambda: torch.ones(4, dtype=torch.complex64).conj().imag,
        TypeError,
        "lazy negative view",
    ),
    # It failed with torch's "Attempted to access the data pointer on an invalid python
    # storage", naming neither the batch nor the place.
    "wrapper subclass": (
        lambda: Wrapper(torch.ones(4)),
        TypeError,
        "a Wrapper, a tensor subclass with no memory of its own",
    ),
}


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.filterwarnings("ignore:.*(quantize|nested):UserWarning")
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the check does not depend on the loop
@pytest.mark.parametrize("case", list(UNCOPYABLE))
async def test_a_tensor_the_loader_cannot_copy_is_refused_naming_its_batch_and_place(
    case: str, kind: str, ring: bool | None
) -> None:
    """Batches 0 and 1 are fine; batch 2 holds, under ``["extra"][1]``, a tensor that cannot be
    copied whole. The consumer gets the first two, then an error that names the batch, the
    place and the kind of tensor (rather than torch's own error from deep in a copy), and
    nothing is left behind."""
    make, error, what = UNCOPYABLE[case]
    items = [{"x": t, "extra": ["id", torch.ones(2)]} for t in batches(3)]
    items[2]["extra"][1] = make()

    async def async_items() -> AsyncIterator[Any]:
        for item in items:
            await anyio.lowlevel.checkpoint()
            yield item

    source = items if kind == "sync" else async_items()
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring) as loader,
    ):
        got = []
        pattern = rf"batch 2 holds .*{what}.* at \['extra'\]\[1\], which the loader cannot copy"
        with pytest.raises(error, match=pattern):
            async for batch in loader:
                got.append(batch["x"].clone())
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, batches(2)))
        assert_nothing_left(m)


async def test_a_failed_copy_raises_at_its_batch_after_the_ones_before(ring: bool | None) -> None:
    data = batches(6)
    async with ResidencyManager(backend=sim()) as m:
        m.backend.faults.fail_transfer_at = 3
        async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring) as loader:
            got = []
            with pytest.raises(RuntimeError, match="injected transfer failure"):
                async for batch in loader:
                    got.append(batch.clone())
            assert [torch.equal(a, b) for a, b in zip(got, data)] == [True, True]
        assert_nothing_left(m)


async def test_an_async_source_needs_the_loader_entered(ring: bool | None) -> None:
    async with ResidencyManager(backend=sim()) as m:
        loader = DeviceLoader(m, breaking_async_source(2), "cuda:0", ring=ring)
        with pytest.raises(RuntimeError, match="async with DeviceLoader"):
            await collect(loader)
        await loader.aclose()
        assert_nothing_left(m)


async def test_bad_arguments_are_refused_with_what_to_do(ring: bool | None) -> None:
    async with ResidencyManager(backend=sim()) as m:
        with pytest.raises(ValueError, match="cuda location"):
            DeviceLoader(m, [], "pinned-host", ring=ring)
        with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
            DeviceLoader(m, [], "cuda:0", prefetch=-1, ring=ring)
        with pytest.raises(TypeError, match="iterable or async iterable"):
            DeviceLoader(m, 42, "cuda:0", ring=ring)
        # Iterable, but not of batches: refused rather than iterated into characters or keys.
        for text in ("batches", b"batches"):
            with pytest.raises(TypeError, match="yields characters or bytes"):
                DeviceLoader(m, text, "cuda:0", ring=ring)
        with pytest.raises(TypeError, match="a dict of tensors is one batch"):
            DeviceLoader(m, {"x": torch.ones(4)}, "cuda:0", ring=ring)
        # A map-style Dataset (samples, not batches) was refused without saying what to do.
        with pytest.raises(TypeError, match=r"map-style Dataset.*wrap it in a DataLoader"):
            DeviceLoader(m, Numbered(), "cuda:0", ring=ring)
        # A tensor was iterated row by row, a batch per row (a NumPy array's rows even stayed
        # in host memory, passed through as leaves that are no tensors).
        with pytest.raises(TypeError, match=r"got a tensor of shape \(64, 4\) \(iterated, it"):
            DeviceLoader(m, torch.ones(64, 4), "cuda:0", ring=ring)
        with pytest.raises(TypeError, match=r"got a NumPy array of shape \(8,\) .*rows \(not t"):
            DeviceLoader(m, np.zeros(8, np.float32), "cuda:0", ring=ring)
        # A blank name was taken: reservations " ring e1 #0", errors "batch 1 of : ...".
        for blank in ("", "  "):
            with pytest.raises(ValueError, match="name must name the loader"):
                DeviceLoader(m, [], "cuda:0", name=blank, ring=ring)
        assert not m.snapshot().location("cuda:0").reservations  # nothing was made
        for bad in ("abc", 2.0, None, True):  # the wrong type is a TypeError, naming it
            with pytest.raises(TypeError, match=r"prefetch must be an int >= 0, got .*\("):
                DeviceLoader(m, [], "cuda:0", prefetch=bad, ring=ring)  # type: ignore[arg-type]
        for name in ("read_ahead", "run_ahead"):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 1.*, got 0"):
                DeviceLoader(m, [], "cuda:0", ring=ring, **{name: 0})
        with pytest.raises(ValueError, match="does not exist"):
            DeviceLoader(m, [], "cuda:7", ring=ring)
        with pytest.raises(ValueError, match="staging_slots is for staged sources"):
            DeviceLoader(m, [], "cuda:0", staging_slots=2, ring=ring)
        with pytest.raises(ValueError, match="pack_min_bytes"):
            DeviceLoader(m, [], "cuda:0", pack_min_bytes=-1, ring=ring)
        with pytest.raises(ValueError, match="pack_min_bytes"):
            DeviceLoader(m, [], "cuda:0", pack_min_bytes="4 lumps", ring=ring)
        with pytest.raises(TypeError, match="pack_min_bytes"):
            DeviceLoader(m, [], "cuda:0", pack_min_bytes=True, ring=ring)
        # A size as budgets take one
        assert DeviceLoader(m, [], "cuda:0", pack_min_bytes="4MiB").pack_min_bytes == 4 << 20
        assert DeviceLoader(m, [], "cuda:0", pack_min_bytes=0).pack_min_bytes == 0


# ---------------------------------------------------------------- ending a pass


async def test_breaking_out_early_releases_everything_and_closes_the_source(
    ring: bool | None,
) -> None:
    closed = threading.Event()

    def source() -> Iterator[torch.Tensor]:
        try:
            yield from batches(50)
        finally:
            closed.set()

    async with ResidencyManager(backend=sim(copy_gbps=1.0)) as m:
        async with DeviceLoader(m, source(), "cuda:0", prefetch=4, ring=ring) as loader:
            async for batch in loader:
                if torch.equal(batch, batches(50)[2]):
                    break
        assert closed.is_set()  # the loader's exit waited for the source's thread
        assert_nothing_left(m)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_source_that_fails_while_it_is_closed_is_logged_not_dropped(
    ring: bool | None, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Breaking out of a pass closes the source's generator; an error its ``finally`` raised
    then was swallowed without a word. Nobody is left to raise it to, so it is logged (on
    the ``aresidency`` logger, with its traceback), as Python reports an error of a
    generator's finalizer."""

    class CleanupFailed(Exception):
        pass

    def source() -> Iterator[torch.Tensor]:
        try:
            yield from batches(20)
        finally:
            raise CleanupFailed("the source's file would not close")

    async def async_source() -> AsyncIterator[torch.Tensor]:
        try:
            for tensor in batches(20):
                yield tensor
        finally:
            raise CleanupFailed("the source's file would not close")

    async with ResidencyManager(backend=sim()) as m:
        made = source() if kind == "sync" else async_source()
        async with DeviceLoader(m, made, "cuda:0", prefetch=2, ring=ring) as loader:
            async for _batch in loader:
                break
        assert_nothing_left(m)
    logged = [r for r in caplog.records if r.name == "aresidency" and r.exc_info]
    assert [type(r.exc_info[1]) for r in logged if r.exc_info] == [CleanupFailed]
    assert "closing the source's iterator" in logged[0].getMessage()


async def test_a_new_pass_ends_the_previous_one(ring: bool | None) -> None:
    dataloader = DataLoader(Numbered(), batch_size=4)
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, dataloader, "cuda:0", prefetch=2, ring=ring) as loader,
    ):
        first = aiter(loader)
        await anext(first)
        second = aiter(loader)
        got = [batch["i"].tolist() async for batch in second]  # the second pass, to its end
        assert len(got) == 6
        # The first pass's consumer is told, rather than seeing its pass end early.
        with pytest.raises(RuntimeError, match=r"pass 1 of .* was ended by pass 2, which another"):
            await anext(first)
        await loader.drain()
        assert [v.handle.name for v in m.state.values()] == []
        async for _ in loader:  # a third pass: the second had ended on its own
            break
        with pytest.raises(StopAsyncIteration):
            await anext(second)


@pytest.mark.parametrize("kind", ["generator", "async generator"])
async def test_a_second_pass_over_a_generator_is_refused_not_run_empty(
    ring: bool | None, kind: str
) -> None:
    """A generator is read once: the pass that read it closed it, so a second pass (the
    next epoch of a training loop) got no batch at all and ended as if the source were empty
    (or, after a ``break``, would have missed the batches the first pass read ahead). It is
    refused, saying so; a source whose ``__iter__`` makes a new generator runs every pass."""
    data = batches(6)

    def numbers() -> Iterator[torch.Tensor]:
        yield from data

    async def async_numbers() -> AsyncIterator[torch.Tensor]:
        for tensor in data:
            yield tensor

    source = numbers() if kind == "generator" else async_numbers()
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring) as loader:
            got = []
            async for batch in loader:
                got.append(batch.clone())
                if len(got) == 2:
                    break
            for _ in range(2):  # refused each time, changing nothing
                with pytest.raises(RuntimeError, match=r"pass 2 of .* source is an (async )?i"):
                    async for batch in loader:
                        got.append(batch.clone())
            assert [t.tolist() for t in got] == [t.tolist() for t in data[:2]]
            assert loader.stats().epochs == 1

        class Again:
            def __iter__(self) -> Iterator[torch.Tensor]:
                return numbers()

        async with DeviceLoader(m, Again(), "cuda:0", prefetch=2, ring=ring) as loader:
            for _ in range(2):
                assert [t.tolist() async for t in loader] == [t.tolist() for t in data]
        assert_nothing_left(m)


@pytest.mark.parametrize("wrap", [False, True], ids=["data", "batches"])
async def test_two_tasks_sharing_one_iterator_refuse_the_second_and_spare_the_first(
    ring: bool | None, wrap: bool
) -> None:
    """Two worker tasks pulling from one iterator (``it = aiter(loader)``, ``async for b in
    it`` in each). Both found the iterator without a pass and each started one: the first
    worker was told a newer pass ended its own ("which another 'async for' over the loader
    began", though there was none), and the second read what the first pass's thread left
    of a generator, nothing, ending quietly. As an async generator does, the iterator now
    refuses an ``anext`` while another task waits in one, and the first worker gets every
    batch."""
    gate = Gate()
    data = batches(6)
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, gated(data, gate, at=0), "cuda:0", ring=ring) as loader:
            it = aiter(loader.batches() if wrap else loader)
            got: list[torch.Tensor] = []
            refused: list[BaseException] = []

            async def first() -> None:
                async for item in it:
                    got.append((item.data if wrap else item).clone())

            async def second() -> None:
                with pytest.raises(RuntimeError, match="while another task waits") as info:
                    await anext(it)
                refused.append(info.value)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(first)
                await anyio.to_thread.run_sync(gate.reached.wait)
                await anyio.wait_all_tasks_blocked()  # the first waits for batch 0
                tasks.start_soon(second)
                await anyio.wait_all_tasks_blocked()  # refused, or blocked in a second pass
                gate.open.set()
            assert len(refused) == 1
            assert [g.tolist() for g in got] == [d.tolist() for d in data]
        assert_nothing_left(m)


async def test_two_tasks_iterating_one_loader_at_once_fail_clearly(ring: bool | None) -> None:
    """The second task's pass ends the first's; the first task, waiting for its next batch,
    gets an error saying so (not the end of its pass, which would look like the end of the
    data), and everything is released."""
    data = batches(6)
    gate = Gate()

    class Held:  # every pass holds before batch 1 until the gate opens
        def __iter__(self) -> Iterator[torch.Tensor]:
            return gated(data, gate, 1)

    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, Held(), "cuda:0", prefetch=2, ring=ring) as loader:
            got: list[torch.Tensor] = []
            errors: list[BaseException] = []
            told, one = anyio.Event(), anyio.Event()

            async def first() -> None:
                try:
                    async for batch in loader:
                        got.append(batch.clone())
                        one.set()
                except RuntimeError as error:
                    errors.append(error)
                told.set()

            second = aiter(loader)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(first)
                with anyio.fail_after(10):
                    await one.wait()
                    await anyio.to_thread.run_sync(gate.reached.wait)  # 1 waits for batch 1
                    tasks.start_soon(anext, second)  # the second pass: ends the first
                    await told.wait()  # before the second pass can read (the gate is shut)
                gate.open.set()
            await second.aclose()
            assert len(errors) == 1, errors
            assert "pass 1 of" in str(errors[0]) and "was ended by pass 2" in str(errors[0])
            assert len(got) == 1 and torch.equal(got[0], data[0])
        assert_nothing_left(m)


async def test_aclose_without_async_with_releases_everything(ring: bool | None) -> None:
    async with ResidencyManager(backend=sim(copy_gbps=1.0)) as m:
        loader = DeviceLoader(m, batches(20), "cuda:0", prefetch=4, ring=ring)
        iterator = aiter(loader)
        await anext(iterator)
        await anext(iterator)
        await loader.aclose()
        assert_nothing_left(m)
        # The pass was cut short: its iterator says so rather than end as if the source did.
        with pytest.raises(anyio.ClosedResourceError, match="after 2 batch"):
            await anext(iterator)


async def test_an_aclose_while_another_task_closes_the_loader_waits_for_that_close(
    ring: bool | None,
) -> None:
    """Two closes at once (a shutdown handler's ``aclose`` while the ``async with loader``
    block ends, say): the second returned at once, while the first still waited for the
    source's thread to leave its ``next``, so the second caller went on with the loader not
    closed yet. It now returns once the close is done, as the first does."""
    gate = Gate()
    async with ResidencyManager(backend=sim()) as m:
        loader = DeviceLoader(m, gated(batches(4), gate, at=1), "cuda:0", prefetch=0, ring=ring)
        iterator = aiter(loader)
        done: list[str] = []

        async def close(name: str) -> None:
            await loader.aclose()
            done.append(name)

        with anyio.fail_after(10):
            await anext(iterator)
            await anyio.to_thread.run_sync(gate.reached.wait)  # the source is in its next
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(close, "first")
                await anyio.wait_all_tasks_blocked()
                tasks.start_soon(close, "second")
                await anyio.wait_all_tasks_blocked()
                assert done == []  # both wait for the source's thread
                gate.open.set()
        assert sorted(done) == ["first", "second"]
        assert_nothing_left(m)


async def test_a_batch_asked_for_while_another_task_begins_the_close_says_closed(
    ring: bool | None,
) -> None:
    """Another task's ``aclose`` has begun (the loader is closed, the close at its first
    await) when the consumer asks for its next batch: that ``anext`` raises
    ``ClosedResourceError``, never a quiet end that makes a cut pass look complete."""
    async with ResidencyManager(backend=sim()) as m:
        loader = DeviceLoader(m, batches(50), "cuda:0", prefetch=2, ring=ring)
        iterator = aiter(loader)
        with anyio.fail_after(10):
            await anext(iterator)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(loader.aclose)
                while loader.status != "closed":  # until the close began (at its first await)
                    await anyio.lowlevel.checkpoint()
                with pytest.raises(anyio.ClosedResourceError, match="after 1 batch"):
                    await anext(iterator)
        assert_nothing_left(m)


async def test_a_consumer_in_another_task_is_told_when_the_loader_closes_under_it(
    ring: bool | None,
) -> None:
    """One task iterates, another closes the loader while the consumer waits for a batch (the
    source is held back): the consumer's loop raises ``ClosedResourceError`` naming how far it
    got, instead of ending as if the source were exhausted. A pass that ended with the source
    closes quietly, as before."""
    gate = Gate()
    async with ResidencyManager(backend=sim()) as m:
        loader = DeviceLoader(m, gated(batches(6), gate, at=3), "cuda:0", ring=ring)
        got: list[int] = []
        errors: list[BaseException] = []
        three = anyio.Event()

        async def consume() -> None:
            try:
                async for batch in loader.batches():
                    got.append(batch.index)
                    if len(got) == 3:
                        three.set()
            except anyio.ClosedResourceError as error:
                errors.append(error)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consume)
            with anyio.fail_after(10):
                await three.wait()
            await anyio.to_thread.run_sync(gate.reached.wait)
            await anyio.wait_all_tasks_blocked()  # the consumer waits for batch 3
            tasks.start_soon(loader.aclose)
            await anyio.wait_all_tasks_blocked()  # the pass ended; the close waits for the
            assert errors and loader.status == "closed"  # source's thread, held at the gate
            gate.open.set()
        assert got == [0, 1, 2]
        assert len(errors) == 1 and "after 3 batch(es)" in str(errors[0])
        assert_nothing_left(m)
        whole = DeviceLoader(m, batches(3), "cuda:0", ring=ring)
        it = aiter(whole)
        assert len([b async for b in it]) == 3
        await whole.aclose()  # after the source's end: nothing to report
        with pytest.raises(StopAsyncIteration):  # the whole pass reached it: still ended
            await anext(it)
        assert_nothing_left(m)


async def test_a_consumer_is_told_when_its_iterator_s_aclose_ends_the_pass(
    ring: bool | None,
) -> None:
    """One task iterates ``it = aiter(loader)``, another calls ``it.aclose()`` while the
    consumer waits for a batch (the source is held back). The consumer's loop ended quietly
    after 3 of 6 batches, as if the source were exhausted; it raises ``ClosedResourceError``
    naming how far it got, and so does a later ``anext(it)``. An ``aclose()`` after the
    pass ran to its end still leaves the iterator at its quiet end."""
    gate = Gate()
    async with ResidencyManager(backend=sim()) as m:
        loader = DeviceLoader(m, gated(batches(6), gate, at=3), "cuda:0", ring=ring)
        it = aiter(loader.batches())
        got: list[int] = []
        errors: list[BaseException] = []
        three = anyio.Event()

        async def consume() -> None:
            try:
                async for batch in it:
                    got.append(batch.index)
                    if len(got) == 3:
                        three.set()
            except anyio.ClosedResourceError as error:
                errors.append(error)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consume)
            with anyio.fail_after(10):
                await three.wait()
            await anyio.to_thread.run_sync(gate.reached.wait)
            await anyio.wait_all_tasks_blocked()  # the consumer waits for batch 3
            await it.aclose()
            await anyio.wait_all_tasks_blocked()
            assert errors  # told at once, while the source's thread is held at the gate
            gate.open.set()
        assert got == [0, 1, 2]
        assert len(errors) == 1 and "ended by its iterator's aclose()" in str(errors[0])
        assert "after 3 batch(es)" in str(errors[0])
        with pytest.raises(anyio.ClosedResourceError, match="after 3 batch"):
            await anext(it)
        await loader.aclose()
        assert_nothing_left(m)
        whole = DeviceLoader(m, batches(3), "cuda:0", ring=ring)
        it = aiter(whole)
        assert sum([1 async for _ in it]) == 3
        await it.aclose()  # after the source's end: nothing to report
        with pytest.raises(StopAsyncIteration):
            await anext(it)
        await whole.aclose()
        assert_nothing_left(m)


async def test_cancelled_before_the_first_batch_releases_everything(ring: bool | None) -> None:
    gate = Gate()
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, gated(batches(5), gate, at=0), "cuda:0", ring=ring) as loader,
    ):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:

                async def cancel_when_blocked() -> None:
                    await anyio.to_thread.run_sync(gate.reached.wait)
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()

                tasks.start_soon(cancel_when_blocked)
                await collect(loader)
        assert scope.cancelled_caught
        assert_nothing_left(m)
        gate.open.set()


async def test_cancelled_while_waiting_for_a_batch_mid_pass_releases_everything() -> None:
    gate = Gate()
    got: list[torch.Tensor] = []
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, gated(batches(8), gate, at=5), "cuda:0", prefetch=2, ring=False) as loader,
    ):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:

                async def cancel_when_blocked() -> None:
                    await anyio.to_thread.run_sync(gate.reached.wait)
                    await until(lambda: len(got) == 5)  # (the consumer's own list)
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()

                tasks.start_soon(cancel_when_blocked)
                async for batch in loader:
                    got.append(batch.clone())
        assert scope.cancelled_caught and len(got) == 5
        assert_nothing_left(m)
        gate.open.set()


async def test_cancelled_inside_the_body_releases_everything_at_the_loaders_exit(
    ring: bool | None,
) -> None:
    async with ResidencyManager(backend=sim(copy_gbps=1.0)) as m:
        with anyio.CancelScope() as scope:
            async with DeviceLoader(m, batches(30), "cuda:0", prefetch=4, ring=ring) as loader:
                async for _batch in loader:
                    if loader.stats().batches == 3:
                        scope.cancel()
                        await anyio.lowlevel.checkpoint()  # the body is cancelled here
        assert scope.cancelled_caught
        assert_nothing_left(m)


async def test_cancelling_the_consuming_task_from_outside_releases_everything(
    ring: bool | None,
) -> None:
    async with ResidencyManager(backend=sim()) as m:
        started = anyio.Event()

        async def consume() -> None:
            async with DeviceLoader(
                m, breaking_async_source(1000), "cuda:0", prefetch=3, ring=ring
            ) as ld:
                async for _batch in ld:
                    started.set()
                    await anyio.sleep_forever()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consume)
            await started.wait()
            tasks.cancel_scope.cancel()
        assert_nothing_left(m)


async def test_cancelled_aclose_still_releases_everything(ring: bool | None) -> None:
    async with ResidencyManager(backend=sim()) as m:
        stream = m.backend.current_stream("cuda:0")
        loader = DeviceLoader(m, batches(10), "cuda:0", prefetch=3, ring=ring)
        iterator = aiter(loader)
        batch = await anext(iterator)
        done = threading.Event()
        results: list[torch.Tensor] = []

        def kernel() -> None:  # a slow "kernel" on the consumer's stream reads the batch
            time.sleep(0.05)
            results.append(batch.clone())
            done.set()

        m.backend.run_in_stream_order(stream, kernel)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await loader.aclose()  # cancelled from the start: its cleanup is shielded
        assert done.is_set()  # the release waited for the kernel's reader event
        assert torch.equal(results[0], batches(10)[0])
        assert_nothing_left(m)


# ---------------------------------------------------------------- slow sides


def slow_source(count: int, seconds: float) -> Iterator[torch.Tensor]:
    for batch in batches(count, 4096):
        time.sleep(seconds)  # the source's own work: slower than the loader and consumer
        yield batch


async def test_a_source_slower_than_the_consumer_is_named_the_bottleneck(ring: bool | None) -> None:
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, slow_source(6, 0.02), "cuda:0", prefetch=2, ring=ring) as loader,
    ):
        got = await collect(loader)
        stats = loader.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, batches(6, 4096)))
    assert stats.bottleneck == "source"
    assert stats.wait_source_s > stats.wait_copy_s + stats.wait_budget_s
    assert stats.source_busy_s >= 6 * 0.02
    assert stats.source_gbps is not None and stats.copy_gbps is not None
    assert stats.source_gbps < stats.copy_gbps


async def test_copies_slower_than_the_source_are_named_the_bottleneck() -> None:
    data = batches(6, 64 * KiB)  # 256 KiB each: 13 ms at 0.02 GB/s
    async with (
        ResidencyManager(backend=sim(copy_gbps=0.02)) as m,
        DeviceLoader(m, data, "cuda:0", prefetch=2, ring=False) as loader,
    ):
        got = await collect(loader)
        stats = loader.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, data))
    assert stats.bottleneck == "copy"
    assert stats.copy_busy_s >= 6 * 256 * KiB / 0.02e9 * 0.9


async def test_copies_overlap_a_slower_consumer(ring: bool | None) -> None:
    data = batches(10, 16 * KiB)
    compute_s = 0.02
    waits = []
    async with ResidencyManager(backend=sim(copy_gbps=0.5)) as m:
        stream = m.backend.current_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", prefetch=2, ring=ring) as loader:
            iterator = aiter(loader)
            while True:
                start = time.perf_counter()
                try:
                    batch = await anext(iterator)
                except StopAsyncIteration:
                    break
                waits.append(time.perf_counter() - start)
                stream.sleep(compute_s)  # the step's "kernels", on the consumer's stream
                await m.backend.wait(m.backend.record_event(stream))
                assert not is_poisoned(batch).any()
    # After the first batch the next one was always there already.
    assert sum(waits[1:]) < 0.25 * compute_s * len(data)


# ---------------------------------------------------------------- DeviceBatch lifetimes


async def test_a_batch_not_kept_is_released_at_the_next_step_and_its_memory_freed() -> None:
    data = batches(4)
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, data, "cuda:0", ring=False) as loader,
    ):
        iterator = loader.batches()
        first = await anext(iterator)
        assert isinstance(first, DeviceBatch) and not first.released
        assert torch.equal(first.data, data[0])
        second = await anext(iterator)
        assert first.released and not second.released
        await loader.drain()
        assert is_poisoned(first.data).all()  # the simulation poisons freed memory
        assert torch.equal(second.data, data[1])


async def test_a_batch_kept_in_async_with_outlives_later_steps() -> None:
    data = batches(5)
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, data, "cuda:0", prefetch=1, ring=False) as loader,
    ):
        iterator = loader.batches()
        first = await anext(iterator)
        async with first as kept:
            for index in range(1, 4):
                later = await anext(iterator)
                assert torch.equal(later.data, data[index])
                await loader.drain()
                assert first.kept and torch.equal(kept, data[0])
        assert first.released
        await loader.drain()
        assert is_poisoned(kept).all()
        with pytest.raises(RuntimeError, match="was released"):
            async with first:
                pass


async def test_release_frees_a_batch_before_the_next_step(ring: bool | None) -> None:
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, batches(3), "cuda:0", prefetch=0, ring=ring) as loader,
    ):
        iterator = loader.batches()
        batch = await anext(iterator)
        batch.release()
        batch.release()  # a second call does nothing
        await loader.drain()
        assert [v.handle.name for v in m.state.values()] == []
        assert "released" in repr(batch)


async def test_a_batch_released_from_another_thread_is_refused_and_stays_as_it_was(
    ring: bool | None,
) -> None:
    # A batch handed to a worker thread (anyio.to_thread) that releases it there: the release
    # changes the loader's state (the ring's slots, or the manager's leases and values), which
    # only the loop's thread may touch. It used to go through from the worker thread.
    data = batches(3)
    async with ResidencyManager(backend=sim()) as m:
        side = m.backend.new_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring) as loader:
            iterator = loader.batches()
            batch = await anext(iterator)
            for call in (batch.release, functools.partial(batch.register_stream, side)):
                with pytest.raises(RuntimeError, match="another thread than its event loop") as no:
                    await anyio.to_thread.run_sync(call)
                no.value.__traceback__ = None  # (its frames hold the batch)
            assert not batch.released
            assert torch.equal(batch.data, data[0])
            await anyio.to_thread.run_sync(anyio.from_thread.run_sync, batch.release)
            assert batch.released
            await anyio.to_thread.run_sync(batch.release)  # released already: does nothing
            del batch, call, no  # (not kept past its release)
            rest = [b.data.clone() async for b in iterator]
            assert [r.tolist() for r in rest] == [d.tolist() for d in data[1:]]
        assert_nothing_left(m)


async def test_the_loader_s_aclose_and_drain_from_another_thread_are_refused_and_change_nothing(
    ring: bool | None,
) -> None:
    # loader.aclose() run on another thread's event loop (asyncio.run in a worker thread)
    # marked the loader closed, then stopped at the first batch it released (or, before the
    # batch's own check, released it off the loop); drain() and the iterator's aclose() ran
    # off the loop too. Each is refused before it changes anything, and the pass goes on.
    data = batches(4)
    async with ResidencyManager(backend=sim()) as m:
        loader = DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring)
        it = aiter(loader)
        first = (await anext(it)).clone()
        for call in (loader.drain, loader.aclose, it.aclose):
            with pytest.raises(RuntimeError, match="another thread than its manager's event loop"):
                await anyio.to_thread.run_sync(asyncio.run, call())
        assert loader.status == "open"
        rest = [batch.clone() async for batch in it]
        assert [b.tolist() for b in [first, *rest]] == [d.tolist() for d in data]
        await loader.aclose()
        assert_nothing_left(m)


async def test_a_reader_stream_registered_on_a_batch_keeps_its_memory_until_it_ran(
    ring: bool | None,
) -> None:
    data = batches(3)
    async with ResidencyManager(backend=sim()) as m:
        side = m.backend.new_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", ring=ring) as loader:
            iterator = loader.batches()
            batch = await anext(iterator)
            results: list[torch.Tensor] = []

            def kernel() -> None:
                time.sleep(0.05)
                results.append(batch.data.clone())

            m.backend.run_in_stream_order(side, kernel)
            batch.register_stream(side)
            batch.release()
            await loader.drain()
            assert torch.equal(results[0], data[0])  # read before the release freed it


# ---------------------------------------------------------------- stats


async def test_stats_report_counts_rates_and_their_string_form(ring: bool | None) -> None:
    async with (
        ResidencyManager(backend=sim()) as m,
        DeviceLoader(m, batches(5), "cuda:0", ring=ring) as loader,
    ):
        await collect(loader)
        stats = loader.stats()
    assert isinstance(stats, LoaderStats)
    assert (stats.batches, stats.source_batches, stats.epochs) == (5, 5, 1)
    assert stats.bytes == stats.source_bytes == stats.copy_bytes == 5 * 1024
    assert stats.wall_s > 0 and stats.batches_per_s is not None
    text = str(stats)
    assert "5 batches, 5120 B" in text and "bottleneck" in text
    assert stats.to_dict()["bottleneck"] == stats.bottleneck


async def test_the_next_batch_is_copied_while_the_step_runs_even_when_nothing_else_moves() -> None:
    # prefetch=1: when the consumer asks for a batch, that batch alone is copied; once it is
    # handed out no copy is in flight, so nothing but the hand-out itself can start the next.
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, batches(6), "cuda:0", prefetch=1, ring=False) as loader:
            probe = AheadProbe(m, loader)
            async for _batch in loader:
                left = 6 - loader.stats().batches
                with anyio.fail_after(5):
                    while probe.ahead(complete=True) < min(1, left):
                        await m.wait_for_change()
        probe.close()
        assert probe.most == 1


async def test_each_step_lets_the_loop_run_even_when_the_next_batch_is_ready() -> None:
    """A consumer whose step only enqueues work (no await of its own) must still give the loop
    a turn per batch: with every batch already on the device, a ticker task keeps running."""
    data = batches(12)
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=12, ring=False) as loader:
            probe = AheadProbe(m, loader)
            ticks = 0
            stop = anyio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await anyio.lowlevel.checkpoint()

            got = []
            async with anyio.create_task_group() as tg:
                iterator = loader.__aiter__()
                got.append((await iterator.__anext__()).clone())
                with anyio.fail_after(5):  # every other batch on the device before the steps
                    while probe.ahead(complete=True) < 11:
                        await m.wait_for_change()
                tg.start_soon(ticker)
                await anyio.lowlevel.checkpoint()
                before = ticks
                for _ in range(11):
                    got.append((await iterator.__anext__()).clone())  # no await in the "step"
                ran = ticks - before
                stop.set()
            probe.close()
        assert ran >= 10, f"the ticker ran {ran} times during 11 steps"
    assert all(torch.equal(a, b) for a, b in zip(got, data))


@pytest.mark.parametrize(
    "waits, named",
    [
        ((0.001, 0.0, 0.001), "consumer"),  # waited 6% of the time, but not for the loader
        ((0.05, 0.0, 0.001), "source"),
        ((0.0, 0.0, 0.055), "copy"),
    ],
)
def test_the_bottleneck_is_what_the_consumer_waited_for(
    waits: tuple[float, float, float], named: str
) -> None:
    """A consumer whose waits the loader cannot name (the loop handing batches over) was not
    kept waiting by the source, the budget or the copies: it is the bottleneck itself."""
    source, budget, copy = waits
    stats = LoaderStats(
        wall_s=1.0, wait_s=0.06, wait_source_s=source, wait_budget_s=budget, wait_copy_s=copy
    )
    assert stats.bottleneck == named


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_two_open_loaders_of_one_manager_may_not_share_a_name(ring: bool) -> None:
    """A loader's reservations are named after it: a second open loader with the same name is
    refused when it is made (it used to fail at its first batch with a duplicate reservation
    named after the other's ring), naming the name; once the first is closed the name is
    free; loaders without a name never collide."""
    source = batches(4)
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend=sim()) as m:
        first = DeviceLoader(m, source, "cuda:0", prefetch=1, name="train", ring=ring)
        with pytest.raises(ValueError, match="another DeviceLoader named 'train' is open"):
            DeviceLoader(m, source, "cuda:0", prefetch=1, name="train", ring=ring)
        unnamed = [DeviceLoader(m, source, "cuda:0", prefetch=1, ring=ring) for _ in range(2)]
        async with first:
            assert [b[0].item() for b in await collect(first)] == [s[0].item() for s in source]
        async with DeviceLoader(m, source, "cuda:0", prefetch=1, name="train", ring=ring) as again:
            got = await collect(again)
        for loader in unnamed:
            async with loader:
                got += await collect(loader)
        assert len(got) == 3 * len(source)
        with pytest.raises(TypeError, match="name must be a string"):
            DeviceLoader(m, source, "cuda:0", name=7)  # type: ignore[arg-type]
        assert_nothing_left(m)


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_a_named_loop_left_by_a_break_frees_the_name_for_the_next_loader(ring: bool) -> None:
    """A quick script's ``async for batch in DeviceLoader(..., name="train")`` left by a
    ``break`` drops its iterator, and the pass ends on its own, a moment later. The next
    loader of that name (the next epoch's) was refused meanwhile ("another DeviceLoader named
    'train' is open"), and nothing could close the first: no one held it. It opens now, its
    ring's reservations numbered after the ending pass's, so the two never collide."""
    source = batches(6)
    want = [s[0].item() for s in source]
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend=sim()) as m:
        with anyio.fail_after(10):
            for _ in range(3):
                seen = []
                async for batch in DeviceLoader(
                    m, source, "cuda:0", prefetch=2, name="train", ring=ring
                ):
                    seen.append(batch[0].item())
                    if len(seen) == 2:
                        break
                assert seen == want[:2]
            async with DeviceLoader(
                m, source, "cuda:0", prefetch=2, name="train", ring=ring
            ) as last:
                assert [b[0].item() for b in await collect(last)] == want
                # A loader of the name that is open (entered, or with a pass running) still
                # refuses another.
                with pytest.raises(ValueError, match="another DeviceLoader named 'train' is open"):
                    DeviceLoader(m, source, "cuda:0", name="train", ring=ring)
            while list(m.state.values()) or m.snapshot().location("cuda:0").reserved_bytes:
                await m.wait_for_change(0.05)  # (the dropped passes end as the device passes)
        assert_nothing_left(m)
