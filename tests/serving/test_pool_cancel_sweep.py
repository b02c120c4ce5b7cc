"""Cancellation, the pool's close and the manager's close at every point of a pool's
requests, swept (see tests/_sweep.py). The stories run several requests at once on a budget
where they wait for room: resident models, streamed ones, a model rebuilt from a checkpoint,
a nested request, a removal and hot swap while requests run, and ``pool.aclose()``; every
request has a reserve and calls its model. Simulated backend: a simulation of CUDA devices
in host memory, its copies run on worker threads.

Cancelled at any point, the cancellation reaches the caller (or the story ended first),
nothing is left admitted, waiting, leased, held, reserved or in flight, every model still in
the pool serves a request whose output is bit-identical to the plain model's, and once the
pool closed no value is left in the manager and every model computes as before. With the
pool (or the manager) closing at any point instead, every request ends (served exactly, or
refused with the documented error), nothing hangs and the same holds afterwards."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch
from _sweep import count_turns, cut_after, sweep_points
from safetensors.torch import save_file

from aresidency import ResidencyManager
from aresidency.runtime import ManagerClosedError
from aresidency.serving import ModelPool
from aresidency.testing import assert_quiet, settled

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL

pytestmark = pytest.mark.anyio

KiB = 1 << 10
RESERVE = 4 * KiB


class Bench:
    """A pool on a fresh manager with models ``a`` and ``b`` (``a`` rebuilt from a checkpoint
    in the ``checkpoint`` story), the plain outputs of every module it served, and what the
    story's requests ended with."""

    def __init__(self, m: ResidencyManager, kind: str, path: Path) -> None:
        self.m = m
        self.kind = kind
        self.pool = ModelPool(m)
        self.modules: dict[int, torch.nn.Module] = {}
        self.expected: dict[int, torch.Tensor] = {}
        if kind == "checkpoint":
            original = TinyLM(seed=1)
            if not path.exists():
                save_file({k: v.contiguous() for k, v in original.state_dict().items()}, path)
            self.add("a", TinyLM(seed=1), checkpoint=path)
        else:
            self.add("a", TinyLM(seed=1))
        self.add("b", TinyLM(seed=2))
        self.refused: list[BaseException] = []  # requests ended by a close (the closing sweeps)
        self.allowed: tuple[type[BaseException], ...] = ()
        self.arrived = 0  # requests that called pool.use

    def add(self, name: str, module: torch.nn.Module, **options: object) -> None:
        self.expected[id(module)] = reference(module, TOKENS)
        self.modules[id(module)] = module
        self.pool.add(name, module, **options)  # type: ignore[arg-type]

    async def request(self, name: str, calls: int = 1) -> None:
        self.arrived += 1  # (and pool.use runs to its first await in this step)
        try:
            async with self.pool.use(name, reserve=RESERVE) as model:
                expected = self.expected[id(model.module)]
                for _ in range(calls):
                    assert torch.equal(await model(TOKENS), expected)
        except self.allowed as error:
            self.refused.append(error)

    async def nested(self) -> None:
        try:
            async with self.pool.use("a", reserve=RESERVE) as outer:
                async with self.pool.use("b") as inner:
                    assert torch.equal(await inner(TOKENS), self.expected[id(inner.module)])
                assert torch.equal(await outer(TOKENS), self.expected[id(outer.module)])
        except self.allowed as error:
            self.refused.append(error)

    async def swap(self) -> None:
        """Remove ``a`` while its requests run, add a new version under its name, use it."""
        try:
            await self.pool.remove("a")
            self.add("a", TinyLM(seed=3))
        except self.allowed as error:
            self.refused.append(error)
            return
        await self.request("a")

    async def check_after(self) -> None:
        """Nothing left behind; every model serves exactly; closed, nothing registered and
        every module computes as before."""
        pool = self.pool
        if self.m.running:
            for name in pool.models:
                await pool.module(name).drain()
            await settled(self.m)
            assert_quiet(self.m)
            if not pool.closed:
                assert_nothing_leaked(self.m, pool)
                for name in pool.models:
                    async with pool.use(name) as model:
                        expected = self.expected[id(model.module)]
                        assert torch.equal(await model(TOKENS), expected)
        assert pool.admitted == 0 and pool.waiting == 0
        await pool.aclose()
        if self.m.running:
            assert [v.handle.name for v in self.m.state.values()] == []
        for key, module in self.modules.items():
            assert torch.equal(reference(module, TOKENS), self.expected[key])


def story_of(bench: Bench) -> Callable[[], Awaitable[None]]:
    async def story() -> None:
        async with anyio.create_task_group() as tasks:
            if bench.kind == "nested":
                tasks.start_soon(bench.nested)
                tasks.start_soon(bench.request, "b")
                tasks.start_soon(bench.request, "a")
                return
            for name in "aba":
                tasks.start_soon(bench.request, name, 2)
            if bench.kind in ("swap", "aclose"):
                while bench.arrived < 3:  # (the requests arrived: those for 'a' are served)
                    await anyio.lowlevel.checkpoint()
                tasks.start_soon(bench.swap if bench.kind == "swap" else bench.pool.aclose)

    return story


