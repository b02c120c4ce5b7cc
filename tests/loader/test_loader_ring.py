"""The loader's ring (``aresidency.loader.ring``) on the simulated backend (a simulation of CUDA
devices in host memory; its copies run on worker threads, throttled with ``copy_gbps``).

What only the ring has: its slots are named reservations (no value per batch), made as the
window needs them and grown for a larger batch, given back while a scope waits for room, and
freed at the end of the pass. The behaviour it shares with the managed values (order, identity,
errors, cancellation) is tested for both in ``test_loader.py``."""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import MemoryReservation, ResidencyBudgetError, ResidencyManager, ResidencyPlan
from aresidency.backends.base import Backend
from aresidency.backends.sim import SimBackend
from aresidency.loader import DeviceLoader
from aresidency.loader.lifetime import HostWaits
from aresidency.loader.ring import RingEpoch

from ._support import KiB, assert_nothing_left, batches, max_charge, until

pytestmark = pytest.mark.anyio

CHARGE = 1 * KiB  # a 256-float batch: 1024 B, one slot


def is_slot(t: Any, location: str = "cuda:0") -> bool:
    """A transition of a slot's reservation at ``location`` (``pinned-host``: its twin)."""
    return t.name is not None and " ring " in t.name and str(t.location) == location


def ring_names(manager: ResidencyManager) -> set[str]:
    """Every slot reservation the trace shows (made, ever)."""
    return {t.name for t in manager.trace().transitions if t.kind == "reserve" and is_slot(t)}


def peak_slots(manager: ResidencyManager, location: str = "cuda:0") -> int:
    """The most slot reservations active at once at ``location`` (replaying the trace)."""
    live = peak = 0
    for t in manager.trace().transitions:
        if is_slot(t, location):
            if t.kind == "reserve":
                live += 1
                peak = max(peak, live)
            elif t.kind == "unreserve":
                live -= 1
    return peak


def live_slots(manager: ResidencyManager) -> list[str]:
    """The slot reservations active at cuda:0 now."""
    return [name for name, _n in _reservations(manager) if " ring " in name]


def _reservations(manager: ResidencyManager) -> tuple[tuple[str, int], ...]:
    return manager.snapshot().location("cuda:0").reservations


def waiting_for_room(loader: DeviceLoader) -> bool:
    """Whether the ring's thread waits for room for a slot (the consumer with it)."""
    epoch = loader._epoch
    if not isinstance(epoch, RingEpoch):
        return False
    request = epoch._request
    return request is not None and request.blocked_since is not None


def copied_ahead(loader: DeviceLoader) -> int:
    """Batches copied (issued) beyond the ones handed out."""
    stats = loader.stats()
    return stats.copy_bytes // CHARGE - stats.batches


async def test_the_ring_is_the_default_for_a_synchronous_source_and_registers_no_value() -> None:
    data = batches(12)
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=3) as loader:
            assert loader.ring
            got = []
            async for batch in loader:
                got.append(batch.clone())
                assert [v.handle.name for v in m.state.values()] == []
                assert 1 <= len(live_slots(m)) <= 4
                assert str(m.backend.location_of(batch)) == "cuda:0"
            assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        # prefetch 3 + the batch in use: four slots at most, each one batch's charge
        assert 1 <= peak_slots(m) <= 4
        assert max_charge(m.trace()) <= 4 * CHARGE
        assert_nothing_left(m)


async def test_prefetch_bounds_the_batches_copied_ahead_and_the_slots() -> None:
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, batches(16), "cuda:0", prefetch=3) as loader:
            most = 0
            async for _batch in loader:
                left = 16 - loader.stats().batches
                # the window fills while the step holds its batch, and goes no further
                await until(lambda left=left: copied_ahead(loader) >= min(3, left))
                most = max(most, copied_ahead(loader))
                assert copied_ahead(loader) <= 3
        assert most == 3
        assert peak_slots(m) == 4
        assert_nothing_left(m)


async def test_prefetch_zero_uses_one_slot() -> None:
    async with ResidencyManager(backend=SimBackend()) as m:
        got = []
        async with DeviceLoader(m, batches(6), "cuda:0", prefetch=0) as loader:
            async for batch in loader:
                got.append(batch.clone())
                assert copied_ahead(loader) == 0  # nothing copies while the step runs
        assert peak_slots(m) == 1
        assert got == [b for b in got] and len(got) == 6
        assert_nothing_left(m)


async def test_a_budget_smaller_than_the_window_limits_the_slots() -> None:
    data = batches(20)
    budget = 3 * CHARGE
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend(copy_gbps=1.0)) as m:
        got = []
        async with DeviceLoader(m, data, "cuda:0", prefetch=8) as loader:
            async for batch in loader:
                got.append(batch.clone())
                left = 20 - loader.stats().batches
                # the window fills as far as the budget lets it (two beside this one)
                await until(lambda left=left: copied_ahead(loader) >= min(2, left))
                assert copied_ahead(loader) <= 2
        assert peak_slots(m) == 3
        assert max_charge(m.trace()) <= budget
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))


@pytest.mark.parametrize("prefetch", [0, 2])
async def test_a_larger_batch_grows_a_slot_and_the_old_buffer_is_given_back(prefetch: int) -> None:
    """prefetch=0: one slot, released before the next batch is asked for, so a larger batch
    always grows it (1 KiB, then 4 KiB, then 16 KiB: three reservations in turn). prefetch=2:
    how many slots are made, and which grow, depends on how far ahead the thread got."""
    sizes = [256, 256, 1024, 256, 4096, 512, 4096, 100]
    data = [torch.randn(n) for n in sizes]
    budget = 40 * KiB
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend()) as m:
        got = []
        async with DeviceLoader(m, data, "cuda:0", prefetch=prefetch) as loader:
            async for batch in loader:
                got.append(batch.clone())
                # what the ring holds is what its live slots are charged, nothing else
                charged = sum(n for name, n in _reservations(m) if " ring " in name)
                assert charged == m.snapshot().location("cuda:0").reserved_bytes
        if prefetch == 0:
            assert len(ring_names(m)) == 3  # the slot was grown twice (new reservations)
        assert max_charge(m.trace()) <= budget
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))


