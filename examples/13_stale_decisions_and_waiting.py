"""Automatic Example 13: stale decisions are refused, and controller.scope waits for admission.

A decision is derived from one state version (``decision.expected_state_version``). Entering it
after any other change raises ``ResidencyStaleStateError`` before anything changes: the victims
and peaks it chose may no longer be right, so it is never replayed. ``controller.scope(request)``
derives a fresh decision instead, and when the request is blocked only by transient state (a
lease, a hold, pending events, another scope's reservation) it waits for that state to change,
up to ``timeout`` seconds. Runs on the GPU when there is one, otherwise on the simulated backend
(a simulation of CUDA devices made of host memory).

    python examples/13_stale_decisions_and_waiting.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import (
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyStaleStateError,
)

MiB = 1 << 20


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 8 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        old = manager.register(torch.zeros(MiB), name="old", location="cuda:0")  # 4 MiB
        new = manager.register(torch.zeros(2 * MiB), name="new")  # 8 MiB: old must go
        controller = ResidencyController(manager)
        request = ResidencyRequest("load-new", requirements=[(new, "cuda:0")])

        # 1. A decision, then an intervening change: entering the old decision is refused.
        decision = await controller.decide(request)
        print(f"decided at v{decision.expected_state_version}: evict {decision.evictions[0]}")
        manager.register(torch.zeros(1), name="unrelated")  # any mutation bumps the version
        try:
            async with manager.scope(decision):
                pass
        except ResidencyStaleStateError as error:
            print(f"stale: expected v{error.expected_version}, now v{error.actual_version}")

        # 2. controller.scope waits while a lease on 'old' blocks its eviction.
        lease_entered, lease_done = asyncio.Event(), asyncio.Event()

        async def reader() -> None:
            async with manager.acquire(old, "cuda:0"):
                lease_entered.set()
                await asyncio.sleep(0.05)  # a short piece of work on 'old'
            lease_done.set()

        task = asyncio.create_task(reader(), name="reader")
        await lease_entered.wait()
        async with controller.scope(request, timeout=5.0) as scope:
            print(f"admitted after the lease ended: {lease_done.is_set()}")
            print(f"entered a fresh decision at v{scope.decision.expected_state_version}")
        await task
        print(f"stale retries so far: {controller.stale_retries}")


if __name__ == "__main__":
    asyncio.run(main())
