"""Diagnose a hang on the GPU: run the release-after-reader and the peer-copy scenarios under
a timeout and, if one does not finish, print every asyncio task's stack and the waiter state.

    python3 benchmarks/diag_cuda_hang.py
"""

from __future__ import annotations

import asyncio
import sys

import torch

from aresidency import ReplicaMode, ResidencyManager

MiB = 1 << 20


def dump(m: ResidencyManager) -> None:
    waiter = getattr(m.backend, "waiter", None)
    print(
        "waiter:",
        waiter,
        "pending",
        waiter.pending_count() if waiter else None,
        "degraded",
        getattr(waiter, "degraded", None),
        flush=True,
    )
    print("background tasks:", len(m._background), flush=True)
    for task in asyncio.all_tasks():
        print("--", task, flush=True)
        task.print_stack(limit=12, file=sys.stdout)
    for record in m.snapshot().values.values():
        print(
            record.name,
            [
                (str(x.location), x.state.value, x.use_count, x.hold_count, x.pending_event_count)
                for x in record.materializations
            ],
        )


async def release_after_reader() -> None:
    async with ResidencyManager(backend="cuda") as m:
        h = m.register(torch.randn(2 * MiB), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await asyncio.wait_for(m.materialize(h, "cuda:0"), 10)
        print("materialized", flush=True)
        side = torch.cuda.Stream()
        async with m.acquire(h, "cuda:0", stream=side) as lease:
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(0.2 * 1.98e9))
                lease.tensor.sum()
        try:
            await asyncio.wait_for(m.release(h, "cuda:0"), 10)
            print("released", flush=True)
        except TimeoutError:
            print("RELEASE HUNG", flush=True)
            dump(m)
        try:
            await asyncio.wait_for(m.discard(h), 10)
        except TimeoutError:
            print("DISCARD HUNG", flush=True)
            dump(m)
        m._background.clear()


async def peer() -> None:
    if torch.cuda.device_count() < 2:
        print("one GPU: peer scenario skipped")
        return
    async with ResidencyManager(backend="cuda") as m:
        h = m.register(torch.randn(8 * MiB), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await asyncio.wait_for(m.materialize(h, "cuda:0"), 10)
        await asyncio.wait_for(m.materialize(h, "cuda:1"), 10)
        print("peer copy done", flush=True)
        async with m.acquire(h, "cuda:1"):
            pass
        try:
            await asyncio.wait_for(m.discard(h), 10)
            print("discarded", flush=True)
        except TimeoutError:
            print("PEER DISCARD HUNG", flush=True)
            dump(m)
        if m._background:
            print("background left at exit:", flush=True)
            dump(m)
            m._background.clear()


if __name__ == "__main__":
    asyncio.run(release_after_reader())
    asyncio.run(peer())
