"""Weight streaming through the ring (``stream_module(..., ring=True)``, the default for weights
in pinned host memory) on the simulated backend (CUDA devices simulated in host memory: streams
run work in order on worker threads, memory is poisoned when released).

The ring charges one reservation per call and copies blocks into its slots from the thread
that runs them; these tests check what it promises: the budget sees exactly that reservation,
slots are reused only after their readers, a block asked out of order still gets its own
weights, a failed copy or a cancelled call leaves nothing, and a call that follows before the
device passed the previous one takes its ring over instead of waiting."""

from __future__ import annotations

import concurrent.futures
import copy
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from torch import nn

from aresidency import ReplicaMode, ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.integrations import StreamedModule, stream_module

from ._models import Block, Net, Sleepy, SleepyNet

pytestmark = pytest.mark.anyio


def reference(module: nn.Module, *args: Any) -> torch.Tensor:
    """The plain module's output on the CPU (slow blocks made quick: this runs on the loop)."""
    sleepy = [(sub, sub.seconds) for sub in module.modules() if isinstance(sub, Sleepy)]
    for sub, _ in sleepy:
        sub.seconds = 0.0
    try:
        with torch.no_grad():
            out = module(*args)
    finally:
        for sub, seconds in sleepy:
            sub.seconds = seconds
    assert isinstance(out, torch.Tensor)
    return out


def ring_reservations(manager: ResidencyManager) -> dict[str, int]:
    """The ring reservations active at cuda:0 now (name -> bytes)."""
    snap = manager.snapshot()
    return {
        name: nbytes
        for name, nbytes in snap.location("cuda:0").reservations
        if name.startswith("stream ring")
    }


def assert_nothing_left(manager: ResidencyManager, streamed: StreamedModule) -> None:
    snap = manager.snapshot()
    location = snap.location("cuda:0")
    assert location.reserved_bytes == 0, location
    kept = set(streamed.residency()["kept"])
    kept_bytes = sum(snap.value(h).charge_bytes for h in streamed.handles if h.name in kept)
    assert location.used_bytes == kept_bytes
    for handle in streamed.handles:
        for record in snap.value(handle).materializations:
            assert record.use_count == 0 and record.pending_event_count == 0
    assert not streamed.rings


async def churn(
    m: ResidencyManager, tenant: Any, done: anyio.Event, rng: Any, holds: list[float]
) -> None:
    """Another tenant of cuda:0 until ``done``: it takes room for ``tenant`` whenever there is
    some (waiting for a change otherwise), holds it for one of ``holds`` seconds (drawn from
    ``rng``) and gives it back."""
    while not done.is_set():
        try:
            await m.materialize(tenant, "cuda:0")
        except Exception:  # no room now: a streamed call holds it
            await m.wait_for_change(0.01)
            continue
        await anyio.sleep(rng.choice(holds))
        await m.release(tenant, "cuda:0")
        await anyio.lowlevel.checkpoint()


async def sizes(model: nn.Module) -> tuple[int, int]:
    """(largest block, resident bytes) of ``model`` streamed."""
    async with ResidencyManager(backend="sim") as m:
        probe = stream_module(m, model, prefetch=0)
        out = max(probe.block_bytes), probe.resident_bytes
        await probe.aclose()
    return out