@pytest.mark.parametrize(
    ("sizes", "budget", "prefetch"),
    [
        ((10, 1024), 4 * KiB, 0),  # 40 B, then 4 KiB: the whole budget, once the slot left
        ((10, 256, 10, 512, 10), 2 * KiB, 2),  # the 2 KiB batch fits the budget alone
        ((10, 256, 10, 512, 10), 3 * KiB, 3),  # the free slots, too small, stood in its way
    ],
    ids=["grow-the-only-slot", "all-slots-go", "free-slots-go"],
)
async def test_a_larger_batch_under_a_tight_budget_gets_the_ring_s_own_room(
    sizes: tuple[int, ...], budget: int, prefetch: int
) -> None:
    """Batches of varying size under a budget with room for the largest one, but not beside
    the ring's other slots: the ring gives its own slots that could never hold the batch
    back (the free ones too small for it, and the old buffer of the one it grows) and waits
    for their room, so every batch arrives (as through managed values), within the budget.
    Not a refusal saying the consumer's own holding stands in the way (a grown slot, or a
    free one, is none), and not a wait for ever (``timeout`` would say so)."""
    data = [torch.full((n,), float(i)) for i, n in enumerate(sizes)]
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend()) as m:
        got = []
        with anyio.fail_after(10):
            async with DeviceLoader(m, data, "cuda:0", prefetch=prefetch, timeout=5) as loader:
                async for batch in loader:
                    got.append(batch.clone())
                    del batch  # torch frees a slot's memory once no tensor refers to it
        assert max_charge(m.trace()) <= budget
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert_nothing_left(m)
    assert len(got) == len(data) and all(torch.equal(a, b) for a, b in zip(got, data))


@pytest.mark.parametrize("seed", range(6))
async def test_random_sizes_under_a_budget_of_the_largest_batch_all_arrive(seed: int) -> None:
    """Random batch sizes and prefetch under a budget of one to two of the largest batch:
    the loader never fails for lack of room (no batch is larger than the budget)."""
    rng = random.Random(seed)
    sizes = [rng.choice([1, 64, 128, 256, 700, 1024]) for _ in range(rng.randint(6, 16))]
    data = [
        torch.randn(n, generator=torch.Generator().manual_seed(seed + i))
        for i, n in enumerate(sizes)
    ]
    largest = max(-(-n * 4 // 512) * 512 for n in sizes)
    budget = rng.choice([largest, largest + 512, 2 * largest])
    prefetch = rng.randint(0, 4)
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend()) as m:
        got = []
        with anyio.fail_after(20):
            async with DeviceLoader(m, data, "cuda:0", prefetch=prefetch, timeout=5) as loader:
                async for batch in loader:
                    got.append(batch.clone())
        assert max_charge(m.trace()) <= budget
        assert_nothing_left(m)
    assert len(got) == len(data) and all(torch.equal(a, b) for a, b in zip(got, data))


async def test_a_waiting_scope_gets_the_ring_s_free_slots_and_the_ring_grows_back() -> None:
    data = batches(30)
    budget = 4 * CHARGE
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend()) as m:
        entered = anyio.Event()
        leave = anyio.Event()
        plan = ResidencyPlan(reserve=[MemoryReservation("tenant", "cuda:0", 3 * CHARGE)])

        async def tenant() -> None:
            async with m.scope(plan):
                entered.set()
                await leave.wait()

        # While the scope waits for room, the ring takes no new slot (it never overtakes it).
        baseline: set[str] | None = None
        overtaken: set[str] = set()

        def watch() -> None:
            nonlocal baseline
            names = set(live_slots(m))
            if m.waiting_for_room("cuda:0") and not entered.is_set():
                if baseline is None:
                    baseline = names
                overtaken.update(names - baseline)
            else:
                baseline = None

        unwatch = m.add_change_listener(watch)
        got = []
        slots_while_tenant = []
        async with (
            anyio.create_task_group() as tasks,
            DeviceLoader(m, data, "cuda:0", prefetch=3) as loader,
        ):
            async for batch in loader:
                got.append(batch.clone())
                del batch
                if len(got) == 3:
                    await until(lambda: len(live_slots(m)) == 4)  # the whole budget
                    tasks.start_soon(tenant)
                if entered.is_set() and not leave.is_set():
                    slots_while_tenant.append(len(live_slots(m)))
                if len(got) == 15:
                    assert entered.is_set()  # the ring gave its free slots back
                    leave.set()
                if len(got) == 25:
                    await until(lambda: len(live_slots(m)) >= 3)  # and grew back
            stats = loader.stats()
        unwatch()
        assert not overtaken
        assert slots_while_tenant and max(slots_while_tenant) == 1
        assert stats.batches == 30
        assert max_charge(m.trace()) <= budget
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))


async def test_kept_batches_hold_their_slots_and_the_pass_goes_on() -> None:
    data = batches(8)
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=1) as loader:
            kept = []
            async for batch in loader.batches():
                if batch.index % 2 == 0:
                    kept.append(batch)
                    await batch.__aenter__()  # kept past the next steps
                else:
                    assert torch.equal(batch.data, data[batch.index])
                if batch.index == len(data) - 1:  # the pass's end releases every batch
                    # every kept batch still holds its own data: no slot was reused under it
                    for old in kept:
                        assert torch.equal(old.data, data[old.index])
                        await old.__aexit__(None, None, None)
        assert peak_slots(m) >= 5  # four kept + the window
        assert_nothing_left(m)


async def test_cancelled_while_waiting_for_room_gives_everything_back() -> None:
    async with ResidencyManager(budgets={"cuda:0": 2 * CHARGE}, backend=SimBackend()) as m:
        hog = m.reservation("hog", "cuda:0", 2 * CHARGE)
        await hog.__aenter__()
        async with DeviceLoader(m, batches(4), "cuda:0") as loader:
            with anyio.move_on_after(5) as scope:
                async with anyio.create_task_group() as tasks:

                    async def consume() -> None:
                        async for _batch in loader:
                            pass

                    tasks.start_soon(consume)
                    await until(lambda: waiting_for_room(loader))
                    tasks.cancel_scope.cancel()
            assert not scope.cancelled_caught
            assert loader.stats().batches == 0
        await hog.__aexit__(None, None, None)
        assert_nothing_left(m)


