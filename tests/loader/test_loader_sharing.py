"""A loader sharing one device budget with the consumer's own step: a scope or a streamed
call in the task that iterates the loader, whose room the loader's batches copied ahead hold.

Those batches move only when the consumer asks for the next one, so a wait of the step for
their room would never end: it is refused at once, naming the loader. Where the room is there
(the budget holds the window and the step together), the step gets it, and while a streamed
call waits for room the loader holds back (``want_room``) as it does for a waiting scope.
Every test runs through the ring and through managed values (the ``ring`` fixture)."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
import torch
from torch import nn

from aresidency import (
    Materialize,
    MemoryReservation,
    ResidencyBudgetError,
    ResidencyManager,
    ResidencyPlan,
)
from aresidency.backends.sim import SimBackend
from aresidency.core.errors import ResidencyPlanError
from aresidency.integrations import stream_module
from aresidency.loader import DeviceLoader

from ._support import KiB, assert_nothing_left, batches, until

pytestmark = pytest.mark.anyio

CHARGE = 1 * KiB  # a 256-float batch at the device


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))  # 4.5 KiB per block


def taken(m: ResidencyManager) -> int:
    """What is charged or reserved at cuda:0 now."""
    location = m.snapshot().location("cuda:0")
    return location.used_bytes + location.reserved_bytes


async def window_filled(m: ResidencyManager, loader: DeviceLoader, got: int, ahead: int) -> None:
    """Until the loader has read ``ahead`` batches past the ``got`` handed out, and settled.
    Polled: the ring's thread tells the loop nothing while nobody waits."""
    await until(lambda: loader.stats().source_batches >= got + ahead)
    await anyio.wait_all_tasks_blocked()


async def test_a_step_scope_that_only_the_loaders_window_keeps_out_is_refused_at_once(
    ring: bool | None,
) -> None:
    data = batches(8)
    async with ResidencyManager(budgets={"cuda:0": 4 * CHARGE}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=3, ring=ring, name="train") as loader:
            got = []
            async for batch in loader:
                got.append(batch.clone())
                if len(got) == 2:
                    await window_filled(m, loader, len(got), 3)
                    before = m.snapshot().location("cuda:0")
                    plan = ResidencyPlan(reserve=[MemoryReservation("ws", "cuda:0", 2 * CHARGE)])
                    with anyio.fail_after(5), pytest.raises(ResidencyPlanError) as raised:
                        async with m.scope(plan, timeout=None):
                            pass
                    message = str(raised.value)
                    assert "only what the waiting task holds itself" in message
                    assert "of train" in message and "3 " in message  # three copied ahead
                    assert "Lower train's prefetch" in message
                    after = m.snapshot().location("cuda:0")
                    assert (after.used_bytes, after.reserved_bytes) == (
                        before.used_bytes,
                        before.reserved_bytes,
                    )
                    assert m.waiting == 0
        assert_nothing_left(m)
    # the pass went on with nothing lost
    assert len(got) == 8 and all(torch.equal(a, b) for a, b in zip(got, data))


async def test_a_step_scope_that_fits_beside_the_window_gets_in(ring: bool | None) -> None:
    data = batches(6)
    async with ResidencyManager(budgets={"cuda:0": 6 * CHARGE}, backend=SimBackend()) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=3, ring=ring) as loader:
            entered = 0
            async for batch in loader:
                await window_filled(m, loader, entered + 1, min(3, 5 - entered))
                plan = ResidencyPlan(reserve=[MemoryReservation("ws", "cuda:0", 2 * CHARGE)])
                with anyio.fail_after(5):
                    async with m.scope(plan):
                        assert torch.equal(batch, data[entered])
                entered += 1
        assert entered == 6
        assert m.snapshot().location("cuda:0").peak_bytes <= 6 * CHARGE
        assert_nothing_left(m)