# Room for one model and a half: the requests for the other model wait for room (resident),
# or for a third of one: every request streams, waiting for room for its blocks.
BUDGETS = {"resident": TOTAL + TOTAL // 2, "streamed": TOTAL // 3 + 3 * RESERVE}
STORIES = [
    pytest.param("resident", BUDGETS["resident"], id="resident"),
    pytest.param("streamed", BUDGETS["streamed"], id="streamed"),
    pytest.param("checkpoint", BUDGETS["resident"], id="checkpoint"),
    pytest.param("nested", 2 * TOTAL + TOTAL // 2, id="nested"),
    pytest.param("swap", BUDGETS["resident"], id="swap"),
    pytest.param("aclose", BUDGETS["resident"], id="aclose"),
]


async def turns_of(kind: str, budget: int, path: Path) -> int:
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        bench = Bench(m, kind, path)
        total = await count_turns(story_of(bench))
        await bench.check_after()
    return total


@pytest.mark.parametrize(("kind", "budget"), STORIES)
async def test_requests_cancelled_at_any_turn_leave_nothing(
    kind: str, budget: int, tmp_path: Path
) -> None:
    path = tmp_path / "a.safetensors"
    total = await turns_of(kind, budget, path)
    assert total > 5
    cancelled = 0
    for k in sweep_points(total):
        async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
            bench = Bench(m, kind, path)
            cancelled += await cut_after(k, story_of(bench))
            with anyio.fail_after(20):
                await bench.check_after()
    assert cancelled > 0  # the sweep cut stories short (the rest ran to their end)


@pytest.mark.parametrize(("kind", "budget"), STORIES)
async def test_requests_with_the_pool_closing_at_any_turn_end(
    kind: str, budget: int, tmp_path: Path
) -> None:
    """``pool.aclose()`` at each point: the requests that arrived before are served, those
    that arrive after are refused with ``RuntimeError`` (a removal too, and the new version
    of a hot swap is not added); the close returns once they ended."""
    path = tmp_path / "a.safetensors"
    total = await turns_of(kind, budget, path)
    for k in sweep_points(total):
        async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
            bench = Bench(m, kind, path)
            bench.allowed = (RuntimeError,)
            await cut_after(k, story_of(bench), bench.pool.aclose)
            assert bench.pool.closed and bench.pool.models == []
            assert all("the pool is closed" in str(e) for e in bench.refused), bench.refused
            with anyio.fail_after(20):
                await bench.check_after()


@pytest.mark.parametrize(("kind", "budget"), STORIES)
async def test_requests_with_the_manager_closing_at_any_turn_end(
    kind: str, budget: int, tmp_path: Path
) -> None:
    """The manager closes at each point: a request ends served exactly or with
    ``ManagerClosedError``; nothing hangs; the pool closes after it and every module
    computes as before."""
    path = tmp_path / "a.safetensors"
    total = await turns_of(kind, budget, path)
    refused = 0
    for k in sweep_points(total):
        close_now, closed, ready = anyio.Event(), anyio.Event(), anyio.Event()
        box: list[Bench] = []

        async def owner(
            budget: int = budget,
            box: list[Bench] = box,
            ready: anyio.Event = ready,
            close_now: anyio.Event = close_now,
            closed: anyio.Event = closed,
        ) -> None:
            async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
                box.append(Bench(m, kind, path))
                box[0].allowed = (ManagerClosedError,)
                ready.set()
                await close_now.wait()
            closed.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(owner)
                await ready.wait()
                bench = box[0]
                await cut_after(k, story_of(bench), close_now.set)
                await closed.wait()
                refused += bool(bench.refused)
                await bench.check_after()
    assert refused > 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # two native cancellations, in order
async def test_a_removal_cancelled_with_its_models_last_request_leaves_it_serving(
    anyio_backend: str,
) -> None:
    """The removal waiting for the model's last request is cancelled (``task.cancel()``) in
    the step where that request ended, its wake-up already due: it saw the cancellation
    with its wait over, and left the model marked as being removed (every request refused
    with ``KeyError``, its name taken) for ever. It serves now, as after any cancelled
    removal."""
    import asyncio

    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        inside, go_on = anyio.Event(), anyio.Event()
        tasks: list[asyncio.Task[None]] = []

        async def request() -> None:
            async with pool.use("a"):
                inside.set()
                await go_on.wait()
            tasks[0].cancel()  # (the removal's wait just ended)

        loop = asyncio.get_running_loop()
        with anyio.fail_after(10):
            serving = loop.create_task(request())
            await inside.wait()
            tasks.append(loop.create_task(pool.remove("a")))
            await anyio.wait_all_tasks_blocked()  # the removal waits for the request
            go_on.set()
            await serving
            with pytest.raises(asyncio.CancelledError):
                await tasks[0]
            assert pool.models == ["a"]
            async with pool.use("a") as model:
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
            assert_nothing_leaked(m, pool)
            await pool.remove("a")
        assert pool.models == []
        await pool.aclose()
