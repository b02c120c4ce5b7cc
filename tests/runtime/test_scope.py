"""Plans and scopes on the simulated backend: explain, execute, phases, failures, staleness,
admission (FIFO, timeouts, never-fits), cancellation."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from _holders import held_by_another_task

from aresidency import (
    CallableSource,
    Materialize,
    MemoryReservation,
    Move,
    Release,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyStaleStateError,
)
from aresidency.backends.sim import SimBackend

pytestmark = pytest.mark.anyio

KiB = 1024


def tensor(n_bytes: int = 16 * KiB, seed: int = 0) -> torch.Tensor:
    return torch.randn(n_bytes // 4, generator=torch.Generator().manual_seed(seed))


def assert_no_leak(m: ResidencyManager, *, keep_reserved: int = 0) -> None:
    snap = m.snapshot()
    for record in snap.values.values():
        for mat in record.materializations:
            assert (mat.use_count, mat.hold_count, mat.pending_event_count) == (0, 0, 0), record
            assert mat.state.value == "resident", record
    for loc in snap.locations.values():
        if str(loc.location) != "pinned-host":
            assert loc.reserved_bytes == 0, loc
    m._state.check_invariants()


def quiet(m: ResidencyManager) -> bool:
    """Whether :func:`assert_no_leak` would pass (nothing in use, moving or reserved)."""
    try:
        assert_no_leak(m)
    except AssertionError:
        return False
    return True


async def test_scope_enters_reserves_and_exits() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        plan = ResidencyPlan(
            reserve=[MemoryReservation("workspace", "cuda:0", 8 * KiB)],
            enter=[Move(a, "cuda:0")],
            exit=[Move(a, "pinned-host")],
        )
        async with m.scope(plan) as scope:
            rec = m.snapshot().location("cuda:0")
            assert rec.used_bytes == 16 * KiB and rec.reserved_bytes == 8 * KiB
            assert rec.reservations == (("workspace", 8 * KiB),)
        assert [str(x) for x in m.snapshot().value(a).locations] == ["pinned-host"]
        assert m.snapshot().location("cuda:0").charged_bytes == 0
        kinds = [t.kind for t in scope.report.transitions]
        assert kinds == [
            "reserve",
            "move_begin",
            "move_commit",
            "unreserve",
            "move_begin",
            "move_commit",
        ]
        with pytest.raises(RuntimeError, match="single use"):
            async with scope:
                pass


async def test_explain_predicts_the_peak_execution_reaches() -> None:
    rng = random.Random(7)
    for trial in range(30):
        async with ResidencyManager(backend="sim") as m:
            handles = []
            for i in range(4):
                mode = ReplicaMode.REPLICABLE if rng.random() < 0.5 else ReplicaMode.EXCLUSIVE
                loc = rng.choice(["pageable-host", "pinned-host", "cuda:0"])
                handles.append(
                    m.register(
                        tensor(rng.choice([4, 8, 16]) * KiB, i),
                        name=f"v{i}",
                        replica_mode=mode,
                        location=loc,
                    )
                )
            locs = ["pageable-host", "pinned-host", "cuda:0", "cuda:1"]
            enter = [
                rng.choice([Materialize, Move])(h, rng.choice(locs)) for h in rng.sample(handles, 3)
            ]
            reserve = [MemoryReservation("r", rng.choice(locs), rng.choice([0, 4 * KiB]))]
            plan = ResidencyPlan(reserve=reserve, enter=enter)
            explanation = m.explain(plan)
            assert explanation.feasible, explanation.reason
            m._state.reset_peaks()
            await m.execute(plan)
            snap = m.snapshot()
            for loc, predicted in explanation.predicted_peak_bytes.items():
                assert snap.location(loc).peak_bytes == predicted, (trial, loc)
                ledger = explanation.ledger[loc]
                parts = (
                    ledger.resident_bytes
                    + ledger.reserved_bytes
                    + ledger.destination_bytes
                    + ledger.transfer_overlap_bytes
                    + ledger.reconstruction_bytes
                )
                assert parts == ledger.peak_bytes


async def test_stale_decision_is_refused_before_any_change() -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(), name="a")
        plan = ResidencyPlan(enter=[Move(a, "cuda:0")], expected_state_version=m.state_version)
        m.register(tensor(), name="b")  # an intervening mutation
        before = m.snapshot()
        with pytest.raises(ResidencyStaleStateError) as info:
            async with m.scope(plan):
                pass
        assert info.value.expected_version == before.state_version - 1
        assert info.value.actual_version == before.state_version
        assert m.snapshot() == before


async def test_infeasible_plan_fails_preflight_without_changes() -> None:
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        before = m.snapshot()
        with pytest.raises(ResidencyPlanError, match="cuda:0"):
            await m.execute(ResidencyPlan(enter=[Move(a, "cuda:0")]))
        assert m.snapshot() == before


async def test_enter_failure_reports_phase_action_and_committed_prefix() -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(seed=1), name="a")
        b = m.register(tensor(seed=2), name="b")
        c = m.register(tensor(seed=3), name="c", location="cuda:0")
        plan = ResidencyPlan(
            reclaim=[Move(c, "pinned-host")],
            reserve=[MemoryReservation("ws", "cuda:0", 4 * KiB)],
            enter=[Move(a, "cuda:0"), Move(b, "cuda:0")],
        )
        # transfer 1 is the reclaim move; transfer 3 is b's move in the enter phase
        m.backend.faults.fail_transfer_at = 3
        with pytest.raises(ResidencyPlanExecutionError) as info:
            async with m.scope(plan):
                pytest.fail("body must not run")
        error = info.value
        assert error.phase == "enter"
        assert error.failed_action == Move(b, "cuda:0") and error.failed_action_index == 1
        assert error.failed_reservation is None and error.failed_reservation_index is None
        assert "injected" in str(error.__cause__)
        kinds = [(t.kind, t.handle) for t in error.partial_report.transitions]
        assert kinds == [
            ("move_begin", c),
            ("move_commit", c),
            ("reserve", None),
            ("move_begin", a),
            ("move_begin", b),
            ("move_commit", a),
            ("copy_abort", b),
            ("unreserve", None),
        ]
        snap = m.snapshot()
        assert [str(x) for x in snap.value(a).locations] == ["cuda:0"]  # committed, kept
        assert [str(x) for x in snap.value(b).locations] == ["pageable-host"]  # intact
        assert snap.location("cuda:0").reserved_bytes == 0  # prefix released
        assert snap.location("cuda:0").used_bytes == 16 * KiB
        assert_no_leak(m)


async def test_reserve_failure_names_the_reservation_and_releases_the_prefix() -> None:
    async with ResidencyManager(budgets={"cuda:0": 40 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        b = m.register(tensor(seed=2), name="b", location="pinned-host")
        await m.materialize(b, "cuda:0")
        stream = m.backend.current_stream("cuda:0")
        async with m.acquire(b, "cuda:0", stream=stream):
            stream.sleep(0.05)  # the reader's event completes 50 ms from now
        plan = ResidencyPlan(
            reclaim=[Move(b, "pinned-host")],
            reserve=[
                MemoryReservation("r0", "cuda:0", 8 * KiB),
                MemoryReservation("r1", "cuda:0", 16 * KiB),
            ],
            enter=[Move(a, "cuda:0")],
        )
        # Admitted (16 + 8 + 16 fit once b left); then, while the reclaim phase waits for b's
        # reader, the budget shrinks to 20 KiB: the second reservation fails after preflight.
        scope = m.scope(plan)
        entered = anyio.Event()
        errors: list[ResidencyPlanExecutionError] = []

        async def enter() -> None:
            try:
                with pytest.raises(ResidencyPlanExecutionError) as info:
                    await scope.__aenter__()
                errors.append(info.value)
            finally:
                entered.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(enter)
            while m.state.ledger("cuda:0").outgoing_bytes == 0:
                await m.wait_for_change()  # until the reclaim phase began its move
            # (A reservation or a registration onto the device would be refused here: the
            # admitted scope's claim comes first. The budget shrinking takes the room.)
            m.set_budget("cuda:0", 20 * KiB)
            await entered.wait()  # the entry failed
            (error,) = errors
            assert error.phase == "reserve"
            assert error.failed_reservation == plan.reserve[1]
            assert error.failed_reservation_index == 1
            kinds = [t.kind for t in error.partial_report.transitions]
            assert kinds == ["move_begin", "move_commit", "reserve", "unreserve"]
            assert m.snapshot().location("cuda:0").reservations == ()


async def test_body_exception_stays_primary_and_exit_error_is_kept() -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(), name="a", replica_mode=ReplicaMode.REPLICABLE)
        plan = ResidencyPlan(enter=[Materialize(a, "cuda:0")], exit=[Release(a, "cuda:0")])
        scope = m.scope(plan)
        with pytest.raises(KeyError):
            async with scope:
                hold = m.hold(a, "cuda:0")  # makes the exit Release fail
                raise KeyError("body")
        assert isinstance(scope.exit_error, ResidencyPlanExecutionError)
        assert scope.exit_error.phase == "exit"
        hold.release()
        # Written with no name for the scope, the exit failure was lost: the body's exception
        # now carries a note naming it (its traceback shows it).
        with pytest.raises(KeyError) as caught:
            async with m.scope(plan):
                hold = m.hold(a, "cuda:0")
                raise KeyError("body")
        hold.release()
        (note,) = caught.value.__notes__
        assert "also failed at exit (kept on scope.exit_error)" in note
        assert "ResidencyPlanExecutionError: plan execution failed in phase 'exit'" in note
        # Without a body error, the exit error is raised.
        scope2 = m.scope(plan)
        with pytest.raises(ResidencyPlanExecutionError):
            async with scope2:
                hold = m.hold(a, "cuda:0")
        assert scope2.exit_error is not None
        hold.release()


async def test_plan_that_could_never_fit_fails_at_once_even_with_timeout() -> None:
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        with pytest.raises(ResidencyPlanError, match="budget"):
            async with m.scope(ResidencyPlan(enter=[Move(a, "cuda:0")]), timeout=None):
                pass


async def test_waiting_scope_times_out_and_leaves_nothing_behind() -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        b = m.register(tensor(seed=1), name="b")
        await m.materialize(a, "cuda:0")
        async with held_by_another_task(m, a, "cuda:0"):
            with pytest.raises(TimeoutError):
                async with m.scope(ResidencyPlan(enter=[Move(b, "cuda:0")]), timeout=0.05):
                    pass
            with pytest.raises(ResidencyPlanError):
                async with m.scope(ResidencyPlan(enter=[Move(b, "cuda:0")]), timeout=0):
                    pass
        assert m.waiting == 0
        assert_no_leak(m)


@contextlib.asynccontextmanager
async def a_scope_waiting_for_room(m: ResidencyManager) -> AsyncIterator[None]:
    """Registers ``a`` and ``b``, holds ``a`` at cuda:0, and yields once a scope (in a task of
    its own) waits to move ``a`` out and ``b`` in (the hold is transient state: it waits); on
    leaving, releases the hold and waits until the scope was entered."""
    a = m.register(tensor(), name="a")
    b = m.register(tensor(seed=1), name="b")
    await m.materialize(a, "cuda:0")
    hold = m.hold(a, "cuda:0")
    entered = anyio.Event()

    async def waiting_scope() -> None:
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])
        async with m.scope(plan, timeout=5):
            entered.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waiting_scope)
        await anyio.wait_all_tasks_blocked()
        assert m.waiting == 1
        yield
        hold.release()
        await entered.wait()
    assert m.waiting == 0


async def test_registering_at_the_device_never_overtakes_a_waiting_scope() -> None:
    """Registering at a budgeted location cannot wait either: while a scope waits for room
    there it is refused, naming the value, and registers nothing; host registrations go on;
    once the queue is empty it goes ahead."""
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        async with a_scope_waiting_for_room(m):
            version = m.state_version
            with pytest.raises(
                ResidencyBudgetError,
                match=r"registering 'd' at cuda:0.*scope\(s\) waiting for room there come first",
            ):
                m.register(tensor(seed=3), name="d", location="cuda:0")
            assert m.state_version == version  # nothing changed
            assert sorted(v.name for v in m.snapshot().values.values()) == ["a", "b"]
            m.register(tensor(seed=4), name="e")  # host memory: nobody waits for it
        d = m.register(tensor(seed=3), name="d", location="cuda:0")  # nobody waits now
        assert "cuda:0" in {str(x.location) for x in m.snapshot().values[d].materializations}
        assert_no_leak(m)


async def test_materialize_nowait_never_overtakes_a_waiting_scope() -> None:
    """A nowait materialization cannot wait its turn: while a scope waits for room at the
    device it is refused, naming the value and the waiting scope, and changes nothing; once the
    queue is empty it goes ahead."""
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        c = m.register(tensor(seed=2), name="c", replica_mode=ReplicaMode.REPLICABLE)
        async with a_scope_waiting_for_room(m):
            version = m.state_version
            with pytest.raises(
                ResidencyBudgetError,
                match=r"value c .*scope\(s\) waiting for room there come first",
            ):
                m.materialize_nowait(c, "cuda:0")
            assert m.state_version == version  # nothing changed
            assert "cuda:0" not in {
                str(x.location) for x in m.snapshot().values[c].materializations
            }
        await m.materialize_nowait(c, "cuda:0")  # nobody waits: it goes ahead
        assert_no_leak(m)


async def test_many_tasks_contend_for_one_budget_fifo_without_exceeding_it() -> None:
    n = 1000
    async with ResidencyManager(budgets={"cuda:0": 3 * 16 * KiB}, backend="sim") as m:
        handles = []
        for i in range(n):
            handles.append(m.register(tensor(seed=i), name=f"v{i}", location="pinned-host"))
            if i % 20 == 0:  # the test's own set-up must not stall the loop either
                await anyio.lowlevel.checkpoint()
        order: list[int] = []
        peak = 0

        async def worker(i: int) -> None:
            nonlocal peak
            plan = ResidencyPlan(
                reserve=[MemoryReservation(f"ws{i}", "cuda:0", 16 * KiB)],
                enter=[Move(handles[i], "cuda:0")],
                exit=[Move(handles[i], "pinned-host")],
            )
            async with m.scope(plan, timeout=30):
                order.append(i)
                peak = max(peak, m._state.ledger("cuda:0").charged_bytes)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tasks:
            for i in range(n):
                tasks.start_soon(worker, i)
                await anyio.lowlevel.checkpoint()  # tasks reach the admission queue in index order
        assert len(order) == n
        assert order == sorted(order)  # first come, first served
        assert peak <= 3 * 16 * KiB
        assert m.snapshot().location("cuda:0").peak_bytes <= 3 * 16 * KiB
        assert m.snapshot().location("cuda:0").charged_bytes == 0
        assert_no_leak(m)


async def test_cancelling_a_waiting_scope_leaves_no_charge_or_queue_entry() -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        hold = m.hold(a, "cuda:0")
        cancel = anyio.CancelScope()
        cancelled: list[BaseException] = []

        async def enter() -> None:
            plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])
            with cancel:
                try:
                    async with m.scope(plan):
                        pass
                except anyio.get_cancelled_exc_class() as exc:
                    cancelled.append(exc)
                    raise

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(enter)
            # Until the entry is parked (a scope joining the admission queue changes no state,
            # so wait_for_change does not see it; the queue is checked right below).
            await anyio.wait_all_tasks_blocked()
            assert m.waiting == 1
            cancel.cancel()
        assert cancelled and cancel.cancelled_caught
        assert m.waiting == 0
        hold.release()
        assert_no_leak(m)


@pytest.mark.parametrize("cancel_after", range(0, 12))
async def test_cancellation_at_any_await_leaks_nothing(cancel_after: int) -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(seed=1), name="a")
        b = m.register(tensor(seed=2), name="b", location="cuda:0")
        sums = {a: float(m.tensor(a, "pageable-host").sum()), b: float(m.tensor(b, "cuda:0").sum())}
        plan = ResidencyPlan(
            reclaim=[Move(b, "pinned-host")],
            reserve=[MemoryReservation("ws", "cuda:0", 4 * KiB)],
            enter=[Move(a, "cuda:0"), Materialize(b, "pageable-host")],
            exit=[Move(a, "pinned-host")],
        )

        cancel = anyio.CancelScope()

        async def run() -> None:
            with cancel:
                async with m.scope(plan):
                    await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run)
            for _ in range(cancel_after):
                await anyio.lowlevel.checkpoint()
            cancel.cancel()
        # until the background reaping is over (every event reaped, every copy settled)
        with anyio.move_on_after(5):
            while not quiet(m):
                await m.wait_for_change()
        assert_no_leak(m)
        assert m.snapshot().location("cuda:0").reserved_bytes == 0
        for h, total in sums.items():
            (loc,) = m.snapshot().value(h).locations
            assert float(m.tensor(h, loc).sum()) == total


@pytest.mark.parametrize("how", ["execute", "scope", "scope that may wait"])
@pytest.mark.parametrize("phase", ["enter", "exit", "reclaim"])
async def test_an_exclusive_value_asked_twice_in_a_phase_is_refused_before_any_action(
    how: str, phase: str
) -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(), name="a")
        b = m.register(tensor(seed=1), name="b")
        twice = [Move(a, "cuda:0"), Move(a, "pinned-host")]
        if phase == "enter":  # b's move comes first, in the reclaim phase
            plan = ResidencyPlan(reclaim=[Move(b, "cuda:0")], enter=twice)
        else:
            plan = ResidencyPlan(enter=[Move(b, "cuda:0")], **{phase: twice})  # type: ignore[arg-type]
        assert not m.explain(plan).feasible
        version = m.state_version
        with pytest.raises(ResidencyPlanError, match="EXCLUSIVE") as info:
            if how == "execute":
                await m.execute(plan)
            else:
                async with m.scope(plan, timeout=None if how == "scope that may wait" else 0):
                    raise AssertionError("the body of an invalid plan ran")
        assert not isinstance(info.value, ResidencyPlanExecutionError)
        assert m.state_version == version  # nothing began
        assert [str(x) for x in m.snapshot().value(b).locations] == ["pageable-host"]


@pytest.mark.parametrize("how", ["execute", "scope", "scope that may wait"])
@pytest.mark.parametrize("to", ["cuda:1", "pinned-host"])
@pytest.mark.parametrize("inflight", ["moving", "loaded from its source"])
async def test_a_value_whose_move_is_in_flight_is_refused_before_any_action_or_waited_for(
    how: str, to: str, inflight: str
) -> None:
    """``a`` is moving from pinned-host to cuda:0 (the copy held up), or, an EXCLUSIVE value
    with a source, its first load into cuda:0 is: a plan that moves it on (to cuda:1: nothing
    can be read until the copy commits; back to pinned-host: it is moving out of there, or
    not there yet) is what ``explain`` calls infeasible, so ``execute`` and a scope that may
    not wait refuse it with ``ResidencyPlanError`` before any action, as the preflight does,
    not as a failure in the middle (nor a second load of an EXCLUSIVE value). It ends on its
    own: a scope that may wait enters once the copy committed."""
    backend = SimBackend()
    gate = threading.Event()
    async with ResidencyManager(backend=backend) as m:
        data = tensor(seed=1)
        if inflight == "moving":
            a = m.register(data.clone(), name="a", location="pinned-host")
        else:
            a = m.register_source(
                CallableSource(data.clone, shape=data.shape, dtype=data.dtype), name="a"
            )
        b = m.register(tensor(seed=2), name="b")
        backend._devices[0].h2d.submit(lambda: gate.wait(10))  # the move waits behind this
        moving = m.materialize_nowait(a, "cuda:0")
        plan = ResidencyPlan(reclaim=[Move(b, "cuda:0")], enter=[Move(a, to)])
        explanation = m.explain(plan)
        assert not explanation.feasible and explanation.transient, explanation.reason
        version = m.state_version
        entered = anyio.Event()
        try:
            if how == "scope that may wait":
                async with anyio.create_task_group() as tasks:

                    async def enter() -> None:
                        async with m.scope(plan, timeout=None):
                            assert moving.done()
                            assert [str(x) for x in m.snapshot().value(a).locations] == [to]
                            entered.set()

                    tasks.start_soon(enter)
                    await anyio.wait_all_tasks_blocked()
                    assert m.waiting == 1 and not entered.is_set()
                    assert m.state_version == version  # it waits before any action
                    gate.set()
                assert entered.is_set()
            else:
                said = "moving" if inflight == "moving" else "arriving at cuda:0"
                with pytest.raises(ResidencyPlanError, match=said) as info:
                    if how == "execute":
                        await m.execute(plan)
                    else:
                        async with m.scope(plan, timeout=0):
                            raise AssertionError("the body ran")
                assert not isinstance(info.value, ResidencyPlanExecutionError)
                assert m.state_version == version  # nothing began (b stays where it is)
                assert [str(x) for x in m.snapshot().value(b).locations] == ["pageable-host"]
        finally:
            gate.set()
        await moving
        (where,) = m.snapshot().value(a).locations
        assert torch.equal(m.tensor(a, where), data)
        assert_no_leak(m)


async def test_a_scope_for_another_device_does_not_wait_behind_a_waiting_one() -> None:
    """Scope A waits for room at cuda:0 (a hold fills it), then scope B for room at cuda:1 (a
    hold fills that too). When cuda:1's hold ends, B is admitted while A still waits: B never
    contended with A for any room (FIFO holds among the scopes that want the same budgeted
    location; the host both exit to has no budget). Waiting behind A instead could deadlock:
    the holder of cuda:0 may be the task that waits in B."""
    budgets = {"cuda:0": 16 * KiB, "cuda:1": 16 * KiB}
    async with ResidencyManager(budgets=budgets, backend="sim") as m:
        full0 = m.register(tensor(seed=1), name="full0", location="cuda:0")
        full1 = m.register(tensor(seed=2), name="full1", location="cuda:1")
        a = m.register(tensor(seed=3), name="a", location="pinned-host")
        b = m.register(tensor(seed=4), name="b", location="pinned-host")
        hold0, hold1 = m.hold(full0, "cuda:0"), m.hold(full1, "cuda:1")
        entered: list[str] = []
        b_inside = anyio.Event()

        async def scope(name: str, handle: object, device: str, done: anyio.Event) -> None:
            plan = ResidencyPlan(
                reclaim=[Move(full0 if device == "cuda:0" else full1, "pinned-host")],
                enter=[Move(handle, device)],
                exit=[Move(handle, "pinned-host")],
            )
            async with m.scope(plan, timeout=None):
                entered.append(name)
                done.set()

        a_inside = anyio.Event()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(scope, "a", a, "cuda:0", a_inside)
            await anyio.wait_all_tasks_blocked()  # queueing is no transition: until parked
            assert m.waiting == 1
            tasks.start_soon(scope, "b", b, "cuda:1", b_inside)
            await anyio.wait_all_tasks_blocked()
            assert m.waiting == 2
            hold1.release()
            with anyio.fail_after(5):
                await b_inside.wait()
            assert entered == ["b"] and m.waiting == 1  # A still waits for cuda:0
            hold0.release()
            with anyio.fail_after(5):
                await a_inside.wait()
        assert entered == ["b", "a"]
        assert_no_leak(m)


async def test_scopes_for_the_same_device_stay_first_come_first_served() -> None:
    """The same set-up, both scopes for cuda:0: the second fits once room appears for one,
    but the first came first and gets it; the second follows when the first exits."""
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        full = m.register(tensor(seed=1), name="full", location="cuda:0")
        rest = m.register(tensor(seed=2), name="rest", location="cuda:0")
        a = m.register(tensor(32 * KiB, seed=3), name="a", location="pinned-host")  # needs all
        b = m.register(tensor(seed=4), name="b", location="pinned-host")  # needs half
        holds = [m.hold(full, "cuda:0"), m.hold(rest, "cuda:0")]
        entered: list[str] = []
        gate = anyio.Event()
        a_entered = anyio.Event()  # (no state change need follow the body's first step)

        async def scope(name: str, handle: object) -> None:
            reclaim = [Move(rest, "pinned-host")]  # b needs only rest's room
            if name == "a":
                reclaim.insert(0, Move(full, "pinned-host"))
            plan = ResidencyPlan(
                reclaim=reclaim,
                enter=[Move(handle, "cuda:0")],
                exit=[Move(handle, "pinned-host")],
            )
            async with m.scope(plan, timeout=None):
                entered.append(name)
                if name == "a":
                    a_entered.set()
                    await gate.wait()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(scope, "a", a)
            await anyio.wait_all_tasks_blocked()  # queueing is no transition: until parked
            assert m.waiting == 1
            tasks.start_soon(scope, "b", b)
            await anyio.wait_all_tasks_blocked()
            assert m.waiting == 2
            holds.pop().release()  # rest's: room for b, not for a: b still waits behind a
            await anyio.wait_all_tasks_blocked()
            assert entered == [] and m.waiting == 2
            holds.pop().release()
            with anyio.fail_after(5):
                await a_entered.wait()
            assert entered == ["a"]
            gate.set()
        assert entered == ["a", "b"]
        assert_no_leak(m)


# ------------------------------------------------------- room held by the waiting task itself


def _own_holding(kind: str, m: ResidencyManager, a: Any) -> Any:
    """What the test's own task keeps while it enters the next scope: 16 KiB at cuda:0."""
    if kind == "scope":
        return m.scope(ResidencyPlan(enter=[Move(a, "cuda:0")], exit=[Move(a, "pinned-host")]))
    if kind == "reservation":
        return m.scope(ResidencyPlan(reserve=[MemoryReservation("mine", "cuda:0", 16 * KiB)]))
    if kind == "block":
        return m.reservation("mine", "cuda:0", 16 * KiB)
    if kind == "lease":
        return m.acquire(a, "cuda:0")
    assert kind == "hold"
    return m.hold(a, "cuda:0")


