"""Automatic Example 14: the decision evidence of a controller decision (troubleshooting step 5).

Every controller decision carries its evidence: ``expected_state_version`` (the state it was
derived from), ``explored_states`` (how much bounded, deterministic search work it took: not an
eviction count, not a performance score), ``evictions`` (each victim with its location, byte
charge, destination and reason), ``plan`` (``reclaim`` the evictions, ``reserve`` the request's
reservations, ``enter`` a ``Materialize`` per requirement) and ``explanation`` (the predicted
peak per location). This example derives a decision, prints all of it, checks that every
requested endpoint is in place once the decision is entered, and writes ``decision.summary()``
as JSON for a log. Runs on the GPU when there is one, otherwise on the simulated backend (a
simulation of CUDA devices made of host memory).

    python examples/14_automatic_decision_evidence.py
"""

from __future__ import annotations

import asyncio
import json

import torch

from aresidency import (
    CallableSource,
    MemoryReservation,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    format_nbytes,
)

MiB = 1 << 20


def zeros_source() -> CallableSource:
    """A value that can be rebuilt (a stand-in for a checkpoint): the controller may drop it."""
    return CallableSource(lambda: torch.zeros(MiB), shape=(MiB,), dtype=torch.float32)


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 20 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        # cuda:0 holds four 4 MiB values: two plain, one rebuildable, one held (protected).
        resident = [
            manager.register(torch.zeros(MiB), name=f"resident{i}", location="cuda:0")
            for i in range(2)
        ]
        cached = manager.register_source(zeros_source(), name="cached")
        await manager.materialize(cached, "cuda:0")
        held = manager.register(torch.zeros(MiB), name="held", location="cuda:0")
        hold = manager.hold(held, "cuda:0")
        wanted = manager.register(torch.zeros(2 * MiB), name="wanted")  # 8 MiB

        controller = ResidencyController(manager, search_state_limit=10_000)
        request = ResidencyRequest(
            "step5",
            requirements=[ResidencyRequirement(wanted, "cuda:0"), (resident[0], "cuda:0")],
            reservations=[MemoryReservation("workspace", "cuda:0", 2 * MiB)],
        )
        decision = await controller.decide(request)

        # Step 5 of docs/troubleshooting.md, printed.
        print(f"expected_state_version: {decision.expected_state_version}")
        print(f"explored_states: {decision.explored_states} (search work, not evictions)")
        print(f"evictions ({len(decision.evictions)}):")
        for eviction in decision.evictions:
            where = "dropped" if eviction.dropped else f"-> {eviction.destination}"
            print(
                f"  {eviction.handle.name} @ {eviction.location} "
                f"{format_nbytes(eviction.charge_bytes)} {where}: {eviction.reason}"
            )
        print(f"plan.reclaim: {', '.join(str(action) for action in decision.plan.reclaim)}")
        print(f"plan.enter: {', '.join(str(action) for action in decision.plan.enter)}")
        for location, peak in decision.explanation.predicted_peak_bytes.items():
            if not peak:
                continue
            budget = decision.explanation.ledger[location].budget_bytes
            limit = "unlimited" if budget is None else format_nbytes(budget)
            print(f"predicted peak at {location}: {format_nbytes(peak)} (budget {limit})")
        victims = {eviction.handle for eviction in decision.evictions}
        print(f"the held value is never a victim: {held not in victims}")

        # Enter it: every requested endpoint is in place inside the scope.
        async with manager.scope(decision):
            snapshot = manager.snapshot()
            placed = all(
                requirement.location in snapshot.value(requirement.handle).locations
                for requirement in request.requirements
            )
            print(f"every requested endpoint in place: {placed}")
        hold.release()

        # For a log: tensor-free and JSON-able.
        summary = json.dumps(decision.summary())
        print(f"decision.summary() as JSON: {len(summary)} bytes")


if __name__ == "__main__":
    asyncio.run(main())
