"""Byte sizes as people write them, at every API entry point that takes a byte count: the
manager's budgets, ``set_budget``, ``MemoryReservation``, ``manager.reservation``,
``reserve_nowait``, ``register(charge_bytes=...)`` and ``register_source(charge_bytes=...)``.
Each accepted form gives the exact byte count; each refused one raises a sentence naming the
value, and leaves the snapshot as it was.

The sizes are read synchronously, before anything awaits, so the event loop does not matter:
these tests run on asyncio only (the loops themselves are covered everywhere else)."""

from __future__ import annotations

import math
import typing

import pytest
import torch

import aresidency
from aresidency import (
    CallableSource,
    Materialize,
    MemoryReservation,
    ResidencyManager,
    ResidencyPlan,
    budgets_from_max_memory,
)

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

GiB = 1 << 30

# (as written, exact bytes)
GOOD = [
    pytest.param(8 << 20, 8 << 20, id="int"),
    pytest.param(10.5e6, 10_500_000, id="whole-float"),
    pytest.param("512MB", 512_000_000, id="SI"),
    pytest.param("10 GiB", 10 * GiB, id="binary-with-space"),
    pytest.param("1.5GiB", 3 * GiB // 2, id="fractional-binary"),
    pytest.param("64gb", 64_000_000_000, id="any-case"),
    pytest.param("4096", 4096, id="bare-number-string"),
]

# (as written, error type, what the message must show)
BAD = [
    pytest.param("10 GiBs", ValueError, "unknown unit 'GiBs'", id="unknown-unit"),
    pytest.param("-1GB", ValueError, "negative", id="negative-string"),
    pytest.param(-4096, ValueError, "negative", id="negative-int"),
    pytest.param(1.5, ValueError, "not a whole number of bytes", id="fractional-float"),
    pytest.param("1e9", ValueError, "no exponent", id="exponent-string"),
    pytest.param("0.3B", ValueError, "not a whole number", id="fractional-bytes"),
    pytest.param(math.nan, ValueError, "not a finite number", id="nan"),
    pytest.param("ten GB", ValueError, "not a number followed by a unit", id="words"),
    pytest.param(True, TypeError, "a bool is not a size", id="bool"),
    pytest.param([4096], TypeError, "a list is not a size", id="list"),
]


def _matches(error: BaseException, value: object, detail: str) -> None:
    text = str(error)
    assert repr(value) in text, text
    assert detail in text, text
    assert "such as '512MB'" in text, text  # the message says what is accepted


# --- budgets given to the manager -----------------------------------------------------------


@pytest.mark.parametrize(("written", "nbytes"), GOOD)
async def test_a_budget_given_to_the_manager_is_read_in_exact_bytes(written, nbytes):
    async with ResidencyManager(budgets={"cuda:0": written}, backend="sim") as manager:
        assert manager.snapshot().location("cuda:0").budget_bytes == nbytes


async def test_budgets_of_several_locations_may_mix_forms():
    budgets = {"cuda:0": "10GiB", "pinned-host": "64GB", "pageable-host": None, "cuda:1": 1 << 20}
    async with ResidencyManager(budgets=budgets, backend="sim") as manager:
        snapshot = manager.snapshot()
        assert snapshot.location("cuda:0").budget_bytes == 10 * GiB
        assert snapshot.location("pinned-host").budget_bytes == 64_000_000_000
        assert snapshot.location("pageable-host").budget_bytes is None
        assert snapshot.location("cuda:1").budget_bytes == 1 << 20


@pytest.mark.parametrize(("written", "error", "detail"), BAD)
async def test_a_bad_budget_is_refused_when_the_manager_is_made(written, error, detail):
    with pytest.raises(error) as caught:
        ResidencyManager(budgets={"cuda:0": written}, backend="sim")
    _matches(caught.value, written, detail)
    assert "budget for cuda:0" in str(caught.value)


async def test_accelerates_max_memory_converts_into_budgets_through_the_top_level_helper():
    assert aresidency.budgets_from_max_memory is budgets_from_max_memory
    budgets = aresidency.budgets_from_max_memory({0: "1GiB", "cpu": "2GB"})
    async with ResidencyManager(budgets=budgets, backend="sim") as manager:
        snapshot = manager.snapshot()
        assert snapshot.location("cuda:0").budget_bytes == GiB
        assert snapshot.location("pinned-host").budget_bytes == 2_000_000_000


# --- set_budget ------------------------------------------------------------------------------


@pytest.mark.parametrize(("written", "nbytes"), GOOD)
async def test_set_budget_reads_a_size_in_exact_bytes(residency_manager, written, nbytes):
    residency_manager.set_budget("cuda:1", written)
    assert residency_manager.snapshot().location("cuda:1").budget_bytes == nbytes


@pytest.mark.residency(budgets={"cuda:1": "1MiB"})
@pytest.mark.parametrize(("written", "error", "detail"), BAD)
async def test_set_budget_refuses_a_bad_size_and_changes_nothing(
    residency_manager, written, error, detail
):
    before = residency_manager.snapshot()
    with pytest.raises(error) as caught:
        residency_manager.set_budget("cuda:1", written)
    _matches(caught.value, written, detail)
    assert residency_manager.snapshot() == before


# --- MemoryReservation -----------------------------------------------------------------------


@pytest.mark.parametrize(("written", "nbytes"), GOOD)
async def test_a_memory_reservation_reads_its_size_in_exact_bytes(written, nbytes):
    assert MemoryReservation("kv", "cuda:0", written).nbytes == nbytes


@pytest.mark.parametrize(("written", "error", "detail"), BAD)
async def test_a_memory_reservation_refuses_a_bad_size(written, error, detail):
    with pytest.raises(error) as caught:
        MemoryReservation("kv", "cuda:0", written)
    _matches(caught.value, written, detail)
    assert "MemoryReservation 'kv' nbytes" in str(caught.value)


@pytest.mark.residency(budgets={"cuda:0": "8MiB"})
async def test_a_plan_reserves_what_its_reservation_spells(residency_manager):
    manager = residency_manager
    weight = manager.register(torch.zeros(1024), name="w")
    plan = ResidencyPlan(
        reserve=[MemoryReservation("kv", "cuda:0", "2MiB")], enter=[Materialize(weight, "cuda:0")]
    )
    async with manager.scope(plan):
        record = manager.snapshot().location("cuda:0")
        assert record.reservations == (("kv", 2 << 20),)
        assert record.charged_bytes == (2 << 20) + 4096


# --- manager.reservation ---------------------------------------------------------------------


@pytest.mark.parametrize(("written", "nbytes"), GOOD)
async def test_a_direct_reservation_reads_its_size_in_exact_bytes(
    residency_manager, written, nbytes
):
    async with residency_manager.reservation("ws", "pinned-host", written):
        assert residency_manager.snapshot().location("pinned-host").reserved_bytes == nbytes
    assert residency_manager.snapshot().location("pinned-host").reserved_bytes == 0


@pytest.mark.parametrize(("written", "error", "detail"), BAD)
async def test_a_direct_reservation_refuses_a_bad_size_and_changes_nothing(
    residency_manager, written, error, detail
):
    before = residency_manager.snapshot()
    with pytest.raises(error) as caught:
        async with residency_manager.reservation("ws", "pinned-host", written):
            pytest.fail("the body ran")
    _matches(caught.value, written, detail)
    assert "reservation 'ws'" in str(caught.value)
    assert residency_manager.snapshot() == before


# --- register(charge_bytes=...) --------------------------------------------------------------


@pytest.mark.parametrize(("written", "nbytes"), GOOD)
async def test_register_reads_charge_bytes_in_exact_bytes(residency_manager, written, nbytes):
    handle = residency_manager.register(torch.zeros(16), name="w", charge_bytes=written)
    assert residency_manager.snapshot().value(handle).charge_bytes == nbytes


@pytest.mark.parametrize(
    ("written", "error", "detail"),
    [*BAD, pytest.param("0B", ValueError, "greater than 0", id="zero")],
)
async def test_register_refuses_a_bad_charge_and_changes_nothing(
    residency_manager, written, error, detail
):
    before = residency_manager.snapshot()
    with pytest.raises(error) as caught:
        residency_manager.register(torch.zeros(16), name="w", charge_bytes=written)
    _matches(caught.value, written, detail)
    assert "charge_bytes" in str(caught.value)
    assert residency_manager.snapshot() == before


# --- register_source(charge_bytes=...), reserve_nowait -----------------------------------------


def _source() -> CallableSource:
    return CallableSource(lambda: torch.zeros(16), shape=(16,), dtype=torch.float32)


@pytest.mark.parametrize(("written", "nbytes"), GOOD)
async def test_register_source_reads_charge_bytes_as_register_does(
    residency_manager, written, nbytes
):
    """A size string was a TypeError ("must be an int number of bytes") for a source's value,
    though ``register`` took it."""
    handle = residency_manager.register_source(_source(), name="s", charge_bytes=written)
    assert residency_manager.snapshot().value(handle).charge_bytes == nbytes


@pytest.mark.parametrize(("written", "error", "detail"), BAD)
async def test_register_source_refuses_a_bad_charge_and_changes_nothing(
    residency_manager, written, error, detail
):
    before = residency_manager.snapshot()
    with pytest.raises(error) as caught:
        residency_manager.register_source(_source(), name="s", charge_bytes=written)
    _matches(caught.value, written, detail)
    assert "charge_bytes" in str(caught.value)
    assert residency_manager.snapshot() == before


async def test_reserve_nowait_reads_a_size(residency_manager):
    residency_manager.reserve_nowait("ws", "pinned-host", "2KiB")
    assert residency_manager.snapshot().location("pinned-host").reserved_bytes == 2048
    residency_manager.unreserve_nowait("ws", "pinned-host")


def _accepts(hint: object, kind: type) -> bool:
    return hint is kind or any(_accepts(arg, kind) for arg in typing.get_args(hint))


@pytest.mark.parametrize(
    ("method", "parameter"),
    [
        (ResidencyManager.__init__, "budgets"),
        (ResidencyManager.set_budget, "budget_bytes"),
        (ResidencyManager.reservation, "nbytes"),
        (ResidencyManager.reserve_nowait, "nbytes"),
        (ResidencyManager.register, "charge_bytes"),
        (ResidencyManager.register_source, "charge_bytes"),
        (MemoryReservation.__init__, "nbytes"),
    ],
)
async def test_every_size_parameter_is_typed_to_take_what_it_reads(method, parameter):
    """A user's ``mypy --strict`` accepts ``set_budget("cuda:1", "2MiB")`` and ``12.5e9``, as the
    docs write them (``set_budget`` and ``reservation`` were typed ``int``)."""
    hint = typing.get_type_hints(method)[parameter]
    assert _accepts(hint, str) and _accepts(hint, float), (method.__qualname__, hint)


# --- sizes shown to people -------------------------------------------------------------------


@pytest.mark.residency(budgets={"cuda:0": "8GiB"})
async def test_reprs_show_sizes_as_torch_memory_summary_prints_them(residency_manager):
    manager = residency_manager
    # torch's rule: the largest unit the size reaches 768 of (so 1 MiB prints as KiB).
    manager.register(torch.zeros(1 << 20, dtype=torch.uint8), name="w", location="cuda:0")
    record = manager.snapshot().location("cuda:0")
    assert repr(record) == (
        "<Location cuda:0 used=1024 KiB reserved=0 B peak=1024 KiB budget=8192 MiB>"
    )
    assert "pageable-host" not in repr(manager)  # nothing there, and no budget
    assert "cuda:0 1024 KiB/8192 MiB" in repr(manager)
    unlimited = manager.snapshot().location("pinned-host")
    assert repr(unlimited).endswith("budget=unlimited>")
