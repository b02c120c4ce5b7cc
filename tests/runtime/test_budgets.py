"""Budgets, reservations and copies as a demanding user tries them, on the simulated backend (a
simulation of CUDA devices in host memory): each test is one way they broke."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from aresidency import (
    CallableSource,
    Location,
    MemoryReservation,
    ResidencyBudgetError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
)
from aresidency.backends.sim import SimBackend

pytestmark = pytest.mark.anyio

KiB = 1 << 10
PINNED = Location("pinned-host")


class _CountingStarts(SimBackend):
    """A simulated backend that counts how often a manager started it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.starts = 0

    def start(self, bridge: Any = None) -> None:
        self.starts += 1
        super().start(bridge)


async def test_a_pinned_budget_below_the_staging_buffers_is_refused_before_anything_starts() -> (
    None
):
    """The backend's staging buffers are reserved at pinned-host when the manager starts; a
    budget that cannot hold them failed there after the backend and the manager's task group
    had started, and left both running: on trio the task group's nursery, never exited,
    corrupted the run ("Nursery stack corrupted"). Now it is refused before anything starts,
    naming the staging reservation and how to leave it uncharged."""
    backend = _CountingStarts(staging_nbytes=4 * KiB)
    manager = ResidencyManager(budgets={"pinned-host": 1000}, backend=backend)
    with pytest.raises(ResidencyBudgetError) as caught:
        async with manager:
            pytest.fail("a manager whose staging buffers do not fit its budget started")
    error = caught.value
    assert (error.location, error.budget_bytes, error.used_bytes, error.reserved_bytes) == (
        PINNED,
        1000,
        0,
        0,
    )
    assert (error.requested_bytes, error.kind, error.handle) == (4 * KiB, "reservation", None)
    assert "'aresidency.staging'" in str(error)
    assert "reserve_staging=False" in str(error)
    assert backend.starts == 0
    # The task goes on with nothing of the manager's left open around it.
    async with anyio.create_task_group() as group:
        group.start_soon(anyio.lowlevel.checkpoint)
    # Left uncharged, the same budget starts; with room, the buffers are reserved for the
    # manager's lifetime and shown in the snapshot.
    async with ResidencyManager(
        budgets={"pinned-host": 1000}, backend=backend, reserve_staging=False
    ) as m:
        assert m.snapshot().location(PINNED).reservations == ()
    async with ResidencyManager(
        budgets={"pinned-host": 8 * KiB}, backend=SimBackend(staging_nbytes=4 * KiB)
    ) as m:
        record = m.snapshot().location(PINNED)
        assert record.reservations == (("aresidency.staging", 4 * KiB),)
        assert (record.used_bytes, record.reserved_bytes) == (0, 4 * KiB)


async def test_copies_made_at_registration_and_by_a_rebuild_carry_no_autograd_state() -> None:
    """``requires_grad`` is off on every copy the manager makes. A parameter registered at
    another location, or loaded from a source that returns a module's weight and placed in
    pinned memory, was copied with ``copy_``, which recorded a ``CopyBackwards``: the copy
    required grad and held the user's parameter in its graph."""
    async with ResidencyManager(backend="sim") as m:
        layer = torch.nn.Linear(4, 4)
        expected = layer.weight.detach().clone()
        registered = m.register(layer.weight, name="registered", location="pinned-host")
        pinned_source = CallableSource(
            lambda: layer.weight, shape=(4, 4), dtype=torch.float32, source_location="pinned-host"
        )
        rebuilt_in_place = m.register_source(pinned_source, name="rebuilt in place")
        rebuilt_and_placed = m.register_source(
            CallableSource(lambda: layer.weight, shape=(4, 4), dtype=torch.float32),
            name="rebuilt and placed",
        )
        await m.materialize(rebuilt_in_place, "pinned-host")
        await m.materialize(rebuilt_and_placed, "pinned-host")
        for handle in (registered, rebuilt_in_place, rebuilt_and_placed):
            async with m.acquire(handle, "pinned-host") as lease:
                copy = lease.tensor
                assert (copy.requires_grad, copy.grad_fn) == (False, None), handle
                assert torch.equal(copy, expected)


async def test_a_reservation_block_entered_twice_says_it_is_single_use() -> None:
    """``block = manager.reservation(...)`` kept and entered again (once per request) failed
    with contextlib's ``AttributeError: ... has no attribute 'args'``; now a ``RuntimeError``
    says the block is single use, and nothing is reserved."""
    async with ResidencyManager(backend="sim", budgets={"cuda:0": 64 * KiB}) as m:
        block = m.reservation("workspace", "cuda:0", 8 * KiB)
        async with block:
            assert m.snapshot().location("cuda:0").reservations == (("workspace", 8 * KiB),)
        version = m.state_version
        with pytest.raises(RuntimeError, match=r"'workspace'.* is single use and was entered"):
            async with block:
                pytest.fail("a reservation block was entered twice")
        assert m.state_version == version
        assert m.snapshot().location("cuda:0").reservations == ()
        async with m.reservation("workspace", "cuda:0", 8 * KiB):  # a new block is fine
            assert m.snapshot().location("cuda:0").reserved_bytes == 8 * KiB


