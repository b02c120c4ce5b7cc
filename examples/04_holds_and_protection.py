"""Explicit Example 4: holds and leases protect a materialization; removal is refused, not waited.

A ``Hold`` keeps a materialization in place without using it (for example while a request that
will need it is queued). While a lease or a hold is active, ``release`` and ``move`` raise
``ResidencyInUseError`` naming the counts that protect it and the task that owns each lease or
hold; pending CUDA reader events, on the other hand, always complete, so a release simply waits
for them. Runs on the GPU when there is one, otherwise on the simulated backend (a simulation
of CUDA devices made of host memory).

    python examples/04_holds_and_protection.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import ResidencyInUseError, ResidencyManager

MiB = 1 << 20


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        cache = manager.register(torch.zeros(256, 1024), name="kv-cache", location="cuda:0")

        # 1. A hold protects the copy on cuda:0 from removal.
        hold = manager.hold(cache, "cuda:0")
        try:
            await manager.move(cache, "pinned-host")
        except ResidencyInUseError as error:
            print(
                f"move refused: use_count={error.use_count} hold_count={error.hold_count} "
                f"pending_event_count={error.pending_event_count} owners={list(error.owners)}"
            )
        hold.release()

        # 2. A lease protects it too, and the error names the task that holds the lease.
        async def reader(entered: asyncio.Event, finish: asyncio.Event) -> None:
            async with manager.acquire(cache, "cuda:0"):
                entered.set()
                await finish.wait()

        entered, finish = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(reader(entered, finish), name="decode-step-7")
        await entered.wait()
        try:
            await manager.move(cache, "pinned-host")
        except ResidencyInUseError as error:
            print(f"move refused while task {error.owners[0]!r} holds a lease")
        finish.set()
        await task

        # 3. With no lease or hold left, the move goes through (it waits for reader events).
        await manager.move(cache, "pinned-host")
        record = manager.snapshot().value(cache)
        print(f"moved: kv-cache now at {', '.join(str(loc) for loc in record.locations)}")


if __name__ == "__main__":
    asyncio.run(main())