class _Slow:
    """A source that counts how far it was read."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        self.items = items
        self.read = 0
        self.lock = threading.Lock()

    def __iter__(self) -> Iterator[torch.Tensor]:
        for item in self.items:
            with self.lock:
                self.read += 1
            yield item


@pytest.mark.parametrize("seed", range(8))
async def test_random_sizes_budgets_kept_batches_and_cancellation(seed: int) -> None:
    """Random batch sizes and structures, budgets, prefetch, kept batches and a pass ended at a
    random point (break, cancellation, or to the end): every batch handed out is the source's,
    the budget is never exceeded, and nothing is left."""
    rng = random.Random(seed)
    count = rng.randint(5, 25)
    data: list[Any] = []
    for i in range(count):
        n = rng.choice([1, 64, 256, 300, 1024, 3000])
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed * 100 + i))
        data.append(x if rng.random() < 0.5 else {"x": x, "y": (x[:1] + 1, i)})
    prefetch = rng.randint(0, 5)
    # Room for the two batches kept, the one in use and one more (a consumer that keeps more
    # than the budget holds would wait for room for ever, as it should: timeout=5 says so).
    budget = rng.choice([52 * KiB, 80 * KiB, None])
    stop_at = rng.choice([count, rng.randint(0, count)])
    how = rng.choice(["break", "cancel"])
    budgets = {} if budget is None else {"cuda:0": budget}
    async with ResidencyManager(
        budgets=budgets, backend=SimBackend(copy_gbps=rng.choice([None, 2.0]))
    ) as m:
        pack = rng.choice([0, None])  # pageable batches through the pinned twins, or not
        async with DeviceLoader(
            m, _Slow(data), "cuda:0", prefetch=prefetch, timeout=5, pack_min_bytes=pack
        ) as loader:
            kept: list[Any] = []
            with anyio.CancelScope() as scope:
                async for batch in loader.batches():
                    item = data[batch.index]
                    got = batch.data
                    if isinstance(item, dict):
                        assert torch.equal(got["x"], item["x"])
                        assert (
                            torch.equal(got["y"][0], item["y"][0]) and got["y"][1] == item["y"][1]
                        )
                    else:
                        assert torch.equal(got, item)
                    if rng.random() < 0.2 and len(kept) < 2:
                        await batch.__aenter__()
                        kept.append(batch)
                    elif kept and rng.random() < 0.5:
                        await kept.pop(0).__aexit__(None, None, None)
                    if batch.index + 1 >= stop_at:
                        if how == "cancel":
                            scope.cancel()
                            await anyio.lowlevel.checkpoint()
                        break
        for batch in kept:
            assert batch.released  # the end of the pass (the loader's exit) released it
        if budget is not None:
            assert max_charge(m.trace()) <= budget
            assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert_nothing_left(m)


class _NoCopyInto(SimBackend):
    """The simulation without ``copy_into`` (a backend that lacks the ring's copy)."""

    copy_into = Backend.copy_into  # type: ignore[assignment]


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
async def test_a_tensor_already_in_device_memory_is_refused_naming_its_batch_and_place(
    device: str,
) -> None:
    """A source whose batches hold a tensor already on a device (a collate_fn that ran a
    transform there). On CUDA the ring's copy refuses a device source ("copy_into copies
    host memory to a device, got a cuda source"), naming neither the batch nor the tensor;
    the simulation copied it silently. Both now refuse it at its place, after the batches
    before it, saying what to do; through managed values it is handed out (the docs say
    so)."""
    async with ResidencyManager(backend=SimBackend()) as m:
        on_device = m.backend.allocate((4,), torch.float32, device)
        on_device.fill_(7.0)
        items = [{"x": t, "extra": ["id", torch.ones(2)]} for t in batches(3)]
        items[2]["extra"][1] = on_device
        async with DeviceLoader(m, items, "cuda:0", prefetch=2) as loader:
            got = []
            pattern = rf"batch 2 holds a tensor in {device} memory at \['extra'\]\[1\]"
            with pytest.raises(ValueError, match=pattern):
                async for batch in loader:
                    got.append(batch["x"].clone())
            assert [g.tolist() for g in got] == [i["x"].tolist() for i in items[:2]]
        assert live_slots(m) == []
        async with DeviceLoader(m, items, "cuda:0", ring=False) as loader:
            seen = [batch["extra"][1].tolist() async for batch in loader]
        assert seen[2] == [7.0] * 4
        del on_device, items
        assert_nothing_left(m)


async def test_ring_true_is_refused_where_it_cannot_run() -> None:
    async with ResidencyManager(backend=_NoCopyInto()) as m:
        with pytest.raises(ValueError, match="needs a backend with copy_into"):
            DeviceLoader(m, [torch.zeros(4)], "cuda:0", ring=True)
        loader = DeviceLoader(m, [torch.zeros(4)], "cuda:0")
        assert not loader.ring  # the managed values, then
        async with loader:
            got = [b.clone() async for b in loader]
        assert len(got) == 1
    async with ResidencyManager(backend=SimBackend()) as m:
        with pytest.raises(TypeError, match="ring must be"):
            DeviceLoader(m, [torch.zeros(4)], "cuda:0", ring="yes")  # type: ignore[arg-type]
        assert not DeviceLoader(m, [torch.zeros(4)], "cuda:0", ring=False).ring


async def test_an_async_source_goes_through_the_ring_too() -> None:
    data = batches(10)

    async def source() -> Any:
        for item in data:
            await anyio.lowlevel.checkpoint()
            yield item

    async with ResidencyManager(budgets={"cuda:0": 3 * CHARGE}, backend=SimBackend()) as m:
        async with DeviceLoader(m, source(), "cuda:0", prefetch=4, read_ahead=1) as loader:
            assert loader.ring
            got = [b.clone() async for b in loader]
            assert [v.handle.name for v in m.state.values()] == []
        assert peak_slots(m) <= 3
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))


