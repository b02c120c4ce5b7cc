"""The promises under cancellation, concurrency and bad input, one test per way they broke:
no garbage read, no hang, no leak, a designed error for every mistake (on the simulated
backend: a simulation of CUDA devices in host memory, whose released or unfilled memory holds
poison)."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from _holders import held_by_another_task

from aresidency import (
    CallableSource,
    Location,
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
    ResidencySnapshot,
    ResidencyUnavailableError,
    diagnose,
)
from aresidency.backends import SimBackend, is_poisoned
from aresidency.runtime import ManagerClosedError

pytestmark = pytest.mark.anyio

KiB = 1 << 10


def tensor(n: int = 4096, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def checksum(t: torch.Tensor) -> float:
    return float(t.double().sum())


def quiet(m: ResidencyManager) -> None:
    """Nothing leased, held, read, reserved (but the backend's) or in flight."""
    snap = m.snapshot()
    for value in snap.values.values():
        for record in value.materializations:
            assert record.use_count == record.hold_count == record.pending_event_count == 0
            assert record.state.value == "resident", (value.name, record)
    for record in snap.locations.values():
        assert record.reserved_bytes == 0 or record.location.kind == "pinned-host"
    assert m.waiting == 0
    m.state.check_invariants()


async def settle(m: ResidencyManager) -> None:
    """Wait (on conditions) until no transfer is in flight and no reader event pending."""
    while any(
        record.state.value != "resident" or record.pending_event_count
        for value in m.snapshot().values.values()
        for record in value.materializations
    ):
        await m.wait_for_change(5)


# ---------------------------------------------------------------- data


async def test_a_cancelled_wait_on_materialize_nowait_leaves_nothing_incoming() -> None:
    async with ResidencyManager(
        budgets={"cuda:0": 16 * KiB}, backend=SimBackend(copy_gbps=0.01)
    ) as m:
        h = m.register(tensor(), name="w")
        pending = m.materialize_nowait(h, "cuda:0")  # 16 KiB at 10 MB/s: ~1.6 ms
        with anyio.move_on_after(0):
            await pending
        await pending.wait_settled()
        assert pending.done()
        assert [str(loc) for loc in m.snapshot().value(h).locations] == ["pageable-host"]
        quiet(m)
        # Nothing stuck: the room it took is free again.
        other = m.register(tensor(seed=1), name="other")
        await m.move(other, "cuda:0")
        quiet(m)


async def test_a_lease_on_an_incoming_copy_keeps_it_when_its_requester_is_cancelled() -> None:
    backend = SimBackend(copy_gbps=0.005)  # 16 KiB: ~3 ms
    async with ResidencyManager(backend=backend) as m:
        data = tensor()
        h = m.register(data.clone(), name="w")
        pending = m.materialize_nowait(h, "cuda:0")
        stream = m.backend.current_stream("cuda:0")
        async with m.acquire(h, "cuda:0", stream=stream) as lease:
            seen: list[float] = []
            view = lease.tensor
            # The reader runs on the lease's stream, after the copy (as a kernel would).
            backend.run_in_stream_order(stream, lambda: seen.append(checksum(view)))
            pending.cancel()  # the requester goes away while the lease reads the copy
        await pending.wait_settled()
        assert pending.exception() is None  # completed, not aborted: a lease was reading it
        await m.backend.wait(m.backend.record_event(stream))
        assert seen == [checksum(data)]
        await settle(m)
        assert [str(loc) for loc in m.snapshot().value(h).locations] == ["cuda:0"]
        quiet(m)


async def test_a_copy_read_by_a_lease_that_exited_still_arrives_when_its_requester_goes() -> None:
    # The lease's kernels were enqueued after the copy and the lease has exited (its reader
    # event pending): cancelling the requester must not cancel the copy they read.
    backend = SimBackend()
    async with ResidencyManager(backend=backend) as m:
        data = tensor()
        h = m.register(data.clone(), name="w")
        gate = threading.Event()
        backend.device_streams(0).h2d.submit(lambda: gate.wait(10))  # holds up the copy
        try:
            pending = m.materialize_nowait(h, "cuda:0")
            stream = m.backend.current_stream("cuda:0")
            seen: list[float] = []
            lease = m.acquire(h, "cuda:0", stream=stream)
            lease.enter_nowait()  # the copy is enqueued: its stream waits for it on the device
            view = lease.tensor
            backend.run_in_stream_order(stream, lambda: seen.append(checksum(view)))
            assert lease.exit_nowait() is None  # the use ended; its reader event is pending
            record = m.snapshot().value(h).materialization("cuda:0")
            assert (record.state.value, record.use_count) == ("incoming", 0)
            assert record.pending_event_count == 1
            pending.cancel()  # the requester goes away while the reader waits for the copy
        finally:
            gate.set()
        await pending.wait_settled()
        assert pending.exception() is None  # completed, not aborted: its reader needs it
        assert lease.failure() is None
        await m.backend.wait(m.backend.record_event(stream))
        assert seen == [checksum(data)]
        await settle(m)
        assert [str(loc) for loc in m.snapshot().value(h).locations] == ["cuda:0"]
        quiet(m)


async def test_a_lease_released_ends_its_use_at_once_and_only_once() -> None:
    # lease.release(): the use ends there (its block's end then does nothing more), so the
    # materialization can be dropped; a second release is refused; a release after the
    # manager closed says so, and the use has ended all the same.
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        async with m.acquire(h, "cuda:0") as lease:
            assert m.snapshot().value(h).materialization("cuda:0").use_count == 1
            lease.release()
            assert m.snapshot().value(h).materialization("cuda:0").use_count == 0
            assert lease.status == "exited"
            with pytest.raises(RuntimeError, match="the lease is exited, not entered"):
                lease.release()
        await m.release(h, "cuda:0")  # nothing protects it any more
        assert [str(loc) for loc in m.snapshot().value(h).locations] == ["pageable-host"]
        never = m.acquire(h, "pageable-host")
        with pytest.raises(RuntimeError, match="not entered"):
            never.release()
        late = m.acquire(h, "pageable-host").enter_nowait()
    with pytest.raises(ManagerClosedError, match="closed while the read lease on value w"):
        late.release()
    assert late.status == "exited"


async def test_a_lease_entered_on_a_copy_that_fails_says_so_at_exit() -> None:
    backend = SimBackend(copy_gbps=0.005)
    async with ResidencyManager(backend=backend) as m:
        h = m.register(tensor(), name="w")
        backend.faults.fail_transfer_at = 1
        pending = m.materialize_nowait(h, "cuda:0")
        stream = m.backend.current_stream("cuda:0")
        with pytest.raises(ResidencyUnavailableError, match="was not the value"):
            async with m.acquire(h, "cuda:0", stream=stream) as lease:
                view = lease.tensor
                poisoned: list[bool] = []
                backend.run_in_stream_order(
                    stream, lambda: poisoned.append(bool(is_poisoned(view).any()))
                )
        await pending.wait_settled()
        assert isinstance(pending.exception(), RuntimeError)
        await m.backend.wait(m.backend.record_event(stream))
        assert poisoned == [True]  # what it read was garbage: the exit said so
        await settle(m)
        assert [str(loc) for loc in m.snapshot().value(h).locations] == ["pageable-host"]
        quiet(m)


def cuda0(m: ResidencyManager, h: Any) -> tuple[int, list[str]]:
    """cuda:0's charged bytes, and the states of ``h``'s materialization there (if any)."""
    snap = m.snapshot()
    states = [r.state.value for r in snap.value(h).materializations if str(r.location) == "cuda:0"]
    return snap.location("cuda:0").charged_bytes, states


async def test_a_copy_failing_under_a_hold_is_reported_at_once_and_dropped_when_it_ends() -> None:
    """The task that holds the incoming copy awaits it: the copy's failure reaches it as soon
    as the copy failed (the hold cannot end while its owner waits, so waiting for the hold
    would never end); the failed destination stays charged, protected by the hold, and is
    dropped when the hold ends."""
    backend = SimBackend()
    async with ResidencyManager(backend=backend) as m:
        h = m.register(tensor(), name="w")
        backend.faults.fail_transfer_at = 1
        pending = m.materialize_nowait(h, "cuda:0")
        hold = m.hold(h, "cuda:0")
        with anyio.fail_after(5), pytest.raises(RuntimeError, match="injected transfer failure"):
            await pending
        assert pending.done() and isinstance(pending.exception(), RuntimeError)
        assert cuda0(m, h) == (4 * 4096, ["incoming"])  # still charged: the hold protects it
        assert m.held_tensor(h, "cuda:0") is None  # nothing there to read
        hold.release()
        assert cuda0(m, h) == (0, [])
        assert [str(loc) for loc in m.snapshot().value(h).locations] == ["pageable-host"]
        quiet(m)
        await m.materialize(h, "cuda:0")  # the value is intact: it goes there again
        assert torch.equal(m.tensor(h, "cuda:0"), tensor())


async def test_awaiting_a_failed_copy_inside_a_lease_on_it_raises_its_error() -> None:
    """A lease entered on the incoming copy, and the copy awaited inside it: the failure is
    raised there (not a wait for the lease to end, which the awaiting task itself ends)."""
    backend = SimBackend()
    async with ResidencyManager(backend=backend) as m:
        h = m.register(tensor(), name="w")
        backend.faults.fail_transfer_at = 1
        pending = m.materialize_nowait(h, "cuda:0")
        stream = backend.current_stream("cuda:0")
        with anyio.fail_after(5), pytest.raises(RuntimeError, match="injected transfer failure"):
            async with m.acquire(h, "cuda:0", stream=stream):
                await pending
        await settle(m)  # the lease's reader event passed: the destination is dropped
        assert cuda0(m, h) == (0, [])
        quiet(m)


async def test_closing_with_a_hold_on_a_copy_that_failed_does_not_wait_for_the_hold() -> None:
    """The manager closes while a hold protects a copy that failed: closing does not wait for
    the hold (nothing would end it); the hold's release afterwards changes nothing and says
    the manager closed. The same with the copy's operation awaited after the close."""
    backend = SimBackend()
    with anyio.fail_after(5):
        async with ResidencyManager(backend=backend) as m:
            h = m.register(tensor(), name="w")
            backend.faults.fail_transfer_at = 1
            pending = m.materialize_nowait(h, "cuda:0")
            hold = m.hold(h, "cuda:0")
            await pending.wait_settled()  # the copy failed (nobody awaited it with a timeout)
    assert isinstance(pending.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="injected transfer failure"):
        await pending
    with pytest.raises(ManagerClosedError, match="the hold on"):
        hold.release()


async def test_a_scope_whose_copy_fails_under_anothers_hold_fails_at_once() -> None:
    """A scope bringing two values in, one of whose copies fails while another task's hold
    protects it: the scope's entry fails with the copy's error right away, names the
    action, and the failed copy is dropped when the hold ends."""
    backend = SimBackend()
    async with ResidencyManager(backend=backend) as m:
        a = m.register(tensor(seed=1), name="a")
        b = m.register(tensor(seed=2), name="b")
        backend.faults.fail_transfer_at = 2
        entered = m.scope(ResidencyPlan(enter=[Materialize(a, "cuda:0"), Materialize(b, "cuda:0")]))
        holds: list[Any] = []

        def hold_incoming() -> None:  # the moment b's copy is begun, another holder holds it
            value = m.state.find_value(b)
            if (
                value is not None
                and not holds
                and any(str(loc) == "cuda:0" for loc in value.materializations)
            ):
                holds.append(m.hold(b, "cuda:0"))

        remove = m.add_change_listener(hold_incoming)
        with anyio.fail_after(5), pytest.raises(ResidencyPlanExecutionError) as failed:
            async with entered:
                pass
        remove()
        assert holds, "the hold was never made"
        assert "b" in str(failed.value) and "injected transfer failure" in str(failed.value)
        holds[0].release()
        await settle(m)
        assert [str(loc) for loc in m.snapshot().value(b).locations] == ["pageable-host"]
        quiet(m)


async def test_a_write_lease_stops_another_task_from_making_a_replica() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        async with m.acquire(h, "cuda:0", mode="write"):
            before = m.snapshot()
            with pytest.raises(ResidencyInUseError, match="write lease"):
                await m.materialize(h, "pinned-host")
            assert m.snapshot() == before
        await m.materialize(h, "pinned-host")  # after the write, a replica is fine
        quiet(m)


async def test_the_managers_own_storage_cannot_be_registered_again() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w")
        await m.move(h, "cuda:0")
        before = m.snapshot()
        with pytest.raises(ValueError, match="already belongs to"):
            m.register(m.tensor(h, "cuda:0"))
        with pytest.raises(ValueError, match="already belongs to"):
            m.register(m.tensor(h, "cuda:0")[10:20])  # a view shares the storage too
        assert m.snapshot() == before


async def test_a_source_must_load_into_host_memory() -> None:
    class DeviceSource:
        shape = (16,)
        dtype = torch.float32
        source_location = "cuda:0"

        def load(self) -> torch.Tensor:
            return torch.zeros(16)

    async with ResidencyManager(backend="sim") as m:
        before = m.snapshot()
        with pytest.raises(ValueError, match="host memory"):
            m.register_source(DeviceSource())
        assert m.snapshot() == before


class _Wrapper(torch.Tensor):
    """A wrapper subclass (as DTensor is): no storage of its own, it computes through
    ``__torch_dispatch__`` on the tensor it wraps."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        made = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )
        made.inner = inner
        return made  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.inner if isinstance(x, _Wrapper) else x

        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.quantize_per_tensor(torch.rand(8), 0.1, 0, torch.quint8),
        lambda: torch.nested.nested_tensor([torch.rand(2), torch.rand(3)]),
        lambda: torch.rand(4, 4).to_sparse(),
        lambda: torch.empty(8, device="meta"),
        lambda: torch.randn(4, dtype=torch.complex64).conj(),
        lambda: torch.randn(4, dtype=torch.complex64).conj().imag,
        lambda: _Wrapper(torch.zeros(8)),
    ],
    ids=["quantized", "nested", "sparse", "meta", "conj view", "negative view", "wrapper"],
)
async def test_tensors_that_cannot_be_copied_whole_are_refused(make: Any) -> None:
    async with ResidencyManager(backend="sim") as m:
        before = m.snapshot()
        with pytest.raises((TypeError, ValueError), match=r"cannot register a value: it is a"):
            m.register(make())
        with pytest.raises((TypeError, ValueError), match=r"cannot register value 'w': it is"):
            m.register(make(), name="w", location="cuda:0")
        assert m.snapshot() == before


async def test_a_wrapper_subclass_is_refused_naming_the_value_and_what_to_register() -> None:
    """A tensor subclass made with _make_wrapper_subclass (as DTensor is) has no memory of its
    own: register used to fail inside torch ("invalid python storage"), naming nothing. It is
    refused up front, as the loader refuses it in a batch; a subclass with memory of its own
    (a Parameter) is still taken."""
    async with ResidencyManager(backend="sim") as m:
        before = m.snapshot()
        with pytest.raises(TypeError) as info:
            m.register(_Wrapper(torch.zeros(8)), name="shard.0")
        message = str(info.value)
        assert "value 'shard.0'" in message and "_Wrapper" in message
        assert "no memory of its own" in message and "to_local()" in message
        assert m.snapshot() == before
        h = m.register(torch.nn.Parameter(torch.ones(8)), name="p")
        await m.materialize(h, "cuda:0")
        assert m.snapshot().value(h).locations == (Location.parse("cuda:0"),)


# ---------------------------------------------------------------- hangs


async def test_a_scope_blocked_by_values_nobody_protects_fails_at_once() -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")  # resident, unprotected
        b = m.register(tensor(seed=1), name="b")
        with pytest.raises(ResidencyPlanError, match="budget"):
            async with m.scope(ResidencyPlan(enter=[Move(b, "cuda:0")]), timeout=None):
                pass
        assert m.waiting == 0
        assert [str(x) for x in m.snapshot().value(a).locations] == ["cuda:0"]


async def test_a_scope_blocked_by_a_lease_waits_and_enters_when_it_ends() -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        entered = anyio.Event()
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])

        async def enter() -> None:
            async with m.scope(plan, timeout=None):
                entered.set()

        async with anyio.create_task_group() as tg:
            async with m.acquire(a, "cuda:0"):
                tg.start_soon(enter)
                await anyio.wait_all_tasks_blocked()  # queued (no transition marks it)
                assert m.waiting == 1
                assert not entered.is_set()  # the lease protects a: the scope waits
            with anyio.fail_after(5):
                await entered.wait()  # the lease ended: admitted
        quiet(m)


async def test_an_empty_plan_does_not_wait_behind_a_waiting_scope() -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        hold = m.hold(a, "cuda:0")
        async with anyio.create_task_group() as tg:
            plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])

            async def waiting_scope() -> None:
                async with m.scope(plan, timeout=5):
                    pass

            tg.start_soon(waiting_scope)
            await anyio.wait_all_tasks_blocked()  # queueing is no transition: wait for it parked
            assert m.waiting == 1
            with anyio.fail_after(1):
                async with m.scope(ResidencyPlan(), timeout=None):
                    pass  # admitted at once: it takes no room anyone waits for
                async with m.scope(
                    ResidencyPlan(reserve=[MemoryReservation("other", "cuda:1", KiB)])
                ):
                    pass  # nor does room on another device
            hold.release()
        quiet(m)


async def test_a_direct_operation_waits_behind_a_scope_short_of_its_room() -> None:
    async with ResidencyManager(budgets={"cuda:0": 32 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        c = m.register(tensor(seed=2), name="c")
        hold = m.hold(a, "cuda:0")
        order: list[str] = []
        async with anyio.create_task_group() as tg:

            async def scope_for_b_and_c() -> None:
                plan = ResidencyPlan(
                    reclaim=[Move(a, "pinned-host")],
                    enter=[Move(b, "cuda:0"), Move(c, "cuda:0")],
                )
                async with m.scope(plan, timeout=5):
                    order.append("scope")

            async def direct_move_of_a_fourth() -> None:
                d = m.register(tensor(seed=3), name="d")
                try:
                    await m.move(d, "cuda:0")
                    order.append("direct")
                except Exception as error:  # it may not fit once the scope entered
                    order.append(type(error).__name__)

            tg.start_soon(scope_for_b_and_c)
            await anyio.wait_all_tasks_blocked()  # queueing is no transition: wait for it parked
            assert m.waiting == 1
            tg.start_soon(direct_move_of_a_fourth)
            await anyio.wait_all_tasks_blocked()
            assert m.waiting == 2  # it queued behind the scope instead of taking room
            hold.release()
        assert order[0] == "scope"


async def test_a_timed_out_scope_says_why_it_waited() -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        a = m.register(tensor(), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])
        async with held_by_another_task(m, a, "cuda:0"):
            with pytest.raises(TimeoutError, match="protected by") as info:
                async with m.scope(plan, timeout=0.05):
                    pass
        assert ": feasible" not in str(info.value)  # the reason it waited, not a stale verdict
        quiet(m)


async def test_closing_the_manager_wakes_every_waiter() -> None:
    outcomes: list[str] = []
    async with anyio.create_task_group() as tg:  # noqa: SIM117 (closed mid-block below)
        async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
            a = m.register(tensor(), name="a", location="cuda:0")
            b = m.register(tensor(seed=1), name="b")
            hold = m.hold(a, "cuda:0")  # never released: nothing would ever admit them
            controller = ResidencyController(m)

            async def scope_waiter() -> None:
                plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(b, "cuda:0")])
                try:
                    async with m.scope(plan, timeout=None):
                        outcomes.append("entered")
                except ManagerClosedError:
                    outcomes.append("scope woken")

            async def controller_waiter() -> None:
                request = ResidencyRequest("r", [ResidencyRequirement(b, "cuda:0")])
                try:
                    async with controller.scope(request, timeout=None):
                        outcomes.append("entered")
                except ManagerClosedError:
                    outcomes.append("controller woken")

            async def change_waiter() -> None:
                try:
                    while True:
                        await m.wait_for_change()
                except ManagerClosedError:
                    outcomes.append("change waiter woken")

            tg.start_soon(scope_waiter)
            tg.start_soon(controller_waiter)
            tg.start_soon(change_waiter)
            await anyio.wait_all_tasks_blocked()  # queueing is no transition: wait for it parked
            assert m.waiting == 2  # the scope, and the controller scope in its turn
            await anyio.wait_all_tasks_blocked()  # all three parked
        # the manager closed here
    assert sorted(outcomes) == ["change waiter woken", "controller woken", "scope woken"]
    assert hold.active


@pytest.mark.parametrize("timeout", [math.nan, True, -1, "5"])
async def test_timeouts_that_are_not_seconds_are_refused(timeout: Any) -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w")
        plan = ResidencyPlan(enter=[Move(h, "cuda:0")])
        with pytest.raises((TypeError, ValueError), match="timeout"):
            m.scope(plan, timeout=timeout)
        request = ResidencyRequest("r", [ResidencyRequirement(h, "cuda:0")])
        with pytest.raises((TypeError, ValueError), match="timeout"):
            ResidencyController(m).scope(request, timeout=timeout)
        with pytest.raises((TypeError, ValueError), match="timeout"):
            await m.wait_for_change(timeout)


# ---------------------------------------------------------------- leaks


async def test_a_stream_of_another_device_is_refused_before_the_lease() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w")
        await m.move(h, "cuda:0")
        other = m.backend.current_stream("cuda:1")
        with pytest.raises(ValueError, match="cuda:1"):
            m.acquire(h, "cuda:0", stream=other)
        with pytest.raises(TypeError, match="stream"):
            m.acquire(h, "cuda:0", stream="not a stream")
        async with m.acquire(h, "cuda:0") as lease:
            with pytest.raises(ValueError, match="cuda:1"):
                lease.register_stream(other)
        await settle(m)
        quiet(m)


async def test_a_lease_ends_even_when_recording_its_reader_event_fails() -> None:
    backend = SimBackend()
    async with ResidencyManager(backend=backend) as m:
        h = m.register(tensor(), name="w")
        await m.move(h, "cuda:0")
        stream = backend.new_stream("cuda:0")
        with pytest.raises(RuntimeError, match="closed"):
            async with m.acquire(h, "cuda:0", stream=stream):
                stream.close()  # the stream goes away under the lease
        record = m.snapshot().value(h).materialization("cuda:0")
        assert record.use_count == 0
        await m.move(h, "pinned-host")  # the value can move again
        quiet(m)


async def test_a_write_lease_ends_as_a_write_lease() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w")
        await m.move(h, "cuda:0")
        for _ in range(3):  # a write lease left half-ended would refuse the next one
            async with m.acquire(h, "cuda:0", mode="write") as lease:
                lease.tensor.add_(1)
        await settle(m)
        quiet(m)


async def test_discarded_values_leave_the_state() -> None:
    async with ResidencyManager(backend="sim") as m:
        keep = m.register(tensor(), name="keep")
        baseline = len(m.snapshot().values)
        for i in range(2000):
            h = m.register(torch.zeros(8), name=f"v{i}")
            await m.discard(h)
        snap = m.snapshot()
        assert len(snap.values) == baseline
        assert keep in snap.values
        assert len(m.state.changed_values) == 0


async def test_resetting_the_peak_of_a_location_the_manager_lacks_changes_nothing() -> None:
    async with ResidencyManager(backend="sim") as m:
        before = m.snapshot()
        with pytest.raises(ValueError, match="cuda:99"):
            m.reset_peak_bytes("cuda:99")
        assert m.snapshot() == before
        assert "cuda:99" not in {str(loc) for loc in m.snapshot().locations}


@pytest.mark.parametrize("call", ["acquire", "hold", "tensor", "held_tensor", "track_readers"])
async def test_the_calls_on_a_materialization_say_a_location_the_backend_lacks(call: str) -> None:
    """A device the backend does not have is the ``ValueError`` every other call gives for it
    (not "no materialization there", which sends the user looking for a missing copy)."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="v")
        before = m.snapshot()
        args: tuple[Any, ...] = (h, "cuda:99", []) if call == "track_readers" else (h, "cuda:99")
        with pytest.raises(ValueError, match="cuda:99 does not exist"):
            getattr(m, call)(*args)
        assert m.snapshot() == before


# ---------------------------------------------------------------- evidence and errors


async def test_an_exit_phase_failure_reports_its_own_transitions() -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(), name="a", replica_mode=ReplicaMode.REPLICABLE)
        b = m.register(tensor(seed=1), name="b")
        plan = ResidencyPlan(
            enter=[Materialize(a, "cuda:0"), Move(b, "cuda:0")],
            exit=[Move(b, "pinned-host"), Release(a, "cuda:0")],
        )
        scope = m.scope(plan)
        with pytest.raises(ResidencyPlanExecutionError) as info:
            async with scope:
                hold = m.hold(a, "cuda:0")  # makes the exit's Release fail after b moved
        error = info.value
        assert error.phase == "exit"
        kinds = [t.kind for t in error.partial_report.transitions]
        # The exit's own move is in the report (it committed and stays in effect).
        assert kinds[-2:] == ["move_begin", "move_commit"]
        assert [str(x) for x in m.snapshot().value(b).locations] == ["pinned-host"]
        hold.release()