@pytest.mark.parametrize("kind", ["scope", "reservation", "block", "lease", "hold"])
async def test_a_scope_waiting_for_room_its_own_task_holds_is_refused_at_once(kind: str) -> None:
    """The waiting task keeps what stands in the way (an entered scope's value or reservation,
    a reservation block, a lease, a hold): it would end only when the task goes on, so even
    ``timeout=None`` does not wait (that wait never ended). The error names what the task
    holds; nothing changed, and once the task let go the same plan enters."""
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        b = m.register(tensor(32 * KiB, seed=1), name="b")
        if kind in ("lease", "hold"):
            await m.materialize(a, "cuda:0")
        # Under a lease or hold, ``a`` itself is in the way: the plan moves it out first.
        reclaim = [Move(a, "pinned-host")] if kind in ("lease", "hold") else []
        plan = ResidencyPlan(
            reclaim=reclaim, enter=[Move(b, "cuda:0")], exit=[Move(b, "pinned-host")]
        )
        holding = _own_holding(kind, m, a)
        if kind == "hold":
            holding_cm: Any = None
        else:
            holding_cm = holding
            await holding_cm.__aenter__()
        try:
            before = m.state_version
            with anyio.fail_after(10), pytest.raises(ResidencyPlanError) as info:
                async with m.scope(plan, timeout=None):
                    pass
            message = str(info.value)
            assert "only what the waiting task holds itself" in message, message
            assert ("1 entered scope(s)" in message) == (kind in ("scope", "reservation"))
            assert ("a at cuda:0" in message) == (kind in ("lease", "hold"))
            assert ("1 reservation block(s) ('mine' at cuda:0)" in message) == (kind == "block")
            assert isinstance(info.value.__cause__, ResidencyError)
            assert m.state_version == before and m.waiting == 0
        finally:
            if holding_cm is not None:
                await holding_cm.__aexit__(None, None, None)
            else:
                holding.release()
        async with m.scope(plan):
            assert m.snapshot().values[b].materializations  # entered once the task let go
        assert_no_leak(m)


