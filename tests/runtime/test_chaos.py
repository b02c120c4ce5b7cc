"""The randomized concurrency workload (see ``_chaos.py``) on the simulated backend (a
simulation of CUDA devices in host memory): many tasks, random cancellations, timeouts and body
exceptions, with and without injected transfer and allocation failures, and with the manager
closing while they run. Zero wrong reads, every task ends, nothing left behind."""

from __future__ import annotations

import anyio
import pytest
from _chaos import Chaos

from aresidency import ResidencyManager
from aresidency.backends import SimBackend

pytestmark = pytest.mark.anyio

BUDGETS = {"cuda:0": 6 * 8192 + 8192, "cuda:1": 4 * 8192, "pinned-host": 12 * 8192}


def sim() -> SimBackend:
    # Slow enough that copies, leases on incoming copies and cancellations overlap.
    return SimBackend(copy_gbps=0.05, chunk_bytes=2048)


def resolve(got: object) -> float:
    assert isinstance(got, list) and len(got) == 1, got  # the stream ran the read
    return float(got[0])


@pytest.mark.parametrize("seed", range(4))
async def test_random_tasks_never_read_garbage_and_leave_nothing_behind(seed: int) -> None:
    async with ResidencyManager(budgets=BUDGETS, backend=sim()) as m:
        chaos = Chaos(m, seed)
        await chaos.run()
        await chaos.settle()
        for stream in (m.backend.current_stream("cuda:0"), m.backend.current_stream("cuda:1")):
            await m.backend.wait(m.backend.record_event(stream))
        assert not chaos.unexpected, chaos.describe_unexpected()
        assert chaos.verify_reads(resolve) > 0
        await chaos.verify_final()
        assert chaos.outcomes.get("done", 0) > 0 and chaos.outcomes.get("cancelled", 0) > 0


@pytest.mark.parametrize("seed", range(3))
async def test_random_tasks_under_injected_failures_never_read_garbage(seed: int) -> None:
    async with ResidencyManager(budgets=BUDGETS, backend=sim()) as m:
        chaos = Chaos(m, 100 + seed, faults=True)
        await chaos.run()
        m.backend.faults.fail_transfer_at = None
        m.backend.faults.oom_at_allocation = None
        await chaos.settle()
        for stream in (m.backend.current_stream("cuda:0"), m.backend.current_stream("cuda:1")):
            await m.backend.wait(m.backend.record_event(stream))
        assert not chaos.unexpected, chaos.describe_unexpected()
        chaos.verify_reads(resolve)
        await chaos.verify_final()
        assert (
            chaos.outcomes.get("injected", 0) > 0
            or chaos.outcomes.get("ResidencyPlanExecutionError", 0) > 0
        )


@pytest.mark.parametrize("seed", range(2))
async def test_closing_the_manager_under_random_tasks_ends_every_task(seed: int) -> None:
    with anyio.fail_after(60):  # every task ends
        async with anyio.create_task_group() as tg:  # noqa: SIM117 (closed mid-block below)
            async with ResidencyManager(budgets=BUDGETS, backend=sim()) as m:
                chaos = Chaos(m, 200 + seed)
                chaos.start(tg)
                # Let them get going; the point is to close the manager mid-work.
                while sum(chaos.outcomes.values()) < 10:
                    await m.wait_for_change(5)
            # the manager closed here, under the running tasks
    assert not m.running
    assert not chaos.unexpected, chaos.describe_unexpected()
    assert chaos.outcomes.get("closed", 0) > 0