@pytest.mark.parametrize("seed", range(6))
async def test_random_tenants_beside_the_ring_never_exceed_the_budget(seed: int) -> None:
    """Scopes of another tenant come and go (some cancelled while they wait for room) while a
    pass runs with random batch sizes: the ring gives its free slots back to a waiting scope,
    grows again after, and the budget is never exceeded; every batch is the source's and
    nothing is left at the end."""
    rng = random.Random(1000 + seed)
    count = 40
    data = [
        torch.randn(rng.choice([64, 256, 700]), generator=torch.Generator().manual_seed(i))
        for i in range(count)
    ]
    budget = 12 * KiB
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend()) as m:
        entered = 0

        async def tenant(n: int, size: int, cancel: bool) -> None:
            nonlocal entered
            plan = ResidencyPlan(reserve=[MemoryReservation(f"tenant-{n}", "cuda:0", size)])
            with anyio.CancelScope() as scope:
                if cancel:
                    scope.deadline = anyio.current_time() + rng.random() * 0.01
                async with m.scope(plan):
                    entered += 1
                    for _ in range(rng.randint(0, 3)):
                        await anyio.lowlevel.checkpoint()

        got = 0
        async with (
            anyio.create_task_group() as tasks,
            DeviceLoader(
                m,
                data,
                "cuda:0",
                prefetch=rng.randint(1, 4),
                timeout=10,
                pack_min_bytes=rng.choice([0, None]),
            ) as loader,
        ):
            n = 0
            async for batch in loader:
                assert torch.equal(batch, data[got])
                got += 1
                del batch
                if rng.random() < 0.3:
                    n += 1
                    size = rng.choice([2, 4, 6]) * KiB
                    tasks.start_soon(tenant, n, size, rng.random() < 0.3)
        assert got == count
        assert entered >= 1
        assert max_charge(m.trace()) <= budget
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        assert_nothing_left(m)


# ------------------------------------------------------------------ pinned twins


def twin_names(manager: ResidencyManager) -> set[str]:
    return {
        t.name
        for t in manager.trace().transitions
        if t.kind == "reserve" and is_slot(t, "pinned-host")
    }


async def test_pageable_batches_are_packed_into_each_slots_pinned_twin() -> None:
    """A pageable batch is packed into its slot's twin in the ring's thread, then copied with
    one call: every slot has a twin of its size charged at pinned-host while it exists, and
    nothing is left there at the end. (Simulated: the twins are not page-locked here.)"""
    data = batches(12)
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", pack_min_bytes=0, prefetch=3) as loader:
            got = [batch.clone() async for batch in loader]
            stats = loader.stats()
        assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        assert stats.packed_bytes == sum(b.numel() * b.element_size() for b in data)
        assert stats.twin_peak_bytes > 0
        assert {f"{name} pinned" for name in ring_names(m)} == twin_names(m)
        assert peak_slots(m, "pinned-host") == peak_slots(m)
        assert "packed into pinned twins" in str(stats)
        assert_nothing_left(m)


async def test_a_grown_slot_gets_a_twin_as_large_and_the_old_one_goes() -> None:
    small = [torch.full((256,), float(i)) for i in range(4)]
    large = [torch.full((4096,), float(i)) for i in range(4, 8)]
    data = small + large
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", pack_min_bytes=0, prefetch=1) as loader:
            got = [batch.clone() async for batch in loader]
        assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        charges = sorted(
            t.nbytes
            for t in m.trace().transitions
            if t.kind == "reserve" and is_slot(t, "pinned-host")
        )
        assert charges[0] < 16 * KiB <= charges[-1]
        assert_nothing_left(m)