async def test_bad_calls_get_designed_errors_and_change_nothing() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w")
        snap = m.snapshot()
        with pytest.raises(TypeError, match="ResidencyPlan"):
            m.explain("x")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ResidencyController needs a ResidencyManager"):
            ResidencyController(object())  # type: ignore[arg-type]
        with pytest.raises(ResidencyUnavailableError, match="no record"):
            snap.location("cuda:5")
        with pytest.raises(ValueError, match="missing"):
            ResidencySnapshot.from_dict({})
        with pytest.raises(TypeError, match="enter phase must be an iterable"):
            ResidencyPlan(enter=None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="requirements must be an iterable"):
            ResidencyRequest("r", requirements=None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="cuda:99"):
            ResidencyController(m).decide(
                ResidencyRequest("r", [ResidencyRequirement(h, "cuda:99")])
            )
        with pytest.raises(ValueError, match="cuda:99"):
            m.explain(ResidencyPlan(enter=[Move(h, "cuda:99")]))
        assert m.snapshot() == snap
    with pytest.raises(TypeError, match="budgets must be a mapping"):
        ResidencyManager(budgets="cuda:0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reserve_staging must be True or False, got 'no'"):
        ResidencyManager(backend="sim", reserve_staging="no")  # type: ignore[arg-type]


