"""Weight streaming under stress on the simulated backend: two streamed modules sharing one
device, calls that overlap, calls cancelled while their copies are in flight, a tenant taking
room a call planned on, a module closed while calls queue, blocks run out of call order under
a tight budget. Each test pins down one sequence the randomized stress found going wrong."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import pytest
import torch
from torch import nn

from aresidency import ReplicaMode, ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.integrations import StreamedModule, stream_module

from ._models import Net
from .test_ring import Planned, assert_nothing_left, churn, reference, sizes

M = TypeVar("M", bound=nn.Module)

pytestmark = pytest.mark.anyio


async def until(manager: ResidencyManager, condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (checked at each state change of the manager, and at
    least every 10 ms for conditions on threads)."""
    with anyio.fail_after(10):
        while not condition():
            await manager.wait_for_change(0.01)


def gate_block(model: nn.Module, block: nn.Module) -> tuple[threading.Event, threading.Event]:
    """A pre-hook on ``block`` (run in the streaming worker thread) that sets ``entered`` and
    waits for ``gate``; returns both."""
    entered, gate = threading.Event(), threading.Event()

    def hook(*_: Any) -> None:
        entered.set()
        assert gate.wait(10)

    block.register_forward_pre_hook(hook)
    return entered, gate


async def test_a_call_queued_behind_another_when_aclose_comes_first_is_refused() -> None:
    """A call waits for the one in flight; aclose() is queued before it: once the module is
    closed, the queued call raises that it is closed (it used to run on the discarded values
    and fail with an unavailable value)."""
    model = frozen(Net(n=3))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    entered, gate = gate_block(model, model.layers[0])
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1)
        results: list[Any] = []

        async def call() -> None:
            try:
                results.append(await streamed(x))
            except Exception as error:
                results.append(error)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            await anyio.to_thread.run_sync(entered.wait)
            tasks.start_soon(streamed.aclose)
            await until(m, lambda: streamed._lock.statistics().tasks_waiting == 1)
            tasks.start_soon(call)
            await until(m, lambda: streamed._lock.statistics().tasks_waiting == 2)
            gate.set()
        assert torch.equal(results[0], expected)
        assert isinstance(results[1], RuntimeError) and "is closed" in str(results[1])
        snap = m.snapshot()
        assert snap.location("cuda:0").used_bytes == 0
        assert snap.location("cuda:0").reserved_bytes == 0


async def test_a_call_beside_another_modules_ring_in_flight_waits_for_its_room() -> None:
    """Module a's call holds its ring (the whole budget beside its tensors outside the
    blocks); module b's call starts meanwhile: it waits for the room (it used to fail with
    "streaming could never run", counting a's ring as if it stayed)."""
    a_model, b_model = frozen(Net(n=4, seed=1)), frozen(Net(n=4, seed=2))
    x = torch.randn(2, 16)
    a_expected, b_expected = reference(a_model, x), reference(b_model, x)
    entered, gate = gate_block(a_model, a_model.layers[1])
    block, resident = await sizes(Net(n=4))
    budget = 2 * resident + 3 * block
    backend = SimBackend()
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        a = stream_module(m, a_model, prefetch=2, name="a")
        b = stream_module(m, b_model, prefetch=2, name="b")
        out: dict[str, Any] = {}

        async def call(name: str, streamed: StreamedModule) -> None:
            out[name] = await streamed(x)  # (no grad-mode context around an await: see frozen)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call, "a", a)
            await anyio.to_thread.run_sync(entered.wait)  # a's ring is reserved
            assert a.current_call is not None and a._ring_bytes() == 3 * block
            tasks.start_soon(call, "b", b)
            await until(m, lambda: b.current_call is not None)  # b waits for room
            gate.set()
        assert torch.equal(out["a"], a_expected) and torch.equal(out["b"], b_expected)
        assert backend.max_memory_allocated("cuda:0") <= budget
        for streamed in (a, b):
            await streamed.drain()
        snap = m.snapshot()
        kept = sum(
            snap.value(h).charge_bytes
            for s in (a, b)
            for h in s.handles
            if h.name in s.residency()["kept"]
        )
        assert snap.location("cuda:0").used_bytes == kept
        for streamed in (a, b):
            await streamed.aclose()