async def test_without_room_at_pinned_host_the_batches_go_through_the_driver() -> None:
    """No room for a twin at pinned-host: the pass copies its pageable batches as before (the
    driver's staging), says why, and charges nothing there."""
    data = batches(8)
    budgets = {"cuda:0": 64 * KiB, "pinned-host": 1 * KiB}
    async with ResidencyManager(budgets=budgets, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", pack_min_bytes=0, prefetch=2) as loader:
            got = []
            async for batch in loader:
                got.append(batch.clone())
                epoch = loader._epoch
                assert isinstance(epoch, RingEpoch) and epoch.twin_refusal is not None
            stats = loader.stats()
        assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        assert stats.packed_bytes == 0 and stats.twin_peak_bytes == 0
        assert twin_names(m) == set()
        assert_nothing_left(m)


async def test_only_batches_from_pack_min_bytes_up_are_packed() -> None:
    small = [torch.full((256,), float(i)) for i in range(3)]  # 1 KiB
    large = [torch.full((4096,), float(i)) for i in range(3, 6)]  # 16 KiB
    data = small + large
    async with ResidencyManager(budgets={"cuda:0": 256 * KiB}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", pack_min_bytes=16 * KiB) as loader:
            got = [batch.clone() async for batch in loader]
            assert loader.stats().packed_bytes == 3 * 16 * KiB
        async with DeviceLoader(m, data, "cuda:0", pack_min_bytes=None) as loader:
            got += [batch.clone() async for batch in loader]
            assert loader.stats().packed_bytes == 0
        async with DeviceLoader(m, data, "cuda:0") as loader:  # default: from 4 MiB up
            got += [batch.clone() async for batch in loader]
            assert loader.stats().packed_bytes == 0
        assert all(torch.equal(a, b) for a, b in zip(got, data * 3, strict=True))
        for bad in (-1, 1.5, "4 lumps"):
            with pytest.raises(ValueError, match="pack_min_bytes"):
                DeviceLoader(m, data, "cuda:0", pack_min_bytes=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="pack_min_bytes"):
            DeviceLoader(m, data, "cuda:0", pack_min_bytes=True)
        assert_nothing_left(m)


async def test_by_default_pageable_batches_from_4_mib_up_are_packed() -> None:
    mib = 1024 * KiB
    data = [torch.full((mib // 4,), 1.0), torch.full((mib,), 2.0), torch.full((mib // 4 - 1,), 3.0)]
    async with ResidencyManager(budgets={"cuda:0": 32 * mib}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=1) as loader:
            got = [batch.clone() async for batch in loader]
            assert loader.stats().packed_bytes == 4 * mib, "only the 4 MiB batch"
        assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        assert_nothing_left(m)


async def test_a_twin_that_cannot_be_page_locked_leaves_the_batches_to_the_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Page-locking a twin fails (a memlock limit, say): no batch fails for it; the pass
    copies through the driver's staging, says why, and ends with nothing left."""

    def refuse(self: RingEpoch, nbytes: int) -> torch.Tensor:
        raise RuntimeError("cudaHostRegister: out of memory (simulated refusal)")

    monkeypatch.setattr(RingEpoch, "_allocate_twin", refuse)
    data = batches(8)
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2, pack_min_bytes=0) as loader:
            got = []
            async for batch in loader:
                got.append(batch.clone())
            epoch = loader._epoch
            assert isinstance(epoch, RingEpoch)
            assert epoch.twin_refusal is not None and "simulated refusal" in epoch.twin_refusal
            assert loader.stats().packed_bytes == 0
        assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        assert_nothing_left(m)


async def test_large_batches_are_packed_by_several_threads_bit_identical(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches of 4 MiB and more are split across the packing threads (three here, whatever
    the machine's cores); what arrives is the source's, byte for byte, strided parts (copied
    by torch) included."""
    from aresidency.backends import memory

    monkeypatch.setattr(memory, "HOST_THREADS", 3)
    split = []
    real = memory.ctypes.memmove
    monkeypatch.setattr(
        memory.ctypes,
        "memmove",
        lambda d, s, n: split.append(threading.get_ident()) or real(d, s, n),
    )

    def make() -> list[Any]:  # 24 MiB of random numbers: off the loop, as a source would
        g = torch.Generator().manual_seed(7)
        return [
            {
                "x": torch.randn(6 << 18, generator=g),
                "t": torch.randn(64, 96, generator=g).t(),
                "i": i,
            }
            for i in range(4)  # 6 MiB each
        ]

    data = await anyio.to_thread.run_sync(make)
    async with ResidencyManager(budgets={"cuda:0": 64 << 20}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=1, pack_min_bytes=0) as loader:
            got = [
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                async for b in loader
            ]
            assert loader.stats().packed_bytes == loader.stats().bytes
        for a, b in zip(got, data, strict=True):
            assert torch.equal(a["x"], b["x"]) and torch.equal(a["t"], b["t"]) and a["i"] == b["i"]
        assert_nothing_left(m)
    assert len(split) >= 3 * len(data) and threading.get_ident() not in split


async def test_the_next_pass_starts_while_the_device_still_runs_the_last_ones_steps() -> None:
    """Starting a pass does not wait for the device to pass the previous pass's batches (it
    would leave the device idle between passes): the old slots stay reserved, and are freed
    only once the step still reading the last batch of the old pass ran."""
    data = batches(4)
    gate = threading.Event()
    read: list[torch.Tensor] = []
    async with ResidencyManager(backend=SimBackend()) as m:
        stream = m.backend.current_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", prefetch=1) as loader:
            first = aiter(loader)
            for _ in range(len(data)):
                last = await anext(first)

            def step() -> None:  # the old pass's last step, still queued on the device
                gate.wait(10)
                read.append(last.clone())

            m.backend.run_in_stream_order(stream, step)  # enqueued before the release
            with pytest.raises(StopAsyncIteration):
                await anext(first)
            with anyio.fail_after(5):
                second = aiter(loader)
                got = (await anext(second)).clone()
            assert torch.equal(got, data[0])
            assert any(" ring e1 " in name for name in live_slots(m)), live_slots(m)
            gate.set()
            rest = [batch.clone() async for batch in second]
        assert_nothing_left(m)
    assert torch.equal(read[0], data[-1])  # its slot was not freed or reused under the step
    assert all(torch.equal(a, b) for a, b in zip(rest, data[1:], strict=True))


async def test_a_next_pass_without_room_waits_for_the_old_slots_to_be_freed() -> None:
    """A budget of exactly one slot, the old pass's: the next pass waits for room (its first
    batch does not come while the old pass's last step is held on the device), gets it once
    that step ran and the old slot was freed, and never exceeds the budget."""
    data = batches(4)
    gate = threading.Event()
    async with ResidencyManager(budgets={"cuda:0": CHARGE}, backend=SimBackend()) as m:
        stream = m.backend.current_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", prefetch=1) as loader:
            first = aiter(loader)
            assert [(await anext(first)).tolist() for _ in data] == [d.tolist() for d in data]
            # A step still reading the last batch: its release (the pass's end) comes after it.
            m.backend.run_in_stream_order(stream, lambda: gate.wait(10))
            with pytest.raises(StopAsyncIteration):
                await anext(first)
            assert sum(" ring e1 " in name for name in live_slots(m)) == 1, live_slots(m)
            second = aiter(loader)
            got: list[torch.Tensor] = []

            async def first_of_second_pass() -> None:
                got.append((await anext(second)).clone())

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(first_of_second_pass)
                await until(lambda: waiting_for_room(loader))
                assert not got
                gate.set()
            assert torch.equal(got[0], data[0])
            rest = [b.clone() async for b in second]
        assert_nothing_left(m)
        assert max_charge(m.trace()) <= CHARGE
    assert all(torch.equal(a, b) for a, b in zip(rest, data[1:], strict=True))


async def test_a_next_pass_waiting_for_old_slots_times_out_once_others_took_their_room() -> None:
    """The wait for the old pass's slot (freed once the device ran its last step) is a wait for
    the device, which ``timeout`` does not count; but a scope that waited first gets that room
    when the slot goes, and from then on the batch waits for room others hold: the timeout
    applies (the consumer, parked without a deadline, is woken to judge the wait again)."""
    data = batches(2)
    gate = threading.Event()
    async with ResidencyManager(budgets={"cuda:0": CHARGE}, backend=SimBackend()) as m:
        stream = m.backend.current_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", prefetch=0, timeout=0.05) as loader:
            first = aiter(loader)
            assert [(await anext(first)).tolist() for _ in data] == [d.tolist() for d in data]
            # A step still reading the last batch: its release (the pass's end) comes after it.
            m.backend.run_in_stream_order(stream, lambda: gate.wait(10))
            with pytest.raises(StopAsyncIteration):
                await anext(first)
            plan = ResidencyPlan(reserve=[MemoryReservation("other", "cuda:0", CHARGE)])
            holding, done = anyio.Event(), anyio.Event()

            async def other() -> None:
                async with m.scope(plan, timeout=None):
                    holding.set()
                    await done.wait()

            second = aiter(loader)
            failed: list[BaseException] = []

            async def first_of_second_pass() -> None:
                with pytest.raises(TimeoutError, match=r"batch 0 .* waited 0\.05 s") as caught:
                    await anext(second)
                failed.append(caught.value)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(other)
                await until(lambda: m.waiting > 0)  # the scope waits for the old slot's room
                tasks.start_soon(first_of_second_pass)
                await until(lambda: waiting_for_room(loader))  # parked, no deadline yet
                assert not failed
                gate.set()  # the old slot goes, the scope gets its room
                with anyio.fail_after(5):
                    await holding.wait()
                    await until(lambda: bool(failed))
                done.set()
        assert_nothing_left(m)
        assert max_charge(m.trace()) <= CHARGE


async def test_drain_waits_for_the_slots_of_the_pass_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``loader.drain()`` during a pass also waits until the previous pass's slots, retired
    when the pass ended, have left the budget (their retiring thread is held here)."""
    from aresidency.loader.lifetime import HostWaits

    gate = threading.Event()
    real_wait_all = HostWaits.wait_all

    def held_when_retiring(self: HostWaits, events: list[Any]) -> bool:
        if threading.current_thread().name == "aresidency-loader-ring-retire":
            gate.wait(10)
        return real_wait_all(self, events)

    async def nothing_released_to_wait_for(self: RingEpoch) -> None:
        return None  # the running pass's own part of drain: not what this test looks at

    monkeypatch.setattr(HostWaits, "wait_all", held_when_retiring)
    monkeypatch.setattr(RingEpoch, "_drain_releases", nothing_released_to_wait_for)
    data = batches(4)
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=1) as loader:
            async for _batch in loader:
                pass
            second = aiter(loader)
            await anext(second)
            assert any(" ring e1 " in name for name in live_slots(m))
            drained = anyio.Event()

            async def drain() -> None:
                await loader.drain()
                drained.set()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(drain)
                await anyio.wait_all_tasks_blocked()
                assert not drained.is_set()
                gate.set()
            assert not any(" ring e1 " in name for name in live_slots(m))
            async for _batch in second:
                pass
        assert_nothing_left(m)


async def test_batches_without_bytes_pass_through_the_ring() -> None:
    """A batch with no tensor, or only empty ones, among normal ones: handed out as it came
    (it used to crash the ring's thread waiting on the event of a copy never made)."""
    data: list[Any] = [
        {"id": 1},
        [{"x": torch.zeros(0)}],
        {"x": torch.arange(4.0), "id": 2},
        {"id": 3, "x": torch.zeros(0, 3, dtype=torch.int64)},
        torch.arange(3),
    ]
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2) as loader:
            with anyio.fail_after(5):
                got = [
                    structure_clone(batch)
                    async for batch in loader  # cloned before the release
                ]
            assert isinstance(loader._epoch, RingEpoch)
        assert_nothing_left(m)
    assert got[0] == {"id": 1}
    assert got[1][0]["x"].shape == (0,)
    assert torch.equal(got[2]["x"], torch.arange(4.0)) and got[2]["id"] == 2
    assert got[3]["x"].shape == (0, 3) and got[3]["x"].dtype == torch.int64
    assert torch.equal(got[4], torch.arange(3))


def structure_clone(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: structure_clone(v) for k, v in batch.items()}
    if isinstance(batch, list):
        return [structure_clone(v) for v in batch]
    return batch


async def test_a_batch_read_after_its_release_reads_the_simulations_poison() -> None:
    """On the simulated backend a released slot is poisoned (NaN, or the byte 0xA5) before
    the slot takes its next batch: a read after the release shows up, and never as another
    batch's data."""
    data = [{"f": torch.full((8,), float(i)), "n": torch.full((4,), i)} for i in range(6)]
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2) as loader:
            kept = []
            with pytest.warns(RuntimeWarning, match="still referenced"):  # and it says so
                async for batch in loader.batches():
                    assert torch.equal(batch.data["f"], data[batch.index]["f"])
                    kept.append(batch)
            await loader.drain()  # every release passed on the device
            for batch in kept:
                assert batch.released
                assert torch.isnan(batch.data["f"]).all(), batch.data["f"]
                raw = batch.data["n"].view(torch.uint8)
                assert (raw == 0xA5).all(), raw
        assert_nothing_left(m)


async def test_a_batch_larger_than_the_budget_is_refused_as_a_reservation() -> None:
    """The ring charges slots as reservations: a batch larger than the whole budget is
    ``ResidencyBudgetError`` with ``kind="reservation"`` and no handle (a reservation's
    error names no value)."""
    async with ResidencyManager(budgets={"cuda:0": 1000}, backend=SimBackend()) as m:
        with pytest.raises(ResidencyBudgetError) as caught:
            async with DeviceLoader(m, batches(2, 1024), "cuda:0", prefetch=1) as loader:
                async for _batch in loader:
                    pass
        assert caught.value.kind == "reservation"
        assert caught.value.handle is None
        assert caught.value.requested_bytes > caught.value.budget_bytes
        assert "larger than" in str(caught.value) or "more than the whole budget" in str(
            caught.value
        )
        assert_nothing_left(m)


async def test_a_consumer_ahead_of_the_device_parks_after_run_ahead_steps() -> None:
    """The device holds every step (a kernel waiting on a gate): the consumer gets batches
    while at most ``run_ahead`` released ones still wait for the device, then parks (on the
    loop, every other task running) until the device catches up.
    The batches were all copied ahead into fresh slots, so only the bound holds it back."""
    data = batches(6)
    gate = threading.Event()
    async with ResidencyManager(backend=SimBackend()) as m:
        stream = m.backend.current_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", prefetch=6, run_ahead=2) as loader:
            it = aiter(loader)
            got = [(await anext(it)).clone()]
            await until(lambda: copied_ahead(loader) == 5)  # each batch in a slot of its own
            m.backend.run_in_stream_order(stream, lambda: gate.wait(10))  # the held step
            got += [(await anext(it)).clone() for _ in range(2)]  # 1 and 2 behind: handed out
            epoch = loader._epoch
            assert isinstance(epoch, RingEpoch)
            parked: list[torch.Tensor] = []

            async def next_batch() -> None:
                parked.append((await anext(it)).clone())

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(next_batch)  # 3 behind: parks
                await anyio.wait_all_tasks_blocked()
                assert not parked
                assert len(epoch._behind) == 3
                gate.set()
            got += parked
            got += [b.clone() async for b in it]
            assert loader.stats().device_wait_s > 0
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))


