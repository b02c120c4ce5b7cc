"""What the diagnosis work found and fixed, each on the simulated backend (a simulation of CUDA
devices in host memory): a failed plan's report holds only its own transitions and counts only
those in effect; an infeasible plan's error chains the blocking error; budget errors say what was
asked; a move's trace names both ends; an in-use error names the tasks holding the leases and
holds; the decisions a user wants to see are logged, and nothing is computed for a disabled log.
"""

from __future__ import annotations

import json
import logging
import threading

import anyio
import pytest
import torch

import aresidency.runtime.scopes as scopes_module
from aresidency import (
    Location,
    MemoryReservation,
    Move,
    Release,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyController,
    ResidencyInUseError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyRequest,
    ResidencyRequirement,
)

pytestmark = pytest.mark.anyio

KiB = 1 << 10
CUDA0 = Location.parse("cuda:0")


def tensor(kib: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.full((kib * 256,), float(seed))  # float32: kib KiB


# ------------------------------------------------------------- partial execution reports


async def test_partial_report_holds_only_the_plans_own_transitions_while_others_commit() -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(seed=1), name="a")
        b = m.register(tensor(seed=2), name="b")
        c = m.register(tensor(seed=3), name="c", location="cuda:0")
        stream = m.backend.current_stream(CUDA0)
        gate = threading.Event()
        async with m.acquire(c, "cuda:0", stream=stream):
            # A reader's kernel that runs until the test opens the gate: the plan's reclaim
            # (moving c out) waits for it, and other tasks commit meanwhile.
            m.backend.run_in_stream_order(stream, gate.wait)
        plan = ResidencyPlan(
            reclaim=[Move(c, "pinned-host")],
            reserve=[MemoryReservation("ws", "cuda:0", 4 * KiB)],
            enter=[Move(a, "cuda:0"), Move(b, "cuda:0")],
        )
        m.backend.faults.fail_transfer_at = 3  # b's move in the enter phase
        errors: list[ResidencyPlanExecutionError] = []
        failed = anyio.Event()

        async def run_plan() -> None:
            try:
                await m.execute(plan)
            except ResidencyPlanExecutionError as error:
                errors.append(error)
            finally:
                failed.set()

        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(run_plan)
                    while m.state.ledger("cuda:0").outgoing_bytes == 0:
                        await m.wait_for_change()  # the reclaim began, waits for c's reader
                    d = m.register(tensor(seed=4), name="d")  # another task's register ...
                    other = ResidencyPlan(reserve=[MemoryReservation("other", "cuda:1", KiB)])
                    async with m.scope(other):  # ... and another scope's reservation
                        gate.set()
                        await failed.wait()
        finally:
            gate.set()
        (error,) = errors
        report = error.partial_report
        assert all(t.handle != d and t.name != "other" for t in report.transitions)
        trace = m.trace().transitions
        theirs = [t.seq for t in trace if t.handle == d or t.name == "other"]
        ours = [t.seq for t in report.transitions]
        assert ours[0] < min(theirs) < ours[-1]  # they committed while the plan ran
        assert [(t.kind, t.handle) for t in report.transitions] == [
            ("move_begin", c),
            ("move_commit", c),
            ("reserve", None),
            ("move_begin", a),
            ("move_begin", b),
            ("move_commit", a),
            ("copy_abort", b),
            ("unreserve", None),
        ]
        assert [(t.kind, t.handle) for t in report.in_effect] == [
            ("move_begin", c),
            ("move_commit", c),
            ("move_begin", a),
            ("move_commit", a),
        ]
        assert "4 committed transition(s) stay in effect (4 more were clean-up" in str(error)
        assert str(error) == error.args[0]


# --------------------------------------------------------------- infeasible plan errors


async def test_an_infeasible_plan_error_chains_the_explanations_blocking_error() -> None:
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        m.register(tensor(seed=1), name="a", location="cuda:0")
        b = m.register(tensor(seed=2), name="b")
        c = m.register(tensor(seed=3), name="c")
        plan = ResidencyPlan(enter=[Move(b, "cuda:0"), Move(c, "cuda:0")])
        explanation = m.explain(plan)
        assert explanation.predicted_peak_bytes[CUDA0] == 12 * KiB  # the whole plan's
        assert explanation.reached_peak_bytes[CUDA0] == 8 * KiB  # before it fails
        with pytest.raises(ResidencyPlanError) as caught:
            await m.execute(plan)
        cause = caught.value.__cause__
        assert isinstance(cause, ResidencyBudgetError)
        assert cause.to_dict() == explanation.blocking_error.to_dict()  # type: ignore[union-attr]
        assert (cause.handle, cause.used_bytes, cause.in_simulation) == (c, 8 * KiB, True)
        assert caught.value.plan is plan
        assert caught.value.to_dict()["cause"]["type"] == "ResidencyBudgetError"