async def test_a_call_charges_one_reservation_for_its_ring_and_no_block_replicas() -> None:
    model = SleepyNet(n=6, seconds=0.02)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2, name="net")
        assert streamed.ring
        ran = threading.Event()
        hook = model.layers[1].register_forward_hook(lambda *_: ran.set())
        result: list[torch.Tensor] = []

        async def call() -> None:
            with torch.no_grad():
                result.append(await streamed(x))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            await anyio.to_thread.run_sync(ran.wait)  # in the middle of the call
            block = max(streamed.block_bytes)
            assert list(ring_reservations(m).values()) == [3 * block]
            snap = m.snapshot()
            on_device = [
                h.name
                for h in streamed.handles
                if "cuda:0" in [str(loc) for loc in snap.value(h).locations]
            ]
            assert on_device == []  # blocks live in the ring, not as replicas
        hook.remove()
        assert torch.equal(result[0], expected)
        assert streamed.copies == 6  # each block once
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_device_memory_stays_within_a_budget_of_three_blocks() -> None:
    # The test's own set-up (a model and its output on the CPU) off the loop: the guard
    # measures the code under test.
    model = await anyio.to_thread.run_sync(lambda: Net(d=64, n=12))
    x = torch.randn(4, 16)
    expected = await anyio.to_thread.run_sync(reference, model, x)
    block, resident = await sizes(await anyio.to_thread.run_sync(lambda: Net(d=64, n=12)))
    budget = resident + 3 * block
    backend = SimBackend()
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        streamed = stream_module(m, model, prefetch=5)  # wants six slots: three fit
        for _ in range(3):
            backend.reset_peak_memory_allocated("cuda:0")
            with torch.no_grad():
                assert torch.equal(await streamed(x), expected)
            assert backend.max_memory_allocated("cuda:0") <= budget
            assert m.snapshot().location("cuda:0").peak_bytes <= budget
        reserves = [
            t.nbytes
            for t in m.trace().transitions
            if t.kind == "reserve" and t.name and t.name.startswith("stream ring")
        ]
        assert reserves and max(reserves) <= budget - resident
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()
    assert backend.memory_allocated("cuda:0") == 0


async def test_a_budget_of_one_block_streams_through_one_slot() -> None:
    model = Net(d=32, n=5)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(Net(d=32, n=5))
    async with ResidencyManager(budgets={"cuda:0": resident + block + 100}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=4)
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        reserves = [t.nbytes for t in m.trace().transitions if t.kind == "reserve"]
        assert reserves == [block]
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


class Shuffled(nn.Module):
    """Runs its blocks out of order: skips one, repeats one, goes back."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(16, seed) for seed in range(5))
        self.plan = [0, 2, 1, 2, 4, 0, 3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.plan:
            x = self.layers[i](x)
        return x


@pytest.mark.parametrize("prefetch", [0, 1, 3])
async def test_blocks_asked_out_of_order_get_their_own_weights(prefetch: int) -> None:
    model = Shuffled()
    x = torch.randn(3, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=prefetch)
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_a_failed_copy_fails_the_call_and_the_next_call_works() -> None:
    model = Net(n=6)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1)
        m.backend.faults.fail_transfer_at = 3  # the resident group's copy, then ring copies
        with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
            await streamed(x)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_a_call_right_behind_the_previous_takes_its_ring_over() -> None:
    """The first call's last block leaves 0.3 s of (simulated) device work behind it, so the
    ring cannot retire before the second call starts: the second takes it over (one
    reservation for both calls) and its copies wait, on the device, for the first call's
    readers of each slot."""
    model = Net(n=5)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(Net(n=5))
    # (a strict budget: the tensors outside the blocks stay between calls)
    async with ResidencyManager(budgets={"cuda:0": resident + 3 * block}, backend="sim") as m:
        compute = m.backend.device_streams(0).compute  # type: ignore[attr-defined]
        streamed = stream_module(m, model, prefetch=2, name="net")
        busy = model.layers[-1].register_forward_hook(lambda *_: compute.sleep(0.3))
        with torch.no_grad():
            first = await streamed(x)
        busy.remove()
        assert list(streamed.rings) == ["stream ring net #1"]  # not retired yet
        with torch.no_grad():
            second = await streamed(x)
        assert torch.equal(first, expected) and torch.equal(second, expected)
        names = [
            t.name
            for t in m.trace().transitions
            if t.kind == "reserve" and t.name and t.name.startswith("stream ring")
        ]
        assert names == ["stream ring net #1"]
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_residency_counts_the_modules_own_idle_ring_as_its_own() -> None:
    """``residency()["others_bytes"]`` is what other tenants hold at the device. After a call,
    while the device has not passed it yet, the call's ring stays reserved for the next call:
    it was counted as another tenant's (a module alone on its device reported others)."""
    model = Net(n=5)
    block, resident = await sizes(Net(n=5))
    async with ResidencyManager(budgets={"cuda:0": resident + 3 * block}, backend="sim") as m:
        compute = m.backend.device_streams(0).compute  # type: ignore[attr-defined]
        gate = threading.Event()  # the device stays behind the call until it is set
        streamed = stream_module(m, model, prefetch=2, name="net")
        hook = model.layers[-1].register_forward_hook(
            lambda *_: m.backend.run_in_stream_order(compute, gate.wait)
        )
        try:
            with torch.no_grad():
                await streamed(torch.randn(2, 16))
            assert list(streamed.rings) == ["stream ring net #1"]  # idle, not retired
            assert ring_reservations(m)
            assert streamed.residency()["others_bytes"] == 0
            m.set_budget("cuda:0", resident + 3 * block + 1024)  # room for another tenant
            other = m.register(torch.zeros(256), name="other", location="cuda:0")
            assert streamed.residency()["others_bytes"] == m.snapshot().value(other).charge_bytes
        finally:
            hook.remove()
            gate.set()
        await streamed.drain()
        await streamed.aclose()


