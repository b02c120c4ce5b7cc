"""Explicit Example 9: the evidence: snapshots, the trace and errors, as JSON.

``manager.snapshot()`` is an atomic, tensor-free, immutable view of the state: per location the
budget, used, reserved and peak bytes; per value its materializations with their charges and
protections (use, hold and pending event counts). ``manager.trace()`` is the bounded ring of
committed transitions (``overwritten`` says how many it dropped). Both, and every
``ResidencyError``, turn into JSON with ``to_dict()``; a snapshot comes back with
``ResidencySnapshot.from_dict``. Runs on the GPU when there is one, otherwise on the simulated
backend (a simulation of CUDA devices made of host memory).

    python examples/09_snapshot_trace_json.py
"""

from __future__ import annotations

import asyncio
import json

import torch

from aresidency import (
    ResidencyBudgetError,
    ResidencyManager,
    ResidencySnapshot,
)

MiB = 1 << 20


async def main() -> None:
    budgets = {"cuda:0": "24MiB"}  # sizes may be written as people write them
    async with ResidencyManager(budgets=budgets, backend="auto", trace_capacity=4) as manager:
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note if manager.backend.host_compute else ''}")
        a = manager.register(torch.zeros(4 * MiB), name="a")  # 16 MiB
        b = manager.register(torch.zeros(4 * MiB), name="b")
        await manager.move(a, "cuda:0")
        hold = manager.hold(a, "cuda:0")

        # 1. The snapshot: one state version, every location and value.
        snapshot = manager.snapshot()
        print(f"snapshot v{snapshot.state_version} of manager {snapshot.manager_id}")
        print(f"  {snapshot.location('cuda:0')!r}")
        m = snapshot.value(a).materialization("cuda:0")
        print(
            f"  a @ cuda:0: charged={m.charged_bytes} use_count={m.use_count} "
            f"hold_count={m.hold_count} pending_event_count={m.pending_event_count}"
        )
        text = json.dumps(snapshot.to_dict())
        again = ResidencySnapshot.from_dict(json.loads(text))
        print(f"  {len(text)} bytes of JSON; round trip equal: {again == snapshot}")
        hold.release()

        # 2. An error, as JSON: every structured field it has.
        try:
            await manager.materialize(b, "cuda:0")
        except ResidencyBudgetError as error:
            fields = error.to_dict()
            print(f"error as JSON: {json.dumps({k: fields[k] for k in ('type', 'kind')})}")
            print(
                f"  location={fields['location']} budget={fields['budget_bytes']} "
                f"used={fields['used_bytes']} reserved={fields['reserved_bytes']} "
                f"requested={fields['requested_bytes']} missing={fields['missing_bytes']}"
            )

        # 3. The trace: a bounded ring (capacity 4 here), so older transitions are gone.
        trace = manager.trace()
        print(
            f"trace: capacity={trace.capacity} kept={len(trace.transitions)} "
            f"overwritten={trace.overwritten}"
        )
        for transition in trace.transitions[-3:]:
            print(f"  {transition}")
        print(f"  trace JSON: {len(json.dumps(trace.to_dict()))} bytes")


if __name__ == "__main__":
    asyncio.run(main())
