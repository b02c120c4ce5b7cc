"""One test per step of a diagnosis: each provokes its failure on the simulated backend (a
simulation of CUDA devices in host memory), calls ``diagnose(error, manager)`` and checks the
evidence the step names against the manager's own snapshot and trace."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
import torch

from aresidency import (
    CallableSource,
    Materialize,
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
    ResidencySearchLimitError,
    ResidencyStaleStateError,
    ResidencyUnavailableError,
    diagnose,
)
from aresidency.diagnosis import diagnose_dump

pytestmark = pytest.mark.anyio

KiB = 1 << 10


def tensor(kib: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.full((kib * 256,), float(seed))  # float32: kib KiB


# --------------------------------------------------------------------- 1: state captured


async def test_step_1_records_the_state_version_the_trace_coverage_and_the_fields() -> None:
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim", trace_capacity=4) as m:
        handles = [m.register(tensor(seed=i), name=f"w{i}") for i in range(3)]
        await m.move(handles[0], "cuda:0")
        await m.move(handles[1], "cuda:0")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.move(handles[2], "cuda:0")
        report = diagnose(caught.value, m)
        snap, trace = m.snapshot(), m.trace()
        step = report.step(1)
        assert report.manager_id == m.id and report.state_version == snap.state_version
        assert step.evidence["state_version"] == snap.state_version
        assert step.evidence["values"] == len(snap.values) == 3
        assert step.evidence["trace"]["kept"] == len(trace.transitions) == 4
        assert step.evidence["trace"]["overwritten"] == trace.overwritten > 0
        assert step.evidence["trace"]["last_version"] == trace.transitions[-1].state_version
        assert step.evidence["handles"] == [handles[2].to_dict()]
        assert step.evidence["fields"]["requested_bytes"] == 4 * KiB
        assert f"{trace.overwritten} older transition(s) were overwritten" in " ".join(
            step.findings
        )
        # Without the manager, the report says what it cannot know.
        alone = diagnose(caught.value)
        assert alone.manager_id is None and "only the error was given" in str(alone)
        assert alone.step(1).evidence["fields"] == step.evidence["fields"]


# ---------------------------------------------------------------------------- 2: endpoint


async def test_step_1_of_a_dump_taken_while_a_scope_waits_names_who_protects_what(
    tmp_path: Path,
) -> None:
    """A dump taken while something seems to hang said who waits for room, not what it waits
    on: the leases and holds of the state, with their tasks, are listed beside the waits."""
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        a = m.register(tensor(seed=1), name="a", location="cuda:0")
        m.register(tensor(seed=2), name="b", location="cuda:0")
        c = m.register(tensor(seed=3), name="c")
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(c, "cuda:0")])

        async def handler() -> None:
            async with m.scope(plan):
                pass

        async with anyio.create_task_group() as tasks:
            with m.hold(a, "cuda:0"):
                tasks.start_soon(handler, name="handler-3")
                with anyio.fail_after(10):
                    while not m.room_waits():
                        await anyio.wait_all_tasks_blocked()
                report = diagnose_dump(m.dump(tmp_path / "hang.json"))
        text = report.step(1).text()
        assert "task handler-3 waits for a scope entering c" in text
        assert "1 active lease(s) and hold(s) now:" in text
        assert "hold on value a (#1) @ cuda:0" in text


async def test_step_2_shows_the_endpoint_is_missing_and_acquire_never_places() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "pinned-host")
        with pytest.raises(ResidencyUnavailableError) as caught:
            m.acquire(h, "cuda:0")
        step = diagnose(caught.value, m).step(2)
        value = m.snapshot().value(h)
        assert step.evidence["handle"] == h.to_dict() and step.evidence["location"] == "cuda:0"
        assert step.evidence["belongs"] and step.evidence["in_state"]
        assert step.evidence["present"] is False
        assert step.evidence["value"] == value.to_dict()
        assert step.evidence["value"]["locations"] == ["pageable-host", "pinned-host"]
        assert step.evidence["value"]["replica_mode"] == "replicable"
        assert step.evidence["value"]["has_source"] is False
        assert "acquire never places" in (step.action or "")


async def test_step_2_tells_a_discarded_value_and_a_foreign_handle() -> None:
    async with (
        ResidencyManager(backend="sim") as m,
        ResidencyManager(backend="sim") as other,
    ):
        h = m.register(tensor(), name="gone")
        await m.discard(h)
        with pytest.raises(ResidencyUnavailableError) as caught:
            await m.move(h, "cuda:0")
        step = diagnose(caught.value, m).step(2)
        assert step.evidence["in_state"] is False and "discarded" in " ".join(step.findings)
        foreign = other.register(tensor(), name="theirs")
        with pytest.raises(ResidencyUnavailableError) as caught:
            await m.move(foreign, "cuda:0")
        step = diagnose(caught.value, m).step(2)
        assert step.evidence["belongs"] is False
        assert other.id in " ".join(step.findings) and "registered it" in (step.action or "")


async def test_an_error_diagnosed_with_another_manager_says_so_first() -> None:
    """diagnose(error, manager) with a manager other than the one that raised it: the
    next action used to come from step 3 with the other manager's free room ("free 4096 B at
    cuda:0"), a state the failure never saw; the foreign handle of step 2 now comes first."""
    async with (
        ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m,
        ResidencyManager(backend="sim") as other,
    ):
        h = m.register(tensor(kib=8), name="w")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.move(h, "cuda:0")
        report = diagnose(caught.value, other)
        assert report.step(2).evidence["belongs"] is False
        assert report.next_action == report.step(2).action
        assert m.id in report.next_action and "registered it" in report.next_action
        # with its own manager the budget arithmetic leads, as before
        own = diagnose(caught.value, m)
        assert own.next_action == own.step(3).action