async def test_cancelling_a_call_that_waits_for_room_leaves_nothing() -> None:
    model = Net(n=4)
    x = torch.randn(2, 16)
    block, resident = await sizes(Net(n=4))
    async with ResidencyManager(budgets={"cuda:0": resident + block}, backend="sim") as m:
        other = m.register(
            torch.zeros(block // 4), name="other", replica_mode=ReplicaMode.REPLICABLE
        )
        await m.materialize(other, "cuda:0")  # takes the room of the ring's one slot
        streamed = stream_module(m, model, prefetch=2)
        with anyio.move_on_after(0.05) as scope, torch.no_grad():
            await streamed(x)  # waits for room for one slot
        assert scope.cancelled_caught
        await streamed.drain()
        assert ring_reservations(m) == {}
        await m.release(other, "cuda:0")
        with torch.no_grad():
            assert torch.equal(await streamed(x), reference(model, x))
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_ring_true_needs_pinned_host_weights() -> None:
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(ValueError, match="ring=True needs the weights in pinned host"):
            stream_module(m, Net(), host="pageable-host", ring=True)
        with pytest.raises(TypeError, match="ring must be"):
            stream_module(m, Net(), ring="yes")  # type: ignore[arg-type]
        streamed = stream_module(m, Net(), host="pageable-host")
        assert not streamed.ring  # staged copies go through the managed values
        await streamed.aclose()


async def test_a_sequential_on_the_loop_streams_through_the_ring() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(*(Sleepy(16, 0.0) for _ in range(6)))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend=SimBackend(copy_gbps=0.05)) as m:
        streamed = stream_module(m, model, prefetch=1)
        assert streamed.ring
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


class Planned(nn.Module):
    """Runs its blocks in a given order (repeats, skips and going back included)."""

    def __init__(self, n: int, plan: list[int], seed: int) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList(Block(16, seed + i) for i in range(n))
        self.plan = plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i in self.plan:
            x = self.layers[i](x)
        return x


@pytest.mark.parametrize("seed", range(12))
async def test_random_models_orders_budgets_and_calls(seed: int) -> None:
    """Randomized: block count, the order the forward runs them in, prefetch, budget (from
    one block beside the resident tensors to none), keeping resident or not, calls with and
    without drain between them, sequential and list models. Every output bit-identical, the
    simulated device memory and the ledger within the budget, nothing left after drain."""
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 7)
    plan = [rng.randrange(n) for _ in range(rng.randint(1, 2 * n + 1))]
    sequential = rng.random() < 0.3
    model: nn.Module
    if sequential:
        torch.manual_seed(seed)
        model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(n)))
    else:
        model = Planned(n, plan, seed)
    xs = [torch.randn(2, 16) for _ in range(rng.randint(1, 3))]
    expected = [reference(model, x) for x in xs]
    block, resident = await sizes(model)
    extra = rng.choice([None, 1, 2, 3, n + 2])
    budget = None if extra is None else resident + extra * block
    backend = SimBackend(copy_gbps=rng.choice([None, 0.5]))
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        streamed = stream_module(
            m, model, prefetch=rng.randint(0, 4), keep_resident=rng.random() < 0.7
        )
        assert streamed.ring
        for x, want in zip(xs, expected):
            backend.reset_peak_memory_allocated("cuda:0")
            with torch.no_grad():
                got = await streamed(x)
            assert torch.equal(got, want), (seed, plan)
            if budget is not None:
                assert backend.max_memory_allocated("cuda:0") <= budget, (seed, plan)
            if rng.random() < 0.5:
                await streamed.drain()
        await streamed.drain()
        if budget is not None:
            assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert_nothing_left(m, streamed)
        await streamed.aclose()
    assert backend.memory_allocated("cuda:0") == 0