@pytest.mark.parametrize("copy_gbps", [None, 0.01])
@pytest.mark.parametrize("host_values", [0, 300], ids=["small", "sliced"])
async def test_a_step_scope_that_needs_a_free_slot_gets_it_or_is_refused_never_waits(
    copy_gbps: float | None, host_values: int
) -> None:
    """The ring's slots: one handed out, one copied ahead, one free (the thread about to
    fill it). The consumer's scope needs less than the free slot's room: admission counts
    that slot as given back, so the thread must not fill it meanwhile (it did, and the scope
    then waited for ever, since only the consumer's own slots stood in the way). Each time the
    scope gets in, or (when the slot was filled before the scope asked) is refused at once.
    ``sliced``: the plan also enters hundreds of host values, so admission judges it in
    slices, letting the loop (and the ring's service) run in between."""
    for attempt in range(8):
        data = batches(8, seed=attempt)
        budget = 3 * CHARGE + 64  # the ring of prefetch=2: no room for a step beside it
        async with ResidencyManager(
            budgets={"cuda:0": budget}, backend=SimBackend(copy_gbps=copy_gbps)
        ) as m:
            host = [m.register(torch.zeros(4), name=f"h{i}") for i in range(host_values)]
            async with DeviceLoader(m, data, "cuda:0", prefetch=2, ring=True) as loader:
                got = 0
                async for batch in loader:
                    assert torch.equal(batch, data[got])
                    if got == 3:
                        plan = ResidencyPlan(
                            reserve=[MemoryReservation("ws", "cuda:0", CHARGE // 2)],
                            enter=[Materialize(h, "pageable-host") for h in host],
                        )
                        try:
                            with anyio.fail_after(5):
                                async with m.scope(plan, timeout=None):
                                    pass
                        except ResidencyPlanError as error:
                            assert "only what the waiting task holds itself" in str(error)
                    got += 1
                    await anyio.lowlevel.checkpoint()
                assert got == 8
                assert m.snapshot().location("cuda:0").peak_bytes <= budget
            for h in host:
                await m.discard(h)
            assert_nothing_left(m)


async def test_the_same_scope_in_another_task_waits_for_the_consumer(ring: bool | None) -> None:
    # Not the consumer's own: the consumer goes on, the window moves, and the scope gets in.
    data = batches(10)
    async with ResidencyManager(budgets={"cuda:0": 4 * CHARGE}, backend=SimBackend()) as m:
        entered = anyio.Event()

        async def tenant() -> None:
            plan = ResidencyPlan(reserve=[MemoryReservation("ws", "cuda:0", 2 * CHARGE)])
            async with m.scope(plan, timeout=None):
                entered.set()

        async with (
            anyio.create_task_group() as tasks,
            DeviceLoader(m, data, "cuda:0", prefetch=3, ring=ring) as loader,
        ):
            got = 0
            async for batch in loader:
                del batch
                got += 1
                if got == 1:
                    await window_filled(m, loader, got, 3)
                    tasks.start_soon(tenant)
                    await anyio.wait_all_tasks_blocked()
                    assert not entered.is_set() and m.waiting == 1
        assert entered.is_set() and got == 10
        assert_nothing_left(m)


@pytest.mark.parametrize("stream_ring", [False, None], ids=["values", "ring"])
async def test_a_streamed_call_that_only_the_loaders_window_keeps_out_raises_at_once(
    ring: bool | None, stream_ring: bool | None
) -> None:
    net = model()
    x = torch.randn(1, 32)
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        streamed = stream_module(m, net, "cuda:0", prefetch=1, ring=stream_ring)
        data = batches(4, 1024)  # 4 KiB each: the window of two fills the budget
        async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring, name="feed") as loader:
            async for batch in loader:
                await window_filled(m, loader, 1, 1)
                with (
                    anyio.fail_after(5),
                    torch.no_grad(),
                    pytest.raises(ResidencyBudgetError) as raised,
                ):
                    await streamed(x)
                message = str(raised.value)
                assert "only what the waiting task holds itself" in message
                assert "of feed" in message and "Lower feed's prefetch" in message
                assert not m.waiting_for_room("cuda:0")  # it no longer asks for room
                del batch
                break
        await streamed.drain()
        await streamed.aclose()
        assert_nothing_left(m)


@pytest.mark.parametrize("stream_ring", [False, None], ids=["values", "ring"])
async def test_a_streamed_call_beside_the_loaders_window_runs_within_the_budget(
    ring: bool | None, stream_ring: bool | None
) -> None:
    net = model()
    x = torch.randn(1, 32)
    with torch.no_grad():
        expected = net(x)
    budget = 13 * KiB  # the window (two 4 KiB batches) and one 4.5 KiB block
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        streamed = stream_module(m, net, "cuda:0", prefetch=1, ring=stream_ring)
        data = batches(6, 1024)
        steps = 0
        async with DeviceLoader(m, data, "cuda:0", prefetch=1, ring=ring) as loader:
            async for batch in loader:
                with anyio.fail_after(5), torch.no_grad():
                    y = await streamed(x)
                assert torch.equal(y, expected)
                assert torch.equal(batch, data[steps])
                steps += 1
        assert steps == 6
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert m.backend.max_memory_allocated("cuda:0") <= budget
        await streamed.drain()
        await streamed.aclose()
        assert_nothing_left(m)


async def test_while_a_streamed_call_waits_for_room_the_loader_holds_back(
    ring: bool | None,
) -> None:
    # Another task holds the room a block needs; the consumer of a loader (a third task) frees
    # room as it goes. The loader must leave it to the waiting call, as it would to a scope.
    net = model()
    x = torch.randn(1, 32)
    block = 4 * KiB + 512
    budget = block + 4 * CHARGE
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        streamed = stream_module(m, net, "cuda:0", prefetch=0, ring=False, keep_resident=False)
        outcome: list[object] = []
        returned = anyio.Event()  # (no state change need follow the call's return)
        blocker = m.reservation("other", "cuda:0", block)
        await blocker.__aenter__()

        async def call() -> None:
            with torch.no_grad():
                outcome.append(await streamed(x))
            returned.set()

        data = batches(12)
        async with (
            anyio.create_task_group() as tasks,
            DeviceLoader(m, data, "cuda:0", prefetch=3, ring=ring) as loader,
        ):
            iterator = aiter(loader)
            first = await anext(iterator)
            await window_filled(m, loader, 1, 3)
            tasks.start_soon(call)
            await anyio.wait_all_tasks_blocked()
            assert m.waiting_for_room("cuda:0") and not outcome
            await blocker.__aexit__(None, None, None)  # its room: the call's, not the loader's
            got = [first.clone()]
            del first
            async for batch in iterator:
                got.append(batch.clone())
            with anyio.fail_after(5):
                await returned.wait()
        assert torch.equal(outcome[0], net(x).detach())  # type: ignore[arg-type]
        assert not m.waiting_for_room("cuda:0")
        assert all(torch.equal(a, b) for a, b in zip(got, data)) and len(got) == 12
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        await streamed.drain()
        await streamed.aclose()
        assert_nothing_left(m)


async def test_two_loaders_read_in_lockstep_need_room_for_both_windows(ring: bool | None) -> None:
    """One task reads two loaders in lockstep (a batch of each per step): the first fills its
    window before the second asks for its first batch, so with less room than both windows
    the second's wait would never end and is refused at once, naming the first's window.
    The error says what the batch is: managed values to be copied there (a materialization;
    it said "a MemoryReservation"), or a ring slot (a reservation). With room for both
    windows, every batch of both arrives."""
    first, second = batches(4, seed=1), batches(4, seed=2)
    async with ResidencyManager(budgets={"cuda:0": 2 * CHARGE}, backend=SimBackend()) as m:
        async with (
            DeviceLoader(m, first, "cuda:0", prefetch=1, ring=ring, name="a") as a,
            DeviceLoader(m, second, "cuda:0", prefetch=1, ring=ring, name="b") as b,
        ):
            into_a, into_b = aiter(a), aiter(b)
            with anyio.fail_after(10):
                await anext(into_a)
                await window_filled(m, a, 1, 1)
                # (read from the source is not yet in the device's room: wait until a's
                # window takes the whole budget, as the refusal below needs)
                await until(lambda: taken(m) >= 2 * CHARGE)
                with pytest.raises(ResidencyBudgetError) as caught:
                    await anext(into_b)
        error = caught.value
        assert "only what the waiting task holds itself stands in the way" in str(error)
        assert "batch 0 of b" in str(error) and " of a (" in str(error)
        if ring is False:
            assert error.kind == "materialization"
            assert "by a new materialization" in str(error)
        else:
            assert error.kind == "reservation"
        assert_nothing_left(m)
    async with ResidencyManager(budgets={"cuda:0": 4 * CHARGE}, backend=SimBackend()) as m:
        async with (
            DeviceLoader(m, first, "cuda:0", prefetch=1, ring=ring) as a,
            DeviceLoader(m, second, "cuda:0", prefetch=1, ring=ring) as b,
        ):
            got = []
            into_b = aiter(b)
            with anyio.fail_after(10):
                async for x in a:
                    y = await anext(into_b)
                    got.append((x.clone(), y.clone()))
        assert [(x.tolist(), y.tolist()) for x, y in got] == [
            (x.tolist(), y.tolist()) for x, y in zip(first, second, strict=True)
        ]
        assert_nothing_left(m)
