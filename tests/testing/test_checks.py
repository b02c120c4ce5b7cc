"""The helpers of aresidency.testing that wait without sleeping and say what a test left
behind: ``settled``, ``until``, ``in_flight``, ``assert_quiet``, ``assert_within_budgets``, on
the plugin's ``residency_manager`` (a simulation of CUDA devices in host memory)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import pytest
import torch

from aresidency import MemoryReservation, ModelPool, ReplicaMode, ResidencyPlan
from aresidency.integrations import stream_module
from aresidency.runtime import ManagerClosedError
from aresidency.testing import (
    assert_quiet,
    assert_within_budgets,
    in_flight,
    settled,
    simulated_manager,
    until,
)

pytestmark = pytest.mark.anyio

KiB = 1024


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event a simulated stream's worker can be made to wait on (opened at teardown, so a
    failing test never leaves a worker blocked)."""
    event = threading.Event()
    yield event
    event.set()


def hold_stream(manager, gate: threading.Event) -> None:
    """Keep cuda:0's compute stream busy until ``gate`` opens: what a long kernel does."""
    stream = manager.backend.current_stream("cuda:0")
    manager.backend.run_in_stream_order(stream, lambda: gate.wait(30))


# --- settled and in_flight --------------------------------------------------------------------


# 10 MB/s: the 64 KiB copy below takes about 7 ms, so it is still in flight when checked.
@pytest.mark.residency(copy_gbps=0.01)
async def test_settled_waits_for_a_copy_in_flight(residency_manager):
    manager = residency_manager
    handle = manager.register(
        torch.ones(16 * KiB), name="w", location="pinned-host", replica_mode=ReplicaMode.REPLICABLE
    )
    pending = manager.materialize_nowait(handle, "cuda:0")
    assert in_flight(manager) == [
        "value w (#1): copy pinned-host -> cuda:0, 65536 B",
        "value w (#1) at pinned-host: 1 consumer event(s) pending (work still reading it)",
    ]

    await settled(manager)

    assert in_flight(manager) == []
    assert pending.done()
    assert [str(loc) for loc in manager.snapshot().value(handle).locations] == [
        "pinned-host",
        "cuda:0",
    ]


async def test_settled_waits_for_readers_still_running_on_the_device(residency_manager, gate):
    manager = residency_manager
    handle = manager.register(torch.ones(1024), name="w", location="cuda:0")
    hold_stream(manager, gate)
    async with manager.acquire(handle, "cuda:0"):
        pass  # the lease's reader event is recorded behind the held stream's work

    (line,) = in_flight(manager)
    assert "1 consumer event(s) pending" in line
    with pytest.raises(TimeoutError, match=r"settled was still false .* consumer event"):
        await settled(manager, timeout=0.05)  # the gate is closed: it cannot settle

    gate.set()
    await settled(manager)
    assert in_flight(manager) == []


async def test_settled_returns_at_once_when_nothing_is_in_flight(residency_manager):
    version = residency_manager.state_version
    with anyio.fail_after(1):
        await settled(residency_manager)
    assert residency_manager.state_version == version


# --- until -----------------------------------------------------------------------------------


async def test_until_returns_the_predicates_value_once_it_holds(residency_manager):
    manager = residency_manager
    handle = manager.register(torch.ones(1024), name="w")
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(manager.materialize, handle, "cuda:1")
        where = await until(
            manager,
            lambda: (
                [str(loc) for loc in manager.snapshot().value(handle).locations] == ["cuda:1"]
                and "moved"
            ),
        )
    assert where == "moved"


async def test_until_times_out_naming_the_condition_and_what_is_in_flight(residency_manager, gate):
    manager = residency_manager
    handle = manager.register(torch.ones(1024), name="w", location="cuda:0")
    hold_stream(manager, gate)
    async with manager.acquire(handle, "cuda:0"):
        pass
    with pytest.raises(TimeoutError) as caught:
        await until(manager, lambda: False, timeout=0.05, what="the moon")
    assert str(caught.value).startswith("the moon was still false after 0.05 s")
    assert "value w (#1) at cuda:0: 1 consumer event(s) pending" in str(caught.value)


async def test_until_wakes_with_manager_closed_error_when_the_manager_closes():
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tasks, simulated_manager() as manager:

        async def wait_forever() -> None:
            try:
                await until(manager, lambda: False, timeout=None)
            except ManagerClosedError as error:
                errors.append(error)

        tasks.start_soon(wait_forever)
        await anyio.wait_all_tasks_blocked()
    assert len(errors) == 1


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m: until("manager", lambda: True), TypeError, "expected a ResidencyManager"),
        (lambda m: until(m, "ready"), TypeError, "until needs a predicate"),
        (lambda m: until(m, lambda: True, timeout=-1), ValueError, "timeout"),
        (lambda m: settled(m, timeout="soon"), TypeError, "timeout"),
    ],
)
async def test_bad_arguments_to_the_waits_are_refused(residency_manager, call, error, match):
    with pytest.raises(error, match=match):
        await call(residency_manager)


# --- assert_quiet ----------------------------------------------------------------------------


async def test_a_fresh_manager_is_quiet(residency_manager):
    assert_quiet(residency_manager)


async def test_assert_quiet_lists_leases_holds_and_reservations(residency_manager):
    manager = residency_manager
    leased = manager.register(torch.ones(1024), name="leased", location="cuda:0")
    held = manager.register(torch.ones(1024), name="held", location="pinned-host")
    hold = manager.hold(held, "pinned-host")
    async with manager.acquire(leased, "cuda:0"), manager.reservation("ws", "cuda:1", "4KiB"):
        with pytest.raises(AssertionError) as caught:
            assert_quiet(manager)
    message = str(caught.value)
    assert message.startswith("the manager is not quiet (state version ")
    assert "value leased (#1) is leased 1x at cuda:0" in message
    assert "value held (#2) is held 1x at pinned-host" in message
    assert "reservation 'ws' holds 4096 B at cuda:1" in message
    hold.release()
    await settled(manager)
    assert_quiet(manager)


