"""The randomized concurrency workload (see ``_chaos.py``) on a real GPU (marked ``cuda``;
skipped without one): real copy streams, leases on incoming copies, cancelled copies, releases
right after a lease, write leases, and a checksum that runs as a slow kernel on the lease's
stream (a spin of about 0.2 ms before the sum), so that a release or a copy that did not wait
for its readers would be caught reading or overwriting data in use. Zero wrong reads, every
task ends, nothing left behind."""

from __future__ import annotations

import os

import anyio
import pytest
import torch
from _chaos import Chaos

from aresidency import ResidencyManager

pytestmark = [pytest.mark.anyio, pytest.mark.cuda]

LOCATIONS = ("pageable-host", "pinned-host", "cuda:0")
VALUE = 2048 * 4  # bytes of one value (Chaos.numel float32)
BUDGETS = {"cuda:0": 6 * VALUE + VALUE, "pinned-host": None}
SPIN = 400_000  # GPU clock cycles: about 0.2 ms on an H200


def slow_checksum(view: torch.Tensor) -> torch.Tensor:
    """On the current stream (the lease's): spin, then sum. Returns a device scalar."""
    torch.cuda._sleep(SPIN)
    return view.double().sum()


def resolve(got: object) -> float:
    """A device read is the checksum kernel's result; a host read was summed at once."""
    if isinstance(got, torch.Tensor):
        return float(got.item())
    assert isinstance(got, list) and len(got) == 1, got
    return float(got[0])


@pytest.mark.parametrize("seed", range(6))
async def test_gpu_random_tasks_never_read_garbage_and_leave_nothing_behind(seed: int) -> None:
    async with ResidencyManager(budgets=BUDGETS, backend="cuda") as m:
        chaos = Chaos(m, 300 + seed, checksum=slow_checksum, locations=LOCATIONS, tasks=16)
        with anyio.fail_after(120):
            await chaos.run()
            await chaos.settle()
        await anyio.to_thread.run_sync(torch.cuda.synchronize)
        assert not chaos.unexpected, chaos.describe_unexpected()
        assert chaos.verify_reads(resolve) > 0
        await chaos.verify_final()
        assert chaos.outcomes.get("done", 0) > 0 and chaos.outcomes.get("cancelled", 0) > 0


# More seeds on demand (ARESIDENCY_CHAOS_SEEDS=40), to hunt a rare failure on the GPU.
FAULT_SEEDS = int(os.environ.get("ARESIDENCY_CHAOS_SEEDS", "3"))


@pytest.mark.parametrize("seed", range(FAULT_SEEDS))
async def test_gpu_random_tasks_under_injected_failures_never_read_garbage(seed: int) -> None:
    async with ResidencyManager(budgets=BUDGETS, backend="cuda") as m:
        chaos = Chaos(m, 400 + seed, faults=True, checksum=slow_checksum, locations=LOCATIONS)
        with anyio.fail_after(120):
            await chaos.run()
            m.backend.faults.fail_transfer_at = None
            m.backend.faults.oom_at_allocation = None
            await chaos.settle()
        await anyio.to_thread.run_sync(torch.cuda.synchronize)
        assert not chaos.unexpected, chaos.describe_unexpected()
        chaos.verify_reads(resolve)
        await chaos.verify_final()


async def test_gpu_closing_the_manager_under_random_tasks_ends_every_task() -> None:
    with anyio.fail_after(60):  # every task ends
        async with anyio.create_task_group() as tg:  # noqa: SIM117 (closed mid-block below)
            async with ResidencyManager(budgets=BUDGETS, backend="cuda") as m:
                chaos = Chaos(m, 500, checksum=slow_checksum, locations=LOCATIONS)
                chaos.start(tg)
                while sum(chaos.outcomes.values()) < 10:
                    await m.wait_for_change(5)
    assert not m.running
    assert not chaos.unexpected, chaos.describe_unexpected()
    assert chaos.outcomes.get("closed", 0) > 0
