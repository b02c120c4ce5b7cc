"""A phase hands its copies to the backend in batches (``Backend.copy_many``): the copies a
batch issues on one stream share a completion event and are watched once, yet every copy
still commits, fails or is cancelled on its own. On the SIMULATED backend (CUDA devices
simulated in host memory)."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import (
    Materialize,
    Move,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanExecutionError,
)
from aresidency.backends import HostEvent, SimBackend, Transfer
from aresidency.core.plans import FIRST_HAND_OUT
from aresidency.runtime import driver

pytestmark = pytest.mark.anyio

N = 40  # more than one batch


def tensor(seed: int) -> torch.Tensor:
    return torch.randn(1024, generator=torch.Generator().manual_seed(seed))


def watched(m: ResidencyManager) -> list[object]:
    """Record what the reaper is asked to watch from now on."""
    reaper = m._running().reaper
    seen: list[object] = []
    watch = reaper.watch

    def counting(waitable: object, callback: object) -> None:
        seen.append(waitable)
        watch(waitable, callback)  # type: ignore[arg-type]

    reaper.watch = counting  # type: ignore[method-assign]
    return seen


def register_all(m: ResidencyManager) -> list[object]:
    return [
        m.register(tensor(i), name=f"v{i}", replica_mode=ReplicaMode.REPLICABLE) for i in range(N)
    ]


async def test_a_plans_copies_are_watched_once_per_batch_and_all_arrive() -> None:
    async with ResidencyManager(backend="sim") as m:
        handles = register_all(m)
        seen = watched(m)
        batches: list[int] = []
        copy_many = m.backend.copy_many

        def counting(requests: list[object]) -> list[object]:
            batches.append(len(requests))
            return copy_many(requests)  # type: ignore[arg-type,return-value]

        m.backend.copy_many = counting  # type: ignore[method-assign]
        await m.execute(ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles]))
        assert sum(batches) == N and max(batches) <= driver.ISSUE_BATCH
        assert len(seen) == len(batches) < N, "one watch per batch (its copies share one event)"
        for i, h in enumerate(handles):
            async with m.acquire(h, "cuda:0") as lease:
                assert torch.equal(lease.tensor, tensor(i))
        m.state.check_invariants()


async def test_a_failed_copy_in_a_batch_fails_its_action_and_the_others_commit() -> None:
    async with ResidencyManager(backend="sim") as m:
        handles = register_all(m)
        m.backend.faults.fail_transfer_at = 5  # inside the first batch
        with pytest.raises(ResidencyPlanExecutionError) as info:
            await m.execute(ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles]))
        assert info.value.failed_action_index == 4
        snap = m.snapshot()
        for i, h in enumerate(handles):
            where = [str(x) for x in snap.value(h).locations]
            assert where == (["pageable-host"] if i == 4 else ["pageable-host", "cuda:0"])
        m.state.check_invariants()


async def test_a_failed_allocation_in_a_batch_fails_its_action_and_the_others_commit() -> None:
    async with ResidencyManager(backend="sim") as m:
        handles = register_all(m)
        m.backend.faults.oom_at_allocation = 3
        with pytest.raises(ResidencyPlanExecutionError) as info:
            await m.execute(ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles]))
        assert info.value.failed_action_index == 2
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        snap = m.snapshot()
        assert [str(x) for x in snap.value(handles[2]).locations] == ["pageable-host"]
        assert all(len(snap.value(h).locations) == 2 for i, h in enumerate(handles) if i != 2)
        m.state.check_invariants()


async def cancel_after(turns: int) -> bool:
    """Cancel a plan of N copies after ``turns`` turns of the loop; check that nothing is
    lost; return whether batches remained to be issued when it was cancelled."""
    # 40 copies of 4 KiB at 20 MB/s: ~8 ms on the simulated copy stream.
    async with ResidencyManager(backend=SimBackend(copy_gbps=0.02)) as m:
        handles = register_all(m)
        issued: list[int] = []
        copy_many = m.backend.copy_many
        free = m.backend.free
        into: dict[int, Transfer] = {}  # destination storage -> its transfer
        early_frees: list[str] = []

        def counting(requests: list[object]) -> list[object]:
            issued.append(len(requests))
            out = copy_many(requests)  # type: ignore[arg-type]
            for transfer in out:
                if isinstance(transfer, Transfer):
                    into[transfer.tensor.untyped_storage().data_ptr()] = transfer
            return out  # type: ignore[return-value]

        def checked_free(tensor: torch.Tensor, location: object) -> None:
            transfer = into.get(tensor.untyped_storage().data_ptr())
            if transfer is not None and not transfer.query():
                early_frees.append(f"{transfer!r} freed while its copy ran")
            free(tensor, location)  # type: ignore[arg-type]

        m.backend.copy_many = counting  # type: ignore[method-assign]
        m.backend.free = checked_free  # type: ignore[method-assign]
        cancel = anyio.CancelScope()
        plan = ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles])

        async def execute() -> None:
            with cancel:
                await m.execute(plan)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(execute)
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()
            cancel.cancel()
            at_cancel = sum(issued)
        snap = m.snapshot()
        arrived = 0
        for i, h in enumerate(handles):
            records = {str(r.location): r.state.value for r in snap.value(h).materializations}
            assert records.get("pageable-host") == "resident"
            if "cuda:0" in records:  # a copy that had landed before the cancellation commits
                assert records["cuda:0"] == "resident"
                async with m.acquire(h, "cuda:0") as lease:
                    assert torch.equal(lease.tensor, tensor(i))
                arrived += 1
        assert snap.location("cuda:0").charged_bytes == arrived * 4096
        assert not early_frees, early_frees
        m.state.check_invariants()
        await m.execute(plan)  # the manager goes on: every value arrives exactly
        for i, h in enumerate(handles):
            async with m.acquire(h, "cuda:0") as lease:
                assert torch.equal(lease.tensor, tensor(i))
        return 0 < at_cancel < N


async def test_cancelling_a_plan_between_batches_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled after 0, 1, 2, ... turns of the loop, some of them while batches remained to
    be issued: every copy in flight is aborted (none was leased) once its device work ran,
    one that had landed commits, the budget holds exactly what committed, and the next plan
    moves every value exactly."""
    monkeypatch.setattr(driver, "ISSUE_SLICE_S", 0.0)  # one batch per turn, on any machine
    between = [await cancel_after(turns) for turns in range(8)]
    assert any(between), "no cancellation landed while batches remained to be issued"