async def test_charges_are_exact_multiples_of_the_granularity_and_at_least_one() -> None:
    """As documented: the larger of the storage and the elements' bytes, rounded up to a
    multiple of 512 and at least 512 (an empty tensor too), the same at every location."""
    async with ResidencyManager(backend="sim") as m:
        cases = {
            "empty": (torch.empty(0, 3), 512),
            "513 bytes": (torch.zeros(513, dtype=torch.uint8), 1024),
            "view of a larger storage": (torch.zeros(1024)[10:20], 4096),
            "expanded": (torch.zeros(1, 300).expand(10, 300), 12288),
        }
        for name, (tensor, charge) in cases.items():
            handle = m.register(tensor, name=name)
            for location in ("pinned-host", "cuda:1", "pageable-host"):
                await m.move(handle, location)
                record = m.snapshot().value(handle)
                assert record.charge_bytes == charge, name
                assert record.materialization(location).charged_bytes == charge, name
            await m.discard(handle)
        assert all(r.used_bytes == 0 for r in m.snapshot().locations.values())


async def test_a_float_tensor_as_a_budget_is_refused_naming_the_budget() -> None:
    """A budget computed with torch (``torch.tensor(8e9)``) has ``__index__`` but refuses it:
    torch's "only integer tensors of a single element can be converted to an index" named
    neither the budget nor what is accepted."""
    with pytest.raises(TypeError, match=r"budget for cuda:0 must be a byte count.*not an integer"):
        ResidencyManager(budgets={"cuda:0": torch.tensor(8e9)}, backend="sim")
    async with ResidencyManager(budgets={"cuda:0": torch.tensor(8 * KiB)}, backend="sim") as m:
        assert m.snapshot().location("cuda:0").budget_bytes == 8 * KiB  # an integer one reads
        with pytest.raises(TypeError, match=r"budget for cuda:1 must be a byte count"):
            m.set_budget("cuda:1", torch.tensor(1.0))
        assert m.snapshot().location("cuda:1").budget_bytes is None


async def test_a_budget_for_a_device_the_backend_lacks_is_refused_naming_the_budgets() -> None:
    """``budgets={"cuda:2": ...}`` on a machine with two devices is refused when the manager
    starts (the backend knows its devices only then), saying that the budgets named it."""
    backend = _CountingStarts(num_devices=2)
    with pytest.raises(ValueError, match=r"budgets name cuda:2, which .*cuda:0\.\.cuda:1"):
        async with ResidencyManager(budgets={"cuda:0": KiB, "cuda:2": KiB}, backend=backend):
            pytest.fail("a manager with a budget for a missing device started")
    assert backend.starts == 0


async def test_a_nested_scope_reserving_its_outer_scopes_name_is_told_to_rename_it() -> None:
    """A nested scope whose plan reserves the name its outer scope holds at the location is
    refused at once (it would wait for itself); the refusal's advice was only about room
    ("exit those scopes ... or put these values in one plan"), not the name that kept it out."""
    plan = ResidencyPlan(reserve=[MemoryReservation("workspace", "cuda:0", 8 * KiB)])
    renamed = ResidencyPlan(reserve=[MemoryReservation("workspace-2", "cuda:0", 8 * KiB)])
    async with ResidencyManager(backend="sim", budgets={"cuda:0": 64 * KiB}) as m, m.scope(plan):
        with pytest.raises(ResidencyPlanError) as caught:
            async with m.scope(plan):
                pytest.fail("a second reservation of one name was admitted")
        assert caught.value.hold_and_wait
        message = str(caught.value)
        assert "'workspace' is already active at cuda:0" in message
        assert "give the plan's reservation a name of its own" in message
        async with m.scope(renamed):
            assert m.snapshot().location("cuda:0").reserved_bytes == 16 * KiB


async def test_a_refused_slice_of_a_large_tensor_says_its_whole_storage_is_charged() -> None:
    """A 40-byte slice of a 64 KiB tensor is charged the whole storage (it keeps it alive);
    registered at a budgeted location the refusal asked for 64 KiB and advised making "the
    value" smaller, as if the slice were that large. It now names the storage and the
    ``.clone()`` that charges only the slice."""
    async with ResidencyManager(backend="sim", budgets={"cuda:0": 8 * KiB}) as m:
        big = torch.arange(16 * KiB, dtype=torch.float32)
        with pytest.raises(ResidencyBudgetError) as caught:
            m.register(big[:10], name="row", location="cuda:0")
        assert caught.value.requested_bytes == 64 * KiB
        message = str(caught.value)
        assert "'row', a view of a storage of 65536 B (64.0 KiB), charged whole" in message
        assert "register a .clone() to charge only its own 40 B" in message
        assert m.snapshot().location("cuda:0").used_bytes == 0
        handle = m.register(big[:10].clone(), name="row", location="cuda:0")
        assert m.snapshot().value(handle).charge_bytes == 512