async def test_a_call_right_after_one_cancelled_with_copies_in_flight_runs() -> None:
    """Managed values (ring=False): a call is cancelled while its copies wait on the copy
    stream; the next call asks first for a block whose cancelled copy has not settled yet: it
    waits for it to settle and copies it again (it used to lease the copy being cancelled and
    fail with "the transfer bringing it there is being cancelled")."""
    model = frozen(Planned(3, [0, 1, 2], seed=3))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    backend = SimBackend()
    async with ResidencyManager(backend=backend) as m:
        h2d = backend.device_streams(0).h2d
        streamed = stream_module(m, model, prefetch=2, ring=False, keep_resident=False)
        copies = threading.Event()
        h2d.submit(lambda: copies.wait(10))  # the copies wait behind this
        with anyio.CancelScope() as scope:

            async def cancel_once_started() -> None:
                await until(m, lambda: streamed.copies >= 2)  # the resident group and block 0
                scope.cancel()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(cancel_once_started)
                await streamed(x)
        assert scope.cancelled_caught
        assert streamed.cancelling  # the cancelled copies have not settled
        model.plan = [0, 2, 1]
        expected = reference(model, x)
        async with anyio.create_task_group() as tasks:
            result: list[torch.Tensor] = []

            async def call() -> None:
                result.append(await streamed(x))

            tasks.start_soon(call)
            await until(m, lambda: streamed.current_call is not None)
            copies.set()
        assert torch.equal(result[0], expected)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


