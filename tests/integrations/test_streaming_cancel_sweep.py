"""Cancellation and the manager's close at every point of streamed calls, swept (see
tests/_sweep.py): two streamed modules share a device budget of little more than two blocks
(their calls wait for room), with a ring and without (``ring=False``: managed values); the
stories are plain calls, repeated calls as a generation loop makes them, and calls followed
by ``drain()`` and ``aclose()``. Simulated backend: a simulation of CUDA devices in host
memory, its copies run on worker threads.

Cancelled at any point, the cancellation reaches the caller (or the story ended first),
nothing is left leased, held, reserved, waiting or in flight, a module still open serves a
call whose output is bit-identical to the plain module's, and once closed every value has
left the manager and the module computes as before with its own tensors. With the manager
closing at any point instead, every call ends (returning its exact output, or raising
``ManagerClosedError``), nothing hangs, and the modules close and compute as before."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest
import torch
from _sweep import count_turns, cut_after, sweep_points

from aresidency import ResidencyManager
from aresidency.integrations import stream_module
from aresidency.runtime import ManagerClosedError
from aresidency.testing import assert_quiet, settled

from ._models import Net

pytestmark = pytest.mark.anyio

BLOCK, OUTSIDE = 23552, 4608  # a Net block's charge, and its tensors outside the blocks
BUDGET = OUTSIDE * 2 + 2 * BLOCK + BLOCK // 2
X = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
STEPS = 3


def reference(model: Net, shift: float = 0.0) -> torch.Tensor:
    with torch.no_grad():
        return model(X, shift=shift)


class Bench:
    """Two streamed modules on a fresh manager, their plain outputs, and what the story did."""

    def __init__(self, m: ResidencyManager, ring: bool | None) -> None:
        self.m = m
        self.models = [Net(seed=seed) for seed in (0, 1)]
        self.expected = [[reference(model, s) for s in range(STEPS)] for model in self.models]
        self.streamed = [stream_module(m, model, prefetch=1, ring=ring) for model in self.models]
        self.closing = False  # whether the manager may close under the story
        self.closed_under: list[ManagerClosedError] = []

    async def call(self, which: int, shift: int = 0) -> None:
        try:
            # (no torch.no_grad() around the await: tasks that run concurrently would exit
            # theirs out of order and leave the thread's grad mode off; a call needs none)
            y = await self.streamed[which](X, shift=float(shift))
        except ManagerClosedError as error:
            if not self.closing:
                raise
            self.closed_under.append(error)
            return
        assert torch.equal(y, self.expected[which][shift])

    async def calls(self, which: int) -> None:
        for shift in range(STEPS):  # a generation loop: one call after the other
            await self.call(which, shift)

    async def close(self, which: int) -> None:
        await self.call(which)
        try:
            await self.streamed[which].drain()
            await self.streamed[which].aclose()
        except ManagerClosedError as error:
            if not self.closing:
                raise
            self.closed_under.append(error)

    async def check_after_cancel(self) -> None:
        """Nothing left behind; an open module still serves, exactly; closed, nothing of it
        stays registered and the plain module computes as before."""
        for streamed in self.streamed:
            if not streamed._closed:
                await streamed.drain()
        await settled(self.m)
        assert_quiet(self.m)
        for which, streamed in enumerate(self.streamed):
            if not streamed._closed:
                await self.call(which, 1)
            await streamed.aclose()
        self.check_closed()

    def check_closed(self) -> None:
        if self.m.running:  # (once the manager closed, its state is final)
            assert [v.handle.name for v in self.m.state.values()] == []
        for model, expected in zip(self.models, self.expected, strict=True):
            assert torch.equal(reference(model), expected[0])


def story_of(kind: str, bench: Bench) -> Callable[[], Awaitable[None]]:
    async def story() -> None:
        async with anyio.create_task_group() as tasks:
            for which in (0, 1):
                if kind == "call":
                    tasks.start_soon(bench.call, which)
                    tasks.start_soon(bench.call, which, 2)  # waits for the module's first call
                elif kind == "calls":
                    tasks.start_soon(bench.calls, which)
                else:
                    tasks.start_soon(bench.close, which)

    return story


STORIES = ["call", "calls", "close"]
RINGS = [pytest.param(None, id="ring"), pytest.param(False, id="no-ring")]


async def turns_of(kind: str, ring: bool | None) -> int:
    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        bench = Bench(m, ring)
        total = await count_turns(story_of(kind, bench))
        await bench.check_after_cancel()
    return total


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("kind", STORIES)
async def test_streamed_calls_cancelled_at_any_turn_leave_nothing(
    kind: str, ring: bool | None
) -> None:
    total = await turns_of(kind, ring)
    assert total > 5
    cancelled = 0
    for k in sweep_points(total):
        async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
            bench = Bench(m, ring)
            cancelled += await cut_after(k, story_of(kind, bench))
            with anyio.fail_after(20):
                await bench.check_after_cancel()
    assert cancelled > 0  # the sweep cut stories short (the rest ran to their end)


async def closing_manager(
    ring: bool | None, body: Callable[[Bench, anyio.Event, anyio.Event], Awaitable[None]]
) -> None:
    """A manager entered in a task of its own that closes when ``body`` sets its first event
    (the second is set once it closed); the body runs on the bench beside it."""
    close_now, closed, ready = anyio.Event(), anyio.Event(), anyio.Event()
    box: list[Bench] = []

    async def owner() -> None:
        async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
            box.append(Bench(m, ring))
            box[0].closing = True
            ready.set()
            await close_now.wait()
        closed.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(owner)
            await ready.wait()
            await body(box[0], close_now, closed)


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("kind", STORIES)
async def test_streamed_calls_with_the_manager_closing_at_any_turn_end(
    kind: str, ring: bool | None
) -> None:
    total = await turns_of(kind, ring)
    closed_under = 0
    for k in sweep_points(total):

        async def body(
            bench: Bench, close_now: anyio.Event, closed: anyio.Event, k: int = k
        ) -> None:
            nonlocal closed_under
            await cut_after(k, story_of(kind, bench), close_now.set)
            closed_under += bool(bench.closed_under)
            await closed.wait()
            for streamed in bench.streamed:
                await streamed.aclose()
            bench.check_closed()

        await closing_manager(ring, body)
    assert closed_under > 0


@pytest.mark.parametrize("ring", RINGS)
async def test_a_close_cancelled_at_any_turn_still_closes(ring: bool | None) -> None:
    """``aclose()`` alone, cancelled at every one of its turns (after a call that left
    blocks kept and releases settling): cut short, it left values registered and held that
    nothing discarded (a second ``aclose()`` returned at once). It finishes, then the
    cancellation is raised (at the task's next await)."""

    async def closed_after_a_call(bench: Bench) -> Callable[[], Awaitable[None]]:
        await bench.call(0)
        return bench.streamed[0].aclose

    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        bench = Bench(m, ring)
        total = await count_turns(await closed_after_a_call(bench))
        await bench.check_after_cancel()
    for k in sweep_points(total, 20):
        async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
            bench = Bench(m, ring)
            await cut_after(k, await closed_after_a_call(bench))  # (cancelled, or closed)
            await bench.check_after_cancel()
