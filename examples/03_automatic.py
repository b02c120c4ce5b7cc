"""Automatic residency: a controller chooses what to evict so that a request fits.

The story: an inference server keeps eight adapters (16 MiB each) and a KV headroom on a GPU
budget that holds only four adapters at a time. Each request names the adapters it needs on
``cuda:0`` plus a KV reservation; the controller decides which resident adapters to evict (and
where: pinned host memory, or dropped when they can be rebuilt from their source), explains the
peak, and the scope carries the decision out. Runs on a GPU, or on the simulated backend
(``cuda:N`` made of host memory) without one.

    python examples/03_automatic.py
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
    ResidencyStaleStateError,
)

MiB = 1 << 20


def adapter_source(seed: int) -> CallableSource:
    """Adapters 4..7 can be rebuilt from a 'checkpoint' (here: a seeded generator)."""

    def load() -> torch.Tensor:
        return torch.randn(2048, 2048, generator=torch.Generator().manual_seed(seed))

    return CallableSource(load, shape=(2048, 2048), dtype=torch.float32)


async def main() -> None:
    budgets = {"cuda:0": 4 * 16 * MiB + 8 * MiB, "pinned-host": 256 * MiB}
    async with ResidencyManager(budgets=budgets, backend="auto") as manager:
        simulated = " (simulated CUDA devices in host memory)" if manager.backend.simulated else ""
        print(f"backend: {manager.backend.name}{simulated}")
        adapters = [
            manager.register(torch.randn(2048, 2048), name=f"adapter{i}", location="pinned-host")
            for i in range(4)
        ] + [manager.register_source(adapter_source(i), name=f"adapter{i}") for i in range(4, 8)]
        controller = ResidencyController(manager, search_state_limit=10_000)

        for step, wanted in enumerate([(0, 1), (2, 4), (5, 6, 7), (0, 3)]):
            request = ResidencyRequest(
                f"request-{step}",
                requirements=[ResidencyRequirement(adapters[i], "cuda:0") for i in wanted],
                reservations=[MemoryReservation("kv", "cuda:0", 8 * MiB)],
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

        # A decision entered after another change is refused, never replayed...
        request = ResidencyRequest("late", requirements=[(adapters[1], "cuda:0")])
        decision = await controller.decide(request)
        manager.register(torch.zeros(1), name="unrelated")  # an intervening mutation
        try:
            async with manager.scope(decision):
                pass
        except ResidencyStaleStateError as error:
            print(f"\nstale: expected v{error.expected_version}, now v{error.actual_version}")
        # ...while controller.scope derives a fresh decision and enters it.
        async with controller.scope(request, timeout=5.0):
            print("controller.scope re-derived the decision and entered it")


if __name__ == "__main__":
    asyncio.run(main())
