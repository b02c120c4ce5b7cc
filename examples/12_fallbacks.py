"""Automatic Example 12: fallback locations for a request, and the fallback graph for victims.

A ``ResidencyRequirement`` names where a value must be and, optionally, ``fallbacks``: other
locations, in order of preference, used only when the preferred placement is infeasible.
``decision.placements`` says which one each requirement got. Where evicted values go is the
controller's ``FallbackGraph`` (by default ``cuda:N -> pinned-host -> pageable-host``, or
dropped when the value can be rebuilt from its source). Runs on the GPU when there is one,
otherwise on the simulated backend (a simulation of CUDA devices made of host memory).

    python examples/12_fallbacks.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import (
    FallbackGraph,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
)

MiB = 1 << 20


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 10 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        pinned = manager.register(torch.zeros(MiB), name="router", location="cuda:0")  # 4 MiB
        a = manager.register(torch.zeros(MiB), name="expert-a")
        b = manager.register(torch.zeros(MiB), name="expert-b")
        controller = ResidencyController(manager)

        # The router is held (in use elsewhere): it cannot be evicted, so only one more
        # 4 MiB value fits on cuda:0. expert-b accepts pinned host memory instead.
        hold = manager.hold(pinned, "cuda:0")
        request = ResidencyRequest(
            "route",
            requirements=[
                ResidencyRequirement(a, "cuda:0"),
                ResidencyRequirement(b, "cuda:0", fallbacks=("pinned-host",)),
            ],
        )
        decision = await controller.decide(request)
        print(f"placements: {', '.join(str(p) for p in decision.placements)}")
        async with manager.scope(decision):
            snapshot = manager.snapshot()
            for handle in (a, b):
                record = snapshot.value(handle)
                print(f"  {record.name} @ {', '.join(str(loc) for loc in record.locations)}")
        hold.release()

        # A custom fallback graph: victims leaving a GPU go straight to pageable memory.
        controller.fallback_graph = FallbackGraph({"cuda:*": ("pageable-host",)})
        request = ResidencyRequest("swap", requirements=[(b, "cuda:0")])
        decision = await controller.decide(request)
        for eviction in decision.evictions:
            print(f"evict {eviction}: {eviction.reason}")


if __name__ == "__main__":
    asyncio.run(main())