@pytest.mark.residency(copy_gbps=0.01)
async def test_assert_quiet_lists_copies_in_flight(residency_manager):
    manager = residency_manager
    handle = manager.register(torch.ones(16 * KiB), name="w", location="pinned-host")
    manager.materialize_nowait(handle, "cuda:0")
    with pytest.raises(AssertionError, match=r"value w \(#1\): move pinned-host -> cuda:0"):
        assert_quiet(manager)
    await settled(manager)
    assert_quiet(manager)


@pytest.mark.residency(budgets={"cuda:0": "8KiB"})
async def test_assert_quiet_lists_a_scope_waiting_for_admission(residency_manager):
    manager = residency_manager
    plan = ResidencyPlan(reserve=[MemoryReservation("kv", "cuda:0", "8KiB")])
    async with anyio.create_task_group() as tasks, manager.reservation("ws", "cuda:0", "8KiB"):

        async def enter() -> None:
            async with manager.scope(plan):
                pass

        tasks.start_soon(enter)
        await anyio.wait_all_tasks_blocked()  # the queue is not state: until() would not wake
        with pytest.raises(AssertionError, match=r"1 scope\(s\) or operation\(s\) wait"):
            assert_quiet(manager)
    assert_quiet(manager)


@pytest.mark.residency(staging_bytes="1MiB")
async def test_the_backends_own_staging_reservation_does_not_count(residency_manager):
    record = residency_manager.snapshot().location("pinned-host")
    assert record.reserved_bytes == 1 << 20  # the simulated backend's staging pool
    assert_quiet(residency_manager)


async def test_the_host_copies_an_open_pool_or_streamed_module_keeps_do_not_count(
    residency_manager,
):
    # A served model's host copy is held for as long as its pool (or stream_module) is
    # open: its module's tensors point into it. assert_quiet named those holds ("value
    # a.block0 (#1) is held 1x at pinned-host", one per block) after every request had
    # ended, so a server's test could not check that a request left nothing behind. A hold
    # of the test's own on such a copy, and a request still in its block, still count.
    manager = residency_manager
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model.requires_grad_(False)
    streamed = stream_module(manager, model, "cuda:0")
    pool = ModelPool(manager)
    pool.add("a", torch.nn.Sequential(torch.nn.Linear(8, 8)).requires_grad_(False))
    await streamed(torch.ones(2, 8))
    async with pool.use("a") as served:
        await served(torch.ones(2, 8))
        with pytest.raises(AssertionError, match=r"value a\.block0 \(#\d+\) is held 1x at cuda:0"):
            assert_quiet(manager)
    await settled(manager)
    assert_quiet(manager)
    handle = streamed.handles[0]
    hold = manager.hold(handle, "pinned-host")
    with pytest.raises(AssertionError, match=r"is held 1x at pinned-host"):
        assert_quiet(manager)
    hold.release()
    assert_quiet(manager)
    await pool.aclose()
    await streamed.aclose()
    assert_quiet(manager)


# --- assert_within_budgets -------------------------------------------------------------------


@pytest.mark.residency(budgets={"cuda:0": "8KiB"})
async def test_a_manager_that_kept_its_budgets_passes(residency_manager):
    residency_manager.register(torch.ones(1024), name="w", location="cuda:0")
    assert_within_budgets(residency_manager)
    assert_within_budgets(residency_manager, {"cuda:0": "4KiB", "pinned-host": 0})


async def test_a_peak_over_a_limit_of_yours_fails_with_exact_and_readable_sizes(
    residency_manager,
):
    manager = residency_manager
    handle = manager.register(torch.ones(1024), name="w", location="cuda:0")  # 4096 B
    await manager.move(handle, "pinned-host")  # gone from cuda:0, but it peaked there
    with pytest.raises(AssertionError) as caught:
        assert_within_budgets(manager, {"cuda:0": "1KiB"})
    assert str(caught.value) == ("over budget: cuda:0 peaked at 4096 B, over its limit of 1024 B")
    manager.reset_peak_bytes("cuda:0")  # from here on only
    assert_within_budgets(manager, {"cuda:0": "1KiB"})


@pytest.mark.residency(budgets={"cuda:0": "8KiB"})
async def test_a_budget_lowered_below_an_earlier_peak_fails_until_the_peak_is_reset(
    residency_manager,
):
    manager = residency_manager
    handle = manager.register(torch.ones(1024), name="w", location="cuda:0")
    await manager.move(handle, "pinned-host")
    manager.set_budget("cuda:0", "2KiB")
    with pytest.raises(AssertionError, match=r"cuda:0 peaked at 4096 B, over its budget of 2048 B"):
        assert_within_budgets(manager)
    manager.reset_peak_bytes("cuda:0")
    assert_within_budgets(manager)


@pytest.mark.parametrize(
    ("limits", "error", "match"),
    [
        ({"cuda:7": "1KiB"}, ValueError, r"limit for cuda:7: the manager has no such location"),
        ({"cuda:0": "lots"}, ValueError, r"limit for cuda:0 must be a byte count"),
        ({"gpu": "1KiB"}, ValueError, "'gpu'"),
    ],
)
async def test_bad_limits_are_refused(residency_manager, limits, error, match):
    with pytest.raises(error, match=match):
        assert_within_budgets(residency_manager, limits)