async def test_step_2_checks_each_requirement_of_a_request_the_controller_refused(
    tmp_path: Path,
) -> None:
    """Step 2 of docs/troubleshooting.md checks each requirement of a request on its own.
    A request refused by controller.decide (no decision was made) left the report with no
    step 2 at all: the error carried no request. It now carries ``request``, and step 2 lists
    each requirement with where its value is now, live and from a dump alike."""
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(kib=8), name="a")
        b = m.register(tensor(kib=16), name="b")
        request = ResidencyRequest(
            "two",
            requirements=[ResidencyRequirement(a, "cuda:0"), ResidencyRequirement(b, "cuda:0")],
        )
        with pytest.raises(ResidencyPlanError) as caught:
            await ResidencyController(m).decide(request)
        error = caught.value
        assert error.request is request
        assert [r["handle"] for r in error.to_dict()["request"]["requirements"]] == [
            a.to_dict(),
            b.to_dict(),
        ]
        report = diagnose(error, m)
        step = report.step(2)
        assert [r["handle"] for r in step.evidence["requirements"]] == [a.to_dict(), b.to_dict()]
        text = step.text()
        assert "(value a (#1) (exclusive), cuda:0): now at pageable-host" in text
        assert "(value b (#2) (exclusive), cuda:0): now at pageable-host" in text
        path = tmp_path / "refused.json"
        m.dump(path, error=error)
        assert diagnose_dump(path).to_dict() == report.to_dict()
        # the search limit's error names its request too
        for i in range(4):
            await m.move(m.register(tensor(kib=4, seed=i), name=f"v{i}"), "cuda:0")
        crowded = ResidencyRequest("crowded", requirements=[ResidencyRequirement(b, "cuda:0")])
        with pytest.raises(ResidencySearchLimitError) as limited:
            ResidencyController(m, search_state_limit=1).decide_nowait(crowded)
        assert limited.value.request is crowded


async def test_step_2_says_for_each_requirement_whether_and_through_where_it_is_rebuilt() -> None:
    """Step 2 checks has_source and source_location of the value behind each requirement of a
    request. Its rows gave only the replica mode and the locations ("now at nowhere" for a
    value with only a source), so a refusal at the source location named nothing that led
    there."""
    async with ResidencyManager(budgets={"pinned-host": 2 * KiB}, backend="sim") as m:
        source = CallableSource(
            lambda: tensor(), shape=(1024,), dtype=torch.float32, source_location="pinned-host"
        )
        lora = m.register_source(source, name="lora")
        plain = m.register(tensor(seed=1), name="plain")
        request = ResidencyRequest(
            "two",
            requirements=[
                ResidencyRequirement(lora, "cuda:0"),
                ResidencyRequirement(plain, "cuda:1"),
            ],
        )
        with pytest.raises(ResidencyPlanError) as caught:
            await ResidencyController(m).decide(request)
        text = diagnose(caught.value, m).step(2).text()
        assert (
            "(value lora (#1) (exclusive, reconstructible through its source_location "
            "pinned-host), cuda:0): materialized nowhere now" in " ".join(text.split())
        )
        assert "(value plain (#2) (exclusive), cuda:1): now at pageable-host" in text


async def test_step_2_and_5_of_a_request_naming_an_exclusive_value_twice() -> None:
    """Step 2 of docs/troubleshooting.md: a handle named twice asks for copies at several
    locations at once, which only a REPLICABLE value may have. The report never
    said so (the handles were counted after being made unique), and step 5 called the
    refusal an exhaustive search's verdict on the current state, whose action (wait for the
    state to change) could never help: the request is invalid, and no search ran."""
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a")
        shared = m.register(tensor(seed=1), name="shared", replica_mode=ReplicaMode.REPLICABLE)
        request = ResidencyRequest(
            "twice",
            requirements=[
                ResidencyRequirement(shared, "cuda:0"),
                ResidencyRequirement(shared, "pinned-host"),
                ResidencyRequirement(a, "cuda:0"),
                ResidencyRequirement(a, "pinned-host"),
            ],
        )
        with pytest.raises(ResidencyPlanError) as caught:
            await ResidencyController(m).decide(request)
        report = diagnose(caught.value, m)
        endpoint = report.step(2)
        assert endpoint.evidence["repeated"] == [shared.to_dict(), a.to_dict()]
        assert "named in several requirements" in endpoint.text()
        assert endpoint.action is not None and "keep one requirement for value a (#1)" in (
            endpoint.action
        )
        assert "shared" not in endpoint.action  # REPLICABLE: several locations are legal
        assert report.next_action == endpoint.action
        search = report.step(5)
        assert search.evidence["searched"] is False
        assert "before any search" in search.text() and "exhaustive" not in search.text()
        # A request the search did find infeasible still says so.
        big = m.register(tensor(kib=32), name="big")
        with pytest.raises(ResidencyPlanError) as infeasible:
            await ResidencyController(m).decide(
                ResidencyRequest("big", requirements=[ResidencyRequirement(big, "cuda:0")])
            )
        text = diagnose(infeasible.value, m).step(5).text()
        assert "search (exhaustive within its bound) found the request infeasible" in text


# ------------------------------------------------------------------- 3: budget arithmetic


