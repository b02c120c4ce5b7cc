"""Consumer events, reaping and data safety on the simulated backend (simulated CUDA streams run
work in order on worker threads, so a slow 'kernel' keeps its event pending)."""

from __future__ import annotations

import time

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aresidency import ReplicaMode, ResidencyInUseError, ResidencyManager
from aresidency.backends.sim import SimBackend

pytestmark = pytest.mark.anyio


def data(seed: int = 0, n: int = 4096) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


async def test_release_waits_for_a_readers_event() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(data(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        stream = m.backend.new_stream("cuda:0")  # type: ignore[attr-defined]
        async with m.acquire(h, "cuda:0", stream=stream):
            stream.sleep(0.3)  # a kernel that reads the tensor for 300 ms
        record = m.snapshot().value(h).materialization("cuda:0")
        assert record.pending_event_count == 1 and record.use_count == 0
        start = time.monotonic()
        await m.release(h, "cuda:0")
        assert time.monotonic() - start >= 0.25
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host"]
        kinds = [t.kind for t in m.trace().transitions]
        assert kinds.index("event_reaped") < kinds.index("release")


async def test_direct_release_with_a_hold_is_refused_but_pending_events_are_awaited() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(data(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        stream = m.backend.new_stream("cuda:0")  # type: ignore[attr-defined]
        async with m.acquire(h, "cuda:0", stream=stream) as lease:
            compute = m.backend.current_stream("cuda:0")
            lease.register_stream(compute)
            stream.sleep(0.05)
            compute.sleep(0.05)  # (an idle stream's event could be reaped before the check)
        assert m.snapshot().value(h).materialization("cuda:0").pending_event_count == 2
        hold = m.hold(h, "cuda:0")
        with pytest.raises(ResidencyInUseError) as info:
            await m.release(h, "cuda:0")
        assert info.value.hold_count == 1
        hold.release()
        await m.release(h, "cuda:0")


async def test_move_frees_its_source_only_after_the_copy_and_the_readers() -> None:
    async with ResidencyManager(backend=SimBackend(copy_gbps=0.001)) as m:
        # 16 KiB at 1 MB/s: the copy takes ~16 ms.
        h = m.register(data(), name="w", location="pinned-host")
        stream = m.backend.new_stream("cuda:0")  # type: ignore[attr-defined]
        async with m.acquire(h, "pinned-host") as lease:
            lease.register_stream(stream)
            stream.sleep(0.1)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(m.move, h, "cuda:0")
            # Until the move began: from then on until it commits (after the copy, which
            # itself waits for the 100 ms reader, and after the reader's event is reaped) the
            # source stays outgoing and the destination incoming.
            while len(m.snapshot().value(h).materializations) < 2:
                await m.wait_for_change()
            record = m.snapshot().value(h)
        assert [(str(x.location), x.state.value) for x in record.materializations] == [
            ("pinned-host", "outgoing"),
            ("cuda:0", "incoming"),
        ]
        assert [str(x) for x in m.snapshot().value(h).locations] == ["cuda:0"]
        kinds = [t.kind for t in m.trace().transitions]
        assert kinds.index("event_reaped") < kinds.index("move_commit")


async def test_released_storage_is_poisoned_in_the_simulation() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(data(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        async with m.acquire(h, "cuda:0") as lease:
            stale = lease.tensor  # kept past the lease: a bug the poison makes visible
        await m.release(h, "cuda:0")
        assert torch.isnan(stale).all()


async def test_lease_on_an_incoming_copy_orders_the_stream_after_the_copy() -> None:
    async with ResidencyManager(backend=SimBackend(copy_gbps=0.001)) as m:
        original = data()
        h = m.register(
            original.clone(), name="w", location="pinned-host", replica_mode=ReplicaMode.REPLICABLE
        )
        task = m.materialize_nowait(h, "cuda:0")
        assert m.snapshot().value(h).materialization("cuda:0").state.value == "incoming"
        stream = m.backend.current_stream("cuda:0")
        seen: list[torch.Tensor] = []
        async with m.acquire(h, "cuda:0") as lease:
            tensor = lease.tensor
            stream.submit(lambda: seen.append(tensor.clone()))  # runs after the copy
        await task
        await anyio.to_thread.run_sync(stream.synchronize)
        assert torch.equal(seen[0], original)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.sampled_from(["pageable-host", "pinned-host", "cuda:0", "cuda:1"]),
        min_size=1,
        max_size=8,
    ),
    st.booleans(),
)
async def test_data_survives_any_sequence_of_moves_bit_for_bit(
    path: list[str], replicable: bool
) -> None:
    async with ResidencyManager(backend="sim") as m:
        original = data(seed=len(path))
        mode = ReplicaMode.REPLICABLE if replicable else ReplicaMode.EXCLUSIVE
        h = m.register(original.clone(), name="w", replica_mode=mode)
        for step, loc in enumerate(path):
            if replicable and step % 2:
                await m.materialize(h, loc)
            else:
                await m.move(h, loc)
            for record in m.snapshot().value(h).materializations:
                async with m.acquire(h, record.location) as lease:
                    assert torch.equal(lease.tensor.cpu(), original)
        m._state.check_invariants()


async def test_a_copy_and_a_move_out_of_one_source_in_one_phase_complete() -> None:
    from aresidency import Materialize, Move, ResidencyPlan

    async with ResidencyManager(backend="sim") as m:
        original = data()
        h = m.register(original.clone(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        plan = ResidencyPlan(enter=[Materialize(h, "cuda:0"), Move(h, "cuda:1")])
        with anyio.fail_after(5):
            await m.execute(plan)
        assert [str(x) for x in m.snapshot().value(h).locations] == ["cuda:0", "cuda:1"]
        for loc in ("cuda:0", "cuda:1"):
            async with m.acquire(h, loc) as lease:
                assert torch.equal(lease.tensor, original)