@pytest.mark.parametrize("seed", range(48))  # a stale "kept" group showed once in ~300
async def test_random_calls_beside_another_tenant_and_cancellations(seed: int) -> None:
    """Randomized: streamed calls while another task takes and gives back room at the same
    device, some calls cancelled at a random point. Calls that finish are bit-identical; the
    budget holds throughout; once everything settled, nothing of the module is left but what
    it keeps, and the tenant's room was never taken from it."""
    import random

    rng = random.Random(1000 + seed)
    n = rng.randint(2, 6)
    plan = [rng.randrange(n) for _ in range(rng.randint(n, 2 * n))]
    model = Planned(n, plan, seed)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(model)
    budget = resident + rng.randint(2, 4) * block
    backend = SimBackend(copy_gbps=0.5)
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        streamed = stream_module(m, model, prefetch=rng.randint(0, 3))
        tenant = m.register(
            torch.zeros(block // 4), name="tenant", replica_mode=ReplicaMode.REPLICABLE
        )
        done = anyio.Event()

        async def other() -> None:
            await churn(m, tenant, done, rng, [0, 0.001, 0.003])

        finished = 0
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other)
            for _ in range(6):
                with anyio.move_on_after(rng.choice([None, 0.0005, 0.003, 0.02])) as scope:
                    with torch.no_grad():
                        got = await streamed(x)
                if not scope.cancelled_caught:
                    assert torch.equal(got, expected), (seed, plan)
                    finished += 1
                assert backend.max_memory_allocated("cuda:0") <= budget
            done.set()
        await streamed.drain()
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        snap = m.snapshot()
        tenant_here = "cuda:0" in [str(loc) for loc in snap.value(tenant).locations]
        if tenant_here:
            await m.release(tenant, "cuda:0")
        assert_nothing_left(m, streamed)
        await streamed.aclose()
    assert backend.memory_allocated("cuda:0") == 0


class LingeringExecutor(concurrent.futures.Executor):
    """Runs each call in a thread of its own that, once the future completed, keeps the work it
    ran (as a thread pool's worker keeps its work item until it takes the next) until
    ``let_go`` is set."""

    def __init__(self) -> None:
        self.let_go = threading.Event()
        self.threads: list[threading.Thread] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        work = [fn, args, kwargs]

        def thread() -> None:
            try:
                future.set_result(work[0](*work[1], **work[2]))
            except BaseException as error:
                future.set_exception(error)
            self.let_go.wait(30)
            work.clear()

        self.threads.append(threading.Thread(target=thread, daemon=True))
        self.threads[-1].start()
        return future


async def test_the_thread_that_ran_a_call_keeps_nothing_of_its_device_memory() -> None:
    """The thread that ran a call drops it before the call returns: once the module closed,
    no device memory is left allocated (the call's resident tensors were), even while that
    thread lives on holding what it was given to run."""
    model = Net(n=3)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    backend = SimBackend()
    executor = LingeringExecutor()
    try:
        async with ResidencyManager(backend=backend) as m:
            streamed = stream_module(m, model, prefetch=1)
            assert streamed.ring and streamed.resident_group is not None
            streamed.call_executor = lambda: executor  # type: ignore[method-assign]
            with torch.no_grad():
                assert torch.equal(await streamed(x), expected)
            await streamed.aclose()
            assert not executor.let_go.is_set() and executor.threads[0].is_alive()
            assert backend.memory_allocated("cuda:0") == 0
    finally:
        executor.let_go.set()
        for thread in executor.threads:
            thread.join(5)