async def test_step_3_reconciles_the_five_byte_fields_with_the_snapshot() -> None:
    async with ResidencyManager(budgets={"cuda:0": 10 * KiB}, backend="sim") as m:
        a = m.register(tensor(seed=1), name="a")
        b = m.register(tensor(seed=2), name="b")
        c = m.register(tensor(seed=3), name="c")
        await m.move(a, "cuda:0")
        await m.move(b, "cuda:0")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.move(c, "cuda:0")
        error = caught.value
        assert (error.handle, error.kind, error.in_simulation) == (c, "materialization", False)
        step = diagnose(error, m).step(3)
        record = m.snapshot().location("cuda:0")
        ev = step.evidence
        assert ev["used_bytes"] == record.used_bytes == 8 * KiB
        assert ev["reserved_bytes"] == record.reserved_bytes == 0
        assert ev["budget_bytes"] == record.budget_bytes == 10 * KiB
        assert ev["requested_bytes"] == 4 * KiB and ev["new_peak_bytes"] == 12 * KiB
        assert ev["missing_bytes"] == 2 * KiB == error.missing_bytes
        assert ev["kind"] == "materialization" and ev["handle"] == c.to_dict()
        assert ev["free_now_bytes"] == 2 * KiB
        assert {e["name"] for e in ev["candidates"]} == {"a", "b"}
        assert ev["freeable_bytes"] == 8 * KiB
        assert "a new materialization of value c" in " ".join(step.findings)


async def test_step_3_of_a_value_larger_than_the_whole_budget_says_it_can_never_fit() -> None:
    """Freeing room at the location cannot help what an empty location would not hold: the
    diagnosis says so and what would, while the evidence keeps the five byte fields."""
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        small = m.register(tensor(kib=2, seed=1), name="small")
        await m.move(small, "cuda:0")
        big = m.register(tensor(kib=16, seed=2), name="big")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.materialize(big, "cuda:0")
        error = caught.value
        assert (error.budget_bytes, error.used_bytes, error.requested_bytes) == (
            8 * KiB,
            2 * KiB,
            16 * KiB,
        )
        assert "it can never fit under this budget" in str(error)
        report = diagnose(error, m)
        step = report.step(3)
        action = step.action or ""
        assert action.startswith("it can never fit under this budget: raise the budget at")
        assert "at least 16384 B" in action and "free " not in action
        assert report.next_action == action
        assert step.evidence["never_fits"] is True
        assert step.evidence["missing_bytes"] == 10 * KiB == error.missing_bytes
        assert any("more than the whole budget" in f for f in step.findings)


async def test_step_3_judges_a_refused_set_budget_against_the_new_budget() -> None:
    """set_budget below the charge: the budget in force stays, nothing is requested. The
    diagnosis used to weigh the 0 requested bytes against the old budget's free room and say
    "the request fits now: retry it", which fails again."""
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(kib=16), name="a")
        await m.move(a, "cuda:0")
        with pytest.raises(ResidencyBudgetError) as caught:
            m.set_budget("cuda:0", 4 * KiB)
        error = caught.value
        assert (error.kind, error.budget_bytes, error.used_bytes) == ("budget", 4 * KiB, 16 * KiB)
        assert m.snapshot().location("cuda:0").budget_bytes == 64 * KiB  # unchanged
        report = diagnose(error, m)
        step = report.step(3)
        text = " ".join(step.findings) + " " + (step.action or "")
        assert "retry" not in (step.action or "")
        assert "fits now" not in text and "would fit" not in text
        assert step.evidence["over_new_budget_bytes"] == 12 * KiB
        assert "still 12288 B over the new budget of 4096 B" in text
        assert "before lowering its budget" in (step.action or "")
        assert report.next_action == step.action
        assert "set_budget" in " ".join(report.step(8).findings)
        # once the charge fits under the new budget, retrying is the advice
        await m.move(a, "pinned-host")
        step = diagnose(error, m).step(3)
        assert step.evidence["over_new_budget_bytes"] == 0
        assert "retry set_budget" in (step.action or "")


