"""Streamed calls made from inside another streamed call's forward (``call_threadsafe`` from
a block or a forward hook, in the forward's thread or, for a plain ``nn.Sequential`` on the
simulated backend, on the simulated stream's thread; from a pooled model's forward): refused
at once when they could only wait for the outer call, which waits for them; otherwise run,
and cancelled with the outer call.

Each test bounds its calls with ``anyio.fail_after``. A call that cannot be cancelled (the
outer call, cancelled, waits for its thread, blocked in the nested call) would outlast that
bound: :meth:`Bench.within` then closes the manager, which ends the waits it hangs on, so
that the test fails (``hung``) instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc
import pytest
import torch
from torch import nn

from aresidency import ResidencyBudgetError, ResidencyManager, ValueHandle
from aresidency.integrations import StreamedModule, stream_module
from aresidency.runtime import ManagerClosedError
from aresidency.serving import ModelPool

pytestmark = pytest.mark.anyio

BLOCK = 4608  # the device charge of one Linear(32, 32) block (4224 B, at 512 B granularity)
BOUND = 10.0  # seconds a call may take before the test calls it hung


class Calls(nn.Module):
    """A block that calls ``inner`` (set once streamed) on its output: a streamed call made
    from inside the outer call's forward, by the block's forward or (``hooked``) by a forward
    hook on it."""

    def __init__(self, hooked: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.inner: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.hooked = hooked
        if hooked:
            self.register_forward_hook(self.hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.linear(x))
        return x if self.inner is None or self.hooked else self.inner(x)

    def hook(self, module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
        return None if self.inner is None else self.inner(output)


class Layers(nn.Module):
    """Blocks run by the module's own forward (in the streaming worker thread)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def outer_model(kind: str) -> tuple[nn.Module, Calls]:
    """Three blocks, the second a :class:`Calls`: run by the module's forward (``"forward"``;
    ``"hook"``: the call made by a forward hook), or a plain ``nn.Sequential`` (on the
    simulated backend its blocks run on the compute stream's thread)."""
    torch.manual_seed(4)
    calls = Calls(hooked=kind == "hook")
    layers = [nn.Linear(32, 32), calls, nn.Linear(32, 32)]
    return (nn.Sequential(*layers) if kind == "sequential" else Layers(layers)), calls


def inner_model(kind: str = "forward") -> nn.Module:
    torch.manual_seed(5)
    layers: list[nn.Module] = [nn.Linear(32, 32), nn.Linear(32, 32)]
    return nn.Sequential(*layers) if kind == "sequential" else Layers(layers)