async def test_the_same_room_held_by_another_task_is_waited_for() -> None:
    """Held by another task, the same room is transient: the scope waits (``timeout=None``),
    and enters once that task releases it."""
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        b = m.register(tensor(32 * KiB, seed=1), name="b")
        await m.materialize(a, "cuda:0")
        entered = anyio.Event()

        async def enter() -> None:
            plan = ResidencyPlan(
                reclaim=[Move(a, "pinned-host")],
                enter=[Move(b, "cuda:0")],
                exit=[Move(b, "pinned-host")],
            )
            async with m.scope(plan, timeout=None):
                entered.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                async with held_by_another_task(m, a, "cuda:0"):
                    tasks.start_soon(enter)
                    await anyio.wait_all_tasks_blocked()
                    assert m.waiting == 1 and not entered.is_set()
                await entered.wait()
        assert_no_leak(m)


async def test_room_a_reservation_block_of_another_task_keeps_is_waited_for() -> None:
    """A block is its own task's (as a lease is): a scope of another task waits for its
    room and enters once the block ended."""
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        b = m.register(tensor(32 * KiB, seed=1), name="b")
        entered = anyio.Event()

        async def enter() -> None:
            async with m.scope(ResidencyPlan(enter=[Move(b, "cuda:0")]), timeout=None):
                entered.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                async with m.reservation("theirs", "cuda:0", 16 * KiB):
                    tasks.start_soon(enter)
                    await anyio.wait_all_tasks_blocked()
                    assert m.waiting == 1 and not entered.is_set()
                await entered.wait()
        assert_no_leak(m)