async def test_two_modules_with_one_name_stream_through_rings_at_once() -> None:
    """Two streamed modules of one manager given the same ``name=`` (two model pools naming
    their models alike): their first calls' rings were both named ``stream ring net #1``,
    so the second call in flight failed with ``DuplicateReservationError``. The second ring
    takes the next free name."""
    first, second = Net(n=3, seed=0), Net(n=3, seed=1)
    x = torch.randn(2, 16)
    want = [reference(first, x), reference(second, x)]
    entered, go = threading.Event(), threading.Event()

    def pause(*_: object) -> None:
        entered.set()  # the first call's ring is reserved: its forward runs
        go.wait()

    hook = first.layers[1].register_forward_pre_hook(pause)
    async with ResidencyManager(backend="sim") as m:
        a = stream_module(m, first, name="net")
        b = stream_module(m, second, name="net")
        got: list[torch.Tensor] = []

        async def call_first() -> None:
            with torch.no_grad():
                got.append(await a(x))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call_first)
            try:
                await anyio.to_thread.run_sync(entered.wait)
                assert list(ring_reservations(m)) == ["stream ring net #1"]
                with torch.no_grad():
                    assert torch.equal(await b(x), want[1])
            finally:
                go.set()  # (the first call's thread goes on, whatever happened)
        hook.remove()
        assert torch.equal(got[0], want[0])
        for streamed in (a, b):
            await streamed.drain()
            assert_nothing_left(m, streamed)
            await streamed.aclose()


class _EncoderDecoder(nn.Module):
    """Blocks 0-1 an "encoder" run once, blocks 2-4 a "decoder" run per step; ``generate``
    runs the encoder, some decoder steps, and then (unlike a Hugging Face generate) the
    whole model again, so the ring must give back the blocks its learned cycle left out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

    def run(self, x: torch.Tensor, blocks: range) -> torch.Tensor:
        for i in blocks:
            x = torch.tanh(self.layers[i](x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, range(5))

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        h = self.run(x, range(2))
        for _ in range(4):
            h = self.run(h, range(2, 5))
        h = self.run(h, range(5))  # the encoder again, after the ring left it out
        return self.run(h, range(2, 5))


@pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
async def test_a_cyclic_ring_learns_a_pass_that_starts_later_and_gives_it_up_when_needed(
    prefetch: int,
) -> None:
    model = _EncoderDecoder()
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = copy.deepcopy(model).generate(x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=prefetch, keep_resident=False)
        assert streamed.ring
        with torch.no_grad():
            got = await streamed.generate(x)
            again = await streamed.generate(x)
        assert torch.equal(got, expected) and torch.equal(again, expected)
        await streamed.drain()
        await streamed.aclose()


class Gate(nn.Module):
    """A block whose forward tells ``entered`` and then waits for ``go`` (worker thread)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.entered = threading.Event()
        self.go = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.go.wait(30), "the test never let the block go on"
        return torch.tanh(self.linear(x))


