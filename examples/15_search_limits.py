"""Automatic Example 15: a bounded search: "infeasible" and "inconclusive" are different answers.

The controller's search is deterministic and bounded by ``search_state_limit``. When the bound
is reached first it raises ``ResidencySearchLimitError`` (``request_name``, ``state_limit``,
``explored_states``, ``detail``): feasibility is unknown, not disproved. When the request cannot
fit whatever is evicted (or every candidate is protected), it raises ``ResidencyPlanError``.
``ResidencySearchLimitError`` is a ``ResidencyPlanError``, so catch it first. Runs on the GPU when
there is one, otherwise on the simulated backend (a simulation of CUDA devices made of host
memory).

    python examples/15_search_limits.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import (
    ResidencyController,
    ResidencyManager,
    ResidencyPlanError,
    ResidencyRequest,
    ResidencySearchLimitError,
)

KiB = 1 << 10


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 360 * KiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        # Twenty small values of different sizes fill cuda:0; many eviction sets would do.
        for i in range(20):
            manager.register(torch.zeros((8 + i) * 256), name=f"v{i}", location="cuda:0")
        big = manager.register(torch.zeros(64 * 256), name="big")  # 64 KiB
        request = ResidencyRequest("make-room", requirements=[(big, "cuda:0")])

        for limit in (2, 10_000):
            controller = ResidencyController(manager, search_state_limit=limit)
            try:
                decision = await controller.decide(request)
            except ResidencySearchLimitError as error:
                print(
                    f"limit {error.state_limit}: inconclusive after {error.explored_states} "
                    f"states for {error.request_name!r} ({error.detail})"
                )
            else:
                print(
                    f"limit {limit}: decided after {decision.explored_states} states, "
                    f"{len(decision.evictions)} eviction(s)"
                )

        # Infeasible whatever the bound: more than the whole budget.
        huge = manager.register(torch.zeros(1024 * 256), name="huge")  # 1 MiB > 360 KiB
        controller = ResidencyController(manager)
        try:
            await controller.decide(ResidencyRequest("too-big", requirements=[(huge, "cuda:0")]))
        except ResidencySearchLimitError:
            raise  # not this case
        except ResidencyPlanError as error:
            print(f"infeasible: {type(error).__name__}: {error.reason[:80]}...")


if __name__ == "__main__":
    asyncio.run(main())