@pytest.mark.parametrize("holding", ["reservation block", "scope"])
async def test_a_direct_operation_of_a_task_holding_room_does_not_queue_behind_its_waiter(
    holding: str,
) -> None:
    """Task A keeps room with a reservation block (or an entered scope); task B's scope waits
    for that room. A's ``materialize`` inside its block does not wait its turn behind B (B
    waits for A: that wait would never end); it goes ahead, as one holding a lease does."""
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        x = m.register(tensor(4 * KiB), name="x")
        room = MemoryReservation("a's room", "cuda:0", 32 * KiB)
        order: list[str] = []
        a_holds = anyio.Event()

        async def task_b() -> None:
            await a_holds.wait()
            plan = ResidencyPlan(reserve=[MemoryReservation("b", "cuda:0", 40 * KiB)])
            async with m.scope(plan, timeout=None):
                order.append("B")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(task_b)
                held = (
                    m.reservation(room.name, room.location, room.nbytes)
                    if holding == "reservation block"
                    else m.scope(ResidencyPlan(reserve=[room]))
                )
                async with held:
                    a_holds.set()
                    await anyio.wait_all_tasks_blocked()
                    assert m.waiting == 1  # B waits for the room A keeps
                    await m.materialize(x, "cuda:0")
                    order.append("A's materialize")
                    await m.move(x, "pageable-host")
        assert order == ["A's materialize", "B"]
        assert_no_leak(m)


