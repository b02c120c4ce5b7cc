"""Explicit Example 6: explain a plan before running it, then run it in a scope.

A ``ResidencyPlan`` has four phases: ``reclaim`` (make room), ``reserve`` (named
reservations), ``enter`` (bring values in) and ``exit`` (run when the scope ends).
``manager.explain(plan)`` simulates it on a copy of the state and predicts the peak charge at
every location, with what makes it up; nothing changes. ``async with manager.scope(plan)``
waits for admission (first come, first served), runs reclaim, reserve and enter, runs the
body, ends the reservations and runs exit. An infeasible plan is refused before anything
changes, with ``ResidencyPlanError`` whose cause is the blocking budget error. Runs on the GPU
when there is one, otherwise on the simulated backend (a simulation of CUDA devices made of
host memory).

    python examples/06_scopes_and_explain.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import (
    Location,
    MemoryReservation,
    Move,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
    format_nbytes,
)

MiB = 1 << 20
GPU = Location.parse("cuda:0")  # explanations are keyed by Location


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 40 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        a = manager.register(torch.zeros(4 * MiB), name="a", location="cuda:0")  # 16 MiB
        b = manager.register(torch.zeros(4 * MiB), name="b", location="pinned-host")  # 16 MiB

        # Swap a out, b in, with an 8 MiB workspace while the body runs.
        plan = ResidencyPlan(
            reclaim=[Move(a, "pinned-host")],
            reserve=[MemoryReservation("workspace", "cuda:0", 8 * MiB)],
            enter=[Move(b, "cuda:0")],
            exit=[Move(b, "pinned-host")],
        )
        explanation = manager.explain(plan)
        ledger = explanation.ledger[GPU]  # what makes up the predicted peak on cuda:0
        print(f"explain: feasible={explanation.feasible}")
        print(
            f"  cuda:0 predicted peak {format_nbytes(ledger.peak_bytes)} at {ledger.peak_at}: "
            f"resident {format_nbytes(ledger.resident_bytes)} + reserved "
            f"{format_nbytes(ledger.reserved_bytes)} + incoming "
            f"{format_nbytes(ledger.destination_bytes)} + overlap "
            f"{format_nbytes(ledger.transfer_overlap_bytes)}; headroom "
            f"{format_nbytes(ledger.headroom_bytes or 0)}"
        )

        manager.reset_peak_bytes()
        # Inside the scope b is on cuda:0 and the workspace is reserved.
        async with manager.scope(plan, timeout=5.0) as scope, manager.acquire(b, "cuda:0") as lease:
            print(f"  in the scope: b on cuda:0, {lease.tensor.numel()} elements")
        peak = manager.snapshot().location("cuda:0").peak_bytes
        print(
            f"scope committed {len(scope.report.transitions)} transitions; measured peak "
            f"{format_nbytes(peak)} == predicted {format_nbytes(ledger.peak_bytes)}: "
            f"{peak == ledger.peak_bytes}"
        )

        # A plan that cannot fit: both values on cuda:0 plus 16 MiB of workspace.
        too_big = ResidencyPlan(
            reserve=[MemoryReservation("workspace", "cuda:0", 16 * MiB)],
            enter=[Move(a, "cuda:0"), Move(b, "cuda:0")],
        )
        explanation = manager.explain(too_big)
        print(f"explain: feasible={explanation.feasible}: {explanation.reason}")
        print(
            "  would reach "
            f"{format_nbytes(explanation.predicted_peak_bytes[GPU])} against a budget of "
            f"{format_nbytes(40 * MiB)}"
        )
        try:
            async with manager.scope(too_big, timeout=0):
                pass
        except ResidencyPlanError as error:
            print(f"scope refused before any change: cause {type(error.__cause__).__name__}")


if __name__ == "__main__":
    asyncio.run(main())
