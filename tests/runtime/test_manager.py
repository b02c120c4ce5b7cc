"""The manager's direct operations on the simulated backend (a simulation of CUDA devices in
host memory): placement, moves, replicas, releases, leases, holds, sources, threads."""

from __future__ import annotations

import asyncio
import copy
import functools
import pickle
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import (
    CallableSource,
    Hold,
    Materialize,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyInUseError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyUnavailableError,
    ValueHandle,
)
from aresidency.backends.sim import SimBackend
from aresidency.core.locations import Location
from aresidency.runtime import ManagerClosedError

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is in the test extra (not on Windows)
    uvloop = None

try:
    import trio
except ImportError:  # pragma: no cover - trio is in the test extra
    trio = None

pytestmark = pytest.mark.anyio

MiB = 1 << 20


def checksum(t: torch.Tensor) -> int:
    return int(t.detach().cpu().contiguous().view(torch.uint8).to(torch.int64).sum())


def ledger(m: ResidencyManager) -> dict[str, tuple[int, int]]:
    """Used and reserved bytes per location (peaks record attempts, so they may move)."""
    return {str(k): (r.used_bytes, r.reserved_bytes) for k, r in m.snapshot().locations.items()}


def random_tensor(n: int = 4096, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


async def test_register_charges_rounded_storage_where_the_tensor_lives() -> None:
    async with ResidencyManager(backend="sim") as m:
        t = torch.zeros(1000, dtype=torch.uint8)
        h = m.register(t, name="w")
        snap = m.snapshot()
        v = snap.value(h)
        assert v.charge_bytes == 1024
        assert [str(loc) for loc in v.locations] == ["pageable-host"]
        assert snap.location("pageable-host").used_bytes == 1024


async def test_move_round_trip_keeps_data_bit_for_bit() -> None:
    async with ResidencyManager(backend="sim") as m:
        t = random_tensor()
        expected = checksum(t)
        h = m.register(t.clone(), name="w")
        for loc in ["pinned-host", "cuda:0", "cuda:1", "pageable-host", "cuda:0", "pinned-host"]:
            await m.move(h, loc)
            snap = m.snapshot()
            assert [str(x) for x in snap.value(h).locations] == [loc]
            async with m.acquire(h, loc) as lease:
                assert checksum(lease.tensor) == expected
        assert m.snapshot().location("cuda:0").used_bytes == 0


async def test_move_charges_source_and_destination_together_until_the_copy_commits() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        await m.move(h, "cuda:0")
        kinds = [(t.kind, str(t.location), t.nbytes) for t in m.trace().transitions]
        begin = kinds.index(("move_begin", "cuda:0", 16384))
        commit = kinds.index(("move_commit", "pageable-host", -16384))
        assert begin < commit
        assert m.snapshot().location("pageable-host").peak_bytes == 16384


async def test_materialize_of_replicable_value_adds_a_replica() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        await m.materialize(h, "cuda:1")
        locs = [str(x) for x in m.snapshot().value(h).locations]
        assert locs == ["pageable-host", "cuda:0", "cuda:1"]
        await m.release(h, "cuda:0")
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host", "cuda:1"]


async def test_move_of_a_replicable_value_frees_only_the_copy_it_came_from() -> None:
    # As the manager API page says: the cheapest source is copied and freed; a destination
    # that already holds a copy is left as it is.
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:1")
        await m.move(h, "cuda:1")  # a copy is there already: nothing moves
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host", "cuda:1"]
        await m.move(h, "cuda:0")  # from the other GPU, not the host
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host", "cuda:0"]
        await m.move(h, "pinned-host")  # from the GPU
        locs = [str(x) for x in m.snapshot().value(h).locations]
        assert locs == ["pageable-host", "pinned-host"]


async def test_write_lease_invalidates_other_replicas() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        async with m.acquire(h, "cuda:0", mode="write") as lease:
            lease.tensor.add_(1)
        assert [str(x) for x in m.snapshot().value(h).locations] == ["cuda:0"]


async def test_release_of_last_copy_without_source_is_refused_and_changes_nothing() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        version = m.state_version
        with pytest.raises(ResidencyPlanError, match="last copy"):
            await m.release(h, "pageable-host")
        assert m.state_version == version


async def test_acquire_never_places_a_missing_value() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        version = m.state_version
        with pytest.raises(ResidencyUnavailableError, match="no materialization there"):
            m.acquire(h, "cuda:0")
        assert m.state_version == version
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host"]


async def test_budget_error_carries_the_five_fields_and_changes_nothing() -> None:
    async with ResidencyManager(budgets={"cuda:0": 20000}, backend="sim") as m:
        a = m.register(random_tensor(), name="a")
        b = m.register(random_tensor(seed=1), name="b")
        await m.move(a, "cuda:0")
        before = m.snapshot()
        with pytest.raises(ResidencyBudgetError) as info:
            await m.move(b, "cuda:0")
        error = info.value
        assert (str(error.location), error.budget_bytes) == ("cuda:0", 20000)
        assert (error.used_bytes, error.reserved_bytes, error.requested_bytes) == (16384, 0, 16384)
        assert m.snapshot() == before


async def test_hold_protects_from_release_until_released() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        hold = m.hold(h, "cuda:0")
        with pytest.raises(ResidencyInUseError) as info:
            await m.release(h, "cuda:0")
        assert info.value.hold_count == 1
        hold.release()
        await m.release(h, "cuda:0")
        with pytest.raises(RuntimeError, match="already released"):
            hold.release()


async def test_awaiting_a_hold_is_refused_saying_so_and_leaves_nothing_held() -> None:
    """``await manager.hold(h, loc)`` (every other call of the manager is awaited) took the
    hold, then raised Python's ``TypeError: object Hold can't be used in 'await'
    expression``: the hold object was lost while still active, so the copy stayed protected
    for the manager's life (its release, move and discard refused with ResidencyInUseError).
    The await now gives the hold back and says how to hold."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        with pytest.raises(TypeError, match=r"not awaitable.*'with manager.hold\(") as info:
            await m.hold(h, "cuda:0")  # type: ignore[misc]
        assert "nothing stays held" in str(info.value)
        record = m.snapshot().value(h).materialization("cuda:0")
        assert record is not None and record.hold_count == 0 and m.owners() == []
        await m.release(h, "cuda:0")  # nothing protects it
        hold = m.hold(h, "pageable-host")
        hold.release()
        with pytest.raises(TypeError, match="not awaitable"):
            await hold  # type: ignore[misc]
        assert not hold.active


async def test_a_released_hold_cannot_be_entered_again() -> None:
    """Entering a released hold would protect nothing: refused, by ``with`` and ``async
    with``, changing nothing (the copy stays unprotected and releasable)."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        hold = m.hold(h, "cuda:0")
        hold.release()
        before = m.snapshot()
        with pytest.raises(RuntimeError, match="already released"), hold:
            raise AssertionError("the block of a released hold ran")
        with pytest.raises(RuntimeError, match="already released"):
            async with hold:
                raise AssertionError("the block of a released hold ran")
        assert m.snapshot() == before
        await m.release(h, "cuda:0")


async def test_active_lease_blocks_release_with_use_count() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        async with m.acquire(h, "cuda:0"):
            with pytest.raises(ResidencyInUseError) as info:
                await m.release(h, "cuda:0")
            assert info.value.use_count == 1


@pytest.mark.parametrize("how", ["release", "release_nowait"])
async def test_removing_a_copy_still_arriving_says_so_and_changes_nothing(how: str) -> None:
    # Nothing counted protects the incoming copy: the error says a transfer is in the way
    # (not a lease to exit), and the removal works once the copy arrived.
    backend = SimBackend()
    gate = threading.Event()
    async with ResidencyManager(backend=backend) as m:
        data = random_tensor()
        h = m.register(data.clone(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        backend._devices[0].h2d.submit(lambda: gate.wait(10))  # the copy waits behind this
        try:
            arriving = m.materialize_nowait(h, "cuda:0")
            version = m.state_version
            with pytest.raises(ResidencyInUseError) as info:
                if how == "release":
                    await m.release(h, "cuda:0")
                else:
                    m.release_nowait(h, "cuda:0")
        finally:
            gate.set()
        error = info.value
        assert error.transfer == "incoming" and str(error.location) == "cuda:0"
        assert (error.use_count, error.hold_count, error.pending_event_count) == (0, 0, 0)
        assert "still arriving" in str(error) and "exit the lease" not in str(error)
        assert error.to_dict()["transfer"] == "incoming"
        assert m.state_version == version
        await arriving
        assert torch.equal(m.tensor(h, "cuda:0"), data)
        await m.release(h, "cuda:0")
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host"]


async def test_reconstruction_charges_source_location_temporarily() -> None:
    data = random_tensor()
    async with ResidencyManager(budgets={"pageable-host": 1 * MiB}, backend="sim") as m:
        src = CallableSource(lambda: data.clone(), shape=data.shape, dtype=data.dtype)
        h = m.register_source(src, name="w")
        assert m.snapshot().value(h).recoverability == "reconstructible"
        await m.materialize(h, "cuda:0")
        snap = m.snapshot()
        assert [str(x) for x in snap.value(h).locations] == ["cuda:0"]
        assert snap.location("pageable-host").used_bytes == 0
        assert snap.location("pageable-host").peak_bytes == 16384  # the temporary load
        async with m.acquire(h, "cuda:0") as lease:
            assert torch.equal(lease.tensor.cpu(), data)
        # A value with a source may lose every materialization and be rebuilt.
        await m.release(h, "cuda:0")
        assert m.snapshot().value(h).locations == ()
        await m.materialize(h, "cuda:1")
        assert [str(x) for x in m.snapshot().value(h).locations] == ["cuda:1"]


async def test_a_load_that_returns_a_view_keeps_no_more_memory_than_the_value_is_charged() -> None:
    # load() returns a slice of a larger scratch tensor: the rebuilt value at pageable-host
    # must not keep that whole storage alive behind its 1 KiB charge (the budget would lie).
    async with ResidencyManager(budgets={"pageable-host": 1 * MiB}, backend="sim") as m:
        src = CallableSource(
            lambda: torch.arange(1 << 20, dtype=torch.float32)[256:512],
            shape=(256,),
            dtype=torch.float32,
        )
        h = m.register_source(src, name="row")
        await m.materialize(h, "pageable-host")
        tensor = m.tensor(h, "pageable-host")
        assert torch.equal(tensor, torch.arange(256, 512, dtype=torch.float32))
        kept = tensor.untyped_storage().nbytes()
        assert kept <= m.snapshot().value(h).charge_bytes, kept


async def test_reconstruction_is_refused_when_source_location_budget_is_too_small() -> None:
    data = random_tensor()
    async with ResidencyManager(budgets={"pageable-host": 8192}, backend="sim") as m:
        src = CallableSource(lambda: data.clone(), shape=data.shape, dtype=data.dtype)
        h = m.register_source(src, name="w")
        version = m.state_version
        with pytest.raises(ResidencyBudgetError) as info:
            await m.materialize(h, "cuda:0")
        assert str(info.value.location) == "pageable-host"
        assert m.state_version == version


async def test_value_ids_count_values_only_not_copies() -> None:
    """Value ids shared a counter with copy tickets: with a copy between registrations, the
    fifth value printed as '#9'. Values count on their own (1, 2, 3... in registration
    order, never reused after a discard, so handles stay unique per manager); copies, loads
    and moves in between take none of them."""
    async with ResidencyManager(backend="sim") as m:
        handles = []
        for i in range(6):
            if i == 2:
                source = CallableSource(lambda: torch.ones(16), shape=(16,), dtype=torch.float32)
                handle = m.register_source(source, name=f"v{i}")
            else:
                handle = m.register(torch.zeros(16), name=f"v{i}")
            await m.materialize(handle, "cuda:0")  # a copy (a load for v2) between each
            await m.move(handle, "pinned-host")
            handles.append(handle)
            if i == 3:
                await m.discard(handle)  # its id is not given again
        assert [h.value_id for h in handles] == [1, 2, 3, 4, 5, 6]
        assert str(handles[4]) == "value v4 (#5)"
        assert len(set(handles)) == 6
        assert sorted(h.value_id for h in m.snapshot().values) == [1, 2, 3, 5, 6]


class GoneFile:
    """A source (the protocol, not a CallableSource) whose file is gone: ``load()`` raises
    the same ``OSError`` each time."""

    shape = (4,)
    dtype = torch.float32
    source_location = Location("pageable-host")

    def __init__(self) -> None:
        self.error = FileNotFoundError("shard-00002.safetensors is gone")

    def load(self) -> torch.Tensor:
        raise self.error


@pytest.mark.parametrize("kind", ["callable", "protocol"])
async def test_a_source_whose_load_raises_keeps_its_exception_with_a_note_naming_the_value(
    kind: str,
) -> None:
    """A source's ``load()`` raised ``OSError``: a direct materialize surfaced it as it was,
    without saying which value it was rebuilding. It keeps its type (code catches it), with a
    note naming the value and the location it was being rebuilt at (once, however often the
    same exception is raised); a scope's execution error, which names the action, says the
    same; nothing changed."""
    gone = GoneFile()
    source = (
        gone if kind == "protocol" else CallableSource(gone.load, shape=(4,), dtype=torch.float32)
    )
    async with ResidencyManager(backend="sim") as m:
        h = m.register_source(source, name="w1")
        before = m.snapshot()
        for location in ("cuda:0", "cuda:0", "pinned-host"):
            with pytest.raises(FileNotFoundError, match="is gone") as info:
                await m.materialize(h, location)
            assert info.value is gone.error
            assert m.snapshot().value(h) == before.value(h)
        notes = [
            f"while rebuilding {h} at {where}: load() of its source {source!r} raised this "
            "FileNotFoundError"
            for where in ("cuda:0", "pinned-host")
        ]
        assert gone.error.__notes__ == notes  # one each, the latest rebuild's last
        with pytest.raises(ResidencyPlanExecutionError) as failed:
            async with m.scope(ResidencyPlan(enter=[Materialize(h, "cuda:0")])):
                pass
        assert failed.value.__cause__ is gone.error
        assert f"Materialize('w1', cuda:0): enter failed: {gone.error} ({notes[0]})" in str(
            failed.value
        )
        assert m.snapshot().value(h) == before.value(h)


async def test_cancelling_a_pending_operation_from_another_thread_fails_and_cancels_nothing() -> (
    None
):
    """PendingOperation.cancel() from a worker thread drove the run (its transfers, its
    phase generator, its listeners) on that thread and cancelled it. It is refused there now
    (RuntimeError, as its docstring says it works on the manager's loop), and the operation
    completes as if nothing was asked."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        gate = threading.Event()
        async with m.acquire(h, "cuda:0") as lease:
            m.backend.run_in_stream_order(lease.stream, lambda: gate.wait(10))  # a long kernel
        pending = m.release_nowait(h, "cuda:0")  # waits for that reader
        errors: list[BaseException] = []

        def other() -> None:
            try:
                pending.cancel()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=other)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        gate.set()
        assert [type(e) for e in errors] == [RuntimeError] and "event loop" in str(errors[0])
        await pending  # not cancelled: the release went through
        assert not pending.cancelled()
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host"]


async def test_a_call_from_another_thread_is_told_to_use_the_bridge() -> None:
    """The refusal of a call from a plain thread names the way back to the loop the docs give,
    ``manager.bridge`` (it named anyio.from_thread.run, which a thread anyio did not start
    cannot use, and asyncio.run_coroutine_threadsafe, which trio has not), and that way
    works."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        errors: list[BaseException] = []

        def other() -> None:
            try:
                m.hold(h, "pageable-host")
            except BaseException as e:
                errors.append(e)
            m.bridge.run_async(m.move, h, "cuda:0")

        thread = threading.Thread(target=other)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert [type(e) for e in errors] == [RuntimeError]
        assert "manager.bridge.call_soon" in str(errors[0])
        assert "manager.bridge.run_async" in str(errors[0])
        assert [str(x) for x in m.snapshot().value(h).locations] == ["cuda:0"]


@pytest.mark.parametrize(
    ("shape", "error", "match"),
    [
        ((2.5,), TypeError, r"dimension 2.5 \(float\) that is not an int"),  # was (2,)
        ((True, 4), TypeError, "bool dimension"),  # was (1, 4)
        ("34", TypeError, "sequence of ints"),  # was (3, 4)
        (5, TypeError, "sequence of ints"),  # was "'int' object is not iterable"
        ((2, "3"), TypeError, r"dimension '3' \(str\)"),  # was (2, 3)
        ((-1,), ValueError, "negative dimension"),
    ],
)
def test_a_callable_source_refuses_a_shape_that_is_not_ints_naming_it(
    shape: object, error: type[Exception], match: str
) -> None:
    """CallableSource truncated or parsed what is not a shape (int(2.5), int(True), the
    characters of a string): the value was declared with another shape than asked and the
    load failed later with a shape mismatch, or the error named no shape at all."""
    with pytest.raises(error, match=match):
        CallableSource(lambda: torch.zeros(4), shape=shape, dtype=torch.float32)  # type: ignore[arg-type]
    size = CallableSource(lambda: torch.zeros(2, 3), shape=torch.Size([2, 3]), dtype=torch.float32)
    assert size.shape == (2, 3)
    assert CallableSource(lambda: torch.zeros(2), shape=[2], dtype=torch.float32).shape == (2,)


async def _load_async() -> torch.Tensor:
    return torch.zeros(4)


def test_a_callable_source_refuses_an_async_load_when_it_is_made() -> None:
    """``CallableSource(async_load, ...)`` was accepted; the load, called in a worker thread,
    returned a coroutine that nobody awaited, and every materialize failed later with
    "load() returned coroutine". It is refused when the source is made, saying why."""
    with pytest.raises(TypeError, match=r"coroutine function.*worker thread"):
        CallableSource(_load_async, shape=(4,), dtype=torch.float32)
    with pytest.raises(TypeError, match="coroutine function"):
        CallableSource(functools.partial(_load_async), shape=(4,), dtype=torch.float32)


async def test_discard_frees_everything_and_the_handle_is_then_refused() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        await m.discard(h)
        snap = m.snapshot()
        assert h not in snap.values  # a discarded value leaves the state
        assert snap.location("cuda:0").used_bytes == 0
        with pytest.raises(ResidencyUnavailableError, match="discarded"):
            await m.move(h, "cuda:1")


async def test_handle_of_another_manager_is_refused() -> None:
    async with ResidencyManager(backend="sim") as m1, ResidencyManager(backend="sim") as m2:
        h = m1.register(random_tensor(), name="w")
        with pytest.raises(ResidencyUnavailableError, match="belongs to manager"):
            await m2.move(h, "cuda:0")


async def test_calls_from_another_thread_fail_clearly() -> None:
    async with ResidencyManager(backend="sim") as m:
        errors: list[BaseException] = []

        def other() -> None:
            try:
                m.snapshot()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=other)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
        assert "event loop" in str(errors[0])


async def test_ending_a_hold_or_lease_from_another_thread_fails_clearly_and_changes_nothing() -> (
    None
):
    """hold.release() from a worker thread used to unhold on that thread: a mutation of the
    loop's state off the loop (a transition and a new state_version from another thread), and
    lease.exit_nowait() would do the same. Both are refused there now, before anything
    changes; the hold and the lease stay active and end normally on the loop."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        hold = m.hold(h, "pageable-host")
        lease = m.acquire(h, "pageable-host").enter_nowait()
        before = m.snapshot()
        errors: list[BaseException] = []

        def other() -> None:
            for end in (hold.release, lease.exit_nowait):
                try:
                    end()
                except BaseException as e:
                    errors.append(e)

        thread = threading.Thread(target=other)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert [type(e) for e in errors] == [RuntimeError, RuntimeError]
        assert all("event loop" in str(e) for e in errors)
        assert m.snapshot() == before and hold.active and lease.status == "entered"
        record = m.snapshot().value(h).materialization("pageable-host")
        assert record is not None and (record.use_count, record.hold_count) == (1, 1)
        assert lease.exit_nowait() is None
        hold.release()
        record = m.snapshot().value(h).materialization("pageable-host")
        assert record is not None and (record.use_count, record.hold_count) == (0, 0)


async def test_tenant_hooks_from_another_thread_fail_clearly_and_change_nothing() -> None:
    """reclaimable_changed() and the functions that remove a change listener or a reclaimer
    change lists the loop owns: from another thread they are refused, like every other call,
    and the listener and the reclaimer stay; on the loop they work, after close too."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        heard: list[int] = []
        asked: list[tuple[Location, int]] = []

        def reclaimer(location: Location, nbytes: int) -> int:
            asked.append((location, nbytes))
            return 0

        remove_listener = m.add_change_listener(lambda: heard.append(threading.get_ident()))
        remove_reclaimer = m.add_reclaimer(reclaimer)
        stop_wanting = m.want_room("cuda:0")
        heard.clear()
        before = m.snapshot()
        errors: list[BaseException] = []

        def other() -> None:
            calls = (
                remove_listener,
                remove_reclaimer,
                m.reclaimable_changed,
                stop_wanting,
                lambda: m.waiting_for_room("cuda:0"),
            )
            for call in calls:
                try:
                    call()
                except BaseException as e:
                    errors.append(e)

        thread = threading.Thread(target=other)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert [type(e) for e in errors] == [RuntimeError] * 5
        assert all("event loop" in str(e) for e in errors)
        assert m.snapshot() == before and heard == [] and m.waiting_for_room("cuda:0")
        stop_wanting()
        assert not m.waiting_for_room("cuda:0")
        await m.move(h, "pinned-host")  # the listener still hears, on the loop's thread
        assert heard and set(heard) == {threading.get_ident()}
        m.reclaim("cuda:0", 1024)  # the reclaimer is still asked
        assert asked == [(Location.parse("cuda:0"), 1024)]
        m.reclaimable_changed()
        remove_reclaimer()
    remove_listener()  # on the loop's thread, after close: fine
    remove_reclaimer()
    m.reclaimable_changed()


async def test_a_lease_s_stream_or_a_done_callback_from_another_thread_is_refused() -> None:
    """lease.register_stream() and pending.add_done_callback() change what the loop owns (the
    streams the lease's exit records events on; the run's callbacks, or a callback run at once
    on the calling thread): from another thread both are refused and nothing is added."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        stream = m.backend.new_stream("cuda:0")  # type: ignore[attr-defined]
        compute = m.backend.current_stream("cuda:0")
        # Another value's copy, so that its events never count on w's cuda:0 record.
        other_value = m.register(random_tensor(), name="other")
        pending = m.materialize_nowait(other_value, "cuda:0")
        called: list[object] = []
        errors: list[BaseException] = []
        async with m.acquire(h, "cuda:0", stream=stream) as lease:

            def other() -> None:
                for call in (
                    lambda: lease.register_stream(compute),
                    lambda: pending.add_done_callback(called.append),
                ):
                    try:
                        call()
                    except BaseException as e:
                        errors.append(e)

            thread = threading.Thread(target=other)
            thread.start()
            await anyio.to_thread.run_sync(thread.join)
            stream.sleep(0.1)
            compute.sleep(0.1)  # were it registered, its event would be pending too
        assert [type(e) for e in errors] == [RuntimeError, RuntimeError]
        assert all("event loop" in str(e) for e in errors)
        record = m.snapshot().value(h).materialization("cuda:0")
        assert record is not None and record.pending_event_count == 1  # the lease's own
        await pending.wait()
        assert called == []
        pending.add_done_callback(called.append)  # on the loop: called at once (it is done)
        assert called == [pending]


async def test_a_reservation_block_and_the_live_state_say_what_they_are_in_their_repr() -> None:
    """``repr(manager.reservation(...))`` and ``repr(manager.state)`` were Python's default
    (``<aresidency.runtime.manager._SingleUse object at 0x...>``): in a debugger or a log line
    they named a private class and nothing else."""
    async with ResidencyManager(backend="sim", budgets={"cuda:0": "1MiB"}) as m:
        block = m.reservation("workspace", "cuda:0", "64KiB")
        assert repr(block) == "<manager.reservation('workspace', 'cuda:0', 65536 B) new>"
        async with block:
            assert repr(block).endswith(" entered>")
        assert repr(block).endswith(" exited>")
        m.register(random_tensor(), name="w")
        assert repr(m.state) == (
            f"<ResidencyState of manager {m.id} v{m.state_version} [1 values, 4 locations]>"
        )


def test_a_manager_not_yet_entered_cannot_be_copied_or_pickled() -> None:
    """A copy (or a pickle loaded back) of a manager had the same id, so each accepted the
    other's handles as its own. Refused, saying what to do instead."""
    m = ResidencyManager(backend="sim", budgets={"cuda:0": "1MiB"})
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="ResidencyManager cannot be copied or pickled"):
            copier(m)


async def test_live_runtime_objects_cannot_be_copied_or_pickled_and_stay_whole() -> None:
    """``copy.copy`` of a running manager shared its runtime: closing the copy closed the
    original's and broke its task group (its own exit then raised anyio's ``AttributeError``).
    A copied hold or lease ended the same hold or lease twice (the second end took another's
    hold, or raised an internal ``ValueError``). Each refuses to be copied or pickled now,
    and the original goes on as it was."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        pending = m.materialize_nowait(h, "cuda:0")
        hold = m.hold(h, "pageable-host")
        lease = m.acquire(h, "pageable-host")
        scope = m.scope(ResidencyPlan(enter=[Materialize(h, "cuda:1")]))
        live = {
            "ResidencyManager": m,
            "Hold": hold,
            "Lease": lease,
            "Scope": scope,
            "PendingOperation": pending,
        }
        before = m.snapshot()
        for name, obj in live.items():
            for copier in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match=f"{name} cannot be copied or pickled"):
                    copier(obj)
        assert m.snapshot() == before
        await pending
        async with lease, scope:
            pass
        hold.release()
        record = m.snapshot().value(h).materialization("pageable-host")
        assert record is not None and (record.use_count, record.hold_count) == (0, 0)
        assert m.snapshot().value(h).locations == (
            Location("pageable-host"),
            Location("cuda:0"),
            Location("cuda:1"),
        )


async def test_unknown_cuda_device_is_a_clear_error() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        with pytest.raises(ValueError, match="cuda:7"):
            await m.move(h, "cuda:7")


async def test_failed_copy_leaves_source_intact_and_ledger_as_it_was() -> None:
    async with ResidencyManager(backend="sim") as m:
        t = random_tensor()
        expected = checksum(t)
        h = m.register(t, name="w")
        await m.move(h, "pinned-host")
        before, before_ledger = m.snapshot(), ledger(m)
        m.backend.faults.fail_transfer_at = 1
        with pytest.raises(RuntimeError, match="injected"):
            await m.move(h, "cuda:0")
        assert ledger(m) == before_ledger
        assert m.snapshot().value(h) == before.value(h)
        async with m.acquire(h, "pinned-host") as lease:
            assert checksum(lease.tensor) == expected


async def test_out_of_memory_at_allocation_leaves_everything_as_it_was() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        before, before_ledger = m.snapshot(), ledger(m)
        m.backend.faults.oom_at_allocation = 1
        with pytest.raises(torch.OutOfMemoryError):
            await m.move(h, "cuda:0")
        assert ledger(m) == before_ledger
        assert m.snapshot().value(h) == before.value(h)


async def test_snapshot_and_trace_report_state_and_overwrites() -> None:
    async with ResidencyManager(backend="sim", trace_capacity=4) as m:
        h = m.register(random_tensor(), name="w")
        await m.move(h, "cuda:0")
        await m.move(h, "pinned-host")
        trace = m.trace()
        assert trace.enabled and trace.capacity == 4 and len(trace.transitions) == 4
        assert trace.overwritten == trace.transitions[0].seq - 1
        assert trace.transitions[-1].state_version == m.state_version
    async with ResidencyManager(backend="sim", trace_capacity=0) as m:
        m.register(random_tensor(), name="w")
        assert not m.trace().enabled and m.trace().transitions == ()


# The comparison snapshots (``m.snapshot()`` of 3,000 values, synchronous by design) take over
# 100 ms on a slow 2-core machine: the guard would flag the test's own check, not the product.
@pytest.mark.allow_loop_stall
async def test_snapshot_async_never_blocks_the_loop_and_equals_snapshot() -> None:
    """The first snapshot of many values builds every record; ``snapshot_async`` builds them in
    slices, letting the loop run between them (a ticker task keeps running), and its snapshot
    is atomic: equal to ``snapshot()`` taken right after, values changed meanwhile included."""
    async with ResidencyManager(budgets={"cuda:0": 1 << 30}, backend="sim") as m:
        handles = [m.register(torch.zeros(4), name=f"v{i}") for i in range(3000)]
        ticks = 0
        stop = anyio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            await m.discard(handles[0])  # a change before the snapshot begins
            before = ticks
            snap = await m.snapshot_async(slice_seconds=0.0002)
            sliced = ticks - before
            stop.set()
        assert sliced > 1, "the loop ran between the slices"
        assert snap == m.snapshot()
        assert len(snap.values) == 2999 and handles[0] not in snap.values
        # Changed values are redone: a value discarded after the first slice is absent too.
        await m.materialize(handles[1], "cuda:0")
        again = await m.snapshot_async(slice_seconds=0.0002)
        assert Location.parse("cuda:0") in again.value(handles[1]).locations
        assert again == m.snapshot()


async def test_snapshot_async_refuses_a_bad_slice() -> None:
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(ValueError, match="slice_seconds"):
            await m.snapshot_async(slice_seconds=float("nan"))


@pytest.mark.parametrize("name", ["", " ", "\t\n "], ids=["empty", "space", "whitespace"])
@pytest.mark.parametrize("how", ["register", "register_at", "register_source"])
async def test_a_blank_value_name_is_refused_and_registers_nothing(name: str, how: str) -> None:
    """A value is named in errors, snapshots and traces: a blank name is refused, as a
    MemoryReservation's is, before anything is copied or charged; None still derives one."""
    async with ResidencyManager(backend="sim", budgets={"pinned-host": 1 * MiB}) as m:
        before = m.snapshot()
        source = CallableSource(lambda: torch.zeros(16), shape=(16,), dtype=torch.float32)
        with pytest.raises(ValueError, match="non-blank name .*got " + re.escape(repr(name))):
            if how == "register":
                m.register(torch.zeros(16), name=name)
            elif how == "register_at":
                m.register(torch.zeros(16), name=name, location="pinned-host")
            else:
                m.register_source(source, name=name)
        assert m.snapshot() == before
        with pytest.raises(TypeError, match="name must be a str"):
            m.register(torch.zeros(16), name=7)  # type: ignore[arg-type]
        assert m.snapshot() == before
        derived = [m.register(torch.zeros(16)), m.register_source(source)]
        assert all(h.name.strip() for h in derived)
        assert m.register(torch.zeros(16), name=" w ").name == " w "  # kept as given


def test_a_blank_reservation_or_request_name_is_refused_like_a_value_name() -> None:
    from aresidency import MemoryReservation, ResidencyRequest

    for name in ("", "  "):
        with pytest.raises(ValueError, match="non-blank str name"):
            MemoryReservation(name, "cuda:0", 1024)
        with pytest.raises(ValueError, match="non-blank str name"):
            ResidencyRequest(name)


@pytest.mark.parametrize("backend", ["gpu", "CUDA", None, 3, torch.zeros(2)])
def test_an_unknown_backend_is_refused_where_the_manager_is_made(backend: object) -> None:
    """It was accepted, and refused only by the ``async with`` that starts the manager."""
    with pytest.raises(ValueError, match="backend must be 'auto', 'cuda', 'sim' or a Backend"):
        ResidencyManager(backend=backend)


_LOOPS = [pytest.param(asyncio.new_event_loop, id="asyncio")]
if uvloop is not None:
    _LOOPS.append(pytest.param(uvloop.new_event_loop, id="uvloop"))


@pytest.mark.timeout(60)  # the old behaviour: a wait for ever, which no cancellation ended
@pytest.mark.parametrize("new_loop", _LOOPS)
def test_a_call_from_another_event_loop_of_the_same_thread_fails_clearly(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """A manager entered on one loop and used from another loop of the same thread (a second
    ``asyncio.run()``, a notebook's loop beside the script's) passed the thread check: the
    copy's completion went to the manager's loop, which was not running, and ``await
    manager.move(...)`` waited for ever. It is refused at once now, before anything changes,
    and the manager goes on on its own loop."""
    own, other = new_loop(), new_loop()
    m = ResidencyManager(backend="sim")
    made: list[tuple[ValueHandle, Hold]] = []

    async def life(ready: asyncio.Event, go: asyncio.Event) -> None:
        async with m:
            h = m.register(random_tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
            made.append((h, m.hold(h, "pageable-host")))
            ready.set()
            await go.wait()  # the other loop runs meanwhile; this one does not
            made[0][1].release()
            await m.materialize(h, "cuda:0")
            locations = m.snapshot().value(h).locations
            assert locations == (Location("pageable-host"), Location("cuda:0"))

    async def use(call: Callable[[], Awaitable[object]]) -> object:
        return await call()

    try:
        ready, go = asyncio.Event(), asyncio.Event()
        lived = own.create_task(life(ready, go))
        own.run_until_complete(ready.wait())
        (h, hold), version = made[0], m.state_version
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: m.materialize(h, "cuda:0"),
            lambda: m.release(h, "pageable-host"),
            lambda: anyio.sleep(0, m.snapshot()),
            lambda: anyio.sleep(0, hold.release()),
        ]
        for call in calls:
            with pytest.raises(RuntimeError, match="belongs to the event loop") as caught:
                other.run_until_complete(use(call))
            assert "asyncio.run" in str(caught.value)
        with pytest.raises(RuntimeError, match="belongs to the event loop"):
            m.register(random_tensor(), name="x")  # no loop runs at all
        assert m.state_version == version and hold.active
        go.set()
        own.run_until_complete(lived)
    finally:
        own.close()
        other.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("new_loop", _LOOPS)
def test_a_manager_entered_and_exited_by_different_tasks_closes_cleanly(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """pytest-asyncio runs an async generator fixture's setup and teardown in two tasks (as
    do a notebook's cells, and an ``AsyncExitStack`` closed by another task). The manager's
    background task group lived in the entering task, so the teardown's exit raised anyio's
    ``RuntimeError: Attempted to exit cancel scope in a different task than it was entered
    in`` after half a close; docs/testing.md told pytest-asyncio users to do exactly that. On
    asyncio the group lives in a task of its own now, and the exit is a plain close."""
    loop = new_loop()

    async def fixture() -> AsyncIterator[ResidencyManager]:
        async with ResidencyManager(backend="sim", budgets={"cuda:0": "1MiB"}) as m:
            yield m

    try:
        made = fixture()
        m = loop.run_until_complete(made.__anext__())  # the setup: a task of its own

        async def test() -> None:  # the test: another task
            h = m.register(random_tensor(), name="w")
            await m.move(h, "cuda:0")
            async with m.acquire(h, "cuda:0") as lease:
                assert torch.equal(lease.tensor, random_tensor())

        loop.run_until_complete(test())

        async def teardown() -> None:  # a third task
            with pytest.raises(StopAsyncIteration):
                await made.__anext__()

        loop.run_until_complete(teardown())
        assert not m.running and "closed" in repr(m)
        with pytest.raises(ManagerClosedError):
            m.register(random_tensor(seed=1), name="x")
    finally:
        loop.close()


@pytest.mark.skipif(trio is None, reason="needs trio")
def test_on_trio_an_exit_by_another_task_is_refused_before_anything_closes() -> None:
    """On trio the manager's task group stays in the entering task (a system task's error
    would end the whole run), so an exit by another task cannot close it: it is refused at
    once with a sentence saying so, and the entering task still closes the manager. (It ran
    half a close, then trio's nursery, left by the wrong task, broke the run. ``trio.run``
    here rather than anyio's test runner, which waited for ever for that broken run.)"""
    m = ResidencyManager(backend="sim")
    errors: list[BaseException] = []

    async def scenario() -> None:
        entered, refused = anyio.Event(), anyio.Event()

        async def owner() -> None:
            async with m:
                entered.set()
                await refused.wait()
                h = m.register(random_tensor(), name="w")
                await m.move(h, "cuda:0")  # still running

        async def other() -> None:
            await entered.wait()
            try:
                await m.__aexit__(None, None, None)
            except BaseException as error:  # what it raised is checked below
                errors.append(error)
            finally:
                refused.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(owner)
                tasks.start_soon(other)

    trio.run(scenario)
    assert [type(e) for e in errors] == [RuntimeError]
    assert "exited by the task that entered it" in str(errors[0])
    assert not m.running


@pytest.mark.parametrize("new_loop", _LOOPS)
def test_leaving_the_manager_from_another_loop_or_thread_is_refused_before_anything_closes(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """``__aexit__`` skipped the loop check every other call makes: called from another loop
    of the thread (or another thread) it began the close, then waited for ever for work
    whose completions go to the manager's own loop. It is refused at once now, the manager
    running as before, and its own loop closes it."""
    own, other = new_loop(), new_loop()
    m = ResidencyManager(backend="sim")

    async def enter() -> None:
        await m.__aenter__()
        m.register(random_tensor(), name="w")

    try:
        own.run_until_complete(enter())
        closing = other.create_task(m.__aexit__(None, None, None))
        other.run_until_complete(asyncio.wait([closing], timeout=10))
        assert closing.done(), "the close from another loop waits"
        with pytest.raises(RuntimeError, match="belongs to the event loop"):
            closing.result()
        errors: list[BaseException] = []

        def in_a_thread() -> None:
            try:
                asyncio.run(m.__aexit__(None, None, None))
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=in_a_thread, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the close from another thread waits"
        assert [type(e) for e in errors] == [RuntimeError]
        assert "event loop's thread" in str(errors[0])
        assert m.running

        async def close() -> None:
            h = next(iter(m.snapshot().values))
            await m.move(h, "cuda:0")  # still running on its own loop
            await m.__aexit__(None, None, None)

        own.run_until_complete(close())
        assert not m.running
    finally:
        own.close()
        other.close()


async def test_cancel_of_a_pending_operation_says_whether_it_asked() -> None:
    """``pending.cancel()`` returns, as ``Future.cancel`` does, whether it asked for the
    cancellation: ``True`` while the copy is in flight, ``False`` asked again or once the
    operation finished (it returned ``None`` whatever happened)."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(random_tensor(), name="w")
        gate = threading.Event()
        m.backend.device_streams(0).h2d.submit(lambda: gate.wait(10))  # holds the copy back
        pending = m.materialize_nowait(h, "cuda:0")
        assert pending.cancel() is True
        assert pending.cancel() is False  # asked already
        gate.set()
        await pending.wait_settled()
        assert pending.cancelled() and pending.cancel() is False
        assert [str(x) for x in m.snapshot().value(h).locations] == ["pageable-host"]
        done = m.materialize_nowait(h, "cuda:0")
        await done
        assert done.cancel() is False and not done.cancelled()
