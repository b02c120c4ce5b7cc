"""Explicit Example 2: register values, then materialize, move, release and discard them.

A value is registered once and named by its ``ValueHandle`` from then on. An EXCLUSIVE value
lives in one place at a time (``materialize`` moves it); a REPLICABLE value may have a copy at
several locations (``materialize`` adds a replica). Each step prints where the values are and
what each location is charged. Runs on the GPU when there is one, otherwise on the simulated
backend (a simulation of CUDA devices made of host memory).

    python examples/02_register_and_move.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import ReplicaMode, ResidencyManager, format_nbytes

MiB = 1 << 20


def where(manager: ResidencyManager) -> str:
    """Each value's locations, from an atomic snapshot."""
    snapshot = manager.snapshot()
    return "; ".join(
        f"{record.name} @ {', '.join(str(loc) for loc in record.locations) or 'nowhere'}"
        for record in snapshot.values.values()
    )


def charges(manager: ResidencyManager) -> str:
    snapshot = manager.snapshot()
    return ", ".join(
        f"{record.location}={format_nbytes(record.used_bytes)}"
        for record in snapshot.locations.values()
        if record.used_bytes
    )


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")

        # register is synchronous: the tensor stays where it is (pageable host memory here).
        weights = manager.register(torch.randn(1024, 1024), name="weights")  # 4 MiB, EXCLUSIVE
        table = manager.register(
            torch.randn(512, 1024), name="table", replica_mode=ReplicaMode.REPLICABLE
        )
        print(f"registered: {where(manager)}")

        # materialize an EXCLUSIVE value elsewhere: a move (the old copy is freed afterwards).
        await manager.materialize(weights, "cuda:0")
        # materialize a REPLICABLE value: a replica; the host copy stays.
        await manager.materialize(table, "cuda:0")
        print(f"after materialize: {where(manager)}")
        print(f"charged: {charges(manager)}")

        # move = copy, then free the source once the copy and its readers completed.
        await manager.move(weights, "pinned-host")
        # release drops one materialization (the last copy of a value without a source is
        # refused: nothing could bring it back).
        await manager.release(table, "cuda:0")
        print(f"after move and release: {where(manager)}")

        # discard forgets the value and frees every copy.
        await manager.discard(table)
        print(f"after discard: {where(manager)}")
        print(f"charged: {charges(manager)}")


if __name__ == "__main__":
    asyncio.run(main())