async def test_a_consumer_cancelled_while_parked_for_the_device_ends_its_pass_cleanly() -> None:
    data = batches(5)
    gate = threading.Event()
    async with ResidencyManager(backend=SimBackend()) as m:
        stream = m.backend.current_stream("cuda:0")
        async with DeviceLoader(m, data, "cuda:0", prefetch=5, run_ahead=1) as loader:
            it = aiter(loader)
            await anext(it)
            await until(lambda: copied_ahead(loader) == 4)
            m.backend.run_in_stream_order(stream, lambda: gate.wait(10))
            await anext(it)  # one behind
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(anext, it)  # two behind: parks
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
                    gate.set()  # the cancelled pass's end waits for the device to pass it
            assert scope.cancelled_caught
            # The cancelled consumer ended the pass: the iterator says so (not a quiet end)
            with pytest.raises(RuntimeError, match="ended when a wait for its next batch"):
                await anext(it)
            again = [b.clone() async for b in loader]  # a new pass gets every batch
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(again, data, strict=True))


async def test_run_ahead_is_refused_unless_a_positive_int() -> None:
    async with ResidencyManager(backend=SimBackend()) as m:
        for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="run_ahead must be an int >= 1"):
                DeviceLoader(m, batches(1), "cuda:0", run_ahead=bad)  # type: ignore[arg-type]
        assert DeviceLoader(m, batches(1), "cuda:0", prefetch=3).run_ahead == 8