async def test_a_task_holding_room_is_not_queued_behind_a_scope_waiting_for_that_room() -> None:
    """Task A's entered scope keeps ``a`` at the device; task B's scope waits for that room.
    A's next scope fits and does not queue behind B (B waits for A, so that queue would never
    move): A goes on, leaves both its scopes, and then B enters."""
    async with ResidencyManager(budgets={"cuda:0": 48 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        b = m.register(tensor(32 * KiB, seed=1), name="b")
        c = m.register(tensor(seed=2), name="c")
        order: list[str] = []
        a_entered = anyio.Event()

        async def task_b() -> None:
            await a_entered.wait()
            plan = ResidencyPlan(
                enter=[Move(b, "cuda:0"), Move(c, "cuda:0")],
                exit=[Move(b, "pinned-host"), Move(c, "pinned-host")],
            )
            async with m.scope(plan, timeout=None):
                order.append("B")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(task_b)
                outer = ResidencyPlan(enter=[Move(a, "cuda:0")], exit=[Move(a, "pinned-host")])
                async with m.scope(outer):
                    a_entered.set()
                    await anyio.wait_all_tasks_blocked()
                    assert m.waiting == 1  # B waits for the room a takes
                    inner = ResidencyPlan(enter=[Move(c, "cuda:0")], exit=[Move(c, "pinned-host")])
                    async with m.scope(inner, timeout=None):
                        order.append("A's inner")
        assert order == ["A's inner", "B"]
        assert_no_leak(m)