class GatedNet(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.gate = Gate(d)
        self.layers.insert(2, self.gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) if isinstance(layer, nn.Linear) else layer(x)
        return x


async def test_residency_counts_the_modules_own_ring_as_its_own_not_another_tenants() -> None:
    """``residency()['others_bytes']`` is what other tenants hold at the device. It counted
    the module's own ring reservation (its call's in flight, or a finished call's not retired
    yet) as another tenant's; it now counts another tenant's reservation only."""
    model = GatedNet()
    gate = model.gate
    x = torch.randn(2, 16)
    async with ResidencyManager(backend="sim", budgets={"cuda:0": 1 << 20}) as m:
        streamed = stream_module(m, model, prefetch=1, name="gated", keep_resident=False)
        m.reserve_nowait("other tenant", "cuda:0", 1000)
        results: list[torch.Tensor] = []

        async def call() -> None:
            with torch.no_grad():
                results.append(await streamed(x))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            await anyio.to_thread.run_sync(gate.entered.wait)
            try:
                assert ring_reservations(m), "the call in flight holds its ring"
                assert streamed.residency()["others_bytes"] == 1000
            finally:
                gate.go.set()
        assert len(results) == 1
        assert streamed.residency()["others_bytes"] == 1000  # (its ring retired or not)
        await streamed.drain()
        assert streamed.residency()["others_bytes"] == 1000
        m.unreserve_nowait("other tenant", "cuda:0")
        await streamed.aclose()


@pytest.mark.parametrize("ring", [True, False])
async def test_residency_reports_the_window_the_budget_leaves_room_for(ring: bool) -> None:
    """A budget with room for the tensors outside the blocks and only two of the three blocks
    of the prefetch window (prefetch=2): ``residency()`` reported a window of 3 x the largest
    block, more than the budget, while the ring ran with two slots. It reports the two blocks
    a call really uses, and says why."""
    model = Net(n=5)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(Net(n=5))
    budget = resident + 2 * block + block // 2
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2, name="net", ring=ring)
        before = streamed.residency()
        assert before["window_bytes"] == 2 * block < budget
        assert before["window_blocks"] == 2
        assert "room for 2 of the 3 blocks of the prefetch window (prefetch=2)" in before["reason"]
        how = "the ring runs with 2 slot(s)" if ring else "a call copies at most 2 block(s)"
        assert how in before["reason"]
        since = m.trace().transitions[-1].seq
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert streamed.residency() == before
        if ring:  # the ring's reservation is the window reported
            rings = [
                t.nbytes
                for t in m.trace().transitions
                if t.seq > since and t.kind == "reserve" and (t.name or "").startswith("stream")
            ]
            assert rings == [before["window_bytes"]]
        await streamed.aclose()


@pytest.mark.parametrize("ring", [True, False])
async def test_residency_counts_no_more_window_blocks_than_the_module_copies(ring: bool) -> None:
    """Two blocks and prefetch=4: ``residency()`` reported a window of 5 x the largest block,
    said the budget had "room for 2 of the 5 blocks of the prefetch window" (there are only
    two), the ring ran with two slots, and the plan, leaving room for five blocks, kept
    nothing while the whole model fit the budget (every call copied both blocks)."""
    model = Net(n=2)
    x = torch.randn(2, 16)
    expected = reference(model, x)
    block, resident = await sizes(Net(n=2))
    whole = resident + 2 * block

    # Streamed every call: the window is the two blocks, and the ring has two slots.
    async with ResidencyManager(budgets={"cuda:0": 4 * whole}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=4, ring=ring, keep_resident=False)
        before = streamed.residency()
        assert (before["window_blocks"], before["window_bytes"]) == (2, 2 * block)
        assert (
            "only 2 distinct block(s) of the 5 the prefetch window would hold" in (before["reason"])
        )
        since = m.trace().transitions[-1].seq
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert streamed.residency() == before
        if ring:  # the ring's reservation is the window reported
            assert [
                t.nbytes
                for t in m.trace().transitions
                if t.seq > since and t.kind == "reserve" and (t.name or "").startswith("stream")
            ] == [before["window_bytes"]]
        await streamed.aclose()

    # A budget that holds the whole model (with half a block to spare): it all stays, nothing
    # is copied after the first call, and no window is reported.
    async with ResidencyManager(budgets={"cuda:0": whole + block // 2}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=4, ring=ring)
        plan = streamed.residency()
        assert len(plan["kept"]) == 3 and plan["streamed"] == []
        assert (plan["window_blocks"], plan["window_bytes"]) == (0, 0)
        assert "nothing is copied" in plan["reason"]
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await streamed(x), expected)
            copies = streamed.copies
            assert torch.equal(await streamed(x), expected)
        assert streamed.copies == copies == 3
        await streamed.drain()
        assert streamed.residency() == plan
        await streamed.aclose()


async def test_a_block_listed_twice_is_one_block_of_the_window() -> None:
    torch.manual_seed(3)
    first, second = nn.Linear(32, 32), nn.Linear(32, 32)
    model = nn.Sequential(first, second, first)
    x = torch.randn(2, 32)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=4)
        report = streamed.residency()
        block = max(streamed.block_bytes)
        assert (report["window_blocks"], report["window_bytes"]) == (2, 2 * block)
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.aclose()