async def test_a_scope_that_waited_and_became_infeasible_chains_the_blocking_error() -> None:
    async with ResidencyManager(budgets={"cuda:0": 12 * KiB}, backend="sim") as m:
        a = m.register(tensor(seed=1), name="a", location="cuda:0")
        b = m.register(tensor(kib=12, seed=2), name="b")
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])
        errors: list[BaseException] = []
        with anyio.fail_after(10), m.hold(a, "cuda:0"):  # transient: the scope waits for it
            async with anyio.create_task_group() as tasks:

                async def enter() -> None:
                    with pytest.raises(ResidencyPlanError) as caught:
                        async with m.scope(plan):
                            pytest.fail("infeasible")
                    errors.append(caught.value)

                tasks.start_soon(enter)
                while not m.waiting:
                    await anyio.wait_all_tasks_blocked()
                # The budget shrinks below what the plan needs: waiting cannot help any more.
                m.set_budget("cuda:0", 8 * KiB)
            blocking = m.explain(plan).blocking_error
        (error,) = errors
        # The first blocking fact of the explanation (the hold, at the reclaim), chained.
        assert isinstance(error.__cause__, ResidencyInUseError)
        assert isinstance(blocking, ResidencyInUseError)
        assert error.__cause__.to_dict() == blocking.to_dict()
        assert error.__cause__.handle == a and str(error.__cause__) in str(error)
        assert error.plan is plan


# ---------------------------------------------------------------------- trace entries


async def test_a_moves_trace_entries_name_both_ends_on_the_live_manager() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", location="cuda:0")
        await m.move(h, "pinned-host")
        begin, commit = m.trace().transitions[-2:]
        assert (begin.kind, str(begin.location), begin.nbytes) == (
            "move_begin",
            "pinned-host",
            4096,
        )
        assert (commit.kind, str(commit.location), commit.nbytes) == (
            "move_commit",
            "cuda:0",
            -4096,
        )
        assert "move cuda:0 -> pinned-host" in str(begin)
        assert "move cuda:0 -> pinned-host" in str(commit)
        data = json.loads(json.dumps(m.trace().to_dict()))
        assert data["transitions"][-1]["source"] == "cuda:0"
        assert data["transitions"][-1]["destination"] == "pinned-host"


# ---------------------------------------------------------------------- owners of leases


async def test_in_use_errors_name_the_task_owning_the_lease_or_the_hold() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        entered, done = anyio.Event(), anyio.Event()
        holds = []

        async def writer() -> None:
            async with m.acquire(h, "pageable-host", mode="write"):
                entered.set()
                await done.wait()

        async def keeper() -> None:
            holds.append(m.hold(h, "pageable-host"))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(writer, name="writer-task")
            await entered.wait()
            # A second write lease: refused at entry, naming the writer.
            with pytest.raises(ResidencyInUseError) as caught:
                async with m.acquire(h, "pageable-host", mode="write"):
                    pytest.fail("two writers")
            assert caught.value.owners == ("writer-task",)
            done.set()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(keeper, name="keeper-task")
        with pytest.raises(ResidencyInUseError) as caught:
            m.discard_nowait(h)
        assert caught.value.owners == ("keeper-task",) and "'keeper-task'" in str(caught.value)
        assert [(str(loc), kind, task) for _, loc, kind, task in m.owners()] == [
            ("pageable-host", "hold", "keeper-task")
        ]
        holds[0].release()
        assert m.owners() == []


async def test_a_scope_exit_blocked_by_a_hold_names_its_owner_in_the_cause() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        scope = m.scope(ResidencyPlan(exit=[Release(h, "pageable-host")]))
        holds = []

        async def holder() -> None:
            holds.append(m.hold(h, "pageable-host"))

        with pytest.raises(ResidencyPlanExecutionError) as caught:
            async with scope, anyio.create_task_group() as tasks:
                tasks.start_soon(holder, name="holder-task")
        cause = caught.value.__cause__
        assert isinstance(cause, ResidencyInUseError) and cause.owners == ("holder-task",)
        assert caught.value.plan is scope.plan and caught.value.phase == "exit"
        holds[0].release()


# ------------------------------------------------------------------------------ logging


async def test_scope_waits_decisions_evictions_and_budget_errors_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="aresidency")
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        a = m.register(tensor(seed=1), name="a", location="cuda:0")
        b = m.register(tensor(seed=2), name="b")
        c = m.register(tensor(seed=3), name="c", location="cuda:0")
        # A budget error of a direct operation.
        with pytest.raises(ResidencyBudgetError):
            await m.move(b, "cuda:0")
        # A scope that waits for a hold to end.
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])
        hold = m.hold(a, "cuda:0")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:

                async def enter() -> None:
                    async with m.scope(plan):
                        pass

                tasks.start_soon(enter)
                while not m.waiting:
                    await anyio.wait_all_tasks_blocked()
                hold.release()
        # A controller decision with an eviction.
        new = m.register(tensor(seed=4), name="new")
        request = ResidencyRequest("step", [ResidencyRequirement(new, "cuda:0")])
        async with ResidencyController(m).scope(request) as scope:
            assert scope.decision.evictions
    messages = [(r.levelno, r.name, r.getMessage()) for r in caplog.records]
    assert all(name.startswith("aresidency") for _, name, _ in messages)
    text = "\n".join(message for _, _, message in messages)
    assert "direct operation refused: budget exceeded at cuda:0" in text
    assert "may wait for admission: infeasible at reclaim #0" in text
    assert "admitted after waiting" in text
    assert "scope for request 'step' entered decision" in text
    assert any(
        level == logging.DEBUG and "evicts" in message and "short for request" in message
        for level, _, message in messages
    )
    del c


async def test_nothing_is_computed_for_the_log_when_it_is_disabled(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="aresidency")

    def forbidden(*args: object) -> None:
        raise AssertionError("the extra simulation ran with logging disabled")

    monkeypatch.setattr(scopes_module, "plan_fits", forbidden)
    monkeypatch.setattr(scopes_module, "explain_plan", forbidden)
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w")
        async with m.scope(ResidencyPlan(enter=[Move(h, "cuda:0")])):
            pass
    assert not caplog.records