def reference(outer: nn.Module, inner: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """What (a copy of) the outer module computes with ``inner`` run unstreamed inside it
    (``None``: without it)."""
    plain = copy.deepcopy(outer)
    (calls,) = (sub for sub in plain.modules() if isinstance(sub, Calls))
    calls.inner = None if inner is None else copy.deepcopy(inner).forward
    with torch.no_grad():
        out = plain(x)
    assert isinstance(out, torch.Tensor)
    return out


class Bench:
    """A simulated manager, entered in the test's task inside a task group opened first, so
    that the test's task may close it while a call runs in that group (:meth:`within`)."""

    def __init__(self, m: ResidencyManager, tasks: anyio.abc.TaskGroup) -> None:
        self.m = m
        self.tasks = tasks

    async def within(self, fn: Callable[[], Awaitable[object]]) -> tuple[object, bool]:
        """Run ``fn()`` (which bounds itself with ``anyio.fail_after(BOUND)``) in a task and
        wait a little longer than that bound for it: past it, the call could not even be
        cancelled, and the manager is closed, which ends the waits it hangs on. Returns what
        ``fn`` returned or raised, and whether it hung."""
        outcome: list[object] = []
        done = anyio.Event()

        async def run() -> None:
            try:
                outcome.append(await fn())
            except Exception as error:
                outcome.append(error)
            finally:
                done.set()

        self.tasks.start_soon(run)
        with anyio.move_on_after(BOUND + 5):
            await done.wait()
        hung = not done.is_set()
        if hung:
            await self.m.__aexit__(None, None, None)
            await done.wait()
        return outcome[0], hung

    async def call_once(self, outer: StreamedModule, x: torch.Tensor) -> object:
        """``await outer(x)`` (no grad, bounded by ``BOUND``) through :meth:`within`: what it
        returned or raised; fails the test if it hung."""

        async def call() -> object:
            with anyio.fail_after(BOUND), torch.no_grad():
                return await outer(x)

        raised, hung = await self.within(call)
        assert not hung, "the nested call waited for ever, and so did the outer one"
        return raised


@contextlib.asynccontextmanager
async def bench(budget: int) -> AsyncIterator[Bench]:
    async with anyio.create_task_group() as tasks:
        m = ResidencyManager(budgets={"cuda:0": budget}, backend="sim")
        await m.__aenter__()
        try:
            yield Bench(m, tasks)
        finally:
            if m.running:
                await m.__aexit__(None, None, None)


async def waits_for_room(m: ResidencyManager, name: str) -> None:
    """Until a wait for room of module ``name``'s call is registered."""
    while not any(what.startswith(f"{name}: ") for *_, what in m.room_waits()):
        await m.wait_for_change()


async def cancelled_once_waiting(
    m: ResidencyManager, name: str, call: Callable[[], Awaitable[object]]
) -> bool:
    """Run ``call()`` and cancel it once module ``name``'s call waits for room; whether it
    ended cancelled (bounded: ``TimeoutError`` past ``BOUND``)."""
    with anyio.fail_after(BOUND):
        scope = anyio.CancelScope()

        async def cancel() -> None:
            await waits_for_room(m, name)
            scope.cancel()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(cancel)
            with scope:
                await call()
            tasks.cancel_scope.cancel()
        return scope.cancelled_caught


async def fill(m: ResidencyManager, nbytes: int) -> ValueHandle:
    """Another tenant's value on the device (resident, protected by nothing: it stays)."""
    other = m.register(torch.zeros(nbytes // 4), name="other")
    await m.materialize(other, "cuda:0")
    return other


@contextlib.asynccontextmanager
async def held_by_another_task(m: ResidencyManager, nbytes: int) -> AsyncIterator[None]:
    """Another tenant's value on the device, held by the test's task (not the calls'): room
    a call waits for, which that task may give back (a wait for it is not refused)."""
    other = await fill(m, nbytes)
    hold = m.hold(other, "cuda:0")
    try:
        yield
    finally:
        hold.release()
        await m.discard(other)


def entry(inner: StreamedModule, kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """How the outer call's forward calls ``inner``: ``call_threadsafe``, or (``kind``
    "task") awaited in a task the forward's thread starts on the loop itself
    (``asyncio.run_coroutine_threadsafe``, ``trio.from_thread.run``). Made on the loop."""
    if kind != "task":
        return inner.call_threadsafe
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio
        import trio

        token = trio.lowlevel.current_trio_token()
        return lambda x: trio.from_thread.run(inner, x, trio_token=token)  # type: ignore[no-any-return]
    return lambda x: asyncio.run_coroutine_threadsafe(inner(x), loop).result()  # type: ignore[no-any-return]


async def close(*streamed: StreamedModule) -> None:
    for module in streamed:
        await module.drain()
        await module.aclose()


@pytest.mark.parametrize("kind", ["forward", "hook", "sequential", "task"])
@pytest.mark.parametrize("holds", ["ring", "kept"])
@pytest.mark.parametrize("inner_ring", [None, False], ids=["inner-ring", "inner-values"])
async def test_a_nested_call_that_only_the_outer_calls_room_keeps_out_is_refused_at_once(
    kind: str, holds: str, inner_ring: bool | None
) -> None:
    # The outer call streams through a ring (or keeps its blocks leased for the call) that
    # fills the budget; a call made from inside its forward found no room and waited for
    # ever (the outer call, even cancelled, waits for its thread, blocked in that call).
    blocks = 2 if holds == "ring" else 3  # a ring of two slots, or the whole model kept
    async with bench(blocks * BLOCK) as b:
        m = b.m
        model, calls = outer_model(kind)
        x = torch.randn(2, 32)
        outer = stream_module(m, model, prefetch=1, name="outer")
        inner = stream_module(m, inner_model(), prefetch=1, ring=inner_ring, name="inner")
        calls.inner = entry(inner, kind)

        raised = await b.call_once(outer, x)
        assert isinstance(raised, ResidencyBudgetError), raised
        message = str(raised)
        assert message.startswith("budget exceeded at cuda:0"), message
        assert "inner: inner." in message and "outer's call in flight" in message, message
        assert "made from inside its forward" in message, message
        assert "Call inner before or after outer's call" in message, message
        # Nothing was left behind: both modules run as before.
        calls.inner = None
        with anyio.fail_after(BOUND), torch.no_grad():
            assert torch.equal(await outer(x), reference(model, None, x))
            await outer.drain()
            await inner(x)
        assert m.room_waits() == []
        await close(outer, inner)


@pytest.mark.parametrize("kind", ["forward", "hook", "sequential", "task"])
@pytest.mark.parametrize("inner_ring", [None, False], ids=["inner-ring", "inner-values"])
async def test_a_nested_call_waiting_for_room_is_cancelled_with_the_outer_call(
    kind: str, inner_ring: bool | None
) -> None:
    # A call made from inside the outer call's forward waits for room another tenant holds
    # (it may give it back: the wait is not refused). Cancelling the outer call waited for
    # its thread, blocked in that call, until the room came: for ever.
    async with bench(3 * BLOCK) as b:
        m = b.m
        model, calls = outer_model(kind)
        x = torch.randn(2, 32)
        outer = stream_module(m, model, prefetch=1, name="outer")
        inner = stream_module(m, inner_model(), prefetch=1, ring=inner_ring, name="inner")
        calls.inner = entry(inner, kind)

        async def call() -> object:
            with torch.no_grad():
                return await outer(x)

        # (the outer call's ring takes the other two blocks)
        async with held_by_another_task(m, BLOCK):
            cancelled, hung = await b.within(lambda: cancelled_once_waiting(m, "inner", call))
            assert not hung, "cancelled, the outer call waited for ever for the nested one"
            assert cancelled is True, cancelled
            assert outer.current_call is None and inner.current_call is None
            assert m.room_waits() == []
        calls.inner = None
        with anyio.fail_after(BOUND), torch.no_grad():
            assert torch.equal(await outer(x), reference(model, None, x))
        await close(outer, inner)


async def test_a_nested_call_waiting_for_room_ends_when_the_manager_closes() -> None:
    async with bench(3 * BLOCK) as b:
        m = b.m
        model, calls = outer_model("forward")
        outer = stream_module(m, model, prefetch=1, name="outer")
        inner = stream_module(m, inner_model(), prefetch=1, name="inner")
        other = await fill(m, BLOCK)
        m.hold(other, "cuda:0")  # (held by the test's task: the nested call waits for it)
        calls.inner = inner.call_threadsafe
        raised: list[BaseException] = []
        ended = anyio.Event()

        async def call() -> None:
            try:
                with anyio.fail_after(BOUND), torch.no_grad():
                    await outer(torch.randn(2, 32))
            except Exception as error:
                raised.append(error)
            finally:
                ended.set()

        b.tasks.start_soon(call)
        with anyio.fail_after(BOUND):
            await waits_for_room(m, "inner")
        await m.__aexit__(None, None, None)
        with anyio.fail_after(BOUND):
            await ended.wait()
        assert len(raised) == 1 and isinstance(raised[0], ManagerClosedError), raised
        assert str(raised[0]).startswith("outer: the manager closed during the call")
        await outer.aclose()
        await inner.aclose()


@pytest.mark.parametrize("case", ["outer-values", "same-stream"])
async def test_a_nested_call_from_a_sequentials_block_that_could_only_wait_is_refused(
    case: str,
) -> None:
    # A plain nn.Sequential on the simulated backend runs its blocks on the compute stream's
    # thread, which the check for nested calls did not look at: a call made from a block
    # waited for ever for the outer call's admission turn (the outer call over managed
    # values holds it until it ends), or for its own blocks, queued on that stream behind
    # the block that waits for them.
    async with bench(64 * BLOCK) as b:
        m = b.m
        model, calls = outer_model("sequential")
        ring = False if case == "outer-values" else None
        outer = stream_module(m, model, prefetch=1, ring=ring, name="outer")
        inner_kind = "sequential" if case == "same-stream" else "forward"
        inner = stream_module(m, inner_model(inner_kind), name="inner")
        calls.inner = inner.call_threadsafe
        x = torch.randn(2, 32)

        raised = await b.call_once(outer, x)
        assert isinstance(raised, RuntimeError), raised
        message = str(raised)
        assert message.startswith("inner: called from inside ") and "outer's call" in message
        assert "wait for ever" in message, message
        calls.inner = None
        with anyio.fail_after(BOUND), torch.no_grad():
            assert torch.equal(await outer(x), reference(model, None, x))
            await inner(x)
        await close(outer, inner)


async def test_a_nested_call_from_a_sequentials_block_runs_when_it_can() -> None:
    async with bench(64 * BLOCK) as b:
        m = b.m
        model, calls = outer_model("sequential")
        x = torch.randn(2, 32)
        want = reference(model, inner_model(), x)
        outer = stream_module(m, model, prefetch=1, name="outer")
        inner = stream_module(m, inner_model(), name="inner")
        calls.inner = inner.call_threadsafe
        with anyio.fail_after(BOUND), torch.no_grad():
            assert torch.equal(await outer(x), want)
        await close(outer, inner)


@pytest.mark.parametrize("kind", ["forward", "task"])
@pytest.mark.parametrize("shared", [False, True], ids=["direct", "shared"])
async def test_a_nested_call_from_a_pooled_models_forward(shared: bool, kind: str) -> None:
    # A resident request's call runs the model's forward in a thread directly on the held
    # replicas (or beside its other calls, shared): a streamed call made from inside it was
    # not seen as nested. With the room held by the request, it waited for ever; waiting for
    # another tenant's room, it could not be cancelled with the request.
    async with bench(4 * BLOCK) as b:
        m = b.m
        model, calls = outer_model("forward")
        x = torch.randn(2, 32)
        pool = ModelPool(m, shared_calls=shared)
        pool.add("pooled", model)
        inner = stream_module(m, inner_model(), prefetch=1, name="inner")
        calls.inner = entry(inner, kind)
        other = await fill(m, BLOCK)  # with the request's three blocks: the whole budget

        async def refused() -> object:
            with anyio.fail_after(BOUND):
                async with pool.use("pooled") as pooled:
                    assert pooled.mode == "resident"
                    return await pooled(x)

        raised, hung = await b.within(refused)
        assert not hung, "the nested call waited for ever, and so did the request"
        assert isinstance(raised, ResidencyBudgetError), raised
        assert "pooled's call in flight" in str(raised) and "inner: inner." in str(raised)
        way = "shared_calls" if shared else "direct_calls"
        assert pool.stats()["pooled"][way] == 1  # (the call took that way)

        await m.discard(other)

        # The same call waiting for room another task holds instead: cancelled with the
        # request's call.
        async def request() -> None:
            async with pool.use("pooled") as pooled:
                await pooled(x)

        async with held_by_another_task(m, BLOCK):
            cancelled, hung = await b.within(lambda: cancelled_once_waiting(m, "inner", request))
            assert not hung, "cancelled, the request waited for ever for the nested call"
            assert cancelled is True, cancelled
            assert inner.current_call is None and m.room_waits() == []
        calls.inner = None
        with anyio.fail_after(BOUND):
            async with pool.use("pooled") as pooled:
                assert torch.equal(await pooled(x), reference(model, None, x))
        await pool.aclose()
        await close(inner)


@pytest.mark.parametrize("kind", ["forward", "task"])
async def test_a_call_of_the_same_module_from_inside_its_forward_is_refused(kind: str) -> None:
    # Calls on one module run one at a time: one made from inside its own call's forward
    # could only wait for the call that makes it. Through a task the forward started on the
    # loop, it was not seen as nested and waited for ever, the outer call uncancellable.
    async with bench(64 * BLOCK) as b:
        model, calls = outer_model("forward")
        x = torch.randn(2, 32)
        outer = stream_module(b.m, model, prefetch=1, name="outer")
        calls.inner = entry(outer, kind)

        raised = await b.call_once(outer, x)
        assert isinstance(raised, RuntimeError), raised
        assert str(raised).startswith("outer: called from inside its own call's forward")
        calls.inner = None
        with anyio.fail_after(BOUND), torch.no_grad():
            assert torch.equal(await outer(x), reference(model, None, x))
        await close(outer)


async def test_a_task_a_forward_started_that_calls_after_the_forward_returned_is_not_nested() -> (
    None
):
    # The task inherits the forward's context; once the outer call returned, a streamed call
    # awaited there is an ordinary call: what the outer call's task holds then (the test's
    # task holds the room the call needs) is not counted as the call's own, so its wait for
    # that room is not refused, and it goes on once the room is given back.
    async with bench(4 * BLOCK) as b:
        model, calls = outer_model("forward")
        x = torch.randn(2, 32)
        outer = stream_module(b.m, model, prefetch=1, name="outer")
        inner = stream_module(b.m, inner_model(), prefetch=1, name="inner")
        started: list[object] = []
        go = threading.Event()

        async def later(y: torch.Tensor) -> torch.Tensor:
            await anyio.to_thread.run_sync(go.wait)
            out: torch.Tensor = await inner(y)
            return out

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            pytest.skip("starts a task from the forward with asyncio.run_coroutine_threadsafe")

        def start(y: torch.Tensor) -> torch.Tensor:
            started.append(asyncio.run_coroutine_threadsafe(later(y), loop))
            return y

        calls.inner = start
        with anyio.fail_after(BOUND), torch.no_grad():
            await outer(x)
            await close(outer)  # (its blocks were kept on the device: all the room now)
            async with held_by_another_task(b.m, 4 * BLOCK):
                go.set()
                await waits_for_room(b.m, "inner")
            (future,) = started
            while not future.done():
                await b.m.wait_for_change(0.05)
            assert isinstance(future.result(), torch.Tensor)
        await close(inner)