class _PlainSource:
    """A source that is only the protocol (not a CallableSource): the runtime checks it too."""

    def __init__(self, load: Callable[[], object]) -> None:
        self.shape = (16,)
        self.dtype = torch.float32
        self.source_location = Location("pageable-host")
        self._load = load

    def load(self) -> object:
        return self._load()


@pytest.mark.parametrize("kind", ["callable", "plain"])
@pytest.mark.parametrize(
    ("load", "error", "returned"),
    [
        (lambda: torch.zeros(8), ValueError, r"shape \(8,\) and dtype torch.float32"),
        (lambda: torch.zeros(16, dtype=torch.int64), ValueError, "dtype torch.int64"),
        (lambda: [0.0] * 16, TypeError, r"returned list \[0.0"),
        (lambda: None, TypeError, "returned NoneType None"),
        (lambda: torch.zeros(16).to_sparse(), TypeError, "layout torch.sparse_coo"),
        (lambda: torch.empty(16, device="meta"), ValueError, "on the meta device"),
        (lambda: _Wrapper(torch.zeros(16)), TypeError, "_Wrapper, a tensor subclass with no"),
    ],
    ids=["shape", "dtype", "list", "none", "sparse", "meta", "wrapper"],
)
async def test_a_source_that_returns_the_wrong_tensor_names_the_value_and_leaks_nothing(
    kind: str, load: Callable[[], object], error: type[Exception], returned: str
) -> None:
    """The error names the value (its name and handle), what was expected and what came
    back, whatever kind of source it is; nothing is left charged."""
    async with ResidencyManager(backend="sim") as m:
        source: object = (
            CallableSource(load, shape=(16,), dtype=torch.float32)  # type: ignore[arg-type]
            if kind == "callable"
            else _PlainSource(load)
        )
        h = m.register_source(source, name="weights.7")  # type: ignore[arg-type]
        with pytest.raises(error) as info:
            await m.materialize(h, "cuda:0")
        message = str(info.value)
        assert str(h) in message and "weights.7" in message and f"#{h.value_id}" in message
        assert "expected a tensor of shape (16,) and dtype torch.float32" in message, message
        assert re.search(returned, message), message
        assert m.snapshot().value(h).locations == ()
        assert all(r.charged_bytes == 0 for r in m.snapshot().locations.values())
        quiet(m)