async def test_a_batch_whose_copy_fails_half_issued_keeps_its_slot_until_the_rest_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of two tensors is copied with one call each: when the second fails (here an
    injected failure) the first is still queued on the device. The pass's end used to free
    the slot (its reservation ended: the budget counted the memory free) under that copy."""
    gate = threading.Event()
    waiting = threading.Event()  # the pass's end waits, in its thread, for device work
    real_wait_all = HostWaits.wait_all

    def wait_all(self: HostWaits, events: Any) -> bool:
        events = list(events)
        if any(not event.query() for event in events):
            waiting.set()
        return real_wait_all(self, events)

    monkeypatch.setattr(HostWaits, "wait_all", wait_all)
    data = [{"a": t, "b": t + 1} for t in batches(3)]
    errors: list[BaseException] = []
    async with ResidencyManager(backend=SimBackend()) as m:
        m.backend.run_in_stream_order(m.backend.device_streams(0).h2d, lambda: gate.wait(10))
        m.backend.faults.fail_transfer_at = 2  # batch 0's "b"; its "a" is queued
        try:
            async with DeviceLoader(m, data, "cuda:0", prefetch=0) as loader:

                async def first() -> None:
                    try:
                        await anext(aiter(loader))
                    except RuntimeError as error:
                        errors.append(error)

                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(first)
                    # The batch raised (it used to, at once), or its pass's end waits for the
                    # copy still queued (it does now).
                    await until(lambda: bool(errors) or waiting.is_set())
                    assert len(live_slots(m)) == 1, "the slot was freed under a queued copy"
                    gate.set()
                assert [str(e) for e in errors] == ["injected transfer failure"]
        finally:
            gate.set()
        assert_nothing_left(m)


async def test_run_ahead_holds_across_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes of one batch each, the device holding every step: each new pass used to start
    with nothing behind it (the steps of the passes before were forgotten), so the consumer
    never parked and ran ahead of the device by as many passes as it liked. The released
    batches of the pass before count as well: the consumer parks at the second batch."""
    data = batches(1)
    gate = threading.Event()
    async with ResidencyManager(backend=SimBackend()) as m:
        parked = threading.Event()
        real_wait = m.backend.wait

        async def wait(waitable: Any) -> None:
            parked.set()  # only the consumer's catch-up awaits device events here
            await real_wait(waitable)

        monkeypatch.setattr(m.backend, "wait", wait)
        stream = m.backend.current_stream("cuda:0")
        got: list[torch.Tensor] = []
        done = anyio.Event()
        try:
            async with DeviceLoader(m, data, "cuda:0", prefetch=1, run_ahead=1) as loader:
                m.backend.run_in_stream_order(stream, lambda: gate.wait(10))  # the held step

                async def passes() -> None:
                    for _ in range(5):
                        got.extend([b.clone() async for b in loader])
                    done.set()

                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(passes)
                    await until(lambda: done.is_set() or parked.is_set())
                    ran_ahead, handed = done.is_set(), loader.stats().batches
                    gate.set()
                    assert not ran_ahead, "five passes ran ahead of the held device"
                    assert handed == 2  # pass 1's batch behind, pass 2's out
                assert loader.stats().device_wait_s > 0
        finally:
            gate.set()
        assert_nothing_left(m)
    assert len(got) == 5 and all(torch.equal(g, data[0]) for g in got)