@pytest.mark.parametrize("plan", [[2, 0, 1], [1, 0], [0, 2, 1, 0], [3, 1, 2, 0, 3]])
async def test_blocks_run_out_of_order_under_a_one_block_budget_finish(plan: list[int]) -> None:
    """Managed values (ring=False), room for one block beside the tensors outside the blocks,
    a model that runs its blocks out of call order: the block it asks for needs the room a
    block prefetched in call order holds. The prefetched block is handed back (the call used
    to wait for room forever)."""
    model = frozen(Planned(max(plan) + 1, plan, seed=4))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(model)
    budget = resident + block + 100
    backend = SimBackend(copy_gbps=0.5)
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        streamed = stream_module(m, model, prefetch=2, ring=False)
        for _ in range(2):
            with anyio.fail_after(10):
                assert torch.equal(await streamed(x), expected)
        assert backend.max_memory_allocated("cuda:0") <= budget
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_a_ring_call_streams_a_kept_block_when_a_tenant_took_its_rings_room() -> None:
    """The ring's call plans to keep three blocks beside one slot; while their copies are on
    their way, a tenant takes the room left for the slot (and keeps it): the call streams a
    block it meant to keep instead (it used to wait for room its own kept blocks held)."""
    model = frozen(Net(n=5, seed=5))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(model)
    budget = resident + 4 * block  # (one block short of the whole model, which would stay)
    backend = SimBackend()
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        h2d = backend.device_streams(0).h2d
        streamed = stream_module(m, model, prefetch=0, name="net")
        tenant = m.register(
            torch.zeros(block // 4), name="tenant", replica_mode=ReplicaMode.REPLICABLE
        )
        copies = threading.Event()
        h2d.submit(lambda: copies.wait(10))
        result: list[torch.Tensor] = []

        async def call() -> None:
            result.append(await streamed(x))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            await until(m, lambda: streamed.copies == 4)  # the resident group, three blocks
            assert len(streamed.kept) == 4
            m.materialize_nowait(tenant, "cuda:0")  # the room left for the ring's slot
            copies.set()
        assert torch.equal(result[0], expected)
        assert backend.max_memory_allocated("cuda:0") <= budget
        await streamed.drain()
        await m.release(tenant, "cuda:0")
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_random_two_modules_calls_cancellations_tenant_and_writes() -> None:
    """Randomized (fixed seeds): two streamed modules (ring or managed values, models that
    run blocks out of order) called in parallel tasks beside a tenant taking and giving back
    room, calls cancelled at random moments, weights written in place between calls, drain
    now and then. Finished calls bit-identical; the budget holds; once settled, each module
    holds at the device exactly what it keeps, and nothing after aclose."""
    for seed in range(4):
        await _two_modules(seed)


def frozen(model: M) -> M:
    """``model`` without autograd: calls in concurrent tasks must not wrap their awaits in
    ``torch.no_grad()`` (the grad mode is the thread's; contexts exited out of order by the
    tasks leave it off for every later test of the loop's thread)."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


async def _two_modules(seed: int) -> None:
    rng = random.Random(7000 + seed)
    models = []
    for k in range(2):
        n = rng.randint(2, 4)
        plan = [rng.randrange(n) for _ in range(rng.randint(n, 2 * n))]
        models.append(frozen(Planned(n, plan, seed * 10 + k)))
    x = torch.randn(2, 16)
    block = max([(await sizes(model))[0] for model in models])
    resident = max([(await sizes(model))[1] for model in models])
    budget = resident + block + rng.randint(2, 5) * block
    backend = SimBackend(copy_gbps=0.5)
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        mods = [
            stream_module(m, model, prefetch=rng.randint(0, 3), ring=k == 0, name=f"m{k}")
            for k, model in enumerate(models)
        ]
        tenant = m.register(
            torch.zeros(block // 4), name="tenant", replica_mode=ReplicaMode.REPLICABLE
        )
        done = anyio.Event()

        async def other() -> None:
            await churn(m, tenant, done, rng, [0, 0.001])

        async def caller(k: int) -> None:
            streamed, model = mods[k], models[k]
            for _ in range(4):
                if rng.random() < 0.2:
                    await streamed.drain()
                    with torch.no_grad():
                        p = rng.choice(list(model.parameters()))
                        p.copy_(torch.randn(p.shape))
                expected = reference(model, x)
                with anyio.move_on_after(rng.choice([None, 0.001, 0.005])) as scope:
                    got = await streamed(x)
                if not scope.cancelled_caught:
                    assert torch.equal(got, expected), (seed, k)
                assert backend.max_memory_allocated("cuda:0") <= budget

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(other)
                async with anyio.create_task_group() as callers:
                    for k in range(2):
                        callers.start_soon(caller, k)
                done.set()
        for streamed in mods:
            await streamed.drain()
        snap = m.snapshot()
        if "cuda:0" in [str(loc) for loc in snap.value(tenant).locations]:
            await m.release(tenant, "cuda:0")
        snap = m.snapshot()
        location = snap.location("cuda:0")
        assert location.reserved_bytes == 0 and location.peak_bytes <= budget
        kept_bytes = 0
        for streamed in mods:
            # Before a module's first call (every call of it may have been cancelled while it
            # waited for its turn), residency() is the plan that call would make: it keeps
            # nothing yet (see the test below).
            kept = set(streamed.residency()["kept"]) if streamed.calls else set()
            for handle in streamed.handles:
                value = snap.value(handle)
                here = "cuda:0" in [str(loc) for loc in value.locations]
                assert here == (handle.name in kept), (seed, handle.name)
                kept_bytes += value.charge_bytes if here else 0
                for record in value.materializations:
                    assert record.use_count == 0 and record.pending_event_count == 0
            assert not streamed.rings
        assert location.used_bytes == kept_bytes
        for streamed in mods:
            await streamed.aclose()
        assert m.snapshot().location("cuda:0").used_bytes == 0
    assert backend.memory_allocated("cuda:0") == 0


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "managed"])
async def test_two_calls_whose_tensors_outside_the_blocks_fill_the_room_of_a_block_finish(
    ring: bool,
) -> None:
    """Two modules' calls start together under a budget that holds both modules' tensors
    outside the blocks but not those and a block besides: each call used to take its own,
    then wait for a block's room that the other's held, for ever. The calls open one at a
    time now (per manager and device), so the second waits before it takes anything."""
    a_model, b_model = frozen(Net(n=3, seed=1)), frozen(Net(n=3, seed=2))
    x = torch.randn(2, 16)
    a_expected, b_expected = reference(a_model, x), reference(b_model, x)
    block, resident = await sizes(Net(n=3))
    budget = resident + block + resident // 2  # one call's tensors and a block fit: not two
    assert 2 * resident <= budget < 2 * resident + block
    backend = SimBackend(copy_gbps=0.5)
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        a = stream_module(m, a_model, prefetch=1, name="a", ring=ring)
        b = stream_module(m, b_model, prefetch=1, name="b", ring=ring)
        out: dict[str, Any] = {}

        async def call(name: str, streamed: StreamedModule) -> None:
            for _ in range(3):
                out[name] = await streamed(x)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(call, "a", a)
                tasks.start_soon(call, "b", b)
        assert torch.equal(out["a"], a_expected) and torch.equal(out["b"], b_expected)
        assert backend.max_memory_allocated("cuda:0") <= budget
        for streamed in (a, b):
            await streamed.drain()
            await streamed.aclose()


async def test_a_call_cancelled_while_it_waits_for_its_admission_turn_leaves_nothing() -> None:
    """Module a's call over managed values holds the admission turn at the device (it is in a
    block); module b's call waits for the turn and is cancelled there: it raises the
    cancellation, has taken nothing, and a's call and a later call of b still run."""
    a_model, b_model = frozen(Net(n=3, seed=1)), frozen(Net(n=3, seed=2))
    x = torch.randn(2, 16)
    a_expected, b_expected = reference(a_model, x), reference(b_model, x)
    entered, gate = gate_block(a_model, a_model.layers[1])
    async with ResidencyManager(backend=SimBackend()) as m:
        a = stream_module(m, a_model, prefetch=1, name="a", ring=False)
        b = stream_module(m, b_model, prefetch=1, name="b", ring=False)
        out: dict[str, Any] = {}

        async def call_a() -> None:
            out["a"] = await a(x)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call_a)
            await anyio.to_thread.run_sync(entered.wait)
            cancelled = anyio.Event()
            b_scope: list[anyio.CancelScope] = []

            async def call_b() -> None:
                with anyio.CancelScope() as scope:
                    b_scope.append(scope)
                    await b(x)
                cancelled.set()

            tasks.start_soon(call_b)
            await until(m, lambda: bool(b_scope) and b._lock.locked())
            assert b.current_call is None  # it waits for its turn, before planning anything
            b_scope[0].cancel()
            await cancelled.wait()
            assert all(
                "cuda:0" not in [str(loc) for loc in m.snapshot().value(h).locations]
                for h in b.handles
            )
            gate.set()
        assert torch.equal(out["a"], a_expected)
        assert torch.equal(await b(x), b_expected)
        for streamed in (a, b):
            await streamed.drain()
            await streamed.aclose()