def test_a_callable_source_loaded_directly_names_itself() -> None:
    source = CallableSource(lambda: torch.zeros(8), shape=(16,), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"loading <CallableSource \(16,\).*shape \(8,\)"):
        source.load()
    good = CallableSource(lambda: torch.ones(()), shape=(), dtype=torch.float32)
    assert good.load().item() == 1.0


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(
    "operation", ["materialize", "move", "release", "discard", "scope", "lease"]
)
async def test_a_direct_operation_with_nothing_to_wait_for_still_lets_the_loop_run(
    operation: str,
) -> None:
    """Every async call is a checkpoint: a loop of operations that complete at once (a value
    already there, a release with no reader) must not starve the other tasks."""
    async with ResidencyManager(backend="sim") as m:
        handles = [
            m.register(tensor(64, seed=i), name=f"v{i}", replica_mode=ReplicaMode.REPLICABLE)
            for i in range(20)
        ]
        if operation == "release":
            for h in handles:
                await m.materialize(h, "pinned-host")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            before = ticks
            for h in handles:
                if operation == "release":
                    await m.release(h, "pinned-host")
                elif operation == "discard":
                    await m.discard(h)
                elif operation == "scope":
                    async with m.scope(ResidencyPlan(enter=[Materialize(h, "pageable-host")])):
                        pass
                elif operation == "lease":
                    async with m.acquire(h, "pageable-host"):
                        pass
                else:
                    await getattr(m, operation)(h, "pageable-host")
            ran = ticks - before
            tg.cancel_scope.cancel()
        # once per call (give or take the turn at either end): before, not at all
        assert ran >= len(handles) - 1, f"the ticker ran {ran} times during {len(handles)} calls"