async def test_step_3_never_says_waiting_could_admit_a_scope_refused_as_waiting_on_itself() -> None:
    """A scope whose reclaim needs a value its own task holds is refused at once (waiting would
    never end). Its diagnosis said, in step 3, "only transient state blocks it: waiting could
    admit it", contradicting the error. The error now says hold_and_wait, and step 3 says
    waiting would never end; a scope that only may not wait (timeout=0) keeps the old line."""
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        a = m.register(tensor(kib=16), name="a", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(a, "cuda:0")
        plan = ResidencyPlan(
            reclaim=[Release(a, "cuda:0")],
            reserve=[MemoryReservation("w", "cuda:0", 28 * KiB)],
        )
        own_hold = m.hold(a, "cuda:0")
        with pytest.raises(ResidencyPlanError, match="waiting task holds itself") as caught:
            async with m.scope(plan, timeout=5):
                pytest.fail("admitted past its own hold")
        error = caught.value
        assert error.hold_and_wait is True and error.to_dict()["hold_and_wait"] is True
        text = diagnose(error, m).step(3).text()  # taken before the hold ends (step 3)
        own_hold.release()
        assert "waiting would never end (hold and wait)" in text
        assert "waiting could admit it" not in text
        # another task's hold, and a scope that may not wait: transient, and it says so
        held, done = anyio.Event(), anyio.Event()

        async def holder() -> None:
            with m.hold(a, "cuda:0"):
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(holder)
            await held.wait()
            with pytest.raises(ResidencyPlanError) as caught:
                async with m.scope(plan, timeout=0):
                    pytest.fail("admitted past another task's hold")
            text = diagnose(caught.value, m).step(3).text()
            done.set()
        assert caught.value.hold_and_wait is False
        assert "waiting could admit it" in text


async def test_a_reports_evidence_stays_small_for_a_manager_of_many_values() -> None:
    """``report.to_dict()`` is for logs; step 3 listed every value that could be freed (3 MB
    of JSON for 20,000 values). The lists are cut at MAX_EVIDENCE_ITEMS, largest first, and
    say how many were left out; the sums still count every value."""
    from aresidency.diagnosis._facts import MAX_EVIDENCE_ITEMS

    count = MAX_EVIDENCE_ITEMS + 6
    async with ResidencyManager(budgets={"cuda:0": count * 512}, backend="sim") as m:
        for i in range(count):
            m.register(torch.zeros(128), name=f"v{i}", location="cuda:0")  # 512 B each
        extra = m.register(torch.zeros(128), name="extra")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.move(extra, "cuda:0")
        evidence = diagnose(caught.value, m).step(3).evidence
        assert len(evidence["candidates"]) == MAX_EVIDENCE_ITEMS
        assert evidence["candidates_left_out"] == 6
        assert evidence["freeable_bytes"] == count * 512
        assert "protected_left_out" not in evidence


async def test_step_3_tells_a_reservation_from_a_reconstruction() -> None:
    async with ResidencyManager(
        budgets={"cuda:0": 8 * KiB, "pinned-host": 2 * KiB}, backend="sim"
    ) as m:
        with pytest.raises(ResidencyBudgetError) as caught:
            async with m.reservation("kv", "cuda:0", 12 * KiB):
                pytest.fail("over budget")
        ev = diagnose(caught.value, m).step(3).evidence
        assert (ev["kind"], ev["handle"], ev["missing_bytes"]) == ("reservation", None, 4 * KiB)

        source = CallableSource(
            lambda: tensor(), shape=(1024,), dtype=torch.float32, source_location="pinned-host"
        )
        h = m.register_source(source, name="rebuilt")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.materialize(h, "cuda:0")  # loads through pinned-host: 4 KiB there
        error = caught.value
        assert (error.kind, error.handle, str(error.location)) == (
            "reconstruction",
            h,
            "pinned-host",
        )
        report = diagnose(error, m)
        # Step 2 says the refused location is where the rebuild passes, not the endpoint.
        endpoint = report.step(2)
        assert endpoint.evidence["through_source_location"] is True
        assert (
            "source_location" in endpoint.findings[0]
            and "on its way to cuda:0" in (endpoint.findings[0])
        )
        assert "present" not in endpoint.evidence
        step = report.step(3)
        assert step.evidence["kind"] == "reconstruction"
        assert step.evidence["missing_bytes"] == 2 * KiB
        assert step.evidence["now"] == m.snapshot().location("pinned-host").to_dict()
        assert "temporary reconstruction storage" in " ".join(step.findings)
        assert "pinned-host" in (step.action or "")


async def test_step_3_a_request_refused_for_its_rebuilds_temporary_storage_says_so() -> None:
    """A reconstructible value can be refused because loading it temporarily exceeds the budget
    of its source location. The controller's refusal named only that location's byte counts
    ("pinned-host is 2048 B short ... the request adds 4096 B at its peak") for a request that
    asked for cuda:0: nothing said those bytes are the rebuild's temporary storage."""
    async with ResidencyManager(
        budgets={"cuda:0": 16 * KiB, "pinned-host": 6 * KiB}, backend="sim"
    ) as m:
        source = CallableSource(
            lambda: tensor(), shape=(1024,), dtype=torch.float32, source_location="pinned-host"
        )
        lora = m.register_source(source, name="lora")
        cache = m.register(tensor(seed=1), name="cache", location="pinned-host")
        request = ResidencyRequest("adapter", [ResidencyRequirement(lora, "cuda:0")])
        # the only value that could make room there is protected
        with m.hold(cache, "pinned-host"), pytest.raises(ResidencyPlanError) as caught:
            await ResidencyController(m).decide(request)
        reason = caught.value.reason
        assert reason.startswith("request 'adapter' is infeasible: pinned-host is 2048 B")
        assert (
            "4096 B (4.0 KiB) of it temporary reconstruction storage at the source_location "
            "of lora on its way to cuda:0" in reason
        )
        step = diagnose(caught.value, m).step(5)
        assert "temporary reconstruction storage" in step.text()
        # Once the room is there, the same request is decided, rebuilding through pinned-host.
        decision = await ResidencyController(m).decide(request)
        assert [str(e.location) for e in decision.evictions] == ["pinned-host"]
        ledger = decision.explanation.ledger["pinned-host"]
        assert ledger.budget_bytes == 6 * KiB and ledger.peak_bytes <= 6 * KiB


# ---------------------------------------------------------------------- 4: protection


async def test_step_4_names_the_task_holding_the_lease_that_blocks_a_release() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "pinned-host")
        entered, done = anyio.Event(), anyio.Event()

        async def reader() -> None:
            async with m.acquire(h, "pinned-host"):
                entered.set()
                await done.wait()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(reader, name="reader-task")
            await entered.wait()
            hold = m.hold(h, "pinned-host")
            with pytest.raises(ResidencyInUseError) as caught:
                await m.release(h, "pinned-host")
            error = caught.value
            assert error.owners == ("reader-task", error.owners[1])
            assert "'reader-task'" in str(error)
            report = diagnose(error, m)
            step = report.step(4)
            record = m.snapshot().value(h).materialization("pinned-host")
            ev = step.evidence
            assert (ev["use_count"], ev["hold_count"]) == (record.use_count, record.hold_count)
            assert (ev["use_count"], ev["hold_count"], ev["pending_event_count"]) == (1, 1, 0)
            assert ev["owners"] == list(error.owners)
            kinds = {(o["task"], o["kind"]) for o in ev["owners_now"]}
            assert ("reader-task", "read lease") in kinds
            assert (hold.owner, "hold") in kinds
            action = step.action or ""
            # each task is asked to end what it owns: the lease's, and the hold's
            assert "exit the lease in task(s) 'reader-task' once" in action
            assert f"release the obsolete hold in task(s) {hold.owner!r};" in action
            assert report.next_action == step.action
            hold.release()
            done.set()
        assert m.owners() == []