def gate_after_first_batch(m: ResidencyManager) -> tuple[HostEvent, list[int]]:
    """Hold every copy after the first batch on cuda:0's simulated copy stream until the
    returned event is set; the list receives the first batch's size."""
    gate = HostEvent(label="gate")
    first: list[int] = []
    backend = m.backend
    assert isinstance(backend, SimBackend)
    copy_many = backend.copy_many
    calls = [0]

    def gated(requests: list[object]) -> list[object]:
        out = copy_many(requests)  # type: ignore[arg-type]
        calls[0] += 1
        if calls[0] == 1:
            first.append(len(requests))
            backend.device_streams(0).h2d.wait_event(gate)
        return out  # type: ignore[return-value]

    backend.copy_many = gated  # type: ignore[method-assign]
    return gate, first


def states(m: ResidencyManager, handles: list[object], where: str) -> list[str]:
    out = []
    for h in handles:
        records = {str(r.location): r.state.value for r in m.snapshot().value(h).materializations}
        out.append(records.get(where, "absent"))
    return out


@pytest.mark.parametrize("kind", ["copy", "move"])
async def test_a_batch_commits_while_later_batches_are_still_in_flight(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the last copy completes, only its batch's commits are left: the earlier batches
    committed as they completed (a move's commit frees its source)."""
    monkeypatch.setattr(driver, "ISSUE_SLICE_S", 0.0)  # one batch per turn
    async with ResidencyManager(backend="sim") as m:
        if kind == "copy":
            handles = register_all(m)
            plan = ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles])
        else:
            handles = [m.register(tensor(i), name=f"x{i}") for i in range(N)]  # EXCLUSIVE
            plan = ResidencyPlan(enter=[Move(h, "cuda:0") for h in handles])
        gate, sizes = gate_after_first_batch(m)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(m.execute, plan)
            try:
                with anyio.fail_after(5):
                    while not sizes:
                        await anyio.lowlevel.checkpoint()
                first = handles[: sizes[0]]
                with anyio.fail_after(5):
                    while states(m, first, "cuda:0") != ["resident"] * len(first):
                        await m.wait_for_change(5)
                rest = states(m, handles[sizes[0] :], "cuda:0")
                assert set(rest) <= {"incoming", "absent"} and "incoming" in rest, rest
                if kind == "move":
                    assert states(m, first, "pageable-host") == ["absent"] * len(first)
            finally:
                gate.set()  # whatever happened: the plan (or its cancellation) can end
        assert states(m, handles, "cuda:0") == ["resident"] * N
        for i, h in enumerate(handles):
            async with m.acquire(h, "cuda:0") as lease:
                assert torch.equal(lease.tensor, tensor(i))
        if kind == "move":
            assert m.snapshot().location("pageable-host").charged_bytes == 0
        m.state.check_invariants()