async def test_a_cancelled_caller_of_a_direct_operation_changes_nothing() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w", replica_mode=ReplicaMode.REPLICABLE)
        before = m.snapshot()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await m.discard(h)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await m.materialize(h, "cuda:0")
        entered = []
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with m.scope(ResidencyPlan(enter=[Materialize(h, "cuda:0")])):
                entered.append("scope")
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with m.acquire(h, "pageable-host"):
                entered.append("lease")
        assert entered == []
        assert m.snapshot() == before


async def test_a_direct_move_by_the_task_holding_what_a_scope_waits_for_does_not_deadlock() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(8192), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        c = m.register(tensor(seed=2), name="c")
        big = m.register(tensor(12288, seed=3), name="big")
        hold = m.hold(a, "cuda:0")  # this task's: the scope below waits for it
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(big, "cuda:0")])
        async with anyio.create_task_group() as tg:

            async def waiting_scope() -> None:
                async with m.scope(plan, timeout=None):
                    pass

            tg.start_soon(waiting_scope)
            await anyio.wait_all_tasks_blocked()
            assert m.waiting == 1
            with anyio.fail_after(10):  # a hang guard, not a measurement
                await m.move(b, "cuda:0")  # goes ahead: waiting would never end
                assert {str(x) for x in m.snapshot().value(b).locations} == {"cuda:0"}
                await m.move(b, "pageable-host")
                report = await m.execute(ResidencyPlan(enter=[Move(c, "cuda:0")]))
                assert report.transitions  # it ran: no "not admitted within 0.0 s"
                await m.move(c, "pageable-host")
            assert m.waiting == 1
            hold.release()