async def test_a_tensor_kept_past_its_release_is_counted_and_warned_about_once() -> None:
    """``labels.append(batch["y"])``: the ring reuses the slot of a released batch, so the
    kept tensor changes (here: poison; on CUDA: a later batch). Two requests after the
    release the loader sees it still referenced, counts it, and warns once per pass, naming
    the loader, the pass and the batch."""
    data = [{"x": torch.full((8,), float(i)), "y": torch.full((2,), i)} for i in range(8)]
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2, name="kept") as loader:
            labels = []
            with pytest.warns(RuntimeWarning) as warned:
                async for batch in loader:
                    labels.append(batch["y"])
            assert len(warned) == 1, [str(w.message) for w in warned]
            assert warned[0].filename == __file__  # points at the consumer's `async for`
            message = str(warned[0].message)
            assert "'kept', pass 1: batch 0 is still referenced" in message
            assert ".clone()" in message and "kept_after_release" in message
            # Batches 0..5 were looked at (two requests after each release); 6 and 7 not yet.
            assert loader.stats().kept_after_release == 6
            assert "still referenced after their release: 6" in str(loader.stats())
            await loader.drain()
            assert (labels[0].view(torch.uint8) == 0xA5).all()  # what was kept is gone
        assert_nothing_left(m)


@pytest.mark.parametrize("way", ["loop variables", "clones", "async with", "explicit release"])
async def test_a_consumer_that_keeps_nothing_past_the_release_gets_no_warning(way: str) -> None:
    """The loop's own variables (``batch``, ``x = batch["x"]``) still refer to a batch while
    the next one is asked for: that is not keeping it. Nor is a clone, a batch kept with
    ``async with``, or one released explicitly and not used after."""
    data = [{"x": torch.full((8,), float(i)), "y": torch.full((2,), i)} for i in range(8)]
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2) as loader:
            kept: list[Any] = []
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                if way == "loop variables":
                    async for batch in loader:
                        x, y = batch["x"], batch["y"]
                        kept.append(float(x.sum()) + float(y.sum()))
                elif way == "clones":
                    async for batch in loader:
                        kept.append(batch["y"].clone())
                elif way == "async with":
                    async for held in loader.batches():
                        async with held as data_:
                            kept.append(data_["y"].sum().item())
                else:
                    async for held in loader.batches():
                        kept.append(held.data["x"].sum().item())
                        held.release()
            assert len(kept) == 8
            assert loader.stats().kept_after_release == 0
        assert_nothing_left(m)


async def test_fresh_tensors_after_a_ring_pass_are_copied_and_left_intact() -> None:
    """The ring drops its slots' buffers at the end of a pass; the host allocator then hands
    their addresses to new tensors. A pass of managed values over fresh tensors made after
    that copies every one of them (none is taken for a slot's simulated device memory and
    handed out as is) and leaves the user's tensors bit for bit as they were."""
    async with ResidencyManager(backend=SimBackend()) as m:
        for _ in range(8):
            async with DeviceLoader(m, batches(4), "cuda:0", prefetch=2) as loader:
                assert [b.shape async for b in loader] == [torch.Size([256])] * 4
                await loader.drain()  # the slots are freed
            fresh = batches(8, seed=1)
            kept = [t.clone() for t in fresh]
            async with DeviceLoader(m, fresh, "cuda:0", prefetch=2, ring=False) as loader:
                async for batch in loader.batches():
                    assert batch.data is not fresh[batch.index]
                    assert torch.equal(batch.data, kept[batch.index])
                await loader.drain()
            assert all(torch.equal(a, b) for a, b in zip(fresh, kept, strict=True))
        assert_nothing_left(m)


async def test_a_request_the_ring_s_thread_withdrew_meanwhile_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget of exactly one batch (prefetch=2): at each step the consumer's release frees
    the one slot while the ring's thread waits for room for a second one; the thread then
    withdraws that request and takes the freed slot for the very batch. A consumer that read
    the request just before (the race, forced here: its check for a wait on itself lets the
    thread run until it withdrew) must judge the request as it is now, not count the slot the
    thread just took as a batch it holds itself ("only what the waiting task holds itself
    stands in the way")."""
    import aresidency.loader.ring as ring_module

    withdrawn = threading.Event()
    forced = 0
    loader: DeviceLoader | None = None
    withdraw = RingEpoch._withdraw
    reclaim_for = ring_module.reclaim_for

    def withdrawing(self: RingEpoch, request: Any) -> None:
        withdraw(self, request)
        withdrawn.set()

    def reclaiming(manager: ResidencyManager, device: Any, need: int) -> int:
        nonlocal forced
        epoch = None if loader is None else loader._epoch
        withdrawn.clear()
        request = epoch._request if isinstance(epoch, RingEpoch) else None
        # The consumer read this request as blocked: let the thread (which has its freed
        # slot to take) withdraw it now, between the read and the check. (Not a newer
        # request, made since: the loop, here, has not seen it yet, so it is not blocked.)
        live = request is not None and request.blocked_since is not None
        if live and not request.cancelled and withdrawn.wait(0.05):
            forced += 1
        return reclaim_for(manager, device, need)

    def unanswered(self: RingEpoch, request: Any) -> bool:
        return request is not None and not (request.answered or request.cancelled)

    monkeypatch.setattr(RingEpoch, "_withdraw", withdrawing)
    monkeypatch.setattr(ring_module, "reclaim_for", reclaiming)
    # The consumer no longer reads a request that a free slot fits as a wait for room (the
    # thread takes that slot): read every unanswered one as blocked, as it once did, so that
    # the judging after the read, which this test is about, still meets the race.
    monkeypatch.setattr(RingEpoch, "_waits_for_room", unanswered)
    data = batches(24)
    async with ResidencyManager(budgets={"cuda:0": CHARGE}, backend=SimBackend()) as m:
        got = []
        with anyio.fail_after(20):
            async with DeviceLoader(m, data, "cuda:0", prefetch=2) as loader:
                async for batch in loader:
                    got.append(batch.clone())
        assert forced > 0  # the race was run
        assert max_charge(m.trace()) <= CHARGE
        assert_nothing_left(m)
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True)) and len(got) == 24