async def test_a_move_and_a_copy_of_one_source_in_one_phase_both_land() -> None:
    """Two copies of the phase read one source, and one of them is a move (it frees the
    source): the copy may commit alone, the move only once it is the source's last reader."""
    for seed in range(6):
        async with ResidencyManager(backend=SimBackend(num_devices=2)) as m:
            h = m.register(tensor(seed), name="v", replica_mode=ReplicaMode.REPLICABLE)
            others = register_all(m)[: seed * 3]  # shifts where the pair falls in the batches
            enter = [Materialize(o, "cuda:1") for o in others]
            enter += [Materialize(h, "cuda:0"), Move(h, "cuda:1")]
            await m.execute(ResidencyPlan(enter=enter))
            assert sorted(str(x) for x in m.snapshot().value(h).locations) == ["cuda:0", "cuda:1"]
            for where in ("cuda:0", "cuda:1"):
                async with m.acquire(h, where) as lease:
                    assert torch.equal(lease.tensor, tensor(seed))
            m.state.check_invariants()


async def test_a_long_phase_starts_copying_before_its_last_action_is_begun() -> None:
    """The transfers begun before a checkpoint are issued there: the device works while the
    rest of the phase is being begun."""
    async with ResidencyManager(backend="sim") as m:
        handles = register_all(m)
        begun_at_first_issue: list[int] = []
        copy_many = m.backend.copy_many

        def first_issue(requests: list[object]) -> list[object]:
            if not begun_at_first_issue:
                kinds = [t.kind for t in m.trace().transitions]
                begun_at_first_issue.append(kinds.count("copy_begin"))
            return copy_many(requests)  # type: ignore[arg-type,return-value]

        m.backend.copy_many = first_issue  # type: ignore[method-assign]
        await m.execute(ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles]))
        assert begun_at_first_issue == [FIRST_HAND_OUT]
        assert states(m, handles, "cuda:0") == ["resident"] * N


async def test_a_lease_on_an_early_copy_keeps_it_when_the_phase_is_cancelled_while_beginning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(driver, "ISSUE_SLICE_S", 0.0)
    async with ResidencyManager(backend=SimBackend(copy_gbps=0.02)) as m:
        handles = register_all(m)
        plan = ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles])
        cancel = anyio.CancelScope()
        seen: list[torch.Tensor] = []

        ended = anyio.Event()

        async def execute() -> None:
            try:
                with cancel:
                    await m.execute(plan)
            finally:
                ended.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(execute)
            with anyio.fail_after(5):  # the first checkpoint handed out the first copies
                while states(m, handles[:1], "cuda:0") != ["incoming"]:
                    await anyio.lowlevel.checkpoint()
            assert "absent" in states(m, handles, "cuda:0"), "still beginning actions"
            stream = m.backend.current_stream("cuda:0")
            async with m.acquire(handles[0], "cuda:0", stream=stream) as lease:
                view = lease.tensor
                # The reader runs on the lease's stream, after the copy (as a kernel would).
                m.backend.run_in_stream_order(stream, lambda: seen.append(view.clone()))
                cancel.cancel()  # the plan goes away while the lease reads its first copy
                with anyio.fail_after(5):
                    await ended.wait()  # its cancellation settled with the lease held
        await m.backend.wait(m.backend.record_event(stream))
        assert torch.equal(seen[0], tensor(0))
        where = states(m, handles, "cuda:0")
        assert where[0] == "resident", "the leased copy arrived and stayed"
        # The others: cancelled (gone), or landed before the cancellation (committed, whole).
        assert set(where[1:]) <= {"absent", "resident"} and "absent" in where
        for i, h in enumerate(handles):
            if where[i] == "resident":
                async with m.acquire(h, "cuda:0") as lease:
                    assert torch.equal(lease.tensor, tensor(i))
        m.state.check_invariants()