async def test_an_operation_that_cannot_wait_is_refused_by_the_queue_with_true_fields() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * KiB}, backend="sim") as m:
        a = m.register(tensor(8192), name="a", location="cuda:0")
        b = m.register(tensor(seed=1), name="b")
        big = m.register(tensor(12288, seed=3), name="big")
        hold = m.hold(a, "cuda:0")
        plan = ResidencyPlan(reclaim=[Move(a, "pinned-host")], enter=[Move(big, "cuda:0")])
        async with anyio.create_task_group() as tg:

            async def waiting_scope() -> None:
                async with m.scope(plan, timeout=None):
                    pass

            tg.start_soon(waiting_scope)
            await anyio.wait_all_tasks_blocked()
            version = m.state_version
            with pytest.raises(ResidencyBudgetError, match="come first") as info:
                m.materialize_nowait(b, "cuda:0")
            error = info.value
            fields = (
                error.budget_bytes,
                error.used_bytes,
                error.reserved_bytes,
                error.requested_bytes,
            )
            assert fields == (64 * KiB, 32 * KiB, 0, 16 * KiB)  # the ledger and the request
            assert (error.kind, error.waiting_scopes, error.missing_bytes) == (
                "materialization",
                1,
                0,
            )
            assert error.handle == b
            assert "come first" in error.to_dict()["message"]
            assert error.to_dict()["waiting_scopes"] == 1
            step = diagnose(error, m).step(3)  # the queue refused it, not the budget
            assert step is not None
            text = " ".join(step.findings)
            assert "1 scope(s) wait for room at cuda:0" in text and "missing" not in text
            assert "takes its turn" in (step.action or "")
            with pytest.raises(ResidencyBudgetError, match="come first") as info:
                async with m.reservation("x", "cuda:0", 4 * KiB):
                    pytest.fail("a reservation overtook a waiting scope")
            assert (info.value.kind, info.value.requested_bytes) == ("reservation", 4 * KiB)
            # the size as every reservation takes it: a string, a float of whole bytes
            for size in (4 * KiB, "4KiB", float(4 * KiB)):
                with pytest.raises(ResidencyBudgetError, match="come first"):
                    m.reserve_nowait("x", "cuda:0", size)  # type: ignore[arg-type]
                with pytest.raises(ResidencyBudgetError, match="come first"):
                    async with m.reservation("x", "cuda:0", size):  # type: ignore[arg-type]
                        pytest.fail("a reservation overtook a waiting scope")
            assert m.state_version == version  # refused before anything changed
            hold.release()


