"""Leases and holds taken on a materialization before its data exists (a load from the source
still running in its thread, a copy of a phase not issued yet), when that fill never comes:
the load fails, or the phase is cancelled and its copy given up. Simulated backend.

A waiting lease must end with the failure (never wait for data that will not come: the abort
waits for the lease), and a lease or hold of a materialization that was dropped must never
count down the new one a later copy makes there (that one's own leases would lose their
protection while they read)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import (
    Location,
    Move,
    Release,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    ResidencyUnavailableError,
)
from aresidency.runtime.sources import CallableSource

pytestmark = pytest.mark.anyio


def counts(m: ResidencyManager, handle: object, location: str) -> tuple[int, int, int] | None:
    value = m.snapshot().values[handle]
    for record in value.materializations:
        if record.location == Location.parse(location):
            return record.use_count, record.hold_count, record.pending_event_count
    return None


@pytest.mark.parametrize("where", ["pageable-host", "cuda:0"])
async def test_a_lease_waiting_for_a_load_that_fails_ends_with_the_failure(where: str) -> None:
    async with ResidencyManager(backend="sim") as m:
        gate = threading.Event()

        def load() -> torch.Tensor:
            gate.wait(10)
            raise OSError("the checkpoint file is gone")

        h = m.register_source(CallableSource(load, shape=(1024,), dtype=torch.float32), name="w")
        pending = m.materialize_nowait(h, where)
        failures: list[BaseException] = []

        async def lease() -> None:
            try:
                async with m.acquire(h, where):
                    pass
            except ResidencyUnavailableError as error:
                failures.append(error)

        with anyio.fail_after(10):  # the lease waited for ever before
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(lease)
                await anyio.wait_all_tasks_blocked()
                assert counts(m, h, where) == (1, 0, 0)  # it waits on the incoming copy
                gate.set()
                with pytest.raises(OSError, match="checkpoint file is gone"):
                    await pending
        assert len(failures) == 1
        assert "the transfer bringing it there failed: the checkpoint file is gone" in str(
            failures[0]
        )
        assert isinstance(failures[0].__cause__, OSError)
        assert counts(m, h, where) is None  # aborted once the lease ended
        m.state.check_invariants()


async def given_up_copy(m: ResidencyManager) -> tuple[ResidencyPlan, Any, threading.Event]:
    """Register 'a' on the host and 'b' on cuda:0 with a reader still running (a gate); the
    plan returned moves 'a' to cuda:0 and then releases 'b', so that, run, it waits for that
    reader with 'a''s copy begun and not issued. Returns the plan, 'a' and the gate."""
    a = m.register(torch.ones(1024), name="a", replica_mode=ReplicaMode.REPLICABLE)
    b = m.register(torch.ones(1024), name="b", replica_mode=ReplicaMode.REPLICABLE)
    await m.materialize(b, "cuda:0")
    stream = m.backend.current_stream("cuda:0")
    gate = threading.Event()
    m.backend.run_in_stream_order(stream, lambda: gate.wait(10))  # a long kernel reads 'b'
    m.track_readers(b, "cuda:0", [m.backend.record_event(stream)])
    plan = ResidencyPlan(reclaim=[Move(a, "cuda:0"), Release(b, "cuda:0")])
    return plan, a, gate


async def dropped(m: ResidencyManager, handle: object, location: str) -> None:
    """Wait (a step of the loop at a time) until ``handle`` has nothing at ``location``."""
    loc = Location.parse(location)
    while loc in m.state.value(handle).materializations:  # type: ignore[arg-type]
        await anyio.lowlevel.checkpoint()


async def test_a_lease_on_a_copy_given_up_never_counts_down_the_next_copy() -> None:
    async with ResidencyManager(backend="sim") as m:
        plan, a, gate = await given_up_copy(m)
        reclaim = anyio.CancelScope()
        failures: list[BaseException] = []

        async def run_plan() -> None:
            with reclaim:
                await m.execute(plan)

        async def waiting_lease() -> None:
            try:
                async with m.acquire(a, "cuda:0"):
                    pass
            except ResidencyUnavailableError as error:
                failures.append(error)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(run_plan)
                await anyio.wait_all_tasks_blocked()
                tasks.start_soon(waiting_lease)
                await anyio.wait_all_tasks_blocked()
                assert counts(m, a, "cuda:0") == (1, 0, 0)  # leased, no data yet
                reclaim.cancel()
                await dropped(m, a, "cuda:0")  # the reclaim gave the copy up
                # Before the waiting lease runs again, a new copy lands there and is leased.
                await m.materialize_nowait(a, "cuda:0")
                async with m.acquire(a, "cuda:0") as reader:
                    await anyio.wait_all_tasks_blocked()  # the first lease has ended
                    assert len(failures) == 1
                    assert counts(m, a, "cuda:0")[0] == 1  # type: ignore[index]
                    assert torch.equal(reader.tensor, torch.ones(1024))
                gate.set()
                while counts(m, a, "cuda:0") != (0, 0, 0):  # the reader's event is reaped
                    await m.wait_for_change(5)
        assert "given up (cancelled, or it failed) before its data existed" in str(failures[0])
        m.state.check_invariants()


async def test_a_hold_on_a_copy_given_up_never_counts_down_the_next_copy() -> None:
    async with ResidencyManager(backend="sim") as m:
        plan, a, gate = await given_up_copy(m)
        reclaim = anyio.CancelScope()

        async def run_plan() -> None:
            with reclaim:
                await m.execute(plan)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(run_plan)
                await anyio.wait_all_tasks_blocked()
                stale = m.hold(a, "cuda:0")  # on the incoming copy, before its data exists
                reclaim.cancel()
                await dropped(m, a, "cuda:0")
                await m.materialize(a, "cuda:0")
                fresh = m.hold(a, "cuda:0")
                stale.release()  # its materialization is gone: the new one keeps its hold
                assert counts(m, a, "cuda:0") == (0, 1, 0)
                fresh.release()
                assert counts(m, a, "cuda:0") == (0, 0, 0)
                gate.set()
        m.state.check_invariants()
