"""Everyday operations leave no reference cycles of the runtime's objects behind: what they made
goes by reference counting as soon as they end. Objects in a cycle wait for the garbage
collector, and the more of them a program makes the sooner its next full collection, which
stops the event loop for tens of milliseconds once torch is imported. Simulated backend (CUDA
simulated in host memory)."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Iterator

import pytest
import torch

from aresidency import (
    Materialize,
    MemoryReservation,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyError,
    ResidencyManager,
    ResidencyPlan,
)
from aresidency.controller import ResidencyController, ResidencyRequest

# (each check runs a collection on the loop, on purpose)
pytestmark = [pytest.mark.anyio, pytest.mark.allow_loop_stall(1.0)]

MiB = 1 << 20


def ours_in(objects: list[object]) -> list[str]:
    """The type names of the runtime's own objects among ``objects`` (not the test harness's:
    its loop-stall guard is ``aresidency.testing``)."""
    return sorted(
        {
            type(o).__qualname__
            for o in objects
            if type(o).__module__.startswith("aresidency.")
            and not type(o).__module__.startswith("aresidency.testing")
        }
    )


class CycleCatcher:
    """What the collector would free of what the block made (``gc.DEBUG_SAVEALL``: kept in
    ``gc.garbage`` instead), with collection off meanwhile."""

    def __enter__(self) -> CycleCatcher:
        # Only the youngest generation is collected, here and at the end: with collection
        # off, everything made in the block stays in it (a full collection of the whole
        # suite's heap takes seconds).
        gc.collect(0)
        gc.garbage.clear()
        self.enabled = gc.isenabled()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        self.garbage: list[object] = []
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            gc.collect(0)
            self.garbage = list(gc.garbage)
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            if self.enabled:
                gc.enable()


@pytest.fixture
def cycles() -> Iterator[CycleCatcher]:
    catcher = CycleCatcher()
    yield catcher
    gc.set_debug(0)
    gc.enable()


async def test_scopes_direct_operations_refusals_and_controller_scopes_leave_no_cycles(
    cycles: CycleCatcher,
) -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * MiB}, backend="sim") as m:
        values = [
            m.register(torch.zeros(MiB // 4), f"v{i}", ReplicaMode.EXCLUSIVE) for i in range(8)
        ]
        small = m.register(torch.zeros(1024), "small", ReplicaMode.REPLICABLE)
        too_big = m.register(torch.zeros(5 * MiB), "too big", ReplicaMode.REPLICABLE)
        controller = ResidencyController(m, search_state_limit=10_000)
        plan = ResidencyPlan(enter=[Materialize(small, "cuda:0")])
        plan_refused = ResidencyPlan(
            enter=[Materialize(small, "cuda:0"), Materialize(too_big, "cuda:0")]
        )

        async def scope() -> None:
            async with m.scope(plan):
                pass
            await m.release(small, "cuda:0")

        async def direct() -> None:
            await m.materialize(small, "cuda:0")
            await m.release(small, "cuda:0")

        async def refused() -> None:  # more than the whole budget: refused at once
            with pytest.raises(ResidencyBudgetError):
                await m.materialize(too_big, "cuda:0")

        async def scope_refused() -> None:  # its explanation simulated the plan
            with pytest.raises(ResidencyError):
                # (a copy begun before the action that fails: the failure rides on the
                # request that carries that copy out)
                async with m.scope(plan_refused):
                    pass

        async def controller_scope(i: int = 0) -> None:
            request = ResidencyRequest(
                f"r{i}",
                requirements=[(values[i % 8], "cuda:0"), (values[(i + 3) % 8], "cuda:0")],
                reservations=[MemoryReservation("kv", "cuda:0", MiB)],
            )
            async with controller.scope(request, timeout=5.0):
                pass

        operations: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("scope", scope),
            ("materialize and release", direct),
            ("a materialize refused", refused),
            ("a scope refused", scope_refused),
            ("controller scope", controller_scope),
        ]
        for _, operation in operations:  # warm-up: caches and first-use objects
            for _ in range(3):
                await operation()
        for label, operation in operations:
            with cycles:
                for _ in range(10):
                    await operation()
            assert ours_in(cycles.garbage) == [], f"{label}: cycles left for the collector"


async def test_a_loader_whose_source_fails_leaves_no_cycles(cycles: CycleCatcher) -> None:
    from aresidency.loader import DeviceLoader

    def failing() -> Iterator[torch.Tensor]:
        yield torch.randn(16)
        raise ValueError("the source broke")

    async with ResidencyManager(budgets={"cuda:0": 16 * MiB}, backend="sim") as m:

        async def one_pass() -> None:
            with pytest.raises(ValueError, match="the source broke"):
                async with DeviceLoader(m, failing(), "cuda:0", prefetch=2) as loader:
                    async for _ in loader:
                        pass

        for _ in range(3):  # warm-up
            await one_pass()
        with cycles:
            for _ in range(5):
                await one_pass()
        assert ours_in(cycles.garbage) == [], "cycles left for the collector"