async def test_unreserve_nowait_ends_only_what_reserve_nowait_made() -> None:
    """A scope's plan reservation, a ``reservation`` block's and the backend's own staging are
    ended by their owners; ``unreserve_nowait`` refuses them, changing nothing."""
    async with ResidencyManager(backend=SimBackend(), budgets={"cuda:0": 64 * KiB}) as m:
        plan = ResidencyPlan(reserve=[MemoryReservation("act", "cuda:0", 32 * KiB)])
        async with m.scope(plan):
            version = m.state_version
            with pytest.raises(ValueError, match="'act' at cuda:0 was not made by reserve_nowait"):
                m.unreserve_nowait("act", "cuda:0")
            assert m.state_version == version
            assert m.snapshot().location("cuda:0").reserved_bytes == 32 * KiB
        async with m.reservation("blk", "cuda:0", KiB):
            with pytest.raises(ValueError, match=r"'manager\.reservation' block"):
                m.unreserve_nowait("blk", "cuda:0")
        m.state.reserve("aresidency.staging", "pinned-host", KiB, owner="backend")  # as on CUDA
        with pytest.raises(ValueError, match="the backend, for the manager's lifetime"):
            m.unreserve_nowait("aresidency.staging", "pinned-host")
        m.state.unreserve("aresidency.staging", "pinned-host")
        with pytest.raises(ValueError, match="does not exist"):
            m.unreserve_nowait("mine", "cuda:7")
        m.reserve_nowait("mine", "cuda:0", "2KiB")
        assert m.unreserve_nowait("mine", "cuda:0") == 2 * KiB
        assert m.snapshot().location("cuda:0").reserved_bytes == 0
