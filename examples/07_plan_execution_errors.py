"""Explicit Example 7: a plan that fails while it runs, and what it leaves behind.

Preflight (``explain``) can only assume that transfers and loads succeed. When one fails
anyway, ``ResidencyPlanExecutionError`` says in which phase and at which action, chains the
original error as ``__cause__``, and lists in ``partial_report`` every transition the run
committed. Nothing is rolled back: what committed before the failure stays in effect
(``partial_report.in_effect``), so take a new snapshot and continue from the actual state.
Runs on the GPU when there is one, otherwise on the simulated backend (a simulation of CUDA
devices made of host memory).

    python examples/07_plan_execution_errors.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import (
    CallableSource,
    Materialize,
    Move,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanExecutionError,
)

MiB = 1 << 20


def broken_checkpoint() -> torch.Tensor:
    raise OSError("checkpoint shard 3 is truncated")


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 40 * MiB}, backend="auto") as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        old = manager.register(torch.zeros(4 * MiB), name="old", location="cuda:0")  # 16 MiB
        new = manager.register_source(
            CallableSource(broken_checkpoint, shape=(4 * MiB,), dtype=torch.float32), name="new"
        )
        plan = ResidencyPlan(reclaim=[Move(old, "pinned-host")], enter=[Materialize(new, "cuda:0")])
        print(f"explain says feasible={manager.explain(plan).feasible} (it cannot read files)")

        # (manager.execute(plan) runs the same phases and reports phase="execute".)
        try:
            async with manager.scope(plan, timeout=5.0):
                print("not reached: the scope's entry fails")
        except ResidencyPlanExecutionError as error:
            print(f"phase={error.phase} failed_action_index={error.failed_action_index}")
            print(f"failed_action={error.failed_action}")
            print(f"cause: {type(error.__cause__).__name__}: {error.__cause__}")
            print(f"committed in effect ({len(error.partial_report.in_effect)}):")
            for transition in error.partial_report.in_effect:
                print(f"  {transition}")
            print(f"clean-up or undone: {len(error.partial_report.undone)}")

        # The reclaim phase committed: 'old' is in pinned host memory now, and stays there.
        snapshot = manager.snapshot()
        print(
            f"now: old @ {', '.join(str(loc) for loc in snapshot.value(old).locations)}; "
            f"new @ {', '.join(str(loc) for loc in snapshot.value(new).locations) or 'nowhere'}"
        )


if __name__ == "__main__":
    asyncio.run(main())
