"""Automatic Example 11: a controller chooses what to evict so that a request fits.

The story: an inference server keeps eight adapters (4 MiB each) and a KV headroom on a GPU
budget that holds only four adapters at a time. Each request names the adapters it needs on
``cuda:0`` plus a KV reservation; the controller decides which resident adapters to evict (and
where: pinned host memory, or dropped when they can be rebuilt from their source), explains the
peak, and the scope carries the decision out. Runs on a GPU, or on the simulated backend
(``cuda:N`` made of host memory) without one.

    python examples/11_controller_decide_and_scope.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import (
    CallableSource,
    MemoryReservation,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
)

MiB = 1 << 20


def adapter_source(seed: int) -> CallableSource:
    """Adapters 4..7 can be rebuilt from a 'checkpoint' (here: a seeded generator)."""

    def load() -> torch.Tensor:
        return torch.randn(1024, 1024, generator=torch.Generator().manual_seed(seed))

    return CallableSource(load, shape=(1024, 1024), dtype=torch.float32)


async def main() -> None:
    budgets = {"cuda:0": 4 * 4 * MiB + 2 * MiB, "pinned-host": 256 * MiB}
    async with ResidencyManager(budgets=budgets, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        adapters = [
            manager.register(torch.randn(1024, 1024), name=f"adapter{i}", location="pinned-host")
            for i in range(4)
        ] + [manager.register_source(adapter_source(i), name=f"adapter{i}") for i in range(4, 8)]
        controller = ResidencyController(manager, search_state_limit=10_000)

        for step, wanted in enumerate([(0, 1), (2, 4), (5, 6, 7), (0, 3)]):
            request = ResidencyRequest(
                f"request-{step}",
                requirements=[ResidencyRequirement(adapters[i], "cuda:0") for i in wanted],
                reservations=[MemoryReservation("kv", "cuda:0", 2 * MiB)],
            )
            # controller.scope decides, waits while only transient state (leases, holds,
            # pending events of earlier work) stands in the way, re-deciding if the state
            # moved, and enters the decision.
            async with controller.scope(request, timeout=5.0) as scope:
                for i in wanted:
                    async with manager.acquire(adapters[i], "cuda:0") as lease:
                        _ = lease.tensor.sum()
            decision = scope.decision
            print(f"\n{request.name}: needs adapters {wanted}")
            print(
                f"  explored_states={decision.explored_states} "
                f"expected_state_version={decision.expected_state_version}"
            )
            for eviction in decision.evictions:
                print(f"  evict {eviction}")
            peak = decision.explanation.predicted_peak_bytes
            print(
                "  predicted peak: "
                + ", ".join(
                    f"{loc} {nbytes / MiB:.0f} MiB" for loc, nbytes in peak.items() if nbytes
                )
            )
            on_gpu = [
                record.name
                for record in manager.snapshot().values.values()
                if any(str(loc) == "cuda:0" for loc in record.locations)
            ]
            print(f"  on cuda:0 afterwards: {', '.join(on_gpu)}")


if __name__ == "__main__":
    asyncio.run(main())