async def test_a_module_whose_calls_were_all_cancelled_in_their_turn_reports_its_plan() -> None:
    """Module a's call over managed values holds the device's admission turn; each call of
    module b is cancelled while it waits for its turn. b has made no call yet, so
    ``residency()`` is the plan its first call would make (documented): ``kept`` names
    groups none of which is at the device. Once a call of b ran, ``kept`` names exactly the
    groups there. (Under load, the randomized test saw one module's four calls all time out
    in their turn, and took that plan for what the module keeps.)"""
    a_model, b_model = frozen(Net(n=3, seed=1)), frozen(Net(n=3, seed=2))
    x = torch.randn(2, 16)
    a_expected, b_expected = reference(a_model, x), reference(b_model, x)
    block, resident = await sizes(Net(n=3))
    budget = 2 * (resident + 3 * block)  # both whole models stay
    entered, gate = gate_block(a_model, a_model.layers[1])
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=SimBackend()) as m:
        a = stream_module(m, a_model, prefetch=1, name="a", ring=False)
        b = stream_module(m, b_model, prefetch=1, name="b")
        out: dict[str, Any] = {}

        async def call_a() -> None:
            out["a"] = await a(x)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call_a)
            await anyio.to_thread.run_sync(entered.wait)  # a holds the turn
            for _ in range(2):
                with anyio.move_on_after(0.01) as scope:
                    await b(x)
                assert scope.cancelled_caught
            gate.set()
        assert torch.equal(out["a"], a_expected)
        await b.drain()

        def at_device() -> set[str]:
            snap = m.snapshot()
            return {
                h.name
                for h in b.handles
                if "cuda:0" in [str(loc) for loc in snap.value(h).locations]
            }

        assert b.calls == 0
        assert set(b.residency()["kept"]) == {h.name for h in b.handles}  # the plan
        assert at_device() == set()
        assert torch.equal(await b(x), b_expected)
        await b.drain()
        assert b.calls == 1 and set(b.residency()["kept"]) == at_device() != set()
        for streamed in (a, b):
            await streamed.aclose()


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "managed"])
async def test_a_call_cancelled_while_a_kept_block_arrives_keeps_only_what_is_here(
    ring: bool,
) -> None:
    """A call cancelled while the copy of a block it plans to keep is in flight: once the
    module drained, ``residency()["kept"]`` names exactly the groups at the device (the
    arrival the cancellation aborted is not kept), and the next call is exact."""
    model = frozen(Planned(3, [0, 1, 2], 5))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(model)
    backend = SimBackend(copy_gbps=0.002)  # a block's copy takes a while
    budget = resident + 6 * block  # every block can stay beside the window
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        streamed = stream_module(m, model, prefetch=1, ring=ring, name="s")
        first = streamed.handles[0]
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(streamed, x)
            await until(m, lambda: m.copy_issued(first, "cuda:0"))
            tasks.cancel_scope.cancel()
        backend.copy_gbps = None
        await streamed.drain()
        snap = m.snapshot()
        kept = set(streamed.residency()["kept"])
        for handle in streamed.handles:
            here = "cuda:0" in [str(loc) for loc in snap.value(handle).locations]
            assert here == (handle.name in kept), (handle.name, kept)
        assert torch.equal(await streamed(x), expected)
        await streamed.aclose()
    assert backend.memory_allocated("cuda:0") == 0


async def test_drain_forgets_a_kept_group_that_is_not_at_the_device() -> None:
    """Whatever left the module's plan naming a group that is no longer at the device (a
    release or an aborted arrival that settled between calls), ``drain`` ends with ``kept``
    naming only groups there: what ``residency()`` reports and the stress test checks."""
    model = frozen(Planned(3, [0, 1, 2], 6))
    x = torch.randn(2, 16)
    block, resident = await sizes(model)
    async with ResidencyManager(budgets={"cuda:0": resident + 2 * block}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=0, ring=False, name="s")
        await streamed(x)
        await streamed.drain()
        names = {h.name: i for i, h in enumerate(streamed.handles)}
        snap = m.snapshot()
        gone = [
            names[h.name]
            for h in streamed.handles
            if "cuda:0" not in [str(loc) for loc in snap.value(h).locations]
        ]
        assert gone, "the budget keeps only part of the model"
        streamed.kept.add(gone[0])  # the plan names it, the device does not hold it
        await streamed.drain()
        assert gone[0] not in streamed.kept
        assert set(streamed.residency()["kept"]) == {
            h.name
            for h in streamed.handles
            if "cuda:0" in [str(loc) for loc in m.snapshot().value(h).locations]
        }
        await streamed.aclose()