async def test_step_4_names_a_transfer_in_flight_and_never_says_retry_while_it_is() -> None:
    """A removal refused because the copy there is still arriving: no lease, hold or event
    counts, so the diagnosis used to say "nothing protects it any more: retry the removal"
    while the transfer was still in flight."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(kib=64), name="w")
        gate = threading.Event()
        m.backend._devices[1].h2d.submit(lambda: gate.wait(10))  # holds up the copy
        pending = m.materialize_nowait(h, "cuda:1")
        try:
            with pytest.raises(ResidencyInUseError) as caught:
                await m.release(h, "cuda:1")
            error = caught.value
            assert error.transfer == "incoming"
            assert m.snapshot().value(h).materialization("cuda:1").state.value == "incoming"
            report = diagnose(error, m)
            step = report.step(4)
            assert step.evidence["transfer"] == "incoming"
            assert "a transfer is in flight" in " ".join(step.findings)
            assert "await that transfer" in (step.action or "")
            assert "nothing protects it" not in (step.action or "")
            assert report.next_action == step.action
            assert "transfer in flight (incoming)" in " ".join(report.step(8).findings)
        finally:
            gate.set()
        await pending
        step = diagnose(error, m).step(4)  # landed: now the removal may be retried
        assert step.action == "nothing protects it any more: retry the removal"


async def test_step_4_of_a_request_refused_for_protections_names_the_owning_tasks(
    tmp_path: Path,
) -> None:
    """The controller never waits for protected values: it refuses a request that only their
    eviction would admit. Its report (and that of controller.scope timing out on it) had no
    step 4: nothing said which lease or hold, owned by which task, kept the room, and the next
    action was "derive a fresh decision once the state changed"."""
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        a = m.register(tensor(seed=1), name="a", location="cuda:0")
        b = m.register(tensor(seed=2), name="b", location="cuda:0")
        new = m.register(tensor(seed=3), name="new")
        request = ResidencyRequest("generate", [ResidencyRequirement(new, "cuda:0")])
        controller = ResidencyController(m)
        entered, done = anyio.Event(), anyio.Event()

        async def decode_worker() -> None:
            async with m.acquire(a, "cuda:0"):
                entered.set()
                await done.wait()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(decode_worker, name="decode-worker")
            await entered.wait()
            hold = m.hold(b, "cuda:0")
            with pytest.raises(ResidencyPlanError) as refused:
                await controller.decide(request)
            report = diagnose(refused.value, m)
            step = report.step(4)
            text = " ".join(step.text().split())
            assert "protected at the request's budgeted locations (cuda:0)" in text
            assert "held by 'decode-worker' (read lease)" in text
            assert f"held by {hold.owner!r} (hold)" in text
            assert [p["handle"]["name"] for p in step.evidence["protected"]] == ["a", "b"]
            action = step.action or ""
            assert "exit the lease(s) in task(s) 'decode-worker'" in action
            assert f"release the obsolete hold(s) in task(s) {hold.owner!r}" in action
            assert report.next_action == action
            path = tmp_path / "refused.json"
            m.dump(path, refused.value)
            assert diagnose_dump(path).to_dict() == report.to_dict()
            hold.release()
            # controller.scope waiting on the lease times out: the same step 4, from its cause
            wide = m.register(tensor(kib=8, seed=5), name="wide")  # a and b must both go
            wide_request = ResidencyRequest("wide", [ResidencyRequirement(wide, "cuda:0")])
            with pytest.raises(TimeoutError) as timed_out:
                async with controller.scope(wide_request, timeout=0.05):
                    pytest.fail("admitted under the lease")
            step = diagnose(timed_out.value, m).step(4)
            assert "exit the lease(s) in task(s) 'decode-worker'" in (step.action or "")
            assert "hold" not in (step.action or "")
            done.set()
        # A refusal that is not about protections keeps its own next action.
        big = m.register(tensor(kib=16, seed=4), name="big")
        with pytest.raises(ResidencyPlanError) as too_big:
            await controller.decide(ResidencyRequest("big", [ResidencyRequirement(big, "cuda:0")]))
        report = diagnose(too_big.value, m)
        # (the lease's reader event may still be pending: listed, but not the next action)
        assert not report.has_step(4) or report.step(4).action is None
        assert report.next_action == report.step(5).action


# --------------------------------------------------------------- 5: decision evidence


async def _crowded(m: ResidencyManager) -> tuple[list, object]:
    values = []
    for i in range(10):
        h = m.register(tensor(kib=1 + i % 5, seed=i), name=f"v{i}")
        await m.move(h, "cuda:0")
        values.append(h)
    new = m.register(tensor(kib=20, seed=99), name="new")
    return values, new


async def test_step_5_shows_a_decisions_search_work_evictions_and_peaks() -> None:
    async with ResidencyManager(budgets={"cuda:0": 36 * KiB}, backend="sim") as m:
        _, new = await _crowded(m)
        controller = ResidencyController(m)
        request = ResidencyRequest("big", [ResidencyRequirement(new, "cuda:0")])
        decision = await controller.decide(request)
        assert decision.evictions
        # The entry's copy of 'new' fails (after the evictions' moves committed).
        m.backend.faults.fail_transfer_at = len(decision.evictions) + 1
        with pytest.raises(ResidencyPlanExecutionError) as caught:
            async with m.scope(decision):
                pytest.fail("the entry failed")
        error = caught.value
        assert error.decision is decision
        step = diagnose(error, m).step(5)
        ev = step.evidence
        assert ev["request"] == "big"
        assert ev["explored_states"] == decision.explored_states
        assert ev["expected_state_version"] == decision.expected_state_version
        assert [e["handle"]["value_id"] for e in ev["evictions"]] == [
            e.handle.value_id for e in decision.evictions
        ]
        assert [e["reason"] for e in ev["evictions"]] == [e.reason for e in decision.evictions]
        assert (
            ev["predicted_peak_bytes"]["cuda:0"]
            == (decision.explanation.predicted_peak_bytes[decision.plan.enter[0].location])
        )
        text = " ".join(step.findings)
        assert "not an eviction count" in text and decision.evictions[0].reason in text
        # Step 3 shows the decision's explanation as of the state it was made against (the
        # evictions' moves have committed since), saying so.
        step3 = diagnose(error, m).step(3)
        assert step3 is not None
        at = f"at the decision (state v{decision.expected_state_version}), explain(plan): "
        assert any(f.startswith(at) for f in step3.findings), step3.findings


async def test_step_5_records_a_search_limit_as_unknown_feasibility() -> None:
    async with ResidencyManager(budgets={"cuda:0": 36 * KiB}, backend="sim") as m:
        _, new = await _crowded(m)
        controller = ResidencyController(m, search_state_limit=3)
        request = ResidencyRequest("big", [ResidencyRequirement(new, "cuda:0")])
        with pytest.raises(ResidencySearchLimitError) as caught:
            await controller.decide(request)
        report = diagnose(caught.value, m)
        ev = report.step(5).evidence
        assert (ev["request_name"], ev["state_limit"], ev["explored_states"]) == ("big", 3, 3)
        assert "not proof" in " ".join(report.step(5).findings)
        assert "search_state_limit" in report.next_action


# ------------------------------------------------------------------ 6: stale decision


async def test_step_6_lists_the_transitions_between_the_expected_and_actual_version() -> None:
    async with ResidencyManager(budgets={"cuda:0": 36 * KiB}, backend="sim") as m:
        _, new = await _crowded(m)
        controller = ResidencyController(m)
        decision = await controller.decide(
            ResidencyRequest("big", [ResidencyRequirement(new, "cuda:0")])
        )
        late = m.register(tensor(seed=7), name="late")  # the intervening changes
        async with m.reservation("other", "pinned-host", KiB):
            with pytest.raises(ResidencyStaleStateError) as caught:
                async with m.scope(decision):
                    pytest.fail("stale")
            error = caught.value
            assert error.decision is decision and error.plan is decision.plan
            report = diagnose(error, m)
        step = report.step(6)
        ev = step.evidence
        assert ev["expected_version"] == decision.expected_state_version
        assert ev["actual_version"] == error.actual_version == decision.expected_state_version + 2
        expected = m.trace().between(error.expected_version, error.actual_version)
        assert [t["seq"] for t in ev["intervening"]] == [t.seq for t in expected]
        assert [t["kind"] for t in ev["intervening"]] == ["register", "reserve"]
        assert ev["intervening"][0]["handle"] == late.to_dict()
        assert ev["categories"] == {"ownership": 1, "reservation": 1} and ev["missing"] == 0
        assert "controller.decide" in report.next_action
        assert not report.has_step(7)


# --------------------------------------------------------------- 7: partial execution


async def test_step_7_lists_what_stays_in_effect_against_the_snapshot() -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(seed=1), name="a")
        b = m.register(tensor(seed=2), name="b")
        c = m.register(tensor(seed=3), name="c", location="cuda:0")
        plan = ResidencyPlan(
            reclaim=[Move(c, "pinned-host")],
            reserve=[MemoryReservation("ws", "cuda:0", 4 * KiB)],
            enter=[Move(a, "cuda:0"), Materialize(b, "cuda:0")],
        )
        m.backend.faults.fail_transfer_at = 3  # b's copy in the enter phase
        with pytest.raises(ResidencyPlanExecutionError) as caught:
            await m.execute(plan)
        error = caught.value
        assert "(of the plan's enter actions)" in str(error)  # execute is the phase, not enter
        step = diagnose(error, m).step(7)
        snap = m.snapshot()
        ev = step.evidence
        assert ev["phase"] == "execute" and ev["failed_action_index"] == 1
        assert ev["failed_action"]["handle"] == b.to_dict()
        assert ev["cause"]["type"] == type(error.__cause__).__name__
        assert ev["committed"] == len(error.partial_report.transitions) == 8
        assert [t["seq"] for t in ev["in_effect"]] == [
            t.seq for t in error.partial_report.in_effect
        ]
        assert [t["kind"] for t in ev["in_effect"]] == [
            "move_begin",
            "move_commit",
            "move_begin",
            "move_commit",
        ]
        assert [t["kind"] for t in ev["undone"]] == [
            "reserve",
            "move_begin",
            "copy_abort",
            "unreserve",
        ]
        for handle in (a, b, c):
            assert ev["values_now"][str(handle)] == [str(x) for x in snap.value(handle).locations]
        assert ev["values_now"][str(c)] == ["pinned-host"]
        # Printed as a list under its heading, each transition one level in.
        lines = step.text().splitlines()
        heading = lines.index("  - in effect:")
        assert lines[heading + 1] == f"    - {error.partial_report.in_effect[0]}"
        # execute ran no scope: nothing is said of re-entering one
        assert "execute does not roll back" in step.text()
        assert "scope" not in " ".join(step.findings)


async def test_step_7_of_a_body_error_reaches_the_scopes_failed_exit(tmp_path: Path) -> None:
    """A scope body fails and the scope's exit fails too: the body's exception stays primary
    and the exit failure is on scope.exit_error. Diagnosing the body's exception (what the
    application caught) said only "KeyError: not an aresidency error": nothing of the exit's
    partial execution, also for code that never named the scope."""
    async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m:
        a = m.register(tensor(seed=1), name="a")
        plan = ResidencyPlan(enter=[Move(a, "cuda:0")], exit=[Move(a, "pinned-host")])
        with pytest.raises(KeyError) as caught:
            async with m.scope(plan):
                m.backend.faults.fail_transfer_at = 1  # the exit's move
                raise KeyError("body")
        report = diagnose(caught.value, m)
        step = report.step(7)
        assert step.evidence["phase"] == "exit" and step.evidence["failed_action_index"] == 0
        assert step.evidence["failed_action"]["handle"] == a.to_dict()
        assert "it carries a ResidencyPlanExecutionError as its scope's failed exit" in (
            " ".join(report.step(8).text().split())
        )
        assert report.next_action.startswith("take a new snapshot")
        path = tmp_path / "exit.json"
        m.dump(path, caught.value)
        assert diagnose_dump(path).to_dict() == report.to_dict()
        # A body error of ours stays what is diagnosed; step 8 says the exit failed too.
        big = m.register(tensor(kib=8, seed=2), name="big")
        plan = ResidencyPlan(exit=[Move(a, "pageable-host")])
        with pytest.raises(ResidencyBudgetError) as ours:
            async with m.scope(plan) as scope:
                m.backend.faults.fail_transfer_at = 1
                await m.move(big, "cuda:0")
        assert isinstance(scope.exit_error, ResidencyPlanExecutionError)
        report = diagnose(ours.value, m)
        assert report.step(3).evidence["requested_bytes"] == 8 * KiB
        assert "the scope's exit failed too (scope.exit_error, a ResidencyPlanExecutionError)" in (
            " ".join(report.step(8).text().split())
        )


async def test_step_3_of_a_failed_reservation_weighs_the_whole_plan_not_the_one_request() -> None:
    """A scope's reserve phase fails after preflight (the budget was lowered while its reclaim
    ran): the cause is a live budget error for one reservation. The reservation prefix is
    released, so that one reservation alone fits now, but the plan still does not: step 3 used
    to say "the request fits now: retry it" beside explain(plan) saying infeasible."""
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(kib=32), name="a")
        await m.move(a, "cuda:0")
        plan = ResidencyPlan(
            reclaim=[Move(a, "pinned-host")],
            reserve=[
                MemoryReservation("r0", "cuda:0", 8 * KiB),
                MemoryReservation("r1", "cuda:0", 40 * KiB),
            ],
        )
        gate = threading.Event()
        m.backend._devices[0].d2h.submit(lambda: gate.wait(10))  # holds up the reclaim's copy
        failed: list[BaseException] = []

        async def enter() -> None:
            try:
                async with m.scope(plan, timeout=0):
                    pass
            except ResidencyPlanExecutionError as error:
                failed.append(error)

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(enter)
                await anyio.wait_all_tasks_blocked()
                m.set_budget("cuda:0", 40 * KiB)  # the charge is 32 KiB: allowed
                gate.set()
        finally:
            gate.set()
        (error,) = failed
        assert error.phase == "reserve" and error.failed_reservation_index == 1
        cause = error.__cause__
        assert isinstance(cause, ResidencyBudgetError) and not cause.in_simulation
        assert m.snapshot().location("cuda:0").charged_bytes == 0  # the prefix was released
        report = diagnose(error, m)
        step = report.step(3)
        text = " ".join(step.findings)
        assert "explain(plan): infeasible" in text
        assert "the whole plan would peak at 49152 B at cuda:0, 8192 B over budget" in text
        assert "retry" not in (step.action or "") and "fits now" not in (report.next_action or "")
        assert "free 8192 B at cuda:0" in (step.action or "")


# ------------------------------------------------------------------ 8: classification


async def test_step_8_classifies_each_failure_and_its_first_action() -> None:
    async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m:
        h = m.register(tensor(), name="w")
        other = m.register(tensor(seed=1), name="x")
        await m.move(h, "cuda:0")
        errors: list[BaseException] = []
        with pytest.raises(ResidencyBudgetError) as budget:
            await m.move(other, "cuda:0")
        errors.append(budget.value)
        with m.hold(h, "cuda:0"), pytest.raises(ResidencyInUseError) as in_use:
            await m.move(h, "pinned-host")
        errors.append(in_use.value)
        with pytest.raises(ResidencyUnavailableError) as unavailable:
            m.acquire(other, "cuda:0")
        errors.append(unavailable.value)
        decision_step = {
            "ResidencyBudgetError": 3,
            "ResidencyInUseError": 4,
            "ResidencyUnavailableError": 2,
        }
        for error in errors:
            report = diagnose(error, m)
            step = report.step(8)
            name = type(error).__name__
            assert step.evidence["type"] == name
            assert f"step {decision_step[name]}" in step.evidence["first_action"]
            # The next action is the step's own, sharpened by the evidence.
            assert report.next_action == report.step(decision_step[name]).action
        stale = ResidencyStaleStateError(1, 2)
        assert "catch it before ResidencyPlanError" in " ".join(diagnose(stale).step(8).findings)
        foreign = diagnose(RuntimeError("boom"), m).step(8)
        assert foreign.evidence["meaning"] == "not an aresidency error"


async def test_an_error_inside_a_task_groups_exception_group_is_diagnosed(
    tmp_path: Path,
) -> None:
    """anyio's (and asyncio's) task groups raise an ExceptionGroup around a task's error: the
    report said only "ExceptionGroup: not an aresidency error". It now walks into the group to
    the aresidency error it holds (live, and from a dump), and explains a plan it carries."""
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        big = m.register(tensor(kib=16), name="big")
        with pytest.raises(BaseExceptionGroup) as caught:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(m.materialize, big, "cuda:0")
        report = diagnose(caught.value, m)
        assert report.step(3).evidence["kind"] == "materialization"
        assert report.step(3).evidence["requested_bytes"] == 16 * KiB
        assert "it carries a ResidencyBudgetError in its group" in report.step(8).text()
        assert report.next_action == report.step(3).action
        path = tmp_path / "group.json"
        m.dump(path, caught.value)
        assert diagnose_dump(path).to_dict() == report.to_dict()
        # A scope refused at entry, in a task: its plan is explained against the state now.
        plan = ResidencyPlan(enter=[Move(big, "cuda:0")])
        with pytest.raises(BaseExceptionGroup) as refused:
            async with anyio.create_task_group() as tasks:

                async def enter() -> None:
                    async with m.scope(plan):
                        pytest.fail("admitted")

                tasks.start_soon(enter)
        step = diagnose(refused.value, m).step(3)
        assert step.evidence["explanation"]["feasible"] is False


async def test_every_report_prints_its_steps_and_serializes() -> None:
    async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m:
        h = m.register(tensor(), name="w")
        big = m.register(tensor(kib=8), name="big")
        await m.move(h, "cuda:0")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.move(big, "cuda:0")
        report = diagnose(caught.value, m)
        text = str(report)
        for step in report.steps:
            assert f"Step {step.number}. {step.title}" in text
        assert text.strip().splitlines()[-1]  # ends with the next action
        import json

        assert json.loads(json.dumps(report.to_dict()))["steps"][0]["number"] == 1
        with pytest.raises(LookupError, match="no step 6"):
            report.step(6)
        with pytest.raises(TypeError, match="exception"):
            diagnose("not an error", m)  # type: ignore[arg-type]


def test_threading_is_not_needed_for_a_diagnosis_without_a_manager() -> None:
    # diagnose(error) alone touches no loop and no manager: usable from any thread.
    results: list[str] = []
    thread = threading.Thread(
        target=lambda: results.append(str(diagnose(ResidencyStaleStateError(3, 5))))
    )
    thread.start()
    thread.join()
    assert "expected state version 3" in results[0]


async def test_diagnose_names_a_second_argument_that_is_not_a_manager() -> None:
    async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m:
        h = m.register(tensor(kib=8), name="big")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.move(h, "cuda:0")
        with pytest.raises(TypeError, match="second argument is the ResidencyManager"):
            diagnose(caught.value, m.snapshot())  # type: ignore[arg-type]
        assert diagnose(caught.value, m).step(3) is not None


async def test_a_scope_that_times_out_carries_what_stood_in_its_way() -> None:
    """A scope waiting for a lease to end times out: its ``TimeoutError`` is chained to the
    in-use refusal, so the diagnosis shows step 4 with the lease's task."""
    async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        entered, done = anyio.Event(), anyio.Event()

        async def reader() -> None:
            async with m.acquire(a, "cuda:0"):
                entered.set()
                await done.wait()

        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(reader, name="reader-task")
            await entered.wait()
            with pytest.raises(TimeoutError, match="not admitted within") as caught:
                async with m.scope(plan, timeout=0.05):
                    pytest.fail("admitted under the lease")
            assert isinstance(caught.value.__cause__, ResidencyInUseError)
            step = diagnose(caught.value, m).step(4)
            assert step is not None and "'reader-task'" in (step.action or "")
            done.set()


async def test_step_8_of_a_source_s_failed_load_names_the_value_and_what_to_do(
    tmp_path: Path,
) -> None:
    # A source's load() raised: the caller gets the source's own exception (its type kept),
    # with the runtime's note naming the value and where it was going. Step 8 reported only
    # "not an aresidency error"; it now shows the note and says the source failed to load.
    def load() -> torch.Tensor:
        raise FileNotFoundError("shard-3.safetensors is gone")

    async with ResidencyManager(backend="sim") as m:
        h = m.register_source(CallableSource(load, shape=(4,), dtype=torch.float32), name="w3")
        with pytest.raises(FileNotFoundError) as caught:
            await m.materialize(h, "cuda:0")
        live = diagnose(caught.value, m)
        path = m.dump(tmp_path / "dump.json", error=caught.value)
    for report in (live, diagnose_dump(path)):
        step = report.step(8)
        text = step.text()
        assert "not an aresidency error" in text
        assert f"its note: while rebuilding {h} at cuda:0: load() of its source" in text
        assert "a value's source failed to load it" in step.evidence["first_action"]
