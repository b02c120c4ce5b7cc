"""Explicit Example 5: reserve bytes that are not a managed value (a workspace, a KV headroom).

A named reservation charges a location's budget without a tensor behind it: the memory your own
kernels will allocate. ``async with manager.reservation(name, location, nbytes)`` holds it for a
block and never waits (over budget is ``ResidencyBudgetError`` at once, with ``kind ==
"reservation"`` and ``handle is None``); plans reserve with ``MemoryReservation`` (Example 6).
Runs on the GPU when there is one, otherwise on the simulated backend (a simulation of CUDA
devices made of host memory).

    python examples/05_reservations.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import ResidencyBudgetError, ResidencyManager, format_nbytes

MiB = 1 << 20


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 32 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        manager.register(torch.zeros(4 * MiB // 4), name="weights", location="cuda:0")  # 4 MiB

        async with manager.reservation("workspace", "cuda:0", 16 * MiB):
            record = manager.snapshot().location("cuda:0")
            print(
                f"inside: used={format_nbytes(record.used_bytes)} "
                f"reserved={format_nbytes(record.reserved_bytes)} "
                f"reservations={list(record.reservations)}"
            )
            # A second reservation that does not fit is refused at once, with the arithmetic.
            try:
                async with manager.reservation("activations", "cuda:0", 16 * MiB):
                    pass
            except ResidencyBudgetError as error:
                print(
                    f"refused: kind={error.kind} handle={error.handle} "
                    f"{error.used_bytes} + {error.reserved_bytes} + {error.requested_bytes} "
                    f"> {error.budget_bytes} (missing {format_nbytes(error.missing_bytes)})"
                )
        record = manager.snapshot().location("cuda:0")
        print(
            f"after: reserved={format_nbytes(record.reserved_bytes)} "
            f"peak={format_nbytes(record.peak_bytes)}"
        )


if __name__ == "__main__":
    asyncio.run(main())
