"""Explicit Example 8: begin a transfer now, await it later, or cancel it.

``materialize_nowait`` charges the destination and enqueues the copy before it returns, and
gives back a ``PendingOperation``: awaitable, with ``done()``, ``exception()``, ``cancel()``
and ``add_done_callback(fn)`` like a future. It completes whether or not anyone awaits it
(nothing stays half-copied because a caller went away); cancelling it before anyone uses the
destination undoes the charge. Runs on the GPU when there is one, otherwise on the simulated
backend (a simulation of CUDA devices made of host memory).

    python examples/08_pending_operations.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import ReplicaMode, ResidencyManager, format_nbytes
from aresidency.runtime import PendingOperation

MiB = 1 << 20


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        layers = [
            manager.register(
                torch.full((MiB,), float(i)),
                name=f"layer{i}",
                location="pinned-host",
                replica_mode=ReplicaMode.REPLICABLE,  # cuda:0 gets a replica; host copy stays
            )
            for i in range(3)
        ]

        # 1. Begin two prefetches now; the destination is charged before the call returns.
        first = manager.materialize_nowait(layers[0], "cuda:0")
        second = manager.materialize_nowait(layers[1], "cuda:0")
        finished: list[str] = []
        second.add_done_callback(lambda op: finished.append(f"layer1 done={op.done()}"))
        used = manager.snapshot().location("cuda:0").used_bytes
        print(f"right after materialize_nowait: cuda:0 charged {format_nbytes(used)}")
        await first
        await second
        print(f"awaited: {first!r}, callback saw {finished}")

        # 2. Cancel a prefetch nobody needs any more: the charge goes away when it settles.
        third = manager.materialize_nowait(layers[2], "cuda:0")
        third.cancel()
        await third.wait_settled()  # raises nothing; waits until it is done either way
        print(f"cancelled: {third!r} cancelled={third.cancelled()}")
        where = manager.snapshot().value(layers[2]).locations
        print(f"layer2 still at {', '.join(str(loc) for loc in where)}")

        # 3. A pending release of a replica commits once the copy's readers finished.
        release: PendingOperation = manager.release_nowait(layers[0], "cuda:0")
        await release
        used = manager.snapshot().location("cuda:0").used_bytes
        print(f"after release_nowait: cuda:0 charged {format_nbytes(used)}")


if __name__ == "__main__":
    asyncio.run(main())
