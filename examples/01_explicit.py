"""Explicit Example 1: place values by hand, explain a plan, run it in a scope, read the evidence.

Runs on a GPU when there is one (backend "auto") and on the simulated backend otherwise, which
makes ``cuda:N`` out of host memory (a simulation, said so in the output).

    python examples/01_explicit.py
"""

from __future__ import annotations

import asyncio
import json

import torch

from aresidency import (
    CallableSource,
    Materialize,
    MemoryReservation,
    Move,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyUnavailableError,
)

MiB = 1 << 20


async def main() -> None:
    budgets = {"cuda:0": 40 * MiB, "pinned-host": 256 * MiB}
    async with ResidencyManager(budgets=budgets, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")

        # 1. Values: two weight matrices in pageable memory, one rebuilt from a source.
        w0 = manager.register(torch.randn(2048, 2048), name="w0")  # 16 MiB
        w1 = manager.register(
            torch.randn(2048, 2048), name="w1", replica_mode=ReplicaMode.REPLICABLE
        )
        w2 = manager.register_source(
            CallableSource(lambda: torch.ones(2048, 2048), shape=(2048, 2048), dtype=torch.float32),
            name="w2",
        )

        # 2. Direct transitions: a move (EXCLUSIVE), a replica (REPLICABLE).
        await manager.move(w0, "pinned-host")
        await manager.move(w0, "cuda:0")
        await manager.materialize(w1, "cuda:0")
        try:
            manager.acquire(w2, "cuda:0")  # acquire never places
        except ResidencyUnavailableError as error:
            print(f"acquire refused as expected: {error}")

        # 3. Use a value: the lease's stream waits for the copy on the device, not the host.
        async with manager.acquire(w0, "cuda:0") as lease:
            norm = float(lease.tensor.norm())
        print(f"norm of w0 on cuda:0: {norm:.1f}")

        # 4. A budget error carries its five byte numbers (location, budget, used, reserved,
        #    requested).
        try:
            await manager.materialize(w2, "cuda:0")
        except ResidencyBudgetError as error:
            print(
                f"budget: {error.location} budget={error.budget_bytes} used={error.used_bytes}"
                f" reserved={error.reserved_bytes} requested={error.requested_bytes}"
            )

        # 5. A manual plan: make room, reserve a workspace, bring w2 in, put w0 back at the end.
        plan = ResidencyPlan(
            reclaim=[Move(w0, "pinned-host")],
            reserve=[MemoryReservation("workspace", "cuda:0", 8 * MiB)],
            enter=[Materialize(w2, "cuda:0")],
            exit=[Move(w2, "pinned-host")],
        )
        explanation = manager.explain(plan)
        print(f"explain: feasible={explanation.feasible} reason={explanation.reason}")
        for location, peak in explanation.predicted_peak_bytes.items():
            ledger = explanation.ledger[location]
            print(
                f"  {location}: predicted peak {peak / MiB:.1f} MiB (resident "
                f"{ledger.resident_bytes / MiB:.0f}, reserved {ledger.reserved_bytes / MiB:.0f}, "
                f"incoming {ledger.destination_bytes / MiB:.0f}, overlap "
                f"{ledger.transfer_overlap_bytes / MiB:.0f}, reconstruction "
                f"{ledger.reconstruction_bytes / MiB:.0f})"
            )
        manager.reset_peak_bytes()
        async with manager.scope(plan) as scope, manager.acquire(w2, "cuda:0") as lease:
            print(f"w2 rebuilt from its source on cuda:0, sum = {float(lease.tensor.sum()):.0f}")
        print(f"scope committed {len(scope.report.transitions)} transitions")

        # 6. Evidence: an atomic, tensor-free snapshot (JSON) and the bounded trace.
        snapshot = manager.snapshot()
        for record in snapshot.locations.values():
            print(f"  {record!r} peak={record.peak_bytes / MiB:.1f} MiB")
        text = json.dumps(snapshot.to_dict())
        print(f"snapshot v{snapshot.state_version}: {len(text)} bytes of JSON")
        trace = manager.trace()
        print(
            f"trace: {len(trace.transitions)} transitions, {trace.overwritten} overwritten; last:"
        )
        for transition in trace.transitions[-4:]:
            print(f"  {transition}")


if __name__ == "__main__":
    asyncio.run(main())
