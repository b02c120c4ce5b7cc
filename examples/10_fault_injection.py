"""Explicit Example 10: inject faults on the simulation to see how failures look.

Every backend has ``backend.faults``: ``fail_transfer_at = k`` makes the k-th transfer from now
fail after its device work ran, ``oom_at_allocation = k`` makes the k-th allocation raise
``torch.OutOfMemoryError``. Use them in tests to prove that your code survives a failed copy or
an out-of-memory device: the manager aborts the transfer, frees its charge and leaves the value
where it was. Runs on the GPU when there is one, otherwise on the simulated backend (a
simulation of CUDA devices made of host memory).

    python examples/10_fault_injection.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import ResidencyManager

MiB = 1 << 20


def where(manager: ResidencyManager, name: str) -> str:
    for record in manager.snapshot().values.values():
        if record.name == name:
            return ", ".join(str(loc) for loc in record.locations)
    raise KeyError(name)


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        weights = manager.register(torch.ones(MiB), name="weights")
        faults = manager.backend.faults

        # 1. The next transfer fails after its device work ran.
        faults.fail_transfer_at = 1
        try:
            await manager.materialize(weights, "cuda:0")
        except RuntimeError as error:
            print(f"injected transfer failure: {type(error).__name__}: {error}")
        cuda = manager.snapshot().location("cuda:0")
        print(f"  weights still at {where(manager, 'weights')}; cuda:0 used={cuda.used_bytes}")

        # 2. The next allocation runs out of memory, before any copy starts.
        faults.oom_at_allocation = 1
        try:
            await manager.materialize(weights, "cuda:0")
        except torch.OutOfMemoryError as error:
            print(f"injected out-of-memory: {type(error).__name__}")
        print(f"  weights still at {where(manager, 'weights')}")

        # 3. With no fault armed, the same call succeeds: nothing was left half-done.
        await manager.materialize(weights, "cuda:0")
        print(f"without faults: weights at {where(manager, 'weights')}")
        kinds = [t.kind for t in manager.trace().transitions]
        aborted, moved = kinds.count("copy_abort"), kinds.count("move_commit")
        print(f"trace: {aborted} aborted copies, {moved} completed move")


if __name__ == "__main__":
    asyncio.run(main())
